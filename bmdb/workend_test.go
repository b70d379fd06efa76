package bmdb_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/tcpproxy"
)

// workRows counts the work rows of machine held by session.
func workRows(t *testing.T, db *bmdbtest.DB, machine, session uuid.UUID) int64 {
	t.Helper()
	return bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work WHERE machine_id = $1 AND session_id = $2", machine, session)
}

// behindProxy opens a BMDB through a proxy with one connection, so that a
// test can warm it up: pgx prepares a statement in a round trip of its own
// the first time a connection runs it, and a request whose reply is to be
// lost must be sent whole.
func behindProxy(t *testing.T) (*bmdbtest.DB, *tcpproxy.Proxy) {
	t.Helper()
	return bmdbtest.NewBehindProxy(t, bmdb.Config{MaxConns: 1})
}

// lease is long enough that no renewal falls into the short windows in which
// these tests lose replies (a renewal stuck there would hold the only
// connection).
const lease = 30 * time.Second

// lastEvent returns the latest history row of machine.
func lastEvent(t *testing.T, db *bmdbtest.DB, machine uuid.UUID) bmdb.HistoryEvent {
	t.Helper()
	h, err := db.History(t.Context(), bmdb.HistoryFilter{MachineID: machine})
	if err != nil {
		t.Fatal(err)
	}
	if len(h) == 0 {
		t.Fatalf("machine %s has no history", machine)
	}
	return h[len(h)-1]
}

// TestAmbiguousClaimIsReleased loses the reply of a claim that committed:
// Work returns an error, yet the machine is held by the (live) session. The
// session must release it by itself once the database answers again, and
// stay alive, so that the machine is claimable again.
func TestAmbiguousClaimIsReleased(t *testing.T) {
	t.Parallel()
	db, proxy := behindProxy(t)
	s := bmdbtest.Session(t, db, "claimer", lease)
	id := bmdbtest.AddMachine(t, db, s, "lab")
	warmUpClaim(t, s)

	// The claim commits although its caller never hears so, then the
	// connection breaks.
	err := loseReply(t, proxy, true, func(ctx context.Context) error {
		_, err := s.Work(ctx, bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("lab"))
		return err
	}, func() bool { return workRows(t, db, id, s.ID()) == 1 })
	if err == nil {
		t.Fatal("Work with its reply lost returned without error")
	}

	bmdbtest.WaitFor(t, 10*time.Second, "the session releases the work of its lost claim", func(context.Context) (bool, error) {
		return workRows(t, db, id, s.ID()) == 0, nil
	})
	if ev := lastEvent(t, db, id); ev.Event != bmdb.EventCanceled || !strings.Contains(ev.Cause, "unknown") {
		t.Errorf("last history event %s (%q), want Canceled saying the claim's outcome was unknown", ev.Event, ev.Cause)
	}
	if s.Context().Err() != nil {
		t.Fatalf("the session died: %v", context.Cause(s.Context()))
	}
	w, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("lab"))
	if err != nil {
		t.Fatalf("claiming the released machine again: %v", err)
	}
	if w.MachineID != id {
		t.Fatalf("claimed %s, want %s", w.MachineID, id)
	}
	if err := w.Finish(t.Context(), nil); err != nil {
		t.Fatalf("Finish: %v", err)
	}
}

