package bmdb_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/ladder"
)

// recovery is a provider's fleet with silent machines and the recovery
// query the recoverer claims them with (default timeouts).
type recovery struct {
	fixture
	provider string
	cands    bmdb.Candidates
}

func newRecovery(t *testing.T) recovery {
	db := bmdbtest.New(t)
	return recovery{
		fixture:  fixture{t: t, db: db, s: bmdbtest.Session(t, db, "test", time.Minute)},
		provider: "p",
		cands:    bmdb.RecoveryCandidates("p", 0, 0),
	}
}

// silent adds a machine whose agent started two hours ago and never
// heartbeat: a recovery candidate.
func (r recovery) silent() uuid.UUID {
	r.t.Helper()
	id := bmdbtest.AddMachine(r.t, r.db, r.s, r.provider)
	r.started(id, 2*time.Hour)
	return id
}

// claim claims the next recovery candidate under s and checks it is want.
func (r recovery) claim(s *bmdb.Session, want uuid.UUID) *bmdb.Work {
	r.t.Helper()
	w, err := s.Work(r.t.Context(), bmdb.ProcessRecovery, r.cands)
	if err != nil {
		r.t.Fatalf("claiming recovery work: %v", err)
	}
	if w.MachineID != want {
		r.t.Fatalf("claimed machine %s, want %s", w.MachineID, want)
	}
	return w
}

// admit asks s to admit the reboot of machine with a budget of max.
func (r recovery) admit(s *bmdb.Session, machine uuid.UUID, max int64) (bmdb.RebootAdmission, error) {
	r.t.Helper()
	return s.AdmitReboot(r.t.Context(), bmdb.RebootRequest{
		Provider: r.provider, MachineID: machine, Candidates: r.cands,
		Window: 10 * time.Minute, Max: max, StreakLimit: 3,
	})
}

// mustAdmit admits and checks the decision.
func (r recovery) mustAdmit(s *bmdb.Session, machine uuid.UUID, max int64, want bmdb.RebootDecision) bmdb.RebootAdmission {
	r.t.Helper()
	a, err := r.admit(s, machine, max)
	if err != nil {
		r.t.Fatalf("admitting the reboot of %s: %v", machine, err)
	}
	if a.Decision != want {
		r.t.Fatalf("admission of %s: %+v, want decision %s", machine, a, want)
	}
	return a
}

// finish ends w as the recoverer does after a reboot: ClearAgent.
func (r recovery) finish(w *bmdb.Work) {
	r.t.Helper()
	err := w.Finish(r.t.Context(), func(ctx context.Context, tx *bmdb.Tx) error { return tx.ClearAgent(ctx, w.MachineID) })
	if err != nil {
		r.t.Fatalf("finishing the recovery of %s: %v", w.MachineID, err)
	}
}

// expire moves the session's deadline into the past: its lease lapsed
// (the process is stalled: a GC pause, SIGSTOP, a paused VM) without the
// process noticing yet.
func (r recovery) expire(s *bmdb.Session) {
	r.t.Helper()
	r.db.Exec(r.t, "UPDATE sessions SET deadline = now() - interval '1 second' WHERE session_id = $1", s.ID())
}

func (r recovery) rebootsInWindow() int64 {
	r.t.Helper()
	n, err := r.db.RecoveryReboots(r.t.Context(), r.provider, 10*time.Minute)
	if err != nil {
		r.t.Fatal(err)
	}
	return n
}

