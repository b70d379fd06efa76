package e2e

import (
	"context"
	"crypto/ed25519"
	"fmt"
	"os"
	"path/filepath"
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
	"github.com/shepherd/shepherd/ladder"
	"github.com/shepherd/shepherd/power/ipmi/ipmisim"
)

// TestLadderReachesTheBMC: shepherd run with every component manages two
// machines of a static inventory, real OpenSSH servers standing in for whole
// machines, each behind its own IPMI BMC (OpenIPMI's ipmi_sim, whose chassis
// control really cuts and restores the machine's power). On m1 the agent is
// killed: the ladder's first rung restarts it over SSH, without a reboot.
// On m2 the agent hangs (SIGSTOP) and sshd dies: the agent rung finds no SSH
// answer, the in-band reboot (the inventory's reboot command, over SSH)
// cannot reach the machine, and the power cycle through the BMC brings it
// back: Healthy with a new agent, history listing rungs 1–3 and what each
// returned. m3 and m4 hang the same way, but m3's BMC hangs too (its
// ipmi_sim stopped with SIGSTOP) and m4's inventory has the wrong BMC
// password: each climbs to the top within the BMC's bounds and is
// quarantined with a cause naming every rung, the BMC's error class among
// them, and the machine stays down for an operator.
func TestLadderReachesTheBMC(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	dir := t.TempDir()
	dataDir := filepath.Join(dir, "data")
	signer, err := sshx.LoadOrCreateKey(filepath.Join(dataDir, "ssh_key"))
	if err != nil {
		t.Fatal(err)
	}
	agents := filepath.Join(dir, "agents")
	t.Cleanup(func() { stopAgents(t, agents) })

	var inv strings.Builder
	inv.WriteString("machines:\n")
	var machines []*sshtest.Machine
	var bmcs []*ipmisim.BMC
	for i := range 4 {
		id := fmt.Sprintf("m%d", i+1)
		m := sshtest.StartMachine(t, sshtest.Config{AuthorizedKeys: []ssh.PublicKey{signer.PublicKey()}})
		on, off := m.PowerCommands()
		b := ipmisim.Start(t, ipmisim.Config{On: true, PowerOn: on, PowerOff: off})
		pw := filepath.Join(dir, id+".pw")
		password := b.Password.Reveal()
		if id == "m4" {
			password = "not-" + password
		}
		if err := os.WriteFile(pw, []byte(password+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		machines, bmcs = append(machines, m), append(bmcs, b)
		hostKey := strings.TrimSpace(string(ssh.MarshalAuthorizedKey(m.HostKey)))
		// The in-band reboot kills the agent and restarts sshd, as a
		// reboot would; it needs a live sshd to run at all.
		reboot := fmt.Sprintf("kill $(cat %s) 2>/dev/null; kill -HUP $(cat %s)", pidFile(agents, id), m.PIDFile())
		fmt.Fprintf(&inv, `  - id: %s
    address: %s
    port: %d
    ssh_user: %s
    host_key: %q
    reboot_command: %q
    bmc:
      driver: ipmi
      address: %s
      port: %d
      username: %s
      password_file: %s
`, id, m.Addr.Addr(), m.Addr.Port(), m.User, hostKey, reboot, b.Addr.Addr(), b.Addr.Port(), b.Username, pw)
	}
	// BMC calls 200ms apart (SPEC's 5s default would only slow the test;
	// ipmi_sim takes it), a command re-sent after 5s without effect, a
	// call that gets no answer for 5s given up (ipmi_sim answers in
	// milliseconds; the rest is for a loaded machine).
	runStatic(t, db, dir, inv.String(), "bmc_min_interval: 200ms\nbmc_settle: 5s\nbmc_call_timeout: 5s\n",
		// Three of four machines go silent at once, and two of them
		// need restarts: the circuit breaker, tested elsewhere, must not
		// hold the ladder back here.
		"--silent-fraction", "1", "--max-reboots-per-window", "10",
		"--ssh-connect-timeout", "10s", "--recovery-rungs", ladder.Join(ladder.Default))

	waitStates(t, db, "lab", 3*time.Minute, "every machine Healthy", func(st map[bmdb.MachineState]int64) bool {
		return st[bmdb.StateHealthy] == 4
	})
	ids := make([]bmdbMachine, 4)
	for i := range ids {
		ids[i] = lookupMachine(t, db, fmt.Sprintf("m%d", i+1))
	}

	// m1: the agent dies; sshd answers. Rung 1 restarts the agent.
	if err := syscall.Kill(readPid(t, pidFile(agents, "m1")), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitRecovered(t, db, "lab", ids[0].id, ids[0].key, 4, nil)
	rec := recoveryHistory(t, db, ids[0].id)
	if last := rec[len(rec)-1]; !strings.HasPrefix(last.Cause, "recovery rung agent (") || strings.Contains(last.Cause, "below it") {
		t.Errorf("m1's recovery ended with %q, want rung agent alone", last.Cause)
	}
	if log, _ := os.ReadFile(machines[0].LogPath()); strings.Contains(string(log), "Received SIGHUP") {
		t.Error("m1 was rebooted although restarting its agent did")
	}
	if calls, err := bmcs[0].Calls(); err != nil || len(calls) != 0 {
		t.Errorf("m1's BMC was called (%v, %v) although restarting the agent did", calls, err)
	}

	// m2, m3, m4: the agent hangs and sshd dies; m3's BMC hangs too.
	if err := bmcs[2].Freeze(); err != nil {
		t.Fatal(err)
	}
	agentPids := make([]int, 4)
	for i := 1; i < 4; i++ {
		agentPids[i] = readPid(t, pidFile(agents, fmt.Sprintf("m%d", i+1)))
		if err := syscall.Kill(agentPids[i], syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Kill(readPid(t, machines[i].PIDFile()), syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
	}
	agentPid := agentPids[1]
	waitRecovered(t, db, "lab", ids[1].id, ids[1].key, 2, nil)
	rec = recoveryHistory(t, db, ids[1].id)
	cause := rec[len(rec)-1].Cause
	for _, want := range []string{
		"recovery rung power (power cycle through the BMC) done",
		"agent (restart the agent over SSH): failed: the machine does not answer SSH",
		"reboot (in-band reboot): failed:",
	} {
		if !strings.Contains(cause, want) {
			t.Errorf("m2's recovery ended with %q, want it to say %q", cause, want)
		}
	}
	if machines[1].Runs(agentPid) {
		t.Error("m2's hung agent survived the power cycle")
	}
	calls, err := bmcs[1].Calls()
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(calls, ","); !strings.Contains(got, "set power 0") || !strings.Contains(got, "set power 1") {
		t.Errorf("m2's BMC saw %q, want a power off and on", got)
	}
	// The ladder's record: rungs 1 and 2 failed without reaching the
	// machine, rung 3 stands; only rung 3 counts as a restart.
	tried, err := db.RecoveryStreak(t.Context(), ids[1].id)
	if err != nil {
		t.Fatal(err)
	}
	if len(tried) != 0 {
		t.Errorf("m2 heartbeats again, but its streak is %v", tried)
	}
	var rungs []string
	if err := db.Pool.QueryRow(t.Context(), `SELECT array_agg(rung || ':' || failed ORDER BY admission_id) FROM recovery_admissions WHERE machine_id = $1`, ids[1].id).Scan(&rungs); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(rungs, " "); got != "agent:true reboot:true power:false" {
		t.Errorf("m2's admissions: %s, want agent and reboot failed, power done", got)
	}
	d, err := db.GetMachine(t.Context(), ids[1].id)
	if err != nil || d.Power == nil || d.Power.State != bmdb.PowerOn {
		t.Errorf("m2's recorded power state: %+v, %v; want on", d.Power, err)
	}

	for i, class := range map[int]string{2: "unreachable", 3: "auth"} {
		var b bmdb.Backoff
		bmdbtest.WaitFor(t, 2*time.Minute, fmt.Sprintf("m%d quarantined for Recovery", i+1), func(ctx context.Context) (bool, error) {
			var err error
			b, err = db.GetBackoff(ctx, ids[i].id, bmdb.ProcessRecovery)
			return err == nil && b.Quarantined, nil
		})
		for _, want := range []string{
			"every recovery rung failed: agent (restart the agent over SSH): failed: the machine does not answer SSH",
			"; reboot (in-band reboot): failed: ",
			"; power (power cycle through the BMC): failed: power cycle through ipmi://",
		} {
			if !strings.Contains(b.Cause, want) {
				t.Errorf("m%d's quarantine: %q, want it to say %q", i+1, b.Cause, want)
			}
		}
		d, err := db.GetMachine(t.Context(), ids[i].id)
		if err != nil || d.Power == nil || d.Power.ErrorClass != class {
			t.Errorf("m%d's recorded power state: %+v, %v; want the error class %s", i+1, d.Power, err, class)
		}
		if !machines[i].Runs(agentPids[i]) {
			t.Errorf("m%d's hung agent is gone although no rung reached the machine", i+1)
		}
		if strings.Contains(b.Cause, bmcs[i].Password.Reveal()) {
			t.Errorf("m%d's quarantine cause shows the BMC password", i+1)
		}
	}
	if calls, err := bmcs[3].Calls(); err != nil || len(calls) != 0 {
		t.Errorf("the BMC that refused the password carried out %v (%v)", calls, err)
	}
}

// bmdbMachine is a machine's id and its agent's key when looked up.
type bmdbMachine struct {
	id  uuid.UUID
	key ed25519.PublicKey
}

func lookupMachine(t *testing.T, db *bmdbtest.DB, pid string) bmdbMachine {
	t.Helper()
	id, err := db.MachineByProviderID(t.Context(), "lab", pid)
	if err != nil {
		t.Fatal(err)
	}
	_, key, err := db.GetAgentStarted(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	return bmdbMachine{id: id, key: key}
}

// recoveryHistory returns machine's Recovery history; it must not be empty.
func recoveryHistory(t *testing.T, db *bmdbtest.DB, machine uuid.UUID) []bmdb.HistoryEvent {
	t.Helper()
	h, err := db.History(context.WithoutCancel(t.Context()), bmdb.HistoryFilter{MachineID: machine, Process: bmdb.ProcessRecovery})
	if err != nil || len(h) == 0 {
		t.Fatalf("recovery history: %v, %v", h, err)
	}
	return h
}