// TestReconciliationKeepsKnownWork checks that releasing the work of lost
// claims leaves the work the session knows it holds alone, however many
// claims run meanwhile.
func TestReconciliationKeepsKnownWork(t *testing.T) {
	t.Parallel()
	db, proxy := behindProxy(t)
	s := bmdbtest.Session(t, db, "claimer", lease)
	warmUpClaim(t, s)
	var known []*bmdb.Work
	for range 4 {
		bmdbtest.AddMachine(t, db, s, "lab")
	}
	for range 2 {
		w, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("lab"))
		if err != nil {
			t.Fatal(err)
		}
		known = append(known, w)
	}
	// Lose the reply of a claim of one of the two machines left.
	err := loseReply(t, proxy, true, func(ctx context.Context) error {
		_, err := s.Work(ctx, bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("lab"))
		return err
	}, func() bool {
		return bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work WHERE session_id = $1", s.ID()) == int64(len(known)+1)
	})
	if err == nil {
		t.Fatal("Work with its reply lost succeeded")
	}
	// Claim the last machine while reconciliation may run.
	last, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("lab"))
	if err != nil {
		t.Fatal(err)
	}
	known = append(known, last)
	bmdbtest.WaitFor(t, 10*time.Second, "one work row released", func(context.Context) (bool, error) {
		n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work WHERE session_id = $1", s.ID())
		return n == int64(len(known)), nil
	})
	for _, w := range known {
		if err := w.Finish(t.Context(), nil); err != nil {
			t.Errorf("finishing known work on %s: %v", w.MachineID, err)
		}
	}
	// The lost claim's machine was released (and may since have been
	// claimed again by the last claim).
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work_history WHERE event = 'Canceled' AND cause LIKE '%unknown%'"); n != 1 {
		t.Errorf("%d releases of lost claims in history, want 1", n)
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work"); n != 0 {
		t.Errorf("%d work rows left", n)
	}
}

// loseReply runs op, whose replies the proxy drops (from now on, or from
// when op itself switches it), waits until committed reports that op's
// write committed, breaks the connection and returns op's error. Nothing
// waits on a clock: however slow the machine, the write commits and its
// reply is lost.
func loseReply(t *testing.T, proxy *tcpproxy.Proxy, dropNow bool, op func(ctx context.Context) error, committed func() bool) error {
	t.Helper()
	dropped := proxy.DroppedReplies()
	if dropNow {
		proxy.SetMode(tcpproxy.DropReplies)
	}
	result := make(chan error, 1)
	go func() { result <- op(t.Context()) }()
	// The reply must really be swallowed, not only the write committed: on a
	// busy machine the proxy may not have read the reply yet, and passing
	// traffic again would deliver it.
	bmdbtest.WaitFor(t, 30*time.Second, "the write whose reply is lost commits and its reply is dropped", func(context.Context) (bool, error) {
		return committed() && proxy.DroppedReplies() > dropped, nil
	})
	proxy.SetMode(tcpproxy.Pass) // resets the connection that lost the reply
	return <-result
}

// warmUpClaim runs the agent start claim once, so that the connection has it
// prepared.
func warmUpClaim(t *testing.T, s *bmdb.Session) {
	t.Helper()
	if _, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("warm-up")); !errors.Is(err, bmdb.ErrNothingToDo) {
		t.Fatalf("warming up the claim: %v", err)
	}
}

// TestEndRetriedAfterLostReply loses the reply of an end of work that
// committed. Ending again must report what happened (the work ended as
// asked), not that the session expired.
func TestEndRetriedAfterLostReply(t *testing.T) {
	t.Parallel()
	// A transaction's COMMIT loses its reply when fn switches the proxy;
	// single statements are warmed up and sent with the proxy switched.
	for _, end := range []string{"finish in a transaction", "finish in one statement", "cancel"} {
		t.Run(end, func(t *testing.T) {
			t.Parallel()
			db, proxy := behindProxy(t)
			s := bmdbtest.Session(t, db, "ender", lease)
			bmdbtest.AddMachine(t, db, s, "lab")
			id := bmdbtest.AddMachine(t, db, s, "lab")
			claim := func() *bmdb.Work {
				w, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("lab"))
				if err != nil {
					t.Fatal(err)
				}
				return w
			}
			// The first claim warms the end's statement up.
			if w := claim(); end == "cancel" {
				err := w.Cancel(t.Context())
				if err == nil {
					_, err = s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("none"))
				}
				if !errors.Is(err, bmdb.ErrNothingToDo) {
					t.Fatal(err)
				}
				claim() // the canceled machine again: leave it held
			} else if err := w.Finish(t.Context(), nil); err != nil {
				t.Fatal(err)
			}
			w := claim()
			id = w.MachineID
			want := bmdb.EventFinished
			lose := func() {}
			do := func(ctx context.Context) error {
				switch end {
				case "finish in a transaction":
					return w.Finish(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
						if err := tx.SetAgentStarted(ctx, id, make([]byte, 32)); err != nil {
							return err
						}
						lose()
						return nil
					})
				case "finish in one statement":
					return w.Finish(ctx, nil)
				}
				want = bmdb.EventCanceled
				return w.Cancel(ctx)
			}

			// The end commits, its reply lost, then the connection breaks.
			ended := func() bool { return workRows(t, db, id, s.ID()) == 0 }
			var err error
			if end == "finish in a transaction" {
				lose = func() { proxy.SetMode(tcpproxy.DropReplies); lose = func() {} }
				err = loseReply(t, proxy, false, do, ended)
			} else {
				err = loseReply(t, proxy, true, do, ended)
			}
			if err == nil {
				t.Fatal("ending with its reply lost succeeded")
			}
			if !bmdb.Unavailable(err) {
				t.Errorf("Unavailable(%v) = false, want true", err)
			}
			if err := do(t.Context()); err != nil {
				t.Fatalf("ending again after the lost reply: %v, want nil (the first attempt committed)", err)
			}
			if ev := lastEvent(t, db, id); ev.Event != want {
				t.Errorf("last event %s, want %s", ev.Event, want)
			}
			if err := do(t.Context()); !errors.Is(err, bmdb.ErrWorkEnded) {
				t.Errorf("ending a third time: %v, want ErrWorkEnded", err)
			}
		})
	}
}

