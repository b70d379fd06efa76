package bmdb_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/logtest"
)

// silentNow returns how many machines of provider p recovery would take
// and how many the fleet gauges call Silent; the two must agree.
func silentNow(t *testing.T, db *bmdbtest.DB, p string) (candidates, silent int64) {
	t.Helper()
	c := bmdb.RecoveryCandidates(p, 0, 0)
	n, err := db.CountMatching(t.Context(), c)
	if err != nil {
		t.Fatal(err)
	}
	states, err := db.FleetStates(t.Context(), p, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	return n, states[bmdb.StateSilent]
}

// TestSilenceDuringRecorderTroubleDoesNotCount: a machine whose heartbeat
// is older than the timeout is silent only if no callback server was
// unable to record heartbeats within that timeout (issue 10 item 10).
func TestSilenceDuringRecorderTroubleDoesNotCount(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "p", Stale: 1, NeverHeartbeat: 1})
	want := func(what string, n int64) {
		t.Helper()
		c, s := silentNow(t, db, "p")
		if c != n || s != n {
			t.Errorf("%s: %d recovery candidates and %d Silent, want %d", what, c, s, n)
		}
	}
	want("no recorder at all", 2)

	s := bmdbtest.Session(t, db, "server", time.Minute)
	db.Exec(t, `INSERT INTO heartbeat_recorders (session_id, ok_since, checked_at) VALUES ($1, now() - interval '1 day', now())`, s.ID())
	want("recording fine for a day", 2)

	db.Exec(t, `UPDATE heartbeat_recorders SET ok_since = now() - interval '5 minutes'`)
	want("recording again for 5 of the 10 minutes of the timeout", 0)

	db.Exec(t, `UPDATE heartbeat_recorders SET ok_since = now() - interval '1 day', checked_at = now() - interval '10 seconds'`)
	want("a live recorder that missed its check-ins", 0)

	db.Exec(t, `UPDATE heartbeat_recorders SET checked_at = now()`)
	db.Exec(t, `UPDATE sessions SET deadline = now() - interval '1 minute' WHERE session_id = $1`, s.ID())
	want("a recorder that died a minute ago", 0)

	db.Exec(t, `UPDATE sessions SET deadline = now() - interval '1 hour' WHERE session_id = $1`, s.ID())
	want("a recorder that died an hour ago", 2)

	db.Exec(t, `UPDATE sessions SET deadline = now() - interval '1 minute', closed_at = now() - interval '1 minute' WHERE session_id = $1`, s.ID())
	want("a recorder that stopped cleanly", 2)
}

// TestHeartbeatRecorderRun: a running recorder registers itself, restarts
// its window after a failure, and ends its say when it stops.
func TestHeartbeatRecorderRun(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "p", Stale: 1})
	r := db.NewHeartbeatRecorder(nil)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	stop := sync.OnceValue(func() error { cancel(); return <-done })
	defer stop()

	bmdbtest.WaitFor(t, 10*time.Second, "the recorder registers", func(ctx context.Context) (bool, error) {
		var n int64
		err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM heartbeat_recorders`).Scan(&n)
		return n == 1, err
	})
	if c, s := silentNow(t, db, "p"); c != 0 || s != 0 {
		t.Errorf("right after a recorder started: %d candidates, %d Silent; want 0", c, s)
	}

	db.Exec(t, `UPDATE heartbeat_recorders SET ok_since = now() - interval '1 day'`)
	if c, _ := silentNow(t, db, "p"); c != 1 {
		t.Fatalf("recording fine for a day: %d candidates, want 1", c)
	}
	r.Failed()
	bmdbtest.WaitFor(t, 10*time.Second, "the check-in after a failure restarts the window", func(ctx context.Context) (bool, error) {
		var recent bool
		err := db.Pool.QueryRow(ctx, `SELECT ok_since > now() - interval '1 minute' FROM heartbeat_recorders`).Scan(&recent)
		return recent, err
	})
	if c, _ := silentNow(t, db, "p"); c != 0 {
		t.Errorf("after a failed batch: %d candidates, want 0", c)
	}

	if err := stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if c, _ := silentNow(t, db, "p"); c != 1 {
		t.Errorf("after the recorder stopped cleanly: %d candidates, want 1", c)
	}
}

// TestRecorderFailuresAreFlushedAtStop: the check-in failures of an
// outage that the rate limit held back are logged with their count when
// the recorder stops, not lost with it.
func TestRecorderFailuresAreFlushedAtStop(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	// Every registration fails, and counts itself in a sequence (which
	// the failing statement's rollback does not undo).
	db.Exec(t, `CREATE SEQUENCE recorder_attempts`)
	db.Exec(t, `CREATE FUNCTION refuse_recorder() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM nextval('recorder_attempts'); RAISE EXCEPTION 'recorder table refused'; END $$`)
	db.Exec(t, `CREATE TRIGGER refuse_recorder BEFORE INSERT OR UPDATE ON heartbeat_recorders
		FOR EACH ROW EXECUTE FUNCTION refuse_recorder()`)
	logs := logtest.New()
	r := db.NewHeartbeatRecorder(logs.Logger())
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	bmdbtest.WaitFor(t, 30*time.Second, "three failed registrations", func(ctx context.Context) (bool, error) {
		var n int64
		err := db.Pool.QueryRow(ctx, `SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM recorder_attempts`).Scan(&n)
		return n >= 3, err
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	l := logs.With("heartbeat recorder check-in failed")
	if len(l) != 2 || l[1].Attr("repeated") == "" {
		t.Errorf("lines about failed check-ins when Run returned: %+v, want the first and one with the count held back", l)
	}
}
