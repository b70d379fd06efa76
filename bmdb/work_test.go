package bmdb_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/metricstest"
	"github.com/shepherd/shepherd/internal/tcpproxy"
)

// TestWorkGivesUpAfterLosingRaces makes the claim's insert lose (a trigger
// skips it, as a conflicting insert of a concurrent claim would) and checks
// that Work tries three times, counting each lost race, before it reports
// ErrWorkConflict; and that a race lost fewer times costs nothing.
func TestWorkGivesUpAfterLosingRaces(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		lose    int
		wantErr error
	}{
		{2, nil},
		{3, bmdb.ErrWorkConflict},
	} {
		t.Run(fmt.Sprintf("%d races lost", tt.lose), func(t *testing.T) {
			t.Parallel()
			reg := prometheus.NewRegistry()
			db := bmdbtest.NewWithConfig(t, bmdb.Config{Registerer: reg})
			s := bmdbtest.Session(t, db, "claimer", time.Minute)
			id := bmdbtest.AddMachine(t, db, s, "p")
			db.Exec(t, "CREATE SEQUENCE lost_races")
			db.Exec(t, fmt.Sprintf(`CREATE FUNCTION lose_race() RETURNS trigger LANGUAGE plpgsql AS $$
				BEGIN IF nextval('lost_races') <= %d THEN RETURN NULL; END IF; RETURN NEW; END $$`, tt.lose))
			db.Exec(t, "CREATE TRIGGER lose_race BEFORE INSERT ON work FOR EACH ROW EXECUTE FUNCTION lose_race()")

			w, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"))
			if !errors.Is(err, tt.wantErr) || (tt.wantErr == nil && err != nil) {
				t.Fatalf("Work() error = %v, want %v", err, tt.wantErr)
			}
			if got := metricstest.Value(t, reg, "shepherd_bmdb_work_claim_conflicts_total", "process", "AgentStart"); got != float64(min(tt.lose, 3)) {
				t.Errorf("work_claim_conflicts_total = %v, want %d", got, min(tt.lose, 3))
			}
			if tt.wantErr != nil {
				return
			}
			if w.MachineID != id || w.Process != bmdb.ProcessAgentStart {
				t.Errorf("claimed %s for %s, want %s for AgentStart", w.MachineID, w.Process, id)
			}
			if n := workRows(t, db, id, s.ID()); n != 1 {
				t.Errorf("%d work rows for the claim, want 1", n)
			}
		})
	}
}

// TestWorkClaimsAreExclusive has workers of several sessions claim a batch
// of machines at once until none is left: every machine is claimed, and by
// exactly one of them.
func TestWorkClaimsAreExclusive(t *testing.T) {
	t.Parallel()
	const (
		machines = 40
		sessions = 4
		workers  = 4 // per session
	)
	db := bmdbtest.New(t)
	setup := bmdbtest.Session(t, db, "setup", time.Minute)
	for range machines {
		bmdbtest.AddMachine(t, db, setup, "p")
	}
	var (
		mu      sync.Mutex
		claimed = map[uuid.UUID]int{}
		wg      sync.WaitGroup
		errs    = make(chan error, sessions*workers)
	)
	for i := range sessions {
		s := bmdbtest.Session(t, db, fmt.Sprintf("worker-%d", i), time.Minute)
		for range workers {
			wg.Go(func() {
				for range machines + 1 { // more claims than machines would be a bug to report, not to wait out
					w, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"))
					if errors.Is(err, bmdb.ErrNothingToDo) {
						return
					}
					if err != nil {
						errs <- err
						return
					}
					mu.Lock()
					claimed[w.MachineID]++
					mu.Unlock()
				}
			})
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("Work: %v", err)
	}
	if len(claimed) != machines {
		t.Errorf("%d machines claimed, want all %d", len(claimed), machines)
	}
	for id, n := range claimed {
		if n != 1 {
			t.Errorf("machine %s claimed %d times", id, n)
		}
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work"); n != machines {
		t.Errorf("%d work rows, want %d", n, machines)
	}
}

// TestWorkOnSessionTheDatabaseExpired checks that a claim on a session the
// database considers dead reports ErrSessionExpired, not ErrNothingToDo,
// even before the session's renewal noticed.
func TestWorkOnSessionTheDatabaseExpired(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "claimer", time.Minute) // no renewal during the test
	if _, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p")); !errors.Is(err, bmdb.ErrNothingToDo) {
		t.Fatalf("Work with no machine: %v, want ErrNothingToDo", err)
	}
	bmdbtest.AddMachine(t, db, s, "p")
	db.Exec(t, "UPDATE sessions SET deadline = now() - interval '1 millisecond' WHERE session_id = $1", s.ID())
	if _, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p")); !errors.Is(err, bmdb.ErrSessionExpired) {
		t.Fatalf("Work on a session the database expired: %v, want ErrSessionExpired", err)
	}
	if _, err := s.Work(t.Context(), bmdb.Process("NoSuchProcess"), bmdb.AgentStartCandidates("p")); err == nil {
		t.Error("Work for an unknown process succeeded")
	}
}

