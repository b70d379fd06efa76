package manager_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/metricstest"
	"github.com/shepherd/shepherd/ladder"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/power"
	"github.com/shepherd/shepherd/provider/sim"
)

// TestLadderOnSimulatedBMCs climbs the recovery ladder on a simulated fleet
// whose machines have BMCs, each machine failing differently at once:
//   - sim-000001's agent hangs, its host answers: the agent rung restarts
//     it, without a reboot and without touching the BMC;
//   - sim-000002 hangs whole (agent silent, SSH dead): the agent and reboot
//     rungs fail without reaching it, the power cycle brings it back;
//   - sim-000003 hangs, and its BMC refuses the credentials: asked exactly
//     once (BMCs lock accounts), then the machine is quarantined with a
//     cause naming every rung and what it returned;
//   - sim-000004 hangs, and its BMC never answers: within the controller's
//     bounds (2 calls of 500ms), then quarantined the same way.
func TestLadderOnSimulatedBMCs(t *testing.T) {
	t.Parallel()
	f := startFleet(t, fleetConfig{
		sim: sim.Config{Machines: 4, TakeoverLatency: 20 * time.Millisecond, RebootLatency: 100 * time.Millisecond,
			BMC: &sim.BMCConfig{
				Fraction: 1, Transition: 100 * time.Millisecond,
				Power: power.Config{MinInterval: 20 * time.Millisecond, CallTimeout: 500 * time.Millisecond, Settle: 2 * time.Second, Attempts: 2},
				Auth:  sim.BMCFault{Machines: []string{"sim-000003"}},
				Hung:  sim.BMCFault{Machines: []string{"sim-000004"}},
			}},
		recoverer: manager.RecovererConfig{
			// Forty heartbeat intervals: no loaded machine stalls that long.
			HeartbeatTimeout: 8 * time.Second, FirstHeartbeatTimeout: time.Minute,
			MaxRebootsPerWindow: 100, SilentFraction: 1,
		},
		interval:  200 * time.Millisecond,
		agentRung: true,
	})
	f.waitHealthy(4, 3*time.Minute)
	ids := map[string]uuid.UUID{}
	refs, err := f.db.ListProvided(t.Context(), f.sim.Name())
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range refs {
		ids[r.ProviderID] = r.MachineID
	}
	if err := f.sim.Silence("sim-000001"); err != nil {
		t.Fatal(err)
	}
	if err := f.sim.Hang("sim-000002", "sim-000003", "sim-000004"); err != nil {
		t.Fatal(err)
	}

	// lastRecovery waits until machine's Recovery history ends with want.
	lastRecovery := func(pid string, want bmdb.Event) string {
		t.Helper()
		var cause string
		bmdbtest.WaitFor(t, 2*time.Minute, pid+"'s recovery "+string(want), func(ctx context.Context) (bool, error) {
			h, err := f.db.History(ctx, bmdb.HistoryFilter{MachineID: ids[pid], Process: bmdb.ProcessRecovery})
			if err != nil || len(h) == 0 {
				return false, err
			}
			last := h[len(h)-1]
			cause = last.Cause
			return last.Event == want, nil
		})
		return cause
	}

	if cause := lastRecovery("sim-000001", bmdb.EventFinished); cause != "recovery rung agent (restart the agent over SSH) done; waiting for a heartbeat" {
		t.Errorf("sim-000001's recovery: %q, want the agent rung alone", cause)
	}
	cause := lastRecovery("sim-000002", bmdb.EventFinished)
	for _, want := range []string{
		"recovery rung power (power cycle through the BMC) done",
		"below it: agent (restart the agent over SSH): failed: the machine does not answer SSH",
		"; reboot (in-band reboot): failed: rebooting through sim",
	} {
		if !strings.Contains(cause, want) {
			t.Errorf("sim-000002's recovery: %q, want it to say %q", cause, want)
		}
	}
	for pid, class := range map[string]error{"sim-000003": power.ErrAuth, "sim-000004": power.ErrUnreachable} {
		b := waitQuarantined(t, f, ids[pid])
		for _, want := range []string{"every recovery rung failed: agent", "power (power cycle through the BMC): failed: power cycle through sim-bmc " + pid, class.Error()} {
			if !strings.Contains(b.Cause, want) {
				t.Errorf("%s's quarantine: %q, want it to say %q", pid, b.Cause, want)
			}
		}
	}
	f.waitHealthy(2, 2*time.Minute)

	if _, n := f.sim.Rebooted("sim-000001"); n != 0 {
		t.Errorf("sim-000001 rebooted %d times although restarting its agent did", n)
	}
	if n := f.sim.BMCCalls("sim-000001"); n != 0 {
		t.Errorf("sim-000001's BMC called %d times although restarting its agent did", n)
	}
	if n := f.sim.BMCCalls("sim-000002"); n < 4 {
		t.Errorf("sim-000002's BMC called %d times, want a whole cycle (state, off, state, on, state)", n)
	}
	if n := f.sim.BMCCalls("sim-000003"); n != 1 {
		t.Errorf("the BMC that refused the credentials was asked %d times, want once", n)
	}
	if n := f.sim.BMCCalls("sim-000004"); n != 2 {
		t.Errorf("the hung BMC was called %d times, want the controller's 2 attempts", n)
	}
	for _, c := range []struct {
		rung, result string
		want         float64
	}{
		{"agent", "done", 1}, {"agent", "failed", 3}, {"reboot", "failed", 3}, {"reboot", "done", 0},
		{"power", "done", 1}, {"power", "failed", 2}, {"reinstall", "done", 0},
	} {
		if got := metricstest.Value(t, f.reg, "shepherd_recovery_rungs_total", "rung", c.rung, "result", c.result); got != c.want {
			t.Errorf("shepherd_recovery_rungs_total{rung=%q,result=%q} = %v, want %v", c.rung, c.result, got, c.want)
		}
	}
	// The breaker counted the power cycles that reached a BMC, not the
	// agent restart, nor the rungs that failed before reaching anything.
	st, err := manager.ReadBreaker(t.Context(), f.db.DB, f.sim.Name(), manager.RecovererConfig{MaxRebootsPerWindow: 100})
	if err != nil {
		t.Fatal(err)
	}
	if st.RebootsInWindow != 2 {
		t.Errorf("breaker counts %d restarts, want 2 (sim-000002's cycle and the hung BMC's, which may have acted)", st.RebootsInWindow)
	}
}

