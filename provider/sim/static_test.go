package sim_test

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/provider"
	"github.com/shepherd/shepherd/provider/sim"
	"github.com/shepherd/shepherd/provider/static"
)

// TestStaticProviderReboot reboots machines of a fleet through the real
// static provider, over TCP SSH to ServeSSH, and checks how it judges each
// outcome against the fleet's ground truth.
func TestStaticProviderReboot(t *testing.T) {
	t.Parallel()
	const sshTimeout = time.Second
	rec := &recorder{}
	f := startFleet(t, sim.Config{Machines: 4, RebootCommand: rebootCommand, Observer: rec})
	works, fails, hangs, dead := slotID(1), slotID(2), slotID(3), slotID(4)
	if err := f.Provision(works, fails, hangs, dead); err != nil {
		t.Fatal(err)
	}
	var inv strings.Builder
	inv.WriteString("defaults:\n  ssh_user: root\n  reboot_command: " + rebootCommand + "\nmachines:\n")
	for _, id := range []string{works, fails, hangs, dead} {
		key, err := f.HostKey(id)
		if err != nil {
			t.Fatal(err)
		}
		_, port, err := net.SplitHostPort(serve(t, f, id))
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&inv, "  - id: %s\n    address: 127.0.0.1\n    port: %s\n    host_key: %q\n",
			id, port, strings.TrimSpace(string(ssh.MarshalAuthorizedKey(key))))
	}
	path := filepath.Join(t.TempDir(), "inventory.yaml")
	if err := os.WriteFile(path, []byte(inv.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	p, err := static.New(static.Config{Inventory: path, SSHTimeout: sshTimeout, Env: provider.Env{SSHSigner: clientKey()}})
	if err != nil {
		t.Fatalf("static.New: %v", err)
	}
	if err := f.SetRebootFault(fails, sim.RebootFails); err != nil {
		t.Fatal(err)
	}
	if err := f.SetRebootFault(hangs, sim.RebootHangs); err != nil {
		t.Fatal(err)
	}
	if err := f.Kill(dead); err != nil {
		t.Fatal(err)
	}

	if err := p.RebootMachine(testCtx(t), works); err != nil {
		t.Errorf("static RebootMachine(%s): %v, want nil", works, err)
	}
	if rb := rec.reboots(); len(rb) != 1 || rb[0].id != works {
		t.Errorf("Rebooted calls = %+v, want one for %s", rb, works)
	}

	err = p.RebootMachine(testCtx(t), fails)
	if err == nil || errors.Is(err, provider.ErrNotReached) || !strings.Contains(err.Error(), "exit status 1") {
		t.Errorf("static RebootMachine(%s) with RebootFails: %v, want the exit status 1 error", fails, err)
	}

	// A command that never answers looks like a machine that reset at
	// once: the static provider counts the reboot as issued, and only the
	// fleet knows that nothing happened.
	if err := p.RebootMachine(testCtx(t), hangs); err != nil {
		t.Errorf("static RebootMachine(%s) with RebootHangs: %v, want nil after its SSH timeout", hangs, err)
	}

	// A dead machine accepts the TCP connection and never answers.
	err = p.RebootMachine(testCtx(t), dead)
	if !errors.Is(err, provider.ErrNotReached) {
		t.Errorf("static RebootMachine(%s) of a killed machine: %v, want ErrNotReached", dead, err)
	}

	for id, want := range map[string]int{works: 1, fails: 0, hangs: 0, dead: 0} {
		if _, n := f.Rebooted(id); n != want {
			t.Errorf("Rebooted(%s) counts %d reboots, want %d", id, n, want)
		}
	}
	if rb := rec.reboots(); len(rb) != 1 {
		t.Errorf("Rebooted calls = %+v, want only the one of %s", rb, works)
	}
	if st := f.Stats(); st.Reboots != 1 || st.RebootsFailed != 1 || st.RebootsHung != 1 {
		t.Errorf("Stats() = %+v, want 1 reboot, 1 failed, 1 hung", st)
	}
}