// A worker stalled past its lease must not reboot: another worker claimed
// and rebooted the machine meanwhile (issue 10 item 7).
func TestAdmitRebootRefusesAStalledWorker(t *testing.T) {
	t.Parallel()
	r := newRecovery(t)
	m := r.silent()
	a := bmdbtest.Session(t, r.db, "recoverer-a", time.Minute)
	b := bmdbtest.Session(t, r.db, "recoverer-b", time.Minute)
	r.claim(a, m)
	r.expire(a)
	// B's claim expires A's work; B reboots and finishes.
	wb := r.claim(b, m)
	r.mustAdmit(b, m, 10, bmdb.RebootAdmitted)
	r.finish(wb)
	// A wakes up and asks to reboot the machine it no longer holds.
	if adm, err := r.admit(a, m, 10); !errors.Is(err, bmdb.ErrSessionExpired) {
		t.Fatalf("stalled worker's admission: %+v, %v; want ErrSessionExpired", adm, err)
	}
	// Even before B claims it: A's lease lapsed, so A holds nothing.
	m2 := r.silent()
	c := bmdbtest.Session(t, r.db, "recoverer-c", time.Minute)
	r.claim(c, m2)
	r.expire(c)
	if adm, err := r.admit(c, m2, 10); !errors.Is(err, bmdb.ErrSessionExpired) {
		t.Fatalf("admission after the lease lapsed: %+v, %v; want ErrSessionExpired", adm, err)
	}
	if n := r.rebootsInWindow(); n != 1 {
		t.Errorf("reboots in the window: %d, want 1 (B's)", n)
	}
}

// A heartbeat after the claim means the machine recovered: no reboot
// (issue 10 item 7; a heartbeat does not end a claim).
func TestAdmitRebootRefusesARecoveredMachine(t *testing.T) {
	t.Parallel()
	r := newRecovery(t)
	m := r.silent()
	w := r.claim(r.s, m)
	r.tx(func(ctx context.Context, tx *bmdb.Tx) error { return tx.RecordHeartbeat(ctx, m) })
	r.mustAdmit(r.s, m, 10, bmdb.RebootNotSilent)
	if n := r.rebootsInWindow(); n != 0 {
		t.Errorf("reboots in the window: %d, want 0", n)
	}
	if err := w.Cancel(t.Context()); err != nil {
		t.Fatal(err)
	}
}

// A worker that rebooted a machine but lost its session before recording
// it leaves the machine silent with the same agent; the next claim must
// not reboot it again (one reboot per silence), and a failed reboot may be
// repeated.
func TestAdmitRebootOncePerIncarnation(t *testing.T) {
	t.Parallel()
	r := newRecovery(t)
	m := r.silent()
	a := bmdbtest.Session(t, r.db, "recoverer-a", time.Minute)
	r.claim(a, m)
	r.mustAdmit(a, m, 10, bmdb.RebootAdmitted)
	r.expire(a) // rebooted, then lost its session before Finish
	b := bmdbtest.Session(t, r.db, "recoverer-b", time.Minute)
	wb := r.claim(b, m)
	r.mustAdmit(b, m, 10, bmdb.RebootAlreadyIssued)
	r.finish(wb)
	if n := r.rebootsInWindow(); n != 1 {
		t.Errorf("reboots in the window: %d, want 1", n)
	}

	// A failed reboot does not block the next attempt.
	m2 := r.silent()
	w := r.claim(b, m2)
	adm := r.mustAdmit(b, m2, 10, bmdb.RebootAdmitted)
	if err := b.RebootFailed(t.Context(), adm, true, "test failure"); err != nil {
		t.Fatal(err)
	}
	if err := w.Cancel(t.Context()); err != nil {
		t.Fatal(err)
	}
	r.claim(b, m2)
	r.mustAdmit(b, m2, 10, bmdb.RebootAdmitted)
}