// waitQuarantined waits until machine is quarantined for Recovery.
func waitQuarantined(t *testing.T, f *fleet, machine uuid.UUID) bmdb.Backoff {
	t.Helper()
	var b bmdb.Backoff
	bmdbtest.WaitFor(t, 2*time.Minute, "machine "+machine.String()+" quarantined for Recovery", func(ctx context.Context) (bool, error) {
		var err error
		b, err = f.db.GetBackoff(ctx, machine, bmdb.ProcessRecovery)
		if err != nil {
			return false, nil
		}
		return b.Quarantined, nil
	})
	return b
}

// TestLadderClimbsPastAMachineThatStaysDown: a reboot that is carried out
// but after which the machine never answers SSH again (it fails to boot)
// is a failed rung once BootTimeout has passed, and the ladder climbs to
// the power cycle in the same work item; the initializer meets a booted
// machine.
func TestLadderClimbsPastAMachineThatStaysDown(t *testing.T) {
	t.Parallel()
	f := startFleet(t, fleetConfig{
		sim: sim.Config{Machines: 1, TakeoverLatency: 20 * time.Millisecond, RebootLatency: 100 * time.Millisecond,
			BMC: &sim.BMCConfig{Fraction: 1, Transition: 100 * time.Millisecond,
				Power: power.Config{MinInterval: 20 * time.Millisecond, Settle: 2 * time.Second}}},
		recoverer: manager.RecovererConfig{
			HeartbeatTimeout: 8 * time.Second, FirstHeartbeatTimeout: time.Minute,
			MaxRebootsPerWindow: 100, SilentFraction: 1,
			Rungs:       []ladder.Rung{ladder.Reboot, ladder.Power},
			BootTimeout: 2 * time.Second, BootPoll: 100 * time.Millisecond,
		},
		interval:  200 * time.Millisecond,
		agentRung: true,
	})
	f.waitHealthy(1, 3*time.Minute)
	const id = "sim-000001"
	m, err := f.db.MachineByProviderID(t.Context(), f.sim.Name(), id)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.sim.SetRebootFault(id, sim.RebootStaysDown); err != nil {
		t.Fatal(err)
	}
	if err := f.sim.Silence(id); err != nil {
		t.Fatal(err)
	}
	var cause string
	bmdbtest.WaitFor(t, 2*time.Minute, "recovery finished", func(ctx context.Context) (bool, error) {
		h, err := f.db.History(ctx, bmdb.HistoryFilter{MachineID: m, Process: bmdb.ProcessRecovery})
		if err != nil || len(h) == 0 {
			return false, err
		}
		cause = h[len(h)-1].Cause
		return h[len(h)-1].Event == bmdb.EventFinished, nil
	})
	want := "recovery rung power (power cycle through the BMC) done; waiting for a heartbeat; below it: reboot (in-band reboot): failed: " +
		"in-band reboot carried out, but the machine did not answer SSH within 2s"
	if !strings.HasPrefix(cause, want) {
		t.Errorf("recovery: %q, want it to start with %q", cause, want)
	}
	f.waitHealthy(1, 2*time.Minute)
	if _, n := f.sim.Rebooted(id); n != 2 {
		t.Errorf("%d reboots counted, want 2 (the in-band one and the power-on)", n)
	}
}