// loseCommitReply runs end, which must write a history row of event, and
// loses the reply to its COMMIT: the commit waits (a deferred trigger takes
// an advisory lock the test holds) until the proxy drops replies, then
// completes unheard, and then the connection breaks. committed reports,
// from the database, whether end's work has committed. loseCommitReply
// returns end's error, with the proxy passing again. Nothing waits on a
// clock: however slow the machine, the commit happens and its reply is lost.
func loseCommitReply(t *testing.T, db *bmdbtest.DB, proxy *tcpproxy.Proxy, event bmdb.Event,
	end func(ctx context.Context) error, committed func(ctx context.Context) (bool, error)) error {
	t.Helper()
	gate := bmdbtest.HoldInserts(t, db, "work_history", bmdbtest.AtCommit, fmt.Sprintf("NEW.event = '%s'", event))
	defer gate.Remove(t)
	result := make(chan error, 1)
	go func() { result <- end(t.Context()) }()
	gate.WaitHeld(t)
	dropped := proxy.DroppedReplies()
	proxy.SetMode(tcpproxy.DropReplies)
	gate.Open(t)
	// Committed is not enough: the proxy must have read and dropped the
	// reply, or passing traffic again would deliver it (see DroppedReplies).
	bmdbtest.WaitFor(t, 30*time.Second, "the end commits and its reply is dropped", func(ctx context.Context) (bool, error) {
		ok, err := committed(ctx)
		return ok && proxy.DroppedReplies() > dropped, err
	})
	proxy.SetMode(tcpproxy.Pass) // resets the connection that lost the reply
	return <-result
}

