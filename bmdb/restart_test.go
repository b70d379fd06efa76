package bmdb_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sync/errgroup"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/pgserver"
)

// TestPostgresRestart stops and starts PostgreSQL in the middle of a run.
// The workers keep their sessions (short outage) or get new ones (outage
// longer than the lease) by themselves, and the run completes: every machine
// is processed exactly once, and no claim ever overlapped another.
func TestPostgresRestart(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name        string
		lease       time.Duration
		outage      time.Duration
		sameSession bool
	}{
		{"outage shorter than the lease", 10 * time.Second, time.Second, true},
		{"outage longer than the lease", time.Second, 3 * time.Second, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			runRestart(t, tc.lease, tc.outage, tc.sameSession)
		})
	}
}

func runRestart(t *testing.T, lease, outage time.Duration, sameSession bool) {
	const (
		machines = 300
		workers  = 8
	)
	// This test stops its server, so it gets one of its own.
	srv, err := pgserver.Start(t.Context(), pgserver.Config{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	db, err := bmdb.Open(t.Context(), bmdb.Config{URL: srv.URL("postgres")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	raw := &bmdbtest.DB{DB: db, URL: srv.URL("postgres")}
	setup, err := db.StartSession(t.Context(), bmdb.SessionConfig{Component: "setup"})
	if err != nil {
		t.Fatal(err)
	}
	for range machines {
		bmdbtest.AddMachine(t, raw, setup, "p")
	}
	if err := setup.Close(t.Context()); err != nil {
		t.Fatal(err)
	}

	pool, err := pgxpool.New(t.Context(), srv.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	raw.Pool = pool

	var (
		finished atomic.Int64
		mu       sync.Mutex
		sessions = map[uuid.UUID]bool{}
	)
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	allDone := make(chan struct{})
	var doneOnce sync.Once
	g, gctx := errgroup.WithContext(ctx)
	cfg := bmdb.SessionConfig{Component: "restart-worker", Lease: lease}
	g.Go(func() error {
		return db.KeepSession(gctx, cfg, func(ctx context.Context, s *bmdb.Session) error {
			mu.Lock()
			sessions[s.ID()] = true
			mu.Unlock()
			wg, wctx := errgroup.WithContext(ctx)
			for range workers {
				wg.Go(func() error { return restartWorker(wctx, s, &finished, allDone) })
			}
			return wg.Wait()
		})
	})
	g.Go(func() error {
		// Restart once a third of the machines are done.
		pause := time.NewTicker(5 * time.Millisecond)
		defer pause.Stop()
		for finished.Load() < machines/3 {
			select {
			case <-gctx.Done():
				return gctx.Err()
			case <-pause.C:
			}
		}
		if err := srv.Stop(gctx); err != nil {
			return fmt.Errorf("stopping postgres: %w", err)
		}
		stopped := finished.Load()
		select {
		case <-gctx.Done():
			return gctx.Err()
		case <-time.After(outage):
		}
		if err := srv.Start(gctx); err != nil {
			return fmt.Errorf("starting postgres: %w", err)
		}
		t.Logf("postgres was down for %s with %d of %d machines done", outage, stopped, machines)
		// Wait for the run to complete, as the database sees it (a COMMIT
		// cut off by the restart may have succeeded without the worker
		// hearing so), then stop the workers.
		for {
			var n int64
			err := pool.QueryRow(gctx, "SELECT count(*) FROM machine_agent_started").Scan(&n)
			if err == nil && n == machines {
				break
			}
			select {
			case <-gctx.Done():
				return gctx.Err()
			case <-pause.C:
			}
		}
		doneOnce.Do(func() { close(allDone) })
		return nil
	})
	if err := g.Wait(); err != nil {
		t.Fatalf("run did not complete: %v (finished %d of %d)", err, finished.Load(), machines)
	}

	// Each machine finished exactly once: none twice (a lost COMMIT
	// retried as a second run), none never.
	if n := bmdbtest.Scalar[int64](t, raw, "SELECT count(*) FROM work_history WHERE event = 'Finished'"); n != machines {
		t.Errorf("%d Finished history rows, want %d (each machine processed exactly once)", n, machines)
	}
	if twice := bmdbtest.Scalar[[]string](t, raw, `SELECT coalesce(array_agg(machine_id::text), '{}') FROM (
		SELECT machine_id FROM work_history WHERE event = 'Finished' GROUP BY machine_id HAVING count(*) > 1) d`); len(twice) > 0 {
		t.Errorf("machines finished more than once: %v", twice)
	}
	if v := bmdbtest.OverlappingClaims(t, raw); len(v) > 0 {
		t.Errorf("history shows overlapping claims:\n%v", v)
	}
	mu.Lock()
	defer mu.Unlock()
	if sameSession && len(sessions) != 1 {
		t.Errorf("%d sessions used, want the first to survive an outage shorter than its lease", len(sessions))
	}
	if !sameSession && len(sessions) < 2 {
		t.Errorf("%d sessions used, want a new one after an outage longer than the lease", len(sessions))
	}
}

// restartWorker agent-starts machines until all are done, riding out errors
// the way a control loop does: log-worthy errors are retried after a pause.
func restartWorker(ctx context.Context, s *bmdb.Session, finished *atomic.Int64, allDone <-chan struct{}) error {
	pause := func() bool {
		select {
		case <-ctx.Done():
			return false
		case <-allDone:
			return false
		case <-time.After(20 * time.Millisecond):
			return true
		}
	}
	for {
		w, err := s.Work(ctx, bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"))
		switch {
		case errors.Is(err, bmdb.ErrSessionExpired), ctx.Err() != nil:
			return nil // KeepSession opens a new session
		case err != nil:
			if !pause() {
				return nil
			}
			continue
		}
		for {
			err := w.Finish(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
				return tx.SetAgentStarted(ctx, w.MachineID, make([]byte, 32))
			})
			if err == nil {
				finished.Add(1)
				break
			}
			if errors.Is(err, bmdb.ErrSessionExpired) || ctx.Err() != nil {
				return nil
			}
			// The database is down: the work is still ours until our lease
			// runs out, so try again.
			if !pause() {
				return nil
			}
		}
	}
}
