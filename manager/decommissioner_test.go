package manager_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/user"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/metricstest"
	"github.com/shepherd/shepherd/internal/sshtest"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/provider"
	"github.com/shepherd/shepherd/provider/sim"
	"github.com/shepherd/shepherd/provider/static"
)

// fastLoop is a loop configuration for tests: short idle sleeps, and a
// lease long enough that a loaded machine's stalls do not cost a session.
var fastLoop = manager.LoopConfig{IdleSleep: 100 * time.Millisecond, Lease: 10 * time.Second}

// runDecommissioner runs a decommissioner of p until the test ends.
func runDecommissioner(t *testing.T, db *bmdbtest.DB, p provider.Provider, reg prometheus.Registerer, backoff bmdb.BackoffPolicy) {
	t.Helper()
	runDecommissionerWith(t, manager.DecommissionerConfig{Loop: fastLoop, Backoff: backoff}, db, p, reg)
}

// runDecommissionerWith runs a decommissioner of p configured as cfg until
// the test ends.
func runDecommissionerWith(t *testing.T, cfg manager.DecommissionerConfig, db *bmdbtest.DB, p provider.Provider, reg prometheus.Registerer) {
	t.Helper()
	d, err := manager.NewDecommissioner(cfg, db.DB, p, reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- d.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("decommissioner: %v", err)
		}
	})
}

// requestDecommission asks for the machine to leave the fleet, as an
// operator does.
func requestDecommission(t *testing.T, db *bmdbtest.DB, id uuid.UUID) {
	t.Helper()
	s := bmdbtest.Session(t, db, "operator", time.Minute)
	err := s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		return tx.RequestDecommission(ctx, id, "test", "end of life")
	})
	if err != nil {
		t.Fatal(err)
	}
}

// waitDecommissioned waits until the machine is decommissioned and returns
// its record.
func waitDecommissioned(t *testing.T, db *bmdbtest.DB, id uuid.UUID) bmdb.DecommissionRecord {
	t.Helper()
	var rec bmdb.DecommissionRecord
	bmdbtest.WaitFor(t, 60*time.Second, "machine decommissioned", func(ctx context.Context) (bool, error) {
		var err error
		rec, err = db.GetDecommissioned(ctx, id)
		return err == nil, err
	})
	return rec
}