// TestEndAfterLostCommit ends work with the reply of its COMMIT lost, then
// ends it again, and checks what the second attempt reports: a Fail the
// backoff the first one recorded; any other end ErrWorkEnded, naming how
// the work did end.
func TestEndAfterLostCommit(t *testing.T) {
	t.Parallel()
	policy := bmdb.BackoffPolicy{Initial: time.Hour, MaxAttempts: 5}
	for _, tt := range []struct {
		name  string
		event bmdb.Event
		first func(ctx context.Context, w *bmdb.Work) error
	}{
		{"fail, then fail again", bmdb.EventFailed, func(ctx context.Context, w *bmdb.Work) error {
			_, err := w.Fail(ctx, policy, "first attempt")
			return err
		}},
		{"finish, then fail", bmdb.EventFinished, func(ctx context.Context, w *bmdb.Work) error { return w.Finish(ctx, nil) }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			db, proxy := behindProxy(t)
			s := bmdbtest.Session(t, db, "ender", lease)
			id := bmdbtest.AddMachine(t, db, s, "lab")
			w, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("lab"))
			if err != nil {
				t.Fatal(err)
			}
			err = loseCommitReply(t, db, proxy, tt.event, func(ctx context.Context) error { return tt.first(ctx, w) },
				func(context.Context) (bool, error) { return workRows(t, db, id, s.ID()) == 0, nil })
			if err == nil || !bmdb.Unavailable(err) {
				t.Fatalf("first end with its COMMIT's reply lost: %v, want an error that says the database was unavailable", err)
			}
			if n := workRows(t, db, id, s.ID()); n != 0 {
				t.Fatalf("%d work rows after the lost COMMIT, want 0 (the test needs an end that committed)", n)
			}

			b, err := w.Fail(t.Context(), policy, "second attempt")
			if tt.event != bmdb.EventFailed {
				if !errors.Is(err, bmdb.ErrWorkEnded) || !strings.Contains(err.Error(), "committed as "+string(tt.event)) {
					t.Errorf("Fail after a %s committed unheard: %v, want ErrWorkEnded saying so", tt.event, err)
				}
				if _, err := db.GetBackoff(t.Context(), id, bmdb.ProcessAgentStart); !errors.Is(err, bmdb.ErrNotFound) {
					t.Errorf("backoff after a Finish: %v, want none", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("Fail again after the first committed unheard: %v, want nil", err)
			}
			stored, err := db.GetBackoff(t.Context(), id, bmdb.ProcessAgentStart)
			if err != nil {
				t.Fatal(err)
			}
			if !b.Until.Equal(stored.Until) || b.Interval != stored.Interval || b.Quarantined != stored.Quarantined || b.Attempts != 1 || b.Interval != time.Hour || b.Cause != "first attempt" {
				t.Errorf("second Fail returned %+v, want the backoff the first recorded: %+v (one attempt, 1h)", b, stored)
			}
			if ev := lastEvent(t, db, id); ev.Event != bmdb.EventFailed || ev.Cause != "first attempt" {
				t.Errorf("last event %s (%q), want the first attempt's Failed", ev.Event, ev.Cause)
			}
			if _, err := w.Fail(t.Context(), policy, "third attempt"); !errors.Is(err, bmdb.ErrWorkEnded) {
				t.Errorf("third Fail: %v, want ErrWorkEnded", err)
			}
		})
	}
}

// TestCloseMeetsAClaimInFlight closes a session while one of its claims is
// past its snapshot but not committed (a trigger on the work insert waits
// for a lock the test holds). Whatever the claim then reports, the closed
// session must hold nothing: either Close waits for the claim and cancels
// it, or the claim sees the session closed. A claim that commits after
// Close would leave the machine held, with history Started, by a session
// that no longer exists.
func TestCloseMeetsAClaimInFlight(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "claimer", time.Minute)
	id := bmdbtest.AddMachine(t, db, s, "p")
	gate := bmdbtest.HoldInserts(t, db, "work", bmdbtest.BeforeInsert, "")
	type claim struct {
		w   *bmdb.Work
		err error
	}
	claimed := make(chan claim, 1)
	go func() {
		w, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"))
		claimed <- claim{w, err}
	}()
	gate.WaitHeld(t)
	closed := make(chan error, 1)
	go func() { closed <- s.Close(t.Context()) }()
	// Let the claim go once Close has either returned or is itself waiting
	// for a lock: releasing earlier would let the claim commit first and
	// test nothing.
	bmdbtest.WaitFor(t, 30*time.Second, "Close returns or waits for the claim", func(ctx context.Context) (bool, error) {
		if len(closed) > 0 {
			return true, nil
		}
		return bmdbtest.LockWaiters(ctx, db)
	})
	gate.Open(t)
	c := <-claimed
	if err := <-closed; err != nil {
		t.Fatalf("Close: %v", err)
	}
	if n := workRows(t, db, id, s.ID()); n != 0 {
		t.Errorf("%d work rows of the closed session (claim returned %v), want 0", n, c.err)
	}
	if c.err == nil {
		if ev := lastEvent(t, db, id); ev.Event != bmdb.EventCanceled {
			t.Errorf("last event of the claimed machine %s (%q), want Canceled by Close", ev.Event, ev.Cause)
		}
	} else if !errors.Is(c.err, bmdb.ErrSessionExpired) {
		t.Errorf("claim refused by the closing session: %v, want ErrSessionExpired", c.err)
	}
}
