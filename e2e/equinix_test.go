package e2e

import (
	"fmt"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/sshtest"
	"github.com/shepherd/shepherd/internal/sshx"
	"github.com/shepherd/shepherd/provider/equinix/fakemetal"
)

// TestEquinixLifecycle runs a machine's whole life against the fake Metal
// API over real HTTP, with the real binaries: a hardware reservation
// becomes a device (created by the provisioner), the initializer takes it
// over through SSH at the device's address (a real SSH server of the
// test), its agent heartbeats; then the agent dies, the recoverer reboots
// the device through the API, and the machine is taken over again and
// Healthy with a new agent key.
func TestEquinixLifecycle(t *testing.T) {
	t.Parallel()
	const metalToken = "e2e-metal-token-not-for-logs"
	db := bmdbtest.New(t)
	dir := t.TempDir()
	dataDir := filepath.Join(dir, "data")
	signer, err := sshx.LoadOrCreateKey(filepath.Join(dataDir, "ssh_key"))
	if err != nil {
		t.Fatal(err)
	}
	host := sshtest.Start(t, 1, sshtest.Config{AuthorizedKeys: []ssh.PublicKey{signer.PublicKey()}})[0]
	agents := filepath.Join(dir, "agents")
	t.Cleanup(func() { stopAgents(t, agents) })

	fake, err := fakemetal.New(fakemetal.Config{
		Token:          metalToken,
		ProvisionDelay: 300 * time.Millisecond,
		RebootDelay:    500 * time.Millisecond,
		Address:        func(string, int) netip.Addr { return host.Addr.Addr() },
	})
	if err != nil {
		t.Fatal(err)
	}
	fake.AddProject("lab")
	fake.AddReservations("lab", "c3.small.x86", "fr2", "fr", 1)
	api := httptest.NewServer(fake)
	t.Cleanup(api.Close)

	tokenPath, cfgPath := filepath.Join(dir, "metal-token"), filepath.Join(dir, "equinix.yaml")
	if err := os.WriteFile(tokenPath, []byte(metalToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := fmt.Sprintf("project: lab\napi_url: %s/metal/v1\ntoken_file: %s\noperating_system: ubuntu_22_04\nssh_port: %d\nstate_poll_interval: 100ms\n",
		api.URL, tokenPath, host.Addr.Port())
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	proc := startShepherd(t, "run", "--components", "all", "--database-url", db.URL, "--data-dir", dataDir,
		"--provider", "equinix", "--provider-config", cfgPath, "--ssh-user", host.User,
		"--agent", filepath.Join(binaries(t), "shepherd-agent"), "--agent-dir", filepath.Join(agents, "{provider_id}"),
		"--server-listen", fmt.Sprintf("127.0.0.1:%d", freePort(t)), "--heartbeat-interval", "1s",
		"--heartbeat-timeout", "5s", "--first-heartbeat-timeout", "60s", "--silent-fraction", "1",
		"--provisioner-period", "500ms", "--log-level", "debug",
		// This test is about the reboot through the Metal API; with the
		// default ladder the agent rung would restart the dead agent
		// without one (TestLadderReachesTheBMC climbs the ladder).
		"--recovery-rungs", "reboot")

	waitStates(t, db, "equinix", 3*time.Minute, "the device Healthy", func(st map[bmdb.MachineState]int64) bool { return st[bmdb.StateHealthy] == 1 })
	devices := fake.Devices("lab")
	if len(devices) != 1 {
		t.Fatalf("the project has %d devices, want 1", len(devices))
	}
	dev := devices[0]
	m, err := db.MachineByProviderID(t.Context(), "equinix", dev.ID)
	if err != nil {
		t.Fatal(err)
	}
	if keys := fake.SSHKeys("lab"); len(keys) != 1 || !strings.Contains(string(ssh.MarshalAuthorizedKey(signer.PublicKey())), strings.Fields(keys[0].Key)[1]) {
		t.Errorf("project SSH keys %+v, want Shepherd's key once", keys)
	}
	_, oldKey, err := db.GetAgentStarted(t.Context(), m)
	if err != nil {
		t.Fatal(err)
	}

	// Silence: the agent dies. The recoverer reboots the device through
	// the API and the initializer takes it over again.
	if err := syscall.Kill(readPid(t, pidFile(agents, dev.ID)), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	// Rebooted through the API, taken over again, Healthy with a new key.
	waitRecovered(t, db, "equinix", m, oldKey, 1, func() bool { return fake.Reboots(dev.ID) > 0 })
	if v := fake.Check(); len(v) > 0 {
		t.Errorf("the client misbehaved towards the API: %v", v)
	}
	if strings.Contains(proc.output(), metalToken) {
		t.Error("the API token appears in shepherd's output")
	}
}
