package e2e

import (
	"context"
	"crypto/ed25519"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/sshtest"
	"github.com/shepherd/shepherd/internal/sshx"
)

// TestSSHEndToEnd takes over machines behind real SSH servers (OpenSSH's
// sshd where installed, which CI requires; an in-process server otherwise)
// with the real binaries: a static inventory, shepherd run with every
// component, the agent uploaded and started over SSH, heartbeats to the
// real callback server. Then one agent dies and is recovered by the recovery
// ladder's first rung (a new agent, no reboot), and one machine's host key
// changes.
func TestSSHEndToEnd(t *testing.T) {
	t.Parallel()
	for _, kind := range sshtest.Kinds(t) {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			runSSHEndToEnd(t, kind)
		})
	}
}

func runSSHEndToEnd(t *testing.T, kind sshtest.Kind) {
	db := bmdbtest.New(t)
	dir := t.TempDir()
	dataDir := filepath.Join(dir, "data")
	signer, err := sshx.LoadOrCreateKey(filepath.Join(dataDir, "ssh_key"))
	if err != nil {
		t.Fatal(err)
	}
	hosts := sshtest.Start(t, 3, sshtest.Config{Kind: kind, AuthorizedKeys: []ssh.PublicKey{signer.PublicKey()}})
	agents := filepath.Join(dir, "agents")
	t.Cleanup(func() { stopAgents(t, agents) })

	var inv strings.Builder
	inv.WriteString("machines:\n")
	for i, h := range hosts {
		id := fmt.Sprintf("m%d", i+1)
		// A "reboot" kills the machine's agent and, for sshd, restarts it.
		reboot := fmt.Sprintf("kill $(cat %s) 2>/dev/null; true", pidFile(agents, id))
		if h.PIDFile() != "" {
			reboot = fmt.Sprintf("kill $(cat %s) 2>/dev/null; kill -HUP $(cat %s)", pidFile(agents, id), h.PIDFile())
		}
		fmt.Fprintf(&inv, "  - id: %s\n    address: %s\n    port: %d\n    ssh_user: %s\n    reboot_command: %q\n",
			id, h.Addr.Addr(), h.Addr.Port(), h.User, reboot)
	}
	runStatic(t, db, dir, inv.String(), "", "--silent-fraction", "0.5")

	healthy := func(n int64) func(map[bmdb.MachineState]int64) bool {
		return func(st map[bmdb.MachineState]int64) bool { return st[bmdb.StateHealthy] == n }
	}
	waitStates(t, db, "lab", 3*time.Minute, "every machine Healthy", healthy(3))

	// One agent dies: the machine goes silent, the recoverer reboots it
	// through the inventory's command, and the initializer takes it over
	// again with a new key.
	m2, err := db.MachineByProviderID(t.Context(), "lab", "m2")
	if err != nil {
		t.Fatal(err)
	}
	_, oldKey, err := db.GetAgentStarted(t.Context(), m2)
	if err != nil {
		t.Fatal(err)
	}
	pid := readPid(t, pidFile(agents, "m2"))
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitRecovered(t, db, "lab", m2, oldKey, 3, nil)
	// Its sshd answers, so the ladder's first rung restarts the agent
	// without a reboot (TestLadderReachesTheBMC climbs further).
	if kind == sshtest.OpenSSH {
		log, _ := os.ReadFile(hosts[1].LogPath())
		if strings.Contains(string(log), "Received SIGHUP") {
			t.Error("the reboot command ran although restarting m2's agent did")
		}
	}

	// m3's host key changes (a reinstall behind our back). Its next agent
	// start must fail on the host key, and the others must not care.
	m3, err := db.MachineByProviderID(t.Context(), "lab", "m3")
	if err != nil {
		t.Fatal(err)
	}
	hosts[2].ChangeHostKey(t)
	db.Exec(t, "DELETE FROM machine_agent_heartbeat WHERE machine_id = $1", m3)
	db.Exec(t, "DELETE FROM machine_agent_started WHERE machine_id = $1", m3)
	var cause string
	bmdbtest.WaitFor(t, 2*time.Minute, "m3's agent start fails on the host key", func(ctx context.Context) (bool, error) {
		h, err := db.History(ctx, bmdb.HistoryFilter{MachineID: m3, Process: bmdb.ProcessAgentStart})
		if err != nil || len(h) == 0 {
			return false, err
		}
		last := h[len(h)-1]
		cause = last.Cause
		return last.Event == bmdb.EventFailed, nil
	})
	if !strings.Contains(cause, "host key mismatch") {
		t.Errorf("m3's agent start failed with %q, want a host key mismatch", cause)
	}
	if _, _, err := db.GetAgentStarted(t.Context(), m3); err == nil {
		t.Error("m3 got an agent despite the changed host key")
	}
	st, err := db.FleetStates(t.Context(), "lab", 0, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if st[bmdb.StateHealthy] != 2 {
		t.Errorf("states after m3's host key changed: %v, want m1 and m2 still Healthy", st)
	}
}

// waitRecovered waits until machine got a new agent (a key other than
// oldKey) and the provider's fleet has healthy Healthy machines (and until
// extra, if given, holds), then checks that the machine's recovery ended
// Finished in history.
func waitRecovered(t *testing.T, db *bmdbtest.DB, providerName string, machine uuid.UUID, oldKey ed25519.PublicKey, healthy int64, extra func() bool) {
	t.Helper()
	bmdbtest.WaitFor(t, 3*time.Minute, fmt.Sprintf("machine %s recovered, Healthy with a new agent key", machine), func(ctx context.Context) (bool, error) {
		if extra != nil && !extra() {
			return false, nil
		}
		_, key, err := db.GetAgentStarted(ctx, machine)
		if err != nil || key.Equal(oldKey) {
			return false, err
		}
		st, err := db.FleetStates(ctx, providerName, 0, 5*time.Second)
		return err == nil && st[bmdb.StateHealthy] == healthy, err
	})
	h, err := db.History(t.Context(), bmdb.HistoryFilter{MachineID: machine, Process: bmdb.ProcessRecovery})
	if err != nil {
		t.Fatal(err)
	}
	if len(h) == 0 || h[len(h)-1].Event != bmdb.EventFinished {
		t.Errorf("recovery history of machine %s: %+v", machine, h)
	}
}

func pidFile(agents, id string) string { return filepath.Join(agents, id, "state", "agent.pid") }

func readPid(t *testing.T, path string) int {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil {
		t.Fatal(err)
	}
	return pid
}

// stopAgents stops every agent daemon started under agents and waits until
// they are gone, so the test leaves no daemon behind.
func stopAgents(t *testing.T, agents string) {
	files, _ := filepath.Glob(filepath.Join(agents, "*", "state", "agent.pid"))
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
		if err != nil || pid <= 1 {
			continue
		}
		if syscall.Kill(pid, syscall.SIGTERM) != nil {
			continue // already gone
		}
		deadline := time.Now().Add(20 * time.Second)
		for alive(pid) && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond) // cleanup: waiting for a process we do not own
		}
		if alive(pid) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
			t.Errorf("agent daemon %d ignored SIGTERM", pid)
		}
	}
}

