package bmdb_test

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/logtest"
	"github.com/shepherd/shepherd/internal/metricstest"
)

// The tests in this file run the session's Go-side timing (renewal every
// third of the lease, retries, the local deadline, KeepSession's pauses) in
// a synctest bubble, against the real database. Time in the bubble is
// virtual: it only moves when every goroutine of the bubble waits on a timer
// or a channel, never while one waits for the database, so a round trip
// takes no virtual time and the assertions can be exact. The database's
// own clock (the deadline in the sessions table) is not virtual; these tests
// use leases long enough that it never expires a session during a test.
//
// The database is created outside the bubble; the BMDB's pool and the
// connection used to inject failures are opened inside it (their
// goroutines and timers must belong to the bubble) and closed before it
// ends.

// inBubble opens the BMDB at url from inside a synctest bubble, with reg and
// log (nil: none), plus a raw connection for injecting failures. Both are
// closed when the bubble's test ends.
func inBubble(t *testing.T, url string, reg prometheus.Registerer, log *slog.Logger) (*bmdb.DB, *pgx.Conn) {
	t.Helper()
	db, err := bmdb.Open(t.Context(), bmdb.Config{URL: url, Schema: bmdb.SchemaRequireCurrent, Registerer: reg, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	conn, err := pgx.Connect(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return db, conn
}

// refuse makes the database fail every statement that does op ("INSERT",
// "UPDATE OF deadline", ...) on sessions, until the returned function undoes it.
func refuse(t *testing.T, conn *pgx.Conn, op string) (allow func()) {
	t.Helper()
	name := pgx.Identifier{"refuse_" + uuid.NewString()[:8]}.Sanitize()
	run(t, conn, `CREATE OR REPLACE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'refused by the test'; END $$`)
	run(t, conn, "CREATE TRIGGER "+name+" BEFORE "+op+" ON sessions FOR EACH ROW EXECUTE FUNCTION refuse()")
	return func() { run(t, conn, "DROP TRIGGER "+name+" ON sessions") }
}

func run(t *testing.T, conn *pgx.Conn, sql string, args ...any) {
	t.Helper()
	if _, err := conn.Exec(t.Context(), sql, args...); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// TestSessionRenewalTiming checks, on the bubble's clock, that a session
// renews every third of its lease; that failed renewals are retried every
// fifth of that, so an outage shorter than the rest of the lease costs
// nothing; and that a session whose renewals keep failing gives up exactly
// one lease after the last renewal that succeeded was sent, never earlier.
func TestSessionRenewalTiming(t *testing.T) {
	t.Parallel()
	url := bmdbtest.NewDatabase(t)
	synctest.Test(t, func(t *testing.T) {
		reg := prometheus.NewRegistry()
		logs := logtest.New()
		db, conn := inBubble(t, url, reg, logs.Logger())
		const (
			lease  = 30 * time.Second
			period = lease / 3  // renewals
			retry  = period / 5 // retries of a failed renewal
		)
		start := time.Now()
		s, err := db.StartSession(t.Context(), bmdb.SessionConfig{Component: "renewer", Lease: lease})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Close(context.Background()) }) // before the BMDB closes
		// Far more failed renewals than the retries below allow: renewal no
		// longer pauses. Close the session, so that the test can say so.
		logs.OnFlood(100, func() { go s.Close(context.Background()) })
		// at moves the bubble's clock to start+d and lets the session act.
		at := func(d time.Duration) {
			time.Sleep(time.Until(start.Add(d)))
			synctest.Wait()
		}
		check := func(when string, ok, failed float64, lost bool) {
			t.Helper()
			gotOK := metricstest.Value(t, reg, "shepherd_bmdb_session_renewals_total", "result", "ok")
			gotFailed := metricstest.Value(t, reg, "shepherd_bmdb_session_renewals_total", "result", "error")
			if gotOK != ok || gotFailed != failed || s.Lost() != lost {
				t.Fatalf("%s: %v renewals, %v failed, lost %v; want %v, %v, %v (cause %v)",
					when, gotOK, gotFailed, s.Lost(), ok, failed, lost, context.Cause(s.Context()))
			}
		}

		at(period - time.Millisecond)
		check("just before a third of the lease", 0, 0, false)
		at(period)
		check("at a third of the lease", 1, 0, false)
		at(3 * period)
		check("at a whole lease", 3, 0, false)

		// A short outage: the renewal at 4 periods fails and so does its
		// first retry; the second retry succeeds.
		allow := refuse(t, conn, "UPDATE OF deadline")
		at(4*period + 2*retry - time.Millisecond)
		check("during a short outage", 3, 2, false)
		allow()
		at(4*period + 2*retry)
		check("after a short outage", 4, 2, false)

		// A long outage: from the renewal sent at 4p+2r on, every renewal
		// fails. The session must hold until the local deadline, one lease
		// after that renewal was sent, and give up exactly then.
		lastOK := 4*period + 2*retry
		allow = refuse(t, conn, "UPDATE OF deadline")
		at(lastOK + lease - time.Millisecond)
		failed := float64((lease-period)/retry) + 2 // retries from lastOK+period up to, not at, the deadline
		check("just before the local deadline", 4, failed, false)
		if s.Context().Err() != nil {
			t.Fatalf("session context done before the local deadline: %v", context.Cause(s.Context()))
		}
		at(lastOK + lease)
		check("at the local deadline", 4, failed+1, true)
		if !errors.Is(context.Cause(s.Context()), bmdb.ErrSessionExpired) {
			t.Errorf("cause %v, want ErrSessionExpired", context.Cause(s.Context()))
		}
		if got := metricstest.Value(t, reg, "shepherd_bmdb_sessions_lost_total"); got != 1 {
			t.Errorf("sessions_lost_total = %v, want 1", got)
		}
		allow()
		if err := s.Close(t.Context()); err != nil {
			t.Fatal(err)
		}
	})
}

// TestKeepSessionPauses checks KeepSession's retries on the bubble's clock:
// while no session can be started, the pause between attempts doubles from
// 100 ms up to 5 s, each pause jittered within [pause/2, pause); once a
// session was started and then lost, the pause starts over at 100 ms; and a
// session that cannot be closed although it was alive is reported.
func TestKeepSessionPauses(t *testing.T) {
	t.Parallel()
	url := bmdbtest.NewDatabase(t)
	synctest.Test(t, func(t *testing.T) {
		const lease = 30 * time.Second
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		// Far more attempts than the pauses below allow: KeepSession no
		// longer pauses, and is stopped so that the test can say so.
		logs := logtest.New()
		logs.OnFlood(100, cancel)
		db, conn := inBubble(t, url, nil, logs.Logger())
		sessions := make(chan *bmdb.Session, 10)
		done := make(chan error, 1)

		allowStart := refuse(t, conn, "INSERT")
		go func() {
			done <- db.KeepSession(ctx, bmdb.SessionConfig{Component: "keeper", Lease: lease},
				func(ctx context.Context, s *bmdb.Session) error {
					sessions <- s
					<-ctx.Done()
					return nil
				})
		}()
		// 100+200+...+3200 ms, then 5 s pauses: 11 attempts fail within 30 s.
		time.Sleep(30 * time.Second)
		synctest.Wait()
		failed := logs.With("cannot start session, retrying")
		if len(failed) < 11 {
			t.Fatalf("%d failed attempts to start a session in 30 s, want at least 11", len(failed))
		}
		ms := time.Millisecond
		want := []time.Duration{100 * ms, 200 * ms, 400 * ms, 800 * ms, 1600 * ms, 3200 * ms, 5 * time.Second, 5 * time.Second}
		for i, w := range want {
			pause := failed[i].Attrs["pause"].Duration()
			gap := failed[i+1].Time.Sub(failed[i].Time)
			if pause != w || gap < w/2 || gap >= w {
				t.Errorf("attempt %d: pause %s, next attempt %s later; want pause %s, next attempt within [%s, %s)",
					i+1, pause, gap, w, w/2, w)
			}
		}
		if len(sessions) != 0 {
			t.Fatal("fn ran without a session")
		}

		allowStart()
		time.Sleep(5 * time.Second)
		synctest.Wait()
		var first *bmdb.Session
		select {
		case first = <-sessions:
		default:
			t.Fatal("no session within a pause of the database taking sessions again")
		}

		// The database expires the session while no new one can be started:
		// the first renewal finds it gone, and KeepSession retries at once
		// with its shortest pause again.
		allowStart = refuse(t, conn, "INSERT")
		run(t, conn, "UPDATE sessions SET deadline = now() - interval '1 millisecond' WHERE session_id = $1", first.ID())
		lostAt := len(logs.With("cannot start session, retrying"))
		time.Sleep(lease / 3)
		synctest.Wait()
		if !first.Lost() {
			t.Fatal("session not lost at its first renewal after the database expired it")
		}
		if got := logs.With("cannot start session, retrying"); len(got) <= lostAt {
			t.Fatal("no attempt to start a new session after losing one")
		} else if pause := got[lostAt].Attrs["pause"].Duration(); pause != 100*ms {
			t.Fatalf("first attempt after losing a session paused %s, want 100ms", pause)
		}
		allowStart()
		time.Sleep(5 * time.Second) // the longest pause
		synctest.Wait()
		var second *bmdb.Session
		select {
		case second = <-sessions:
		default:
			t.Fatal("no new session after the lost one")
		}
		if second.ID() == first.ID() {
			t.Fatal("KeepSession handed out the lost session again")
		}
		if n := len(logs.With("closing session")); n != 0 {
			t.Errorf("%d warnings about closing sessions, want none (the lost one needs no closing)", n)
		}

		// Stopping with a live session that cannot be closed: KeepSession
		// returns nil (it was asked to stop) and says so in the log.
		refuse(t, conn, "UPDATE OF closed_at")
		cancel()
		synctest.Wait()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("KeepSession: %v, want nil", err)
			}
		default:
			t.Fatal("KeepSession still running after its context was cancelled")
		}
		if n := len(logs.With("closing session")); n != 1 {
			t.Errorf("%d warnings about closing the live session, want 1", n)
		}
	})
}