// The breaker counts every admitted reboot however its work ended:
// Canceled (shutdown) and Expired (a crashed recoverer) too (issue 10
// item 9).
func TestRebootBudgetCountsCanceledAndExpired(t *testing.T) {
	t.Parallel()
	r := newRecovery(t)
	r.silent()
	r.silent()
	r.silent()
	claim := func(s *bmdb.Session) *bmdb.Work {
		t.Helper()
		w, err := s.Work(t.Context(), bmdb.ProcessRecovery, r.cands)
		if err != nil {
			t.Fatalf("claiming recovery work: %v", err)
		}
		return w
	}
	w1 := claim(r.s)
	r.mustAdmit(r.s, w1.MachineID, 2, bmdb.RebootAdmitted)
	if err := w1.Cancel(t.Context()); err != nil {
		t.Fatal(err)
	}
	// Keep the claims below off the machine: its next claim would find its
	// reboot issued already.
	r.backoff(w1.MachineID, bmdb.ProcessRecovery, time.Hour, false)
	crashed := bmdbtest.Session(t, r.db, "crashed", time.Minute)
	w2 := claim(crashed)
	r.mustAdmit(crashed, w2.MachineID, 2, bmdb.RebootAdmitted)
	r.expire(crashed)
	if n, err := r.db.ExpireWork(t.Context()); err != nil || n != 1 {
		t.Fatalf("expiring the crashed recoverer's work: %d, %v", n, err)
	}
	r.backoff(w2.MachineID, bmdb.ProcessRecovery, time.Hour, false)
	if n := r.rebootsInWindow(); n != 2 {
		t.Errorf("reboots in the window: %d, want 2 (one Canceled, one Expired)", n)
	}
	// The budget of 2 is used up.
	w3 := claim(r.s)
	r.mustAdmit(r.s, w3.MachineID, 2, bmdb.RebootBudgetExhausted)
}

// A reboot that never reached the machine does not count (issue 10 item 9).
func TestRebootBudgetSkipsUnreached(t *testing.T) {
	t.Parallel()
	r := newRecovery(t)
	m1, m2 := r.silent(), r.silent()
	w := r.claim(r.s, m1)
	adm := r.mustAdmit(r.s, m1, 1, bmdb.RebootAdmitted)
	if err := r.s.RebootFailed(t.Context(), adm, false, "test: not reached"); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Fail(t.Context(), bmdb.RecoveryBackoff(), "dial tcp: connection refused"); err != nil {
		t.Fatal(err)
	}
	if n := r.rebootsInWindow(); n != 0 {
		t.Errorf("reboots in the window after an unreached reboot: %d, want 0", n)
	}
	r.claim(r.s, m2)
	r.mustAdmit(r.s, m2, 1, bmdb.RebootAdmitted)
}

// Live claims that were not admitted yet count nothing: with a budget of 2
// and three workers holding a machine each, two reboots are admitted, not
// none (issue 10 item 9).
func TestRebootBudgetIgnoresLiveClaims(t *testing.T) {
	t.Parallel()
	r := newRecovery(t)
	ms := []uuid.UUID{r.silent(), r.silent(), r.silent()}
	sessions := make([]*bmdb.Session, len(ms))
	for i, m := range ms {
		sessions[i] = bmdbtest.Session(t, r.db, "recoverer", time.Minute)
		r.claim(sessions[i], m)
	}
	got := map[bmdb.RebootDecision]int{}
	for i, m := range ms {
		a, err := r.admit(sessions[i], m, 2)
		if err != nil {
			t.Fatal(err)
		}
		got[a.Decision]++
	}
	if got[bmdb.RebootAdmitted] != 2 || got[bmdb.RebootBudgetExhausted] != 1 {
		t.Errorf("decisions: %v, want 2 admitted and 1 budget exhausted", got)
	}
}

