package static

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/internal/sshtest"
	"github.com/shepherd/shepherd/provider"
)

// TestRebootIssuedWhenPeerGoesSilent reboots a machine whose reboot
// command resets it at once: the connection neither closes nor answers
// again (a proxy goes silent once the command started). RebootMachine
// must return by SSHTimeout and count the reboot as issued, not failed:
// a failed reboot is repeated after the backoff.
func TestRebootIssuedWhenPeerGoesSilent(t *testing.T) {
	t.Parallel()
	for _, kind := range sshtest.Kinds(t) {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			key, _ := newKey(t)
			h := sshtest.Start(t, 1, sshtest.Config{Kind: kind, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})[0]
			proxy := sshtest.StartProxy(t, h.Addr.String())
			marker := filepath.Join(h.Dir, "rebooting")
			path := filepath.Join(t.TempDir(), "inventory.yaml")
			writeFile(t, path, fmt.Sprintf("machines:\n  - {id: m, address: %s, port: %d, host_key: %q, reboot_command: %q}\n",
				proxy.Addr.Addr(), proxy.Addr.Port(), authorizedKey(h.HostKey),
				sshtest.UntilSilenced(marker)))
			p, err := New(Config{Inventory: path, SSHTimeout: 2 * time.Second, Env: provider.Env{SSHSigner: key, SSHUser: h.User}})
			if err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- p.RebootMachine(t.Context(), "m") }()
			waitFor(t, 30*time.Second, "the reboot command started", func() bool {
				_, err := os.Stat(marker)
				return err == nil
			})
			proxy.Silence()
			// SSHTimeout is 2s; a reboot that waits for the silent machine
			// never returns, and this test fails long before its binary's.
			select {
			case err := <-done:
				if err != nil {
					t.Errorf("RebootMachine of a machine that went silent after the command started: %v, want the reboot counted as issued", err)
				}
			case <-time.After(time.Minute):
				t.Fatal("RebootMachine still waits for a silent machine a minute after its 2s SSHTimeout")
			}
		})
	}
}