// TestFailStoresAnyCause fails work with a cause PostgreSQL would refuse as
// text (NUL, invalid UTF-8): the failure must be recorded all the same, or
// the machine stays held.
func TestFailStoresAnyCause(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "failer", 0)
	id := bmdbtest.AddMachine(t, db, s, "lab")
	w, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("lab"))
	if err != nil {
		t.Fatal(err)
	}
	b, err := w.Fail(t.Context(), bmdb.BackoffPolicy{Initial: time.Hour}, "agent said \x00\xff\xfe")
	if err != nil {
		t.Fatalf("Fail: %v", err)
	}
	if want := "agent said \uFFFD\uFFFD"; b.Cause != want {
		t.Errorf("cause %q, want %q", b.Cause, want)
	}
	if ev := lastEvent(t, db, id); ev.Event != bmdb.EventFailed {
		t.Errorf("last event %s, want Failed", ev.Event)
	}
}

func TestUnavailable(t *testing.T) {
	t.Parallel()
	for _, err := range []error{nil, errors.New("fn said no"), bmdb.ErrSessionExpired, bmdb.ErrWorkEnded, context.Canceled} {
		if bmdb.Unavailable(err) {
			t.Errorf("Unavailable(%v) = true", err)
		}
	}
	if !bmdb.Unavailable(context.DeadlineExceeded) {
		t.Error("Unavailable(context.DeadlineExceeded) = false")
	}
}

// warmUpStart starts and closes a session, so that the connection has the
// start's statement prepared and a start whose reply is to be lost is sent
// whole.
func warmUpStart(t *testing.T, db *bmdbtest.DB) {
	t.Helper()
	warm, err := db.StartSession(t.Context(), bmdb.SessionConfig{Component: "warm-up", Lease: lease})
	if err != nil {
		t.Fatal(err)
	}
	if err := warm.Close(t.Context()); err != nil {
		t.Fatal(err)
	}
}

// TestStartWithLostReplyLeavesNoSession starts a session whose INSERT
// commits but whose reply never arrives: once the connection breaks, once the
// caller gives up first (its context ends, as when `shepherd run` stops its
// other components after one failed to start). StartSession fails, so nobody
// will renew or close the session it may have opened: it must close it
// itself, not leave it open for a lease.
func TestStartWithLostReplyLeavesNoSession(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name   string
		giveUp bool
	}{{"connection breaks", false}, {"caller gives up", true}} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			db, proxy := behindProxy(t)
			warmUpStart(t, db)
			started := func() int64 {
				return bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM sessions WHERE component = 'lost-start'")
			}

			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			dropped := proxy.DroppedReplies()
			proxy.SetMode(tcpproxy.DropReplies)
			result := make(chan error, 1)
			go func() {
				s, err := db.StartSession(ctx, bmdb.SessionConfig{Component: "lost-start", Lease: lease})
				if err == nil {
					err = s.Close(context.Background())
					if err == nil {
						err = errors.New("StartSession succeeded")
					}
				}
				result <- err
			}()
			bmdbtest.WaitFor(t, 30*time.Second, "the start commits and its reply is dropped", func(context.Context) (bool, error) {
				return started() == 1 && proxy.DroppedReplies() > dropped, nil
			})
			if tt.giveUp {
				cancel()
			}
			proxy.SetMode(tcpproxy.Pass) // resets the connection that lost the reply
			err := <-result
			if err == nil || !(bmdb.Unavailable(err) || errors.Is(err, context.Canceled)) {
				t.Fatalf("StartSession with its reply lost: %v, want an error that says the database was unavailable or the caller gave up", err)
			}
			if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM sessions WHERE component = 'lost-start' AND closed_at IS NULL"); n != 0 {
				t.Errorf("%d sessions left open by the start that failed, want 0", n)
			}
			if n := started(); n != 1 {
				t.Errorf("%d sessions recorded for one start, want 1", n)
			}
		})
	}
}