// A machine rebooted StreakLimit times without a heartbeat in between is
// quarantined instead of rebooted again; a heartbeat starts the streak
// over, and so does an operator's reset (issue 10 item 8).
func TestRebootStreakQuarantines(t *testing.T) {
	t.Parallel()
	r := newRecovery(t)
	m := r.silent()
	rebootOnce := func(want bmdb.RebootDecision) bmdb.RebootAdmission {
		t.Helper()
		w := r.claim(r.s, m)
		a := r.mustAdmit(r.s, m, 100, want)
		switch want {
		case bmdb.RebootAdmitted:
			r.finish(w)
			r.started(m, 2*time.Hour) // taken over again; never heartbeats
		case bmdb.RebootStreakQuarantined:
			// The recoverer fails the work with the cause.
			if _, err := w.Fail(t.Context(), bmdb.RecoveryBackoff(), a.Cause); err != nil {
				t.Fatal(err)
			}
		}
		return a
	}
	rebootOnce(bmdb.RebootAdmitted)
	rebootOnce(bmdb.RebootAdmitted)
	// A heartbeat in between: the streak starts over.
	r.tx(func(ctx context.Context, tx *bmdb.Tx) error { return tx.RecordHeartbeat(ctx, m) })
	r.db.Exec(t, "UPDATE machine_agent_heartbeat SET agent_heartbeat_at = now() - interval '1 hour' WHERE machine_id = $1", m)
	for i := 1; i <= 3; i++ {
		if a := rebootOnce(bmdb.RebootAdmitted); a.Streak != i {
			t.Fatalf("reboot %d after the heartbeat: streak %d, want %d", i, a.Streak, i)
		}
	}
	a := rebootOnce(bmdb.RebootStreakQuarantined)
	if !strings.Contains(a.Cause, "3 recovery rungs carried out") || !strings.Contains(a.Cause, "without a heartbeat in between") {
		t.Errorf("quarantine cause %q does not say why", a.Cause)
	}
	b, err := r.db.GetBackoff(t.Context(), m, bmdb.ProcessRecovery)
	if err != nil || !b.Quarantined {
		t.Fatalf("backoff after the streak: %+v, %v; want quarantined", b, err)
	}
	h, err := r.db.History(t.Context(), bmdb.HistoryFilter{MachineID: m, Process: bmdb.ProcessRecovery})
	if err != nil {
		t.Fatal(err)
	}
	quarantines := 0
	for _, e := range h {
		if e.Event == bmdb.EventQuarantined {
			quarantines++
			if e.Cause != a.Cause {
				t.Errorf("quarantine in history: %+v, want the cause %q", e, a.Cause)
			}
		}
	}
	if quarantines != 1 {
		t.Errorf("%d Quarantined events in history, want 1", quarantines)
	}
	if n := r.rebootsInWindow(); n != 5 {
		t.Errorf("reboots in the window: %d, want 5 (the quarantine is none)", n)
	}
	// The operator resets the quarantine.
	w, err := r.s.Work(t.Context(), bmdb.ProcessRecovery, r.cands)
	if !errors.Is(err, bmdb.ErrNothingToDo) {
		t.Fatalf("claim of a quarantined machine: %v, %v", w, err)
	}
	if err := r.db.ResetBackoff(t.Context(), m, bmdb.ProcessRecovery, "ops: fixed the rack's route"); err != nil {
		t.Fatal(err)
	}
	if a := rebootOnce(bmdb.RebootAdmitted); a.Streak != 1 {
		t.Errorf("streak after the reset: %d, want 1", a.Streak)
	}
}