// TestLadderWithoutApplicableRung: a machine none of whose configured rungs
// it can take (power, and it has no BMC) is quarantined with a cause that
// says so, and nothing is done to it.
func TestLadderWithoutApplicableRung(t *testing.T) {
	t.Parallel()
	f := startFleet(t, fleetConfig{
		sim: sim.Config{Machines: 1, TakeoverLatency: 20 * time.Millisecond, RebootLatency: 100 * time.Millisecond},
		recoverer: manager.RecovererConfig{
			HeartbeatTimeout: 8 * time.Second, FirstHeartbeatTimeout: time.Minute, MaxRebootsPerWindow: 100, SilentFraction: 1,
			Rungs: []ladder.Rung{ladder.Power},
		},
		interval: 200 * time.Millisecond,
	})
	f.waitHealthy(1, 3*time.Minute)
	const id = "sim-000001"
	m, err := f.db.MachineByProviderID(t.Context(), f.sim.Name(), id)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.sim.Silence(id); err != nil {
		t.Fatal(err)
	}
	b := waitQuarantined(t, f, m)
	if !strings.HasPrefix(b.Cause, "no recovery rung applies to the machine") {
		t.Errorf("quarantine cause %q", b.Cause)
	}
	// The work fails with the cause; it does not finish as if recovered.
	bmdbtest.WaitFor(t, time.Minute, "the recovery work ended", func(ctx context.Context) (bool, error) {
		h, err := f.db.History(ctx, bmdb.HistoryFilter{MachineID: m, Process: bmdb.ProcessRecovery})
		if err != nil || len(h) == 0 {
			return false, err
		}
		last := h[len(h)-1]
		if last.Event == bmdb.EventFinished {
			t.Fatalf("recovery of a machine no rung applies to ended Finished: %+v", h)
		}
		return last.Event == bmdb.EventFailed && strings.HasPrefix(last.Cause, "no recovery rung applies"), nil
	})
	if _, n := f.sim.Rebooted(id); n != 0 {
		t.Errorf("the machine was rebooted %d times", n)
	}
	if n := bmdbtest.Scalar[int64](t, f.db, "SELECT count(*) FROM recovery_admissions"); n != 0 {
		t.Errorf("%d rungs admitted, want none", n)
	}
}