// alive reports whether pid runs (a zombie does not count).
func alive(pid int) bool {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(data)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	return len(fields) > 0 && fields[0] != "Z"
}

// runStatic starts `shepherd run` with every component on a static
// inventory (written to dir with its provider config, config being extra
// provider config lines), with the data directory dir/data and agents in
// dir/agents/PROVIDER_ID, heartbeats every second and silence after 5 s;
// extra flags go last and override.
func runStatic(t *testing.T, db *bmdbtest.DB, dir, inventory, config string, extra ...string) *process {
	t.Helper()
	invPath, cfgPath := filepath.Join(dir, "inventory.yaml"), filepath.Join(dir, "static.yaml")
	if err := os.WriteFile(invPath, []byte(inventory), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(cfgPath, []byte("inventory: "+invPath+"\nname: lab\n"+config), 0o600); err != nil {
		t.Fatal(err)
	}
	args := []string{"run", "--components", "all", "--database-url", db.URL, "--data-dir", filepath.Join(dir, "data"),
		"--provider", "static", "--provider-config", cfgPath,
		"--agent", filepath.Join(binaries(t), "shepherd-agent"), "--agent-dir", filepath.Join(dir, "agents", "{provider_id}"),
		"--server-listen", fmt.Sprintf("127.0.0.1:%d", freePort(t)), "--heartbeat-interval", "1s",
		"--heartbeat-timeout", "5s", "--first-heartbeat-timeout", "60s",
		"--provisioner-period", "500ms", "--ssh-exec-timeout", "2m", "--log-level", "info",
		// A rebooted (or powered-on) sshd can refuse the first takeover on
		// a loaded machine; SPEC's 5-minute wait would outlast the tests'
		// 3-minute bounds (seen in a run at load 25), so failures retry
		// within seconds. The quarantine after 20 failures stays.
		"--initializer-backoff", "2s,10s,1.5,20"}
	return startShepherd(t, append(args, extra...)...)
}
