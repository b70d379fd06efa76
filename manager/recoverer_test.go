package manager_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/logtest"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/provider"
)

// admitReboots records n reboots of provider's machine id admitted ago,
// whose request reached the machine unless unreached.
func admitReboots(t *testing.T, db *bmdbtest.DB, provider string, id uuid.UUID, n int, ago time.Duration, unreached bool) {
	t.Helper()
	for range n {
		db.Exec(t, `INSERT INTO recovery_admissions (machine_id, provider, admitted_at, reached, failed)
			VALUES ($1, $2, now() - interval '1 millisecond' * $3::bigint, $4, $5)`, id, provider, ago.Milliseconds(), !unreached, unreached)
	}
}

// anyMachine returns one of provider's machines.
func anyMachine(t *testing.T, db *bmdbtest.DB, provider string) uuid.UUID {
	t.Helper()
	refs, err := db.ListProvided(t.Context(), provider)
	if err != nil || len(refs) == 0 {
		t.Fatalf("machines of %s: %v, %v", provider, refs, err)
	}
	return refs[0].MachineID
}

// TestReadBreaker: the circuit breaker of a provider's fleet pauses reboots
// when more than SilentFraction of the started machines are silent (not at
// exactly that fraction), and when the reboots that reached machines within
// the window number the budget; the budget is MaxRebootsPerWindow, or 5 %
// of the fleet (rounded down, at least 1).
func TestReadBreaker(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	// Healthy machines heartbeat; stale ones are silent (their last
	// heartbeat is a day old); awaiting ones have no agent yet.
	for _, f := range []bmdbtest.Fleet{
		{Provider: "quarter", Healthy: 15, Stale: 5},
		{Provider: "over", Healthy: 14, Stale: 6},
		{Provider: "fleet39", Healthy: 39},
		{Provider: "fleet40", Healthy: 40},
		{Provider: "unstarted", AwaitingAgent: 3},
		{Provider: "rebooted", Healthy: 10},
	} {
		bmdbtest.AddFleet(t, db, f)
	}
	m := anyMachine(t, db, "rebooted")
	admitReboots(t, db, "rebooted", m, 2, time.Minute, false)
	admitReboots(t, db, "rebooted", m, 1, time.Minute, true) // never reached the machine
	admitReboots(t, db, "rebooted", m, 1, 11*time.Minute, false)

	defaults := func(st manager.BreakerState) manager.BreakerState {
		st.SilentFraction, st.Window = 0.25, 10*time.Minute
		return st
	}
	for _, tt := range []struct {
		provider string
		cfg      manager.RecovererConfig
		want     manager.BreakerState
	}{
		{"quarter", manager.RecovererConfig{}, defaults(manager.BreakerState{Provided: 20, Started: 20, Silent: 5, Budget: 1})},
		{"over", manager.RecovererConfig{}, defaults(manager.BreakerState{Provided: 20, Started: 20, Silent: 6, Budget: 1, Paused: "silent_fraction"})},
		{"over", manager.RecovererConfig{SilentFraction: 0.3, MaxRebootsPerWindow: 4},
			manager.BreakerState{Provided: 20, Started: 20, Silent: 6, SilentFraction: 0.3, Budget: 4, Window: 10 * time.Minute}},
		// The heartbeat timeouts decide who is silent.
		{"over", manager.RecovererConfig{HeartbeatTimeout: 48 * time.Hour}, defaults(manager.BreakerState{Provided: 20, Started: 20, Budget: 1})},
		{"fleet39", manager.RecovererConfig{}, defaults(manager.BreakerState{Provided: 39, Started: 39, Budget: 1})},
		{"fleet40", manager.RecovererConfig{}, defaults(manager.BreakerState{Provided: 40, Started: 40, Budget: 2})},
		{"unstarted", manager.RecovererConfig{}, defaults(manager.BreakerState{Provided: 3, Budget: 1})},
		{"nobody", manager.RecovererConfig{}, defaults(manager.BreakerState{Budget: 1})},
		// Two reboots reached machines within the window: a budget of two
		// is used up, one of three is not.
		{"rebooted", manager.RecovererConfig{MaxRebootsPerWindow: 2},
			defaults(manager.BreakerState{Provided: 10, Started: 10, RebootsInWindow: 2, Budget: 2, Paused: "reboot_budget"})},
		{"rebooted", manager.RecovererConfig{MaxRebootsPerWindow: 3},
			defaults(manager.BreakerState{Provided: 10, Started: 10, RebootsInWindow: 2, Budget: 3})},
		{"rebooted", manager.RecovererConfig{MaxRebootsPerWindow: 3, Window: 15 * time.Minute},
			manager.BreakerState{Provided: 10, Started: 10, RebootsInWindow: 3, Budget: 3, SilentFraction: 0.25, Window: 15 * time.Minute, Paused: "reboot_budget"}},
	} {
		got, err := manager.ReadBreaker(t.Context(), db.DB, tt.provider, tt.cfg)
		if err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff(tt.want, got); diff != "" {
			t.Errorf("ReadBreaker(%s, %+v) (-want +got):\n%s", tt.provider, tt.cfg, diff)
		}
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := manager.ReadBreaker(ctx, db.DB, "quarter", manager.RecovererConfig{}); err == nil {
		t.Error("ReadBreaker with a cancelled context succeeded")
	}
}

// recordingRebooter is a provider that reboots machines as fail says, and
// records each request and its deadline.
type recordingRebooter struct {
	*scripted
	fail func(id string) error

	mu      sync.Mutex
	reboots map[string]int
	budget  map[string]time.Duration // time left before the request's deadline
}

func (r *recordingRebooter) RebootMachine(ctx context.Context, id string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.reboots[id]++
	if d, ok := ctx.Deadline(); ok {
		r.budget[id] = time.Until(d)
	}
	return r.fail(id)
}

func (r *recordingRebooter) ReinstallMachine(context.Context, string) error {
	return provider.ErrUnsupported
}

func (r *recordingRebooter) rebooted(id string) (int, time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.reboots[id], r.budget[id]
}

// TestRecovererReboots runs a recoverer over three silent machines whose
// reboots succeed, fail, and fail without reaching the machine: the first
// is handed back to the initializer (its agent tags cleared), the others
// fail with a cause that names the provider and back off; the breaker
// counts the two reboots that reached their machines, not the third. Each
// reboot request is bounded by the default RebootTimeout of 5 minutes.
func TestRecovererReboots(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "lab", Stale: 3, Healthy: 7})
	ids, err := db.ListCandidates(t.Context(), bmdb.ProcessRecovery, bmdb.RecoveryCandidates("lab", 0, 0), 10)
	if err != nil || len(ids) != 3 {
		t.Fatalf("silent machines: %v, %v; want 3", ids, err)
	}
	pid := func(id uuid.UUID) string { return "fleet-" + id.String() }
	ok, broken, unreachable := ids[0], ids[1], ids[2]
	p := &recordingRebooter{scripted: newScripted("lab"), reboots: map[string]int{}, budget: map[string]time.Duration{},
		fail: func(id string) error {
			switch id {
			case pid(broken):
				return errors.New("power controller on fire")
			case pid(unreachable):
				return fmt.Errorf("dialing the BMC: %w", provider.ErrNotReached)
			}
			return nil
		}}
	logs := logtest.New()
	rc, err := manager.NewRecoverer(manager.RecovererConfig{
		Loop:                manager.LoopConfig{Parallelism: 2, IdleSleep: 50 * time.Millisecond},
		MaxRebootsPerWindow: 10, SilentFraction: 1,
		Backoff: bmdb.BackoffPolicy{Initial: time.Hour},
	}, db.DB, p, prometheus.NewRegistry(), logs.Logger())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- rc.Run(ctx) }()
	ended := func(ctx context.Context, id uuid.UUID) (bmdb.Event, string, error) {
		h, err := db.History(ctx, bmdb.HistoryFilter{MachineID: id, Process: bmdb.ProcessRecovery})
		if err != nil || len(h) == 0 {
			return "", "", err
		}
		return h[len(h)-1].Event, h[len(h)-1].Cause, nil
	}
	bmdbtest.WaitFor(t, 60*time.Second, "every silent machine's recovery ended", func(ctx context.Context) (bool, error) {
		for _, id := range ids {
			if ev, _, err := ended(ctx, id); err != nil || (ev != bmdb.EventFinished && ev != bmdb.EventFailed) {
				return false, err
			}
		}
		return true, nil
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	for id, want := range map[uuid.UUID]struct {
		event bmdb.Event
		cause string
	}{
		ok:          {bmdb.EventFinished, "recovery rung reboot (in-band reboot) done; waiting for a heartbeat"},
		broken:      {bmdb.EventFailed, "rebooting through lab: power controller on fire"},
		unreachable: {bmdb.EventFailed, "rebooting through lab: dialing the BMC: provider: the request did not reach the machine"},
	} {
		ev, cause, err := ended(t.Context(), id)
		if err != nil || ev != want.event || cause != want.cause {
			t.Errorf("recovery of %s ended %s %q (%v), want %s %q", pid(id), ev, cause, err, want.event, want.cause)
		}
		if n, left := p.rebooted(pid(id)); n != 1 || left <= 4*time.Minute || left > 5*time.Minute {
			t.Errorf("%s: %d reboot requests with %s left before their deadline, want 1 with at most 5m", pid(id), n, left)
		}
	}
	// Rebooted: the initializer takes the machine over again.
	if _, _, err := db.GetAgentStarted(t.Context(), ok); !errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("the rebooted machine still has its agent: %v", err)
	}
	for _, id := range []uuid.UUID{broken, unreachable} {
		if _, _, err := db.GetAgentStarted(t.Context(), id); err != nil {
			t.Errorf("a machine whose reboot failed lost its agent: %v", err)
		}
		if b, err := db.GetBackoff(t.Context(), id, bmdb.ProcessRecovery); err != nil || b.Attempts != 1 {
			t.Errorf("backoff of a failed reboot: %+v, %v", b, err)
		}
	}
	st, err := manager.ReadBreaker(t.Context(), db.DB, "lab", manager.RecovererConfig{MaxRebootsPerWindow: 10})
	if err != nil || st.RebootsInWindow != 2 {
		t.Errorf("breaker after the reboots: %+v, %v; want the 2 that reached their machines counted", st, err)
	}
	if got := logs.With("recording the failed recovery rung"); len(got) != 0 {
		t.Errorf("recording the failed reboots failed: %v", got)
	}
	if got := logs.With("recovering silent machine"); len(got) != 3 {
		t.Errorf("%d lines say a silent machine is rebooted, want 3", len(got))
	}
	for _, l := range logs.With("recovering silent machine") {
		if !strings.HasPrefix(l.Attr("provider_id"), "fleet-") || l.Attr("machine_id") == "" || l.Attr("restarts_in_window") == "" || l.Attr("rung") != "reboot" {
			t.Errorf("reboot line without the machine: %v", l.Attrs)
		}
	}
}

func TestRequestBudgets(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	budgets := manager.RequestBudgets(db.DB)
	b, err := budgets("api-account", 100, 2)
	if err != nil || b == nil {
		t.Fatalf("RequestBudgets(api-account, 100, 2) = %v, %v", b, err)
	}
	if err := b.Wait(t.Context()); err != nil {
		t.Errorf("the first request of a fresh budget waited: %v", err)
	}
	b, err = budgets("", 100, 2)
	if err == nil || b != nil {
		t.Errorf("RequestBudgets without an account = %#v, %v; want no budget (a nil interface) and an error", b, err)
	}
}
