package bmdb_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/logtest"
)

// startedCause returns the cause of the Started row of machine's last
// claim for process.
func startedCause(t *testing.T, db *bmdbtest.DB, w *bmdb.Work) string {
	t.Helper()
	return bmdbtest.Scalar[string](t, db, `SELECT cause FROM work_history
		WHERE machine_id = $1 AND process = $2 AND event = 'Started' ORDER BY history_id DESC LIMIT 1`, w.MachineID, string(w.Process))
}

// A recovery claim's Started row names the silence it saw: the last
// heartbeat and how long ago it was, or that the first never came, with
// the timeout exceeded (issue 13 item 5).
func TestRecoveryStartedNamesTheSilence(t *testing.T) {
	t.Parallel()
	r := newRecovery(t)
	never := r.silent() // started two hours ago, never heartbeat
	fell := bmdbtest.AddMachine(t, r.db, r.s, r.provider)
	r.started(fell, 3*time.Hour)
	r.heartbeat(fell, 0)
	r.db.Exec(t, "UPDATE machine_agent_heartbeat SET agent_heartbeat_at = now() - interval '1 hour 12 minutes 3.5 seconds' WHERE machine_id = $1", fell)
	lastBeat := bmdbtest.Scalar[time.Time](t, r.db, "SELECT agent_heartbeat_at FROM machine_agent_heartbeat WHERE machine_id = $1", fell)
	startedAt := bmdbtest.Scalar[time.Time](t, r.db, "SELECT agent_started_at FROM machine_agent_started WHERE machine_id = $1", never)

	// The longest silent first: the one that never heartbeat.
	w := r.claim(r.s, never)
	want := fmt.Sprintf("silent: no first heartbeat since the agent was started %s, 2h0m0s ago (first heartbeat timeout 30m0s)",
		startedAt.UTC().Format(time.RFC3339))
	if got := startedCause(t, r.db, w); got != want {
		t.Errorf("Started cause of a machine that never heartbeat:\n got %q\nwant %q", got, want)
	}
	w = r.claim(r.s, fell)
	want = fmt.Sprintf("silent: last heartbeat %s, 1h12m3s ago (heartbeat timeout 10m0s)", lastBeat.UTC().Format(time.RFC3339))
	if got := startedCause(t, r.db, w); got != want {
		t.Errorf("Started cause of a machine that fell silent:\n got %q\nwant %q", got, want)
	}
}

// duration_text formats as time.Duration.String does for whole seconds,
// so that causes written in SQL read like those written in Go.
func TestDurationText(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	for _, d := range []time.Duration{0, time.Second, 59 * time.Second, time.Minute, 10 * time.Minute, 12*time.Minute + 3*time.Second,
		time.Hour - time.Second, time.Hour, 36*time.Hour + 61*time.Second, 1500 * time.Millisecond} {
		got := bmdbtest.Scalar[string](t, db, "SELECT duration_text(interval '1 millisecond' * $1::bigint)", d.Milliseconds())
		if want := d.Truncate(time.Second).String(); got != want {
			t.Errorf("duration_text(%s) = %q, want %q", d, got, want)
		}
	}
	if got := bmdbtest.Scalar[string](t, db, "SELECT duration_text(interval '-5 seconds')"); got != "0s" {
		t.Errorf("duration_text of a negative interval = %q, want 0s", got)
	}
}

// A claim that expires dead work names the dead session in its log line,
// as the Expired history row does (issue 13 item 8).
func TestClaimLogsTheDeadSession(t *testing.T) {
	t.Parallel()
	rec := logtest.New()
	db := bmdbtest.NewWithConfig(t, bmdb.Config{Logger: rec.Logger()})
	r := recovery{fixture: fixture{t: t, db: db, s: bmdbtest.Session(t, db, "test", time.Minute)}, provider: "p",
		cands: bmdb.RecoveryCandidates("p", 0, 0)}
	m := r.silent()
	r.work(m, bmdb.ProcessRecovery, true)
	dead := bmdbtest.Scalar[string](t, db, "SELECT session_id::text FROM work WHERE machine_id = $1", m)
	r.claim(r.s, m)
	lines := rec.With("expired work of a dead session")
	if len(lines) != 1 {
		t.Fatalf("%d log lines about expired work, want 1", len(lines))
	}
	if got := lines[0].Attr("dead_session_id"); got != dead {
		t.Errorf("the log line names dead session %q, want %q", got, dead)
	}
}

// Work canceled by its session's Close says whose session closed, so that
// a Canceled row is not a mystery (issue 13 item 5).
func TestCloseCancelsWithACause(t *testing.T) {
	t.Parallel()
	r := newRecovery(t)
	m := r.silent()
	s := bmdbtest.Session(t, r.db, "recoverer", time.Minute)
	r.claim(s, m)
	if err := s.Close(t.Context()); err != nil {
		t.Fatal(err)
	}
	host := bmdbtest.Scalar[string](t, r.db, "SELECT hostname || ', pid ' || pid FROM sessions WHERE session_id = $1", s.ID())
	want := "session closed before the work ended (recoverer on " + host +
		" is stopping or restarting its session); the machine is free for the next claim"
	if got := bmdbtest.Scalar[string](t, r.db, "SELECT cause FROM work_history WHERE machine_id = $1 AND event = 'Canceled'", m); got != want {
		t.Errorf("Canceled cause %q, want %q", got, want)
	}
}