// liveTags counts the rows the machine has in tag tables and backoffs.
func liveTags(ctx context.Context, db *bmdbtest.DB, id uuid.UUID) (int64, error) {
	var n int64
	err := db.Pool.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM machine_provided WHERE machine_id = $1) +
		(SELECT count(*) FROM machine_agent_started WHERE machine_id = $1) +
		(SELECT count(*) FROM machine_agent_heartbeat WHERE machine_id = $1) +
		(SELECT count(*) FROM machine_hardware_report WHERE machine_id = $1) +
		(SELECT count(*) FROM machine_os_installation_request WHERE machine_id = $1) +
		(SELECT count(*) FROM machine_os_installation_report WHERE machine_id = $1) +
		(SELECT count(*) FROM machine_ssh_host_key WHERE machine_id = $1) +
		(SELECT count(*) FROM machine_decommission_request WHERE machine_id = $1) +
		(SELECT count(*) FROM work_backoff WHERE machine_id = $1)`, id).Scan(&n)
	return n, err
}

// checkLeftFleet checks what every decommissioned machine must satisfy: no
// live tag (after the janitor swept what raced with the decommission), no
// candidate query selects it, its machines row has decommissioned_at, and
// its history ends with the Decommission process's Started and Finished.
func checkLeftFleet(t *testing.T, db *bmdbtest.DB, providerName string, id uuid.UUID) {
	t.Helper()
	j, err := manager.NewJanitor(manager.JanitorConfig{}, db.DB, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	bmdbtest.WaitFor(t, time.Minute, "no live tags left", func(ctx context.Context) (bool, error) {
		if _, err := j.Pass(ctx); err != nil {
			return false, err
		}
		n, err := liveTags(ctx, db, id)
		return n == 0, err
	})
	for _, c := range []struct {
		p  bmdb.Process
		cs bmdb.Candidates
	}{
		{bmdb.ProcessAgentStart, bmdb.AgentStartCandidates(providerName)},
		{bmdb.ProcessRecovery, bmdb.RecoveryCandidates(providerName, time.Millisecond, time.Millisecond)},
		{bmdb.ProcessDecommission, bmdb.DecommissionCandidates(providerName)},
	} {
		ids, err := db.ListCandidates(t.Context(), c.p, c.cs, 1000)
		if err != nil {
			t.Fatal(err)
		}
		if slices.Contains(ids, id) {
			t.Errorf("the decommissioned machine is a %s candidate", c.p)
		}
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM machines WHERE machine_id = $1 AND decommissioned_at IS NOT NULL", id); n != 1 {
		t.Error("the machines row is gone or has no decommissioned_at")
	}
	h := events(t, db, id)
	if len(h) < 2 || h[len(h)-2].Process != bmdb.ProcessDecommission || h[len(h)-2].Event != bmdb.EventStarted ||
		h[len(h)-1].Process != bmdb.ProcessDecommission || h[len(h)-1].Event != bmdb.EventFinished {
		t.Errorf("history does not end with the decommission's Started and Finished:")
		for _, e := range h {
			t.Logf("  %s %s %s %s", e.At.Format("15:04:05.000"), e.Process, e.Event, e.Cause)
		}
	}
}

// TestDecommissionSimMachine decommissions a machine of a running simulated
// fleet (callback server, provisioner, initializer, recoverer): the
// provider releases it, which stops its agent; the server would refuse the
// agent's key; it leaves every candidate query and the fleet counts but
// keeps its history; and the provisioner does not take its slot back.
func TestDecommissionSimMachine(t *testing.T) {
	t.Parallel()
	const machines = 5
	const interval = 100 * time.Millisecond
	f := startFleet(t, fleetConfig{
		sim:       sim.Config{Machines: machines, TakeoverLatency: 10 * time.Millisecond},
		recoverer: manager.RecovererConfig{HeartbeatTimeout: time.Minute, FirstHeartbeatTimeout: time.Minute},
		interval:  interval,
	})
	f.waitHealthy(machines, 3*time.Minute)
	refs, err := f.db.ListProvided(t.Context(), f.sim.Name())
	if err != nil {
		t.Fatal(err)
	}
	victim, other := refs[1], refs[2]
	_, key, err := f.db.GetAgentStarted(t.Context(), victim.MachineID)
	if err != nil {
		t.Fatal(err)
	}
	runDecommissioner(t, f.db, f.sim, f.reg, bmdb.BackoffPolicy{})

	requestDecommission(t, f.db, victim.MachineID)
	rec := waitDecommissioned(t, f.db, victim.MachineID)
	if !rec.Released || rec.Provider != f.sim.Name() || rec.ProviderID != victim.ProviderID || rec.RequestedBy != "test" || rec.Reason != "end of life" {
		t.Errorf("decommission record %+v", rec)
	}
	checkLeftFleet(t, f.db, f.sim.Name(), victim.MachineID)

	// Released: the slot is free capacity, and its agent stopped.
	if st := f.sim.Stats(); st.Releases != 1 || st.AgentsRunning != machines-1 {
		t.Errorf("sim stats %+v, want 1 release and %d agents", st, machines-1)
	}
	if m, err := f.sim.GetMachine(t.Context(), victim.ProviderID); err != nil || m.Availability() != provider.KnownUnused {
		t.Errorf("the released slot: %v, %v; want free capacity", m, err)
	}
	waitSimHeartbeat(t, f.sim, other.ProviderID, time.Now().Add(2*interval))
	last := f.sim.LastHeartbeat(victim.ProviderID)
	waitSimHeartbeat(t, f.sim, other.ProviderID, time.Now().Add(5*interval))
	if got := f.sim.LastHeartbeat(victim.ProviderID); !got.Equal(last) {
		t.Errorf("the decommissioned machine's agent heartbeated at %v, after %v", got, last)
	}
	// Its agent key authenticates nothing any more: the server's check.
	res, err := f.db.RecordHeartbeats(t.Context(), []bmdb.Heartbeat{{MachineID: victim.MachineID, AgentKey: key}})
	if err != nil || res[0].Accepted {
		t.Errorf("a heartbeat with the decommissioned agent's key: %+v, %v; want refused", res, err)
	}

	// The fleet carries on without it, and the provisioner, which keeps
	// passing over the listing that has its slot free again, does not make
	// a machine of it.
	passes := func() float64 {
		return metricstest.Value(t, f.reg, "shepherd_provisioner_passes_total", "provider", "sim", "result", "ok")
	}
	after := passes() + 3
	bmdbtest.WaitFor(t, time.Minute, "three more provisioner passes", func(context.Context) (bool, error) {
		return passes() >= after, nil
	})
	f.waitHealthy(machines-1, time.Minute)
	st, err := f.db.FleetStates(t.Context(), f.sim.Name(), 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(st) != 1 || st[bmdb.StateHealthy] != machines-1 {
		t.Errorf("FleetStates() = %v, want the %d other machines Healthy and nothing else", st, machines-1)
	}
	if _, err := f.db.MachineByProviderID(t.Context(), f.sim.Name(), victim.ProviderID); !errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("slot %s is in the fleet again: %v", victim.ProviderID, err)
	}
	// Its earlier history is still there.
	if !slices.ContainsFunc(events(t, f.db, victim.MachineID), func(e bmdb.HistoryEvent) bool {
		return e.Process == bmdb.ProcessAgentStart && e.Event == bmdb.EventFinished
	}) {
		t.Error("the agent start of the decommissioned machine is gone from its history")
	}
}

// waitSimHeartbeat waits until the fleet saw a successful heartbeat of slot
// id after after.
func waitSimHeartbeat(t *testing.T, f *sim.Fleet, id string, after time.Time) {
	t.Helper()
	bmdbtest.WaitFor(t, time.Minute, "a heartbeat of "+id, func(context.Context) (bool, error) {
		return f.LastHeartbeat(id).After(after), nil
	})
}

// unreleasable is a simulated fleet seen through a provider that cannot
// release machines: the decommissioner only forgets them.
type unreleasable struct {
	provider.Provider
	provider.Recoverer
	provider.SSHAccessor
}

// TestDecommissionUnreleasedSimMachine decommissions a simulated machine
// whose provider cannot release it: its agent keeps running and sending
// heartbeats, and the callback server refuses every one of them as retired
// (PermissionDenied, which tells a real agent to stop).
func TestDecommissionUnreleasedSimMachine(t *testing.T) {
	t.Parallel()
	const machines = 3
	const interval = 100 * time.Millisecond
	f := startFleet(t, fleetConfig{
		sim:       sim.Config{Machines: machines, TakeoverLatency: 10 * time.Millisecond},
		recoverer: manager.RecovererConfig{HeartbeatTimeout: time.Minute, FirstHeartbeatTimeout: time.Minute},
		interval:  interval,
	})
	f.waitHealthy(machines, 3*time.Minute)
	refs, err := f.db.ListProvided(t.Context(), f.sim.Name())
	if err != nil {
		t.Fatal(err)
	}
	victim := refs[0]
	runDecommissioner(t, f.db, unreleasable{f.sim, f.sim, f.sim}, prometheus.NewRegistry(), bmdb.BackoffPolicy{})
	requestDecommission(t, f.db, victim.MachineID)
	if rec := waitDecommissioned(t, f.db, victim.MachineID); rec.Released {
		t.Errorf("record %+v says released, the provider cannot release", rec)
	}
	rejected := func() float64 {
		return metricstest.Value(t, f.reg, "shepherd_server_heartbeats_rejected_total", "reason", "retired")
	}
	before := rejected()
	bmdbtest.WaitFor(t, time.Minute, "the agent's heartbeats refused", func(context.Context) (bool, error) {
		return rejected() >= before+2, nil
	})
	if st := f.sim.Stats(); st.AgentsRunning != machines || st.Releases != 0 {
		t.Errorf("sim stats %+v: the agent should still run, unreleased", st)
	}
	checkLeftFleet(t, f.db, f.sim.Name(), victim.MachineID)
	if _, err := f.db.GetAgentHeartbeat(t.Context(), victim.MachineID); !errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("a refused heartbeat was recorded: %v", err)
	}
}

// TestDecommissionStaticNotReadopted decommissions a machine of a static
// inventory, which cannot release it and keeps listing it: the provisioner
// leaves it alone from then on.
func TestDecommissionStaticNotReadopted(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	path := filepath.Join(t.TempDir(), "inventory.yaml")
	inv := "machines:\n"
	for i, id := range []string{"a", "b", "c", "d", "e", "f"} {
		inv += fmt.Sprintf("  - id: %s\n    address: 192.0.2.%d\n    location: lab/rack%d\n", id, i+1, i%2)
	}
	if err := os.WriteFile(path, []byte(inv), 0o644); err != nil {
		t.Fatal(err)
	}
	p, err := static.New(static.Config{Name: "lab", Inventory: path, ReloadInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := any(p).(provider.Releaser); ok {
		t.Fatal("the static provider releases machines; this test needs one that cannot")
	}
	pr, err := manager.NewProvisioner(manager.ProvisionerConfig{}, db.DB, p, prometheus.NewRegistry(), nil)
	if err != nil {
		t.Fatal(err)
	}
	s := bmdbtest.Session(t, db, "provisioner", time.Minute)
	if r, err := pr.Pass(t.Context(), s); err != nil || r.Created != 6 {
		t.Fatalf("first pass %+v, %v; want the 6 machines recorded", r, err)
	}
	b, err := db.MachineByProviderID(t.Context(), "lab", "b")
	if err != nil {
		t.Fatal(err)
	}
	runDecommissioner(t, db, p, prometheus.NewRegistry(), bmdb.BackoffPolicy{})
	requestDecommission(t, db, b)
	rec := waitDecommissioned(t, db, b)
	if rec.Released || rec.ProviderID != "b" || rec.Location != "lab/rack1" {
		t.Errorf("decommission record %+v, want b in lab/rack1, not released", rec)
	}
	checkLeftFleet(t, db, "lab", b)

	for range 2 {
		r, err := pr.Pass(t.Context(), s)
		if err != nil {
			t.Fatal(err)
		}
		if r.Created != 0 || r.Adopted != 0 || r.Decommissioned != 1 || r.MarkedMissing != 0 {
			t.Errorf("pass after the decommission %+v, want b skipped as decommissioned and nothing else done", r)
		}
	}
	if _, err := db.MachineByProviderID(t.Context(), "lab", "b"); !errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("b is in the fleet again: %v", err)
	}
	if got := ourIDs(t, db, "lab"); len(got) != 5 {
		t.Errorf("the fleet after the decommission: %v, want the 5 others", got)
	}
}

// flaky is a provider whose releases fail while fail is set.
type flaky struct {
	provider.Provider // nil: only Name and ReleaseMachine are used
	name              string
	fail              atomic.Bool
	released          atomic.Int32
}

func (f *flaky) Name() string { return f.name }

func (f *flaky) ReleaseMachine(context.Context, string) error {
	if f.fail.Load() {
		return errors.New("provider API unavailable")
	}
	f.released.Add(1)
	return nil
}

// TestDecommissionReleaseFails: while the provider cannot release the
// machine, the work fails and backs off, the machine stays in the fleet as
// Decommissioning; once the provider can, it is decommissioned.
func TestDecommissionReleaseFails(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	setup := bmdbtest.Session(t, db, "setup", time.Minute)
	id := bmdbtest.AddMachine(t, db, setup, "lab")
	p := &flaky{name: "lab"}
	p.fail.Store(true)
	reg := prometheus.NewRegistry()
	runDecommissioner(t, db, p, reg, bmdb.BackoffPolicy{Initial: 300 * time.Millisecond})
	requestDecommission(t, db, id)
	bmdbtest.WaitFor(t, time.Minute, "two failed attempts", func(ctx context.Context) (bool, error) {
		b, err := db.GetBackoff(ctx, id, bmdb.ProcessDecommission)
		if errors.Is(err, bmdb.ErrNotFound) {
			return false, nil
		}
		return err == nil && b.Attempts >= 2, err
	})
	st, err := db.FleetStates(t.Context(), "lab", 0, 0)
	if err != nil || st[bmdb.StateDecommissioning] != 1 {
		t.Errorf("FleetStates() = %v, %v; want the machine Decommissioning", st, err)
	}
	h := events(t, db, id)
	if !slices.ContainsFunc(h, func(e bmdb.HistoryEvent) bool {
		return e.Process == bmdb.ProcessDecommission && e.Event == bmdb.EventFailed && e.Cause != ""
	}) {
		t.Errorf("no Failed decommission with its cause in the history: %+v", h)
	}
	p.fail.Store(false)
	if rec := waitDecommissioned(t, db, id); !rec.Released {
		t.Errorf("record %+v, want released", rec)
	}
	if n := p.released.Load(); n != 1 {
		t.Errorf("%d releases, want 1", n)
	}
	if got := metricstest.Value(t, reg, "shepherd_decommissioner_releases_total", "provider", "lab", "result", "error"); got < 2 {
		t.Errorf("releases_total{result=error} = %v, want >= 2", got)
	}
}

// stoppableAgent is the fake agent binary of TestDecommissionStopsAgentOverSSH:
// takeover as fakeAgent, and "stop --state-dir DIR" records its arguments in
// DIR/../stopped.
const stoppableAgent = `#!/bin/sh
case "$1" in
takeover) cat >/dev/null; exec cat "$(dirname "$3")/response" ;;
stop) echo "$@" >"$(dirname "$3")/stopped" ;;
*) exit 2 ;;
esac
`

// TestDecommissionStopsAgentOverSSH: a static machine cannot be released, so
// its agent would run on after the decommission (issue 10, item 23). The
// decommissioner stops it over SSH through the host key recorded at the
// takeover; a machine it cannot reach is decommissioned all the same (its
// agent stops when the server answers it PermissionDenied).
func TestDecommissionStopsAgentOverSSH(t *testing.T) {
	t.Parallel()
	forEachSSHKind(t, func(t *testing.T, kind sshtest.Kind) {
		key := sshtest.NewKey(t)
		hosts := sshtest.Start(t, 1, sshtest.Config{Kind: kind, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})
		f := newSSHFixture(t, hosts, key, fmt.Sprintf(`machines:
  - {id: reachable, address: HOST_0, port: PORT_0}
  - {id: unreachable, address: 127.0.0.1, port: %d, host_key: KEY_0_0}
