package manager_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/manager"
)

// events returns the history events of a machine, in order.
func events(t *testing.T, db *bmdbtest.DB, id uuid.UUID) []bmdb.HistoryEvent {
	t.Helper()
	h, err := db.History(t.Context(), bmdb.HistoryFilter{MachineID: id})
	if err != nil {
		t.Fatal(err)
	}
	return h
}

func TestRunnerEndsEveryWork(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	setup := bmdbtest.Session(t, db, "setup", time.Minute)
	ok, boom, later, slow := bmdbtest.AddMachine(t, db, setup, "lab"), bmdbtest.AddMachine(t, db, setup, "lab"),
		bmdbtest.AddMachine(t, db, setup, "lab"), bmdbtest.AddMachine(t, db, setup, "lab")

	var mu sync.Mutex
	seen := map[uuid.UUID]int{}
	slowStarted := make(chan struct{})
	var once sync.Once
	loop := manager.Loop{
		Process:    bmdb.ProcessAgentStart,
		Candidates: func() bmdb.Candidates { return bmdb.AgentStartCandidates("lab") },
		Backoff:    bmdb.BackoffPolicy{Initial: time.Hour},
		Do: func(ctx context.Context, task *manager.Task) (manager.FinishFunc, error) {
			mu.Lock()
			seen[task.Machine.MachineID]++
			mu.Unlock()
			mu.Lock()
			tries := seen[task.Machine.MachineID]
			mu.Unlock()
			switch task.Machine.MachineID {
			case boom:
				panic("bad machine")
			case later:
				// Said once: a machine that stays a candidate and always
				// says "retry later" is re-claimed before younger ones.
				if tries == 1 {
					return nil, fmt.Errorf("breaker open: %w", manager.ErrRetryLater)
				}
			case slow:
				once.Do(func() { close(slowStarted) })
				<-ctx.Done()
				return nil, ctx.Err()
			}
			return func(ctx context.Context, tx *bmdb.Tx) error {
				return tx.SetAgentStarted(ctx, task.Machine.MachineID, make([]byte, 32))
			}, nil
		},
	}
	r, err := manager.NewRunner("test-loop", manager.LoopConfig{Parallelism: 3, IdleSleep: 50 * time.Millisecond}, loop, db.DB, prometheus.NewRegistry(), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()

	bmdbtest.WaitFor(t, time.Minute, "ok finished, boom failed, later retried and finished, slow started", func(ctx context.Context) (bool, error) {
		select {
		case <-slowStarted:
		default:
			return false, nil
		}
		for _, m := range []uuid.UUID{ok, later} {
			if _, _, err := db.GetAgentStarted(ctx, m); errors.Is(err, bmdb.ErrNotFound) {
				return false, nil
			} else if err != nil {
				return false, err
			}
		}
		b, err := db.GetBackoff(ctx, boom, bmdb.ProcessAgentStart)
		return err == nil && b.Attempts == 1, err
	})
	// The panic became a failure naming it; the worker lived on.
	if b, _ := db.GetBackoff(t.Context(), boom, bmdb.ProcessAgentStart); b.Cause != "internal error: bad machine" {
		t.Errorf("cause of the panic's failure: %q", b.Cause)
	}
	// Stopping cancels the slow machine's work instead of failing it.
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	h := events(t, db, slow)
	// The last Canceled is the slow worker's, or, if another worker's claim
	// took the machine again as the runner stopped, that claim's.
	if last := h[len(h)-1]; last.Event != bmdb.EventCanceled || (last.Cause != "the test-loop is stopping (context canceled)" &&
		last.Cause != "the test-loop is stopping (the claim committed as it stopped)") {
		t.Errorf("slow machine's last event %s %q, want Canceled saying the loop is stopping", last.Event, last.Cause)
	}
	if _, err := db.GetBackoff(t.Context(), slow, bmdb.ProcessAgentStart); !errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("stopping backed the slow machine off: %v", err)
	}
	// ErrRetryLater cancels without backoff, so the machine is tried again:
	// once more, which finished it.
	mu.Lock()
	n := seen[later]
	mu.Unlock()
	if n != 2 {
		t.Errorf("a machine whose processing said retry later once was tried %d times, want 2", n)
	}
	var laterEvents []bmdb.Event
	for _, e := range events(t, db, later) {
		if e.Process == bmdb.ProcessAgentStart {
			laterEvents = append(laterEvents, e.Event)
			if e.Event == bmdb.EventCanceled && e.Cause != "breaker open: retry later" {
				t.Errorf("the retry later's Canceled cause %q, want the error Do returned", e.Cause)
			}
		}
	}
	if want := []bmdb.Event{bmdb.EventStarted, bmdb.EventCanceled, bmdb.EventStarted, bmdb.EventFinished}; !slices.Equal(laterEvents, want) {
		t.Errorf("history of the machine that said retry later: %v, want %v", laterEvents, want)
	}
	if _, err := db.GetBackoff(t.Context(), later, bmdb.ProcessAgentStart); !errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("retry later backed the machine off: %v", err)
	}
	// A claim cut off by the stop may still commit after its session
	// closed: such work belongs to a dead session, free for anyone (and
	// expired by the next claim or the janitor). No live work may remain.
	if n := bmdbtest.Scalar[int64](t, db, `SELECT count(*) FROM work w JOIN sessions s USING (session_id)
		WHERE s.deadline > now() AND s.closed_at IS NULL`); n != 0 {
		t.Errorf("%d live work rows left after the runner stopped", n)
	}
}