// Missing and Stopped machines are neither recovery candidates nor Silent:
// the provider lost or powered them off, so there is no agent to recover
// (issue 10 item 9).
func TestMissingAndStoppedAreNotSilent(t *testing.T) {
	t.Parallel()
	r := newRecovery(t)
	cases := map[bmdb.ProviderStatus]bmdb.MachineState{
		bmdb.ProviderStatusMissing: bmdb.StateMissing,
		bmdb.ProviderStatusStopped: bmdb.StateStopped,
	}
	for status, want := range cases {
		never, stale := r.silent(), bmdbtest.AddMachine(t, r.db, r.s, r.provider)
		r.started(stale, 2*time.Hour)
		r.heartbeat(stale, time.Hour)
		for _, id := range []uuid.UUID{never, stale} {
			r.status(id, status)
			m, err := r.db.GetMachine(t.Context(), id)
			if err != nil {
				t.Fatal(err)
			}
			if m.State != want {
				t.Errorf("%s machine %s: state %s, want %s", status, id, m.State, want)
			}
		}
	}
	ids, err := r.db.ListCandidates(t.Context(), bmdb.ProcessRecovery, r.cands, 100)
	if err != nil {
		t.Fatal(err)
	}
	if len(ids) != 0 {
		t.Errorf("recovery candidates: %v, want none", ids)
	}
	if n, err := r.db.CountMatching(t.Context(), r.cands); err != nil || n != 0 {
		t.Errorf("silent machines by tags: %d, %v; want 0", n, err)
	}
	st, err := r.db.FleetStates(t.Context(), r.provider, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if st[bmdb.StateSilent] != 0 || st[bmdb.StateMissing] != 2 || st[bmdb.StateStopped] != 2 {
		t.Errorf("fleet states: %v, want 2 Missing, 2 Stopped, none Silent", st)
	}
	if _, started, err := r.db.ProviderAgentCounts(t.Context(), r.provider); err != nil || started != 0 {
		t.Errorf("started agents: %d, %v; want 0 (none can heartbeat)", started, err)
	}
}

// TestLadderClimbs: within one work item a failed rung lets the next one be
// admitted (the breaker counting only restarts that reached the machine);
// the next silence of the machine starts above the last rung carried out,
// and repeats the top rung once it was reached; a heartbeating incarnation
// that goes silent again starts at the bottom.
func TestLadderClimbs(t *testing.T) {
	t.Parallel()
	r := newRecovery(t)
	m := r.silent()
	rungs := []ladder.Rung{ladder.Agent, ladder.Reboot, ladder.Power}
	admit := func(after ladder.Rung, max int64, want bmdb.RebootDecision) bmdb.RebootAdmission {
		t.Helper()
		a, err := r.s.AdmitReboot(t.Context(), bmdb.RebootRequest{
			Provider: r.provider, MachineID: m, Candidates: r.cands, Window: 10 * time.Minute, Max: max,
			StreakLimit: 3, Ladder: rungs, After: after,
		})
		if err != nil {
			t.Fatalf("admitting after %q: %v", after, err)
		}
		if a.Decision != want {
			t.Fatalf("admission after %q: %+v, want %s", after, a, want)
		}
		return a
	}
	fail := func(a bmdb.RebootAdmission, reached bool, result string) {
		t.Helper()
		if err := r.s.RebootFailed(t.Context(), a, reached, result); err != nil {
			t.Fatal(err)
		}
	}

	w := r.claim(r.s, m)
	// The agent rung restarts nothing: a budget of 0 does not hold it back.
	a := admit("", 0, bmdb.RebootAdmitted)
	if a.Rung != ladder.Agent || a.InWindow != 0 || a.Streak != 1 || len(a.Tried) != 0 {
		t.Fatalf("first admission: %+v, want the agent rung, nothing in the window, streak 1, nothing tried", a)
	}
	fail(a, false, "no SSH answer")
	// The reboot rung does restart the machine: the budget applies.
	admit(ladder.Agent, 0, bmdb.RebootBudgetExhausted)
	a = admit(ladder.Agent, 5, bmdb.RebootAdmitted)
	if a.Rung != ladder.Reboot || a.InWindow != 1 {
		t.Fatalf("climbing past agent: %+v, want the reboot rung counted in the window", a)
	}
	fail(a, false, "in-band path dead")
	a = admit(ladder.Reboot, 5, bmdb.RebootAdmitted)
	if a.Rung != ladder.Power || a.InWindow != 1 || a.Streak != 1 {
		t.Fatalf("climbing past reboot: %+v, want the power rung, 1 in the window (the unreached reboot does not count), streak 1", a)
	}
	if len(a.Tried) != 2 || !a.Tried[0].Failed || a.Tried[0].Rung != ladder.Agent || a.Tried[1].Result != "in-band path dead" {
		t.Errorf("tried before power: %+v", a.Tried)
	}
	if _, err := r.s.AdmitReboot(t.Context(), bmdb.RebootRequest{
		Provider: r.provider, MachineID: m, Candidates: r.cands, Window: time.Minute, Max: 5, Ladder: rungs, After: ladder.Power,
	}); err == nil || !strings.Contains(err.Error(), `no rung above "power"`) {
		t.Errorf("admitting above the top: %v", err)
	}
	r.finish(w)
	if n := r.rebootsInWindow(); n != 1 {
		t.Errorf("%d restarts in the window, want 1 (the power cycle)", n)
	}
	tried, err := r.db.RecoveryStreak(t.Context(), m)
	if err != nil {
		t.Fatal(err)
	}
	if got := bmdb.DescribeRungs(tried); got != "agent (restart the agent over SSH): failed: no SSH answer; "+
		"reboot (in-band reboot): failed: in-band path dead; power (power cycle through the BMC): done" {
		t.Errorf("streak: %s", got)
	}

	// Taken over again, silent again without a heartbeat: the top again.
	r.started(m, 2*time.Hour)
	w = r.claim(r.s, m)
	a = admit("", 5, bmdb.RebootAdmitted)
	if a.Rung != ladder.Power || a.Streak != 2 || len(a.Tried) != 3 {
		t.Fatalf("second silence: %+v, want the power rung again, streak 2", a)
	}
	r.finish(w)

	// A heartbeat ends the streak; the next silence starts at the bottom,
	// and a climb for one incarnation keeps the streak's start.
	r.started(m, 2*time.Hour)
	r.tx(func(ctx context.Context, tx *bmdb.Tx) error { return tx.RecordHeartbeat(ctx, m) })
	r.db.Exec(t, "UPDATE machine_agent_heartbeat SET agent_heartbeat_at = now() - interval '1 hour' WHERE machine_id = $1", m)
	w = r.claim(r.s, m)
	a = admit("", 5, bmdb.RebootAdmitted)
	if a.Rung != ladder.Agent || a.Streak != 1 || len(a.Tried) != 0 {
		t.Fatalf("after a heartbeat: %+v, want the agent rung, a new streak", a)
	}
	fail(a, false, "no SSH answer")
	if a = admit(ladder.Agent, 5, bmdb.RebootAdmitted); a.Rung != ladder.Reboot || len(a.Tried) != 1 {
		t.Fatalf("climbing in the new streak: %+v, want the reboot rung with the failed agent rung tried", a)
	}
	r.finish(w)
}

// TestPowerOffHold: an operator's power off quarantines the machine's
// Recovery, and only its own hold is released by the power on: a
// quarantine for another cause stays, and the hold does not replace it.
func TestPowerOffHold(t *testing.T) {
	t.Parallel()
	r := newRecovery(t)
	held, other := r.silent(), r.silent()
	r.backoff(other, bmdb.ProcessRecovery, time.Hour, true) // quarantined, cause "test"
	for _, m := range []uuid.UUID{held, other} {
		r.tx(func(ctx context.Context, tx *bmdb.Tx) error {
			return tx.HoldRecoveryPoweredOff(ctx, m, r.s.ID(), "by alice")
		})
	}
	b, err := r.db.GetBackoff(t.Context(), held, bmdb.ProcessRecovery)
	if err != nil || !b.Quarantined || !strings.HasPrefix(b.Cause, "powered off by an operator (by alice); ") {
		t.Fatalf("held machine's Recovery backoff: %+v, %v", b, err)
	}
	if b, err := r.db.GetBackoff(t.Context(), other, bmdb.ProcessRecovery); err != nil || b.Cause != "test" {
		t.Errorf("the hold replaced another quarantine: %+v, %v", b, err)
	}
	if w, err := r.s.Work(t.Context(), bmdb.ProcessRecovery, r.cands); !errors.Is(err, bmdb.ErrNothingToDo) {
		t.Errorf("claimed recovery work %+v (%v) while both machines are quarantined", w, err)
	}
	for m, want := range map[uuid.UUID]bool{held: true, other: false} {
		var released bool
		r.tx(func(ctx context.Context, tx *bmdb.Tx) error {
			var err error
			released, err = tx.ReleaseRecoveryPowerOffHold(ctx, m, r.s.ID(), "power on by alice")
			return err
		})
		if released != want {
			t.Errorf("release of %s: %v, want %v", m, released, want)
		}
	}
	if _, err := r.db.GetBackoff(t.Context(), held, bmdb.ProcessRecovery); !errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("the power-off hold stayed after the power on: %v", err)
	}
	if b, err := r.db.GetBackoff(t.Context(), other, bmdb.ProcessRecovery); err != nil || !b.Quarantined || b.Cause != "test" {
		t.Errorf("the power on released another quarantine: %+v, %v", b, err)
	}
}