// TestStartCommittingAfterItsAbandonIsClosed breaks the connection of a
// start whose INSERT is still committing, so that the abandon runs first: it
// must wait for that commit and close the session, not find nothing to close
// and let the session open after StartSession has failed. pgx sends a cancel
// request for a connection it loses, which stops a statement still at an
// interruptible point; the start's commit is held by a trigger that ignores
// it, as a commit past that point (writing its WAL) does.
func TestStartCommittingAfterItsAbandonIsClosed(t *testing.T) {
	t.Parallel()
	db, proxy := behindProxy(t)
	warmUpStart(t, db)
	const key = 4711
	db.Exec(t, fmt.Sprintf(`CREATE FUNCTION hold_start() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			LOOP
				BEGIN PERFORM pg_advisory_lock(%[1]d); EXIT;
				EXCEPTION WHEN query_canceled THEN NULL; END;
			END LOOP;
			PERFORM pg_advisory_unlock(%[1]d);
			RETURN NULL;
		END $$`, key))
	db.Exec(t, `CREATE CONSTRAINT TRIGGER hold_start AFTER INSERT ON sessions DEFERRABLE INITIALLY DEFERRED
		FOR EACH ROW WHEN (NEW.component = 'late-start' AND NEW.closed_at IS NULL) EXECUTE FUNCTION hold_start()`)
	gate, err := db.Pool.Acquire(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer gate.Release()
	if _, err := gate.Exec(t.Context(), "SELECT pg_advisory_lock($1)", key); err != nil {
		t.Fatal(err)
	}
	unlocked := false
	unlock := func() {
		if !unlocked {
			unlocked = true
			if _, err := gate.Exec(context.WithoutCancel(t.Context()), "SELECT pg_advisory_unlock($1)", key); err != nil {
				t.Fatal(err)
			}
		}
	}
	defer unlock()

	result := make(chan error, 1)
	go func() {
		s, err := db.StartSession(t.Context(), bmdb.SessionConfig{Component: "late-start", Lease: lease})
		if err == nil {
			err = s.Close(context.Background())
			if err == nil {
				err = errors.New("StartSession succeeded")
			}
		}
		result <- err
	}()
	bmdbtest.WaitFor(t, 60*time.Second, "the start waits at its commit", func(ctx context.Context) (bool, error) {
		var held bool
		err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objid = $1
			AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))`, key).Scan(&held)
		return held, err
	})
	proxy.SetMode(tcpproxy.Reset)
	proxy.SetMode(tcpproxy.Pass)
	returned := false
	bmdbtest.WaitFor(t, 30*time.Second, "the abandon waits for the start's commit, or StartSession returns", func(ctx context.Context) (bool, error) {
		select {
		case err = <-result:
			returned = true
			return true, nil
		default:
		}
		return bmdbtest.LockWaiters(ctx, db)
	})
	unlock()
	if !returned {
		err = <-result
	}
	if err == nil || !bmdb.Unavailable(err) {
		t.Fatalf("StartSession whose connection broke while it committed: %v, want an error that says the database was unavailable", err)
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM sessions WHERE component = 'late-start' AND closed_at IS NULL"); n != 0 {
		t.Errorf("%d sessions left open by the start that failed, want 0", n)
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM sessions WHERE component = 'late-start'"); n != 1 {
		t.Errorf("%d sessions recorded for one start, want 1", n)
	}
}