`, closedPort(t)))
		if err := os.WriteFile(f.agent, []byte(stoppableAgent), 0o755); err != nil {
			t.Fatal(err)
		}
		f.startInitializer()
		if started, cause := f.takeover("reachable", 0); !started {
			t.Fatalf("agent start failed: %s", cause)
		}

		reg := prometheus.NewRegistry()
		runDecommissionerWith(t, manager.DecommissionerConfig{Loop: fastLoop, AgentStop: &manager.AgentStopConfig{
			SSHKey: key, SSHUser: hosts[0].User, AgentDir: filepath.Join(f.agents, "{provider_id}"), Timeout: 20 * time.Second,
		}}, f.db, f.p, reg)
		for _, pid := range []string{"reachable", "unreachable"} {
			requestDecommission(t, f.db, f.machines[pid])
		}
		for _, pid := range []string{"reachable", "unreachable"} {
			waitDecommissioned(t, f.db, f.machines[pid])
		}
		got, err := os.ReadFile(filepath.Join(f.agents, "reachable", "stopped"))
		if err != nil {
			t.Fatalf("the agent of the reachable machine was not stopped: %v", err)
		}
		if want := "stop --state-dir " + filepath.Join(f.agents, "reachable", "state") + "\n"; string(got) != want {
			t.Errorf("the agent was run with %q, want %q", got, want)
		}
		for result, want := range map[string]float64{"stopped": 1, "failed": 1, "unverified": 0} {
			if got := metricstest.Value(t, reg, "shepherd_decommissioner_agent_stops_total", "provider", "lab", "result", result); got != want {
				t.Errorf("agent stops %s = %v, want %v", result, got, want)
			}
		}
	})
}

// closedPort returns a loopback TCP port nothing listens on.
func closedPort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	return port
}

// TestAgentDirUnderHome: a relative agent directory (the default one of an
// SSH user other than root is .local/state/shepherd-agent) lies under the
// SSH user's home: the initializer uploads the agent there and gives it an
// absolute state directory, and the decommissioner stops it with that very
// directory. (The tests' servers let only the user running them in, root in
// CI, so the directory is made relative to that user's home here.)
func TestAgentDirUnderHome(t *testing.T) {
	t.Parallel()
	forEachSSHKind(t, func(t *testing.T, kind sshtest.Kind) {
		key := sshtest.NewKey(t)
		hosts := sshtest.Start(t, 1, sshtest.Config{Kind: kind, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})
		f := newSSHFixture(t, hosts, key, `machines:
  - {id: m1, address: HOST_0, port: PORT_0}