func TestRunnerSurvivesLostSession(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	setup := bmdbtest.Session(t, db, "setup", time.Minute)
	var ids []uuid.UUID
	for range 5 {
		ids = append(ids, bmdbtest.AddMachine(t, db, setup, "lab"))
	}
	var processed atomic.Int64
	release := make(chan struct{})
	loop := manager.Loop{
		Process:    bmdb.ProcessAgentStart,
		Candidates: func() bmdb.Candidates { return bmdb.AgentStartCandidates("lab") },
		Backoff:    bmdb.BackoffPolicy{Initial: time.Second},
		Do: func(ctx context.Context, task *manager.Task) (manager.FinishFunc, error) {
			if processed.Add(1) == 1 {
				<-release // the first machine waits until its session is killed
			}
			return func(ctx context.Context, tx *bmdb.Tx) error {
				return tx.SetAgentStarted(ctx, task.Machine.MachineID, make([]byte, 32))
			}, nil
		},
	}
	r, err := manager.NewRunner("test-loop", manager.LoopConfig{Parallelism: 1, IdleSleep: 50 * time.Millisecond, Lease: time.Second}, loop, db.DB, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	bmdbtest.WaitFor(t, time.Minute, "first machine claimed", func(context.Context) (bool, error) { return processed.Load() == 1, nil })
	db.Exec(t, "UPDATE sessions SET deadline = now() - interval '1 second' WHERE component = 'test-loop'")
	close(release)
	// A new session takes over, and every machine gets its agent.
	bmdbtest.WaitFor(t, time.Minute, "every machine started", func(ctx context.Context) (bool, error) {
		n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM machine_agent_started")
		return n == int64(len(ids)), nil
	})
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(DISTINCT session_id) FROM sessions WHERE component = 'test-loop'"); n < 2 {
		t.Errorf("%d sessions, want a new one after the first was lost", n)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func TestParseLimit(t *testing.T) {
	t.Parallel()
	good := map[string]manager.Limit{
		"250ms,8": {Every: 250 * time.Millisecond, Burst: 8},
		" 1s , 1": {Every: time.Second, Burst: 1},
	}
	for in, want := range good {
		got, err := manager.ParseLimit(in)
		if err != nil || got != want {
			t.Errorf("ParseLimit(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "250ms", "250ms,0", "0s,4", "-1s,2", "abc,2", "1s,x"} {
		if _, err := manager.ParseLimit(in); err == nil {
			t.Errorf("ParseLimit(%q) accepted", in)
		}
	}
}
