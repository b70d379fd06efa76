package bmdb_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"golang.org/x/sync/errgroup"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// TestConcurrentWorkers runs 16 workers in 4 sessions over 500 machines for
// a while. Half the workers start agents (Finish sets AgentStarted), half
// recover machines whose first heartbeat never came (Finish clears the agent
// tags), so every machine keeps cycling between two mutually exclusive
// processes. Claims must be unique at every instant: checked live in Go, by
// sampling the work table, and afterwards in the history. Every machine must
// be processed and no worker may fail.
func TestConcurrentWorkers(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		strategy bmdb.ClaimStrategy
		run      time.Duration
	}{
		{"skip locked", bmdb.ClaimSkipLocked, 10 * time.Second},
		{"plain limit", bmdb.ClaimPlainLimit, 10 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			runConcurrentWorkers(t, tc.strategy, tc.run)
		})
	}
}

func runConcurrentWorkers(t *testing.T, strategy bmdb.ClaimStrategy, run time.Duration) {
	const (
		machines = 500
		sessions = 4
		workers  = 16
	)
	db := bmdbtest.New(t)
	setup := bmdbtest.Session(t, db, "setup", time.Minute)
	ids := make([]uuid.UUID, machines)
	for i := range ids {
		ids[i] = bmdbtest.AddMachine(t, db, setup, "p")
	}
	var ss []*bmdb.Session
	for i := range sessions {
		s, err := db.StartSession(t.Context(), bmdb.SessionConfig{Component: fmt.Sprintf("worker-%d", i), ClaimStrategy: strategy})
		if err != nil {
			t.Fatal(err)
		}
		ss = append(ss, s)
	}

	var (
		holders   sync.Map // machine -> worker holding it, as Go sees it
		processed sync.Map // machine -> true
		cycles    atomic.Int64
		idle      atomic.Int64
		lost      atomic.Int64
	)
	policy := bmdb.BackoffPolicy{Initial: 50 * time.Millisecond}
	// The run lasts at least run, and until every machine was worked on at
	// least once (no machine starves), within a deadline generous enough
	// for a loaded machine: the assertions below are about correctness, not
	// about throughput, which make bench measures.
	start := time.Now()
	ctx, cancel := context.WithTimeout(t.Context(), 10*run)
	defer cancel()
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for ; gctx.Err() == nil; <-tick.C {
			n := 0
			processed.Range(func(any, any) bool { n++; return true })
			if n == machines && time.Since(start) >= run {
				cancel()
			}
		}
		return nil
	})

	// Sampler: the work table must never show a machine held twice by
	// machine-exclusive processes.
	g.Go(func() error {
		tick := time.NewTicker(2 * time.Millisecond)
		defer tick.Stop()
		for ; gctx.Err() == nil; <-tick.C {
			var dup int
			err := db.Pool.QueryRow(gctx, `SELECT count(*) FROM (
				SELECT machine_id FROM work WHERE machine_exclusive GROUP BY machine_id HAVING count(*) > 1) d`).Scan(&dup)
			if err != nil && gctx.Err() == nil {
				return fmt.Errorf("sampling work: %w", err)
			}
			if dup > 0 {
				return fmt.Errorf("%d machines held twice at once", dup)
			}
		}
		return nil
	})
	for i := range workers {
		s := ss[i%sessions]
		process, cands := bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p")
		finish := func(ctx context.Context, tx *bmdb.Tx, id uuid.UUID) error {
			return tx.SetAgentStarted(ctx, id, make([]byte, 32))
		}
		if i%2 == 1 {
			process, cands = bmdb.ProcessRecovery, bmdb.RecoveryCandidates("p", time.Millisecond, time.Hour)
			finish = func(ctx context.Context, tx *bmdb.Tx, id uuid.UUID) error { return tx.ClearAgent(ctx, id) }
		}
		g.Go(func() error {
			for {
				w, err := s.Work(gctx, process, cands)
				switch {
				case errors.Is(err, bmdb.ErrNothingToDo):
					// Like a control loop, pause instead of polling at full rate.
					idle.Add(1)
					select {
					case <-gctx.Done():
					case <-time.After(5 * time.Millisecond):
					}
					continue
				case errors.Is(err, bmdb.ErrWorkConflict):
					lost.Add(1)
					continue
				case err != nil && gctx.Err() != nil:
					return nil
				case err != nil:
					return fmt.Errorf("worker %d: Work: %w", i, err)
				}
				if prev, loaded := holders.LoadOrStore(w.MachineID, i); loaded {
					return fmt.Errorf("worker %d claimed machine %s held by worker %v", i, w.MachineID, prev)
				}
				processed.Store(w.MachineID, true)
				// Release in Go before the database does, so that the next
				// holder can never find us still registered.
				holders.Delete(w.MachineID)
				endCtx := context.WithoutCancel(gctx)
				switch r := rand.IntN(10); {
				case r < 8:
					err = w.Finish(endCtx, func(ctx context.Context, tx *bmdb.Tx) error { return finish(ctx, tx, w.MachineID) })
				case r < 9:
					_, err = w.Fail(endCtx, policy, "injected failure")
				default:
					err = w.Cancel(endCtx)
				}
				if err != nil {
					return fmt.Errorf("worker %d: ending work on %s: %w", i, w.MachineID, err)
				}
				cycles.Add(1)
			}
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	for _, s := range ss {
		if s.Lost() {
			t.Errorf("session %s was lost during the run", s.ID())
		}
		// Close cancels anything a worker claimed just as the run ended.
		if err := s.Close(t.Context()); err != nil {
			t.Error(err)
		}
	}
	for _, id := range ids {
		if _, ok := processed.Load(id); !ok {
			t.Errorf("machine %s was never processed", id)
		}
	}
	if v := bmdbtest.OverlappingClaims(t, db); len(v) > 0 {
		t.Errorf("history shows overlapping claims:\n%v", v)
	}
	// A claim cut off by the end of the run may still commit after its
	// session closed; such work belongs to a dead session and expires.
	if _, err := db.ExpireWork(t.Context()); err != nil {
		t.Fatal(err)
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work"); n != 0 {
		t.Errorf("%d work rows left after every session closed and dead work expired", n)
	}
	ended := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work_history WHERE event IN ('Finished', 'Failed', 'Canceled', 'Expired')")
	started := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work_history WHERE event = 'Started'")
	if started != ended || started < cycles.Load() {
		t.Errorf("history: %d Started, %d ended; workers completed %d cycles", started, ended, cycles.Load())
	}
	took := time.Since(start)
	t.Logf("%d cycles in %s (%.0f/s); %d claims found nothing free, %d kept losing races",
		cycles.Load(), took.Round(time.Millisecond), float64(cycles.Load())/took.Seconds(), idle.Load(), lost.Load())
}