`)
		// stoppableAgent that records its takeover's arguments too.
		agent := strings.Replace(stoppableAgent, "takeover) ", `takeover) echo "$@" >"$(dirname "$3")/started"; `, 1)
		if err := os.WriteFile(f.agent, []byte(agent), 0o755); err != nil {
			t.Fatal(err)
		}
		// OpenSSH starts SFTP and commands in the user's home; the
		// in-process server in the host's directory.
		home := hosts[0].Dir
		if kind == sshtest.OpenSSH {
			u, err := user.Current()
			if err != nil {
				t.Fatal(err)
			}
			home = u.HomeDir
		}
		rel, err := filepath.Rel(home, f.agents)
		if err != nil || filepath.IsAbs(rel) {
			t.Fatalf("%s relative to %s: %q, %v", f.agents, home, rel, err)
		}
		f.agentDir = filepath.Join(rel, "{provider_id}")
		f.startInitializer()
		if started, cause := f.takeover("m1", 0); !started {
			t.Fatalf("agent start with AgentDir %s: %s", f.agentDir, cause)
		}
		if fi, err := os.Stat(filepath.Join(f.agents, "m1", "shepherd-agent")); err != nil || fi.Mode()&0o111 == 0 {
			t.Fatalf("the agent was not uploaded under the home directory: %v", err)
		}
		if got, err := os.ReadFile(filepath.Join(f.agents, "m1", "started")); err != nil ||
			string(got) != "takeover --state-dir "+filepath.Join(f.agents, "m1", "state")+"\n" {
			t.Errorf("the agent's takeover was run with %q (%v), want an absolute --state-dir under the home directory", got, err)
		}

		runDecommissionerWith(t, manager.DecommissionerConfig{Loop: fastLoop, AgentStop: &manager.AgentStopConfig{
			SSHKey: key, SSHUser: hosts[0].User, AgentDir: f.agentDir, Timeout: 20 * time.Second,
		}}, f.db, f.p, prometheus.NewRegistry())
		requestDecommission(t, f.db, f.machines["m1"])
		waitDecommissioned(t, f.db, f.machines["m1"])
		got, err := os.ReadFile(filepath.Join(f.agents, "m1", "stopped"))
		if err != nil {
			t.Fatalf("the agent was not stopped: %v", err)
		}
		if want := "stop --state-dir " + filepath.Join(f.agents, "m1", "state") + "\n"; string(got) != want {
			t.Errorf("the agent was stopped with %q, want %q (the absolute directory it was started in)", got, want)
		}
	})
}
