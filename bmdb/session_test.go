package bmdb_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime/debug"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/logtest"
	"github.com/shepherd/shepherd/internal/metricstest"
)

func TestSessionRenewal(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	db := bmdbtest.NewWithConfig(t, bmdb.Config{Registerer: reg})
	// A lease long enough that a loaded machine cannot delay a renewal past
	// it (two renewals may be late before it runs out); TestSessionRenewalTiming
	// checks the schedule itself, on a virtual clock.
	const lease = 5 * time.Second
	s := bmdbtest.Session(t, db, "test", lease)
	first := bmdbtest.Scalar[time.Time](t, db, "SELECT deadline FROM sessions WHERE session_id = $1", s.ID())
	// Wait until, by the database's clock, the first deadline is a lease in
	// the past: only renewals can have kept the session alive until then.
	bmdbtest.WaitFor(t, 20*lease, "the database's clock a lease past the first deadline", func(ctx context.Context) (bool, error) {
		var past bool
		err := db.Pool.QueryRow(ctx, "SELECT now() > $1::timestamptz + $2 * interval '1 millisecond'", first, lease.Milliseconds()).Scan(&past)
		return past, err
	})
	if s.Lost() || s.Context().Err() != nil {
		t.Fatalf("session lost after renewals: %v", context.Cause(s.Context()))
	}
	if alive := bmdbtest.Scalar[bool](t, db, "SELECT deadline > now() AND closed_at IS NULL FROM sessions WHERE session_id = $1", s.ID()); !alive {
		t.Fatal("session is not alive in the database")
	}
	if got := metricstest.Value(t, reg, "shepherd_bmdb_sessions_open"); got != 1 {
		t.Errorf("sessions_open = %v with one live session, want 1", got)
	}
	// Closing is not losing.
	if err := s.Close(t.Context()); err != nil {
		t.Fatal(err)
	}
	if s.Lost() {
		t.Errorf("Lost() after Close: true, want false (cause %v)", context.Cause(s.Context()))
	}
	for name, want := range map[string]float64{
		"shepherd_bmdb_sessions_open": 0, "shepherd_bmdb_sessions_closed_total": 1, "shepherd_bmdb_sessions_lost_total": 0,
	} {
		if got := metricstest.Value(t, reg, name); got != want {
			t.Errorf("%s = %v after Close, want %v", name, got, want)
		}
	}
}

func TestSessionLost(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	db := bmdbtest.NewWithConfig(t, bmdb.Config{Registerer: reg})
	// Long enough for no renewal to be late on a loaded machine; the
	// session is lost because the database says so, at the next renewal.
	const lease = 5 * time.Second
	s := bmdbtest.Session(t, db, "test", lease)
	bmdbtest.AddMachine(t, db, s, "p")
	bmdbtest.AddMachine(t, db, s, "p")
	w, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"))
	if err != nil {
		t.Fatal(err)
	}
	// The database decides: once the deadline has passed, renewal fails and
	// the session is lost, whatever the process thinks.
	db.Exec(t, "UPDATE sessions SET deadline = now() - interval '1 millisecond' WHERE session_id = $1", s.ID())
	select {
	case <-s.Context().Done():
	case <-time.After(10 * lease):
		t.Fatal("session context not cancelled after the deadline passed")
	}
	if !s.Lost() || !errors.Is(context.Cause(s.Context()), bmdb.ErrSessionExpired) {
		t.Fatalf("Lost() = %v, cause %v", s.Lost(), context.Cause(s.Context()))
	}
	if _, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p")); !errors.Is(err, bmdb.ErrSessionExpired) {
		t.Errorf("Work on a lost session: %v, want ErrSessionExpired", err)
	}
	if err := w.Finish(t.Context(), nil); !errors.Is(err, bmdb.ErrSessionExpired) {
		t.Errorf("Finish on a lost session: %v, want ErrSessionExpired", err)
	}
	if err := s.Transact(t.Context(), func(context.Context, *bmdb.Tx) error { return nil }); !errors.Is(err, bmdb.ErrSessionExpired) {
		t.Errorf("Transact on a lost session: %v, want ErrSessionExpired", err)
	}
	// The lock is not released by the dead session: it is left for expiry.
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work WHERE session_id = $1", s.ID()); n != 1 {
		t.Errorf("%d work rows of the lost session, want 1 left for expiry", n)
	}
	if got := metricstest.Value(t, reg, "shepherd_bmdb_sessions_lost_total"); got != 1 {
		t.Errorf("sessions_lost_total = %v, want 1", got)
	}
	if got := metricstest.Value(t, reg, "shepherd_bmdb_sessions_open"); got != 0 {
		t.Errorf("sessions_open = %v, want 0", got)
	}
	if got := metricstest.Value(t, reg, "shepherd_bmdb_work_ended_total", "result", "lost"); got != 1 {
		t.Errorf("work_ended_total{result=lost} = %v, want 1 (the Finish that found its lock gone)", got)
	}
	// Closing a lost session marks it closed, and counts it neither as
	// closed nor again as gone.
	if err := s.Close(t.Context()); err != nil {
		t.Fatalf("closing the lost session: %v", err)
	}
	if got := metricstest.Value(t, reg, "shepherd_bmdb_sessions_open"); got != 0 {
		t.Errorf("sessions_open = %v after closing the lost session, want 0", got)
	}
	if got := metricstest.Value(t, reg, "shepherd_bmdb_sessions_closed_total"); got != 0 {
		t.Errorf("sessions_closed_total = %v after closing a lost session, want 0", got)
	}
	if !s.Lost() {
		t.Error("Lost() false after closing the lost session")
	}
	n, err := db.ExpireWork(t.Context())
	if err != nil || n != 1 {
		t.Fatalf("ExpireWork() = %d, %v; want 1", n, err)
	}
	h, err := db.History(t.Context(), bmdb.HistoryFilter{MachineID: w.MachineID})
	if err != nil {
		t.Fatal(err)
	}
	if last := h[len(h)-1]; last.Event != bmdb.EventExpired || last.SessionID == nil || *last.SessionID != s.ID() {
		t.Errorf("last history row %+v, want Expired naming session %s", last, s.ID())
	}
}

func TestSessionClose(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	setup := bmdbtest.Session(t, db, "setup", time.Minute)
	m1 := bmdbtest.AddMachine(t, db, setup, "p")
	m2 := bmdbtest.AddMachine(t, db, setup, "p")
	s, err := db.StartSession(t.Context(), bmdb.SessionConfig{Component: "initializer"})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p")); err != nil {
			t.Fatal(err)
		}
	}
	// Close is called on shutdown, with the process's context already done.
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := s.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(ctx); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if s.Context().Err() == nil {
		t.Error("session context still live after Close")
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work"); n != 0 {
		t.Errorf("%d work rows after Close, want 0", n)
	}
	for _, m := range []uuid.UUID{m1, m2} {
		h, err := db.History(t.Context(), bmdb.HistoryFilter{MachineID: m})
		if err != nil {
			t.Fatal(err)
		}
		if len(h) != 2 || h[1].Event != bmdb.EventCanceled || *h[1].SessionID != s.ID() {
			t.Errorf("history of %s: %+v, want Started then Canceled by the session", m, h)
		}
	}
	if closed := bmdbtest.Scalar[bool](t, db, "SELECT closed_at IS NOT NULL FROM sessions WHERE session_id = $1", s.ID()); !closed {
		t.Error("session not marked closed")
	}
	if _, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p")); !errors.Is(err, bmdb.ErrSessionExpired) {
		t.Errorf("Work after Close: %v, want ErrSessionExpired", err)
	}
	// Both machines are free again.
	if n, err := db.CountCandidates(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p")); err != nil || n != 2 {
		t.Errorf("candidates after Close: %d, %v; want 2", n, err)
	}
}

func TestWorkEnds(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	other := bmdbtest.Session(t, db, "other", time.Minute)
	bmdbtest.AddMachine(t, db, s, "p")
	cands := bmdb.AgentStartCandidates("p")
	claim := func() *bmdb.Work {
		t.Helper()
		w, err := s.Work(t.Context(), bmdb.ProcessAgentStart, cands)
		if err != nil {
			t.Fatal(err)
		}
		return w
	}
	held := func() bool {
		t.Helper()
		_, err := other.Work(t.Context(), bmdb.ProcessAgentStart, cands)
		if err != nil && !errors.Is(err, bmdb.ErrNothingToDo) {
			t.Fatal(err)
		}
		return err != nil
	}

	t.Run("the claim carries the Provided tag", func(t *testing.T) {
		w := claim()
		defer w.Cancel(t.Context())
		want, err := db.GetProvided(t.Context(), w.MachineID)
		if err != nil {
			t.Fatal(err)
		}
		if w.Provided != want || w.Provided.Provider != "p" || w.Provided.AgentPhase != bmdb.AgentPhaseAwaitingAgent {
			t.Fatalf("claimed work's Provided = %+v, want %+v", w.Provided, want)
		}
	})

	t.Run("cancel with a cancelled context releases the lock", func(t *testing.T) {
		w := claim()
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		if err := w.Cancel(ctx); err != nil {
			t.Fatalf("Cancel: %v", err)
		}
		if held() {
			t.Fatal("machine still locked after Cancel")
		}
	})
	// The other session holds it now; give it back.
	db.Exec(t, "DELETE FROM work")

	t.Run("a failing Finish keeps the lock and changes nothing", func(t *testing.T) {
		w := claim()
		boom := errors.New("provider said no")
		err := w.Finish(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
			if err := tx.SetAgentStarted(ctx, w.MachineID, make([]byte, 32)); err != nil {
				return err
			}
			return boom
		})
		if !errors.Is(err, boom) {
			t.Fatalf("Finish: %v, want the function's error", err)
		}
		if !held() {
			t.Fatal("machine free after a failed Finish")
		}
		if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM machine_agent_started"); n != 0 {
			t.Fatalf("the failed Finish left %d AgentStarted rows", n)
		}
		if _, err := w.Fail(t.Context(), bmdb.BackoffPolicy{Initial: time.Millisecond}, err.Error()); err != nil {
			t.Fatalf("Fail after a failed Finish: %v", err)
		}
		if err := w.Cancel(t.Context()); !errors.Is(err, bmdb.ErrWorkEnded) {
			t.Fatalf("Cancel after Fail: %v, want ErrWorkEnded", err)
		}
	})
}

// TestMutualExclusionInDatabase inserts work rows directly: the database, not
// the claim query, must refuse a second holder.
func TestMutualExclusionInDatabase(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	m := bmdbtest.AddMachine(t, db, s, "p")
	insert := func(process string, exclusive bool) error {
		_, err := db.Pool.Exec(t.Context(), `INSERT INTO work (machine_id, process, machine_exclusive, session_id)
			VALUES ($1, $2, $3, $4)`, m, process, exclusive, s.ID())
		return err
	}
	if err := insert("AgentStart", true); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		process   string
		exclusive bool
	}{
		{"AgentStart", true},    // the same process twice
		{"Recovery", true},      // another machine-touching process
		{"Decommission", true},  // and another
		{"Recovery", false},     // lying about exclusivity
		{"NoSuchProcess", true}, // unknown processes
	} {
		if err := insert(c.process, c.exclusive); err == nil {
			t.Errorf("inserting %s (exclusive %v) next to AgentStart succeeded", c.process, c.exclusive)
		}
	}
	if err := insert("ProviderUpdate", false); err != nil {
		t.Errorf("a process that does not touch the machine was refused: %v", err)
	}
}

func TestProcessesMatchDatabase(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	rows, err := db.Pool.Query(t.Context(), "SELECT process, machine_exclusive FROM processes")
	if err != nil {
		t.Fatal(err)
	}
	inDB := map[bmdb.Process]bool{}
	for rows.Next() {
		var p string
		var excl bool
		if err := rows.Scan(&p, &excl); err != nil {
			t.Fatal(err)
		}
		inDB[bmdb.Process(p)] = excl
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	inGo := map[bmdb.Process]bool{}
	for _, p := range bmdb.Processes() {
		inGo[p] = p.MachineExclusive()
	}
	if fmt.Sprint(inDB) != fmt.Sprint(inGo) {
		t.Errorf("processes in the database %v, in Go %v", inDB, inGo)
	}
	if err := bmdb.Process("Nope").Validate(); err == nil {
		t.Error("unknown process validated")
	}
}

func TestTransactRetriesDeadlocks(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	db := bmdbtest.NewWithConfig(t, bmdb.Config{Registerer: reg})
	s := bmdbtest.Session(t, db, "test", time.Minute)
	a := bmdbtest.AddMachine(t, db, s, "p")
	b := bmdbtest.AddMachine(t, db, s, "p")
	db.Exec(t, "ALTER DATABASE "+strings.TrimPrefix(dbName(db.URL), "/")+" SET deadlock_timeout = '100ms'")

	// Two transactions take row locks in opposite orders and wait for each
	// other in between, the first time only: PostgreSQL aborts one with a
	// deadlock, and Transact must run it again.
	var firstA, firstB sync.Once
	aLocked, bLocked := make(chan struct{}), make(chan struct{})
	var runs [2]int
	tx := func(i int, first, second uuid.UUID, once *sync.Once, mine, theirs chan struct{}) error {
		return s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
			runs[i]++
			if err := tx.SetAgentStarted(ctx, first, make([]byte, 32)); err != nil {
				return err
			}
			once.Do(func() {
				close(mine)
				<-theirs
			})
			return tx.SetAgentStarted(ctx, second, make([]byte, 32))
		})
	}
	errs := make(chan error, 2)
	go func() { errs <- tx(0, a, b, &firstA, aLocked, bLocked) }()
	go func() { errs <- tx(1, b, a, &firstB, bLocked, aLocked) }()
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatalf("Transact: %v", err)
		}
	}
	deadlocks := metricstest.Value(t, reg, "shepherd_bmdb_transaction_retries_total", "sqlstate", "40P01")
	serialization := metricstest.Value(t, reg, "shepherd_bmdb_transaction_retries_total", "sqlstate", "40001")
	// The first round deadlocks for sure. A victim retried at once can
	// take its first row before the survivor, woken by the abort, takes its
	// second (a loaded machine schedules the survivor late): they deadlock
	// again, and that victim is retried too. So every run beyond the first
	// two is a counted deadlock retry, and there is at least one.
	if total := runs[0] + runs[1]; total < 3 || float64(total-2) != deadlocks || serialization != 0 {
		t.Errorf("transaction bodies ran %v times, retries: %v deadlocks, %v serialization failures; want at least 3 runs, each beyond 2 a deadlock victim's retry",
			runs, deadlocks, serialization)
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM machine_agent_started"); n != 2 {
		t.Errorf("%d machines have AgentStarted after both transactions committed, want 2", n)
	}
}

func dbName(url string) string {
	u := url[strings.LastIndex(url, "/"):]
	if i := strings.IndexByte(u, '?'); i >= 0 {
		u = u[:i]
	}
	return u
}

// TestTransactReportsCommitErrors makes COMMIT itself fail (a deferred
// constraint trigger) and checks that Transact says so and nothing stays.
func TestTransactReportsCommitErrors(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	m := bmdbtest.AddMachine(t, db, s, "p")
	db.Exec(t, `CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'refused at commit'; END $$`)
	db.Exec(t, `CREATE CONSTRAINT TRIGGER refuse_at_commit AFTER INSERT ON machine_agent_started
		DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse()`)
	ran := false
	err := s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		ran = true
		return tx.SetAgentStarted(ctx, m, make([]byte, 32))
	})
	if !ran || err == nil || !strings.Contains(err.Error(), "refused at commit") {
		t.Fatalf("Transact: %v, want the COMMIT's error", err)
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM machine_agent_started"); n != 0 {
		t.Fatalf("%d rows survived a failed COMMIT", n)
	}
}

func TestKeepSessionReplacesLostSessions(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	// Long enough that no session is lost to a loaded machine: the first
	// is lost because the database expires it.
	const lease = 5 * time.Second
	ids := make(chan uuid.UUID, 10)
	done := make(chan error, 1)
	go func() {
		done <- db.KeepSession(ctx, bmdb.SessionConfig{Component: "keeper", Lease: lease},
			func(ctx context.Context, s *bmdb.Session) error {
				ids <- s.ID()
				<-ctx.Done()
				return nil
			})
	}()
	next := func(what string) uuid.UUID {
		t.Helper()
		select {
		case id := <-ids:
			return id
		case err := <-done:
			t.Fatalf("KeepSession returned %v before %s", err, what)
		case <-time.After(10 * lease):
			t.Fatalf("no %s", what)
		}
		return uuid.Nil
	}
	first := next("first session")
	db.Exec(t, "UPDATE sessions SET deadline = now() - interval '1 millisecond' WHERE session_id = $1", first)
	second := next("new session after the first was lost")
	if second == first {
		t.Fatal("KeepSession reused the lost session")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("KeepSession: %v", err)
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM sessions WHERE closed_at IS NULL"); n != 0 {
		t.Errorf("%d sessions left open", n)
	}
}

// Crash test: a separate process claims two machines and is killed with
// SIGKILL, so it never renews its lease or closes its session.

const crashHelperEnv = "SHEPHERD_BMDB_CRASH_HELPER_URL"

// crashLease is the crashed session's lease: its third is the margin the
// SPEC allows between the crash and the deadline, long enough that a
// renewal the helper sent just before it died cannot reach past it however
// late a loaded machine runs it.
const crashLease = 5 * time.Second

// TestCrashHelper is the process that crashes. It only does anything when
// started by TestCrashedSessionReleasesWork.
func TestCrashHelper(t *testing.T) {
	url := os.Getenv(crashHelperEnv)
	if url == "" {
		return
	}
	ctx := context.Background()
	db, err := bmdb.Open(ctx, bmdb.Config{URL: url, Schema: bmdb.SchemaRequireCurrent})
	if err != nil {
		fmt.Println("ERROR", err)
		os.Exit(1)
	}
	s, err := db.StartSession(ctx, bmdb.SessionConfig{Component: "doomed", Lease: crashLease})
	if err != nil {
		fmt.Println("ERROR", err)
		os.Exit(1)
	}
	for range 2 {
		if _, err := s.Work(ctx, bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p")); err != nil {
			fmt.Println("ERROR", err)
			os.Exit(1)
		}
	}
	fmt.Println("CLAIMED", s.ID())
	select {} // renewing, until killed
}

func TestCrashedSessionReleasesWork(t *testing.T) {
	t.Parallel()
	const lease = crashLease
	reg := prometheus.NewRegistry()
	logs := logtest.New()
	db := bmdbtest.NewWithConfig(t, bmdb.Config{Registerer: reg, Logger: logs.Logger()})
	s := bmdbtest.Session(t, db, "survivor", time.Minute)
	m1 := bmdbtest.AddMachine(t, db, s, "p")
	m2 := bmdbtest.AddMachine(t, db, s, "p")

	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashHelper$")
	cmd.Env = append(os.Environ(), crashHelperEnv+"="+db.URL)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	line := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if f := strings.Fields(sc.Text()); len(f) > 0 && (f[0] == "CLAIMED" || f[0] == "ERROR") {
				line <- sc.Text()
				return
			}
		}
		line <- "EOF"
	}()
	var deadID uuid.UUID
	select {
	case l := <-line:
		f := strings.Fields(l)
		if f[0] != "CLAIMED" {
			t.Fatalf("crash helper: %s", l)
		}
		deadID = uuid.MustParse(f[1])
	case <-time.After(30 * time.Second):
		t.Fatal("crash helper did not claim its machines")
	}
	// While the helper lives, its locks hold.
	if _, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p")); !errors.Is(err, bmdb.ErrNothingToDo) {
		t.Fatalf("Work while the holder lives: %v, want ErrNothingToDo", err)
	}
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait() // killed: it can send nothing more
	died := time.Now()

	// The locks hold until the dead session's deadline passes, as the
	// database sees it, and no longer: a claim that started after the
	// database said the deadline had passed must take a machine, and the
	// claim that takes one must have run after the deadline.
	var (
		w        *bmdb.Work
		deadline time.Time
	)
	bmdbtest.WaitFor(t, 10*lease, "a machine of the crashed session is claimed", func(ctx context.Context) (bool, error) {
		var passed bool
		if err := db.Pool.QueryRow(ctx, "SELECT deadline, now() > deadline FROM sessions WHERE session_id = $1", deadID).Scan(&deadline, &passed); err != nil {
			return false, err
		}
		var err error
		w, err = s.Work(ctx, bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"))
		switch {
		case errors.Is(err, bmdb.ErrNothingToDo) && passed:
			t.Fatalf("a claim after the dead session's deadline %s passed found nothing", deadline.Format(time.RFC3339Nano))
		case errors.Is(err, bmdb.ErrNothingToDo):
			return false, nil
		}
		return err == nil, err
	})
	h, err := db.History(t.Context(), bmdb.HistoryFilter{MachineID: w.MachineID, Process: bmdb.ProcessAgentStart})
	if err != nil {
		t.Fatal(err)
	}
	var started *bmdb.HistoryEvent
	for i := range h {
		if h[i].Event == bmdb.EventStarted && h[i].SessionID != nil && *h[i].SessionID == s.ID() {
			started = &h[i]
		}
	}
	if started == nil || started.At.Before(deadline) {
		t.Errorf("claim's Started row %+v, want one at or after the dead session's deadline %s", started, deadline.Format(time.RFC3339Nano))
	}
	// SPEC §2.3: claimable no later than one lease plus one renewal period
	// after the crash. The deadline is one lease after the last renewal,
	// which the helper sent before it died.
	if limit := died.Add(lease + lease/3); deadline.After(limit) {
		t.Errorf("dead session's deadline %s is more than a lease and a renewal period after the crash (%s)",
			deadline.Format(time.RFC3339Nano), died.Format(time.RFC3339Nano))
	}
	// The claim expired the dead session's work on the machine it took; the
	// janitor's ExpireWork takes care of the other. Each says so.
	expired := func(when string, want int) {
		t.Helper()
		if got := metricstest.Value(t, reg, "shepherd_bmdb_work_expired_total", "process", "AgentStart"); got != float64(want) {
			t.Errorf("%s: work_expired_total = %v, want %d", when, got, want)
		}
		if got := len(logs.With("expired work of a dead session")); got != want {
			t.Errorf("%s: %d log lines about expired work, want %d", when, got, want)
		}
	}
	expired("after the claim", 1)
	if n, err := db.ExpireWork(t.Context()); err != nil || n != 1 {
		t.Fatalf("ExpireWork() = %d, %v; want 1", n, err)
	}
	expired("after ExpireWork", 2)
	for _, m := range []uuid.UUID{m1, m2} {
		h, err := db.History(t.Context(), bmdb.HistoryFilter{MachineID: m, Process: bmdb.ProcessAgentStart})
		if err != nil {
			t.Fatal(err)
		}
		found := false
		for _, e := range h {
			if e.Event == bmdb.EventExpired && e.SessionID != nil && *e.SessionID == deadID {
				found = true
			}
		}
		if !found {
			t.Errorf("machine %s: no Expired history row naming the dead session %s: %+v", m, deadID, h)
		}
	}
	if err := w.Finish(t.Context(), nil); err != nil {
		t.Fatal(err)
	}
	// A claim that expires nothing says nothing about expiry.
	other, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"))
	if err != nil {
		t.Fatalf("claiming the machine ExpireWork freed: %v", err)
	}
	expired("after a claim of a free machine", 2)
	if err := other.Finish(t.Context(), nil); err != nil {
		t.Fatal(err)
	}
}

func TestSessionConfigValidate(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		cfg     bmdb.SessionConfig
		wantErr string // "" for valid
	}{
		{bmdb.SessionConfig{Component: "c"}, ""},
		{bmdb.SessionConfig{Component: "c", Lease: 300 * time.Millisecond}, ""},
		{bmdb.SessionConfig{Component: "c", Lease: 299 * time.Millisecond}, "Lease must be 0 (default 10s) or at least 300ms, got 299ms"},
		{bmdb.SessionConfig{Component: "c", Lease: -time.Second}, "Lease must be"},
		{bmdb.SessionConfig{}, "Component is required"},
		{bmdb.SessionConfig{Component: "c", ClaimStrategy: bmdb.ClaimPlainLimit}, ""},
		{bmdb.SessionConfig{Component: "c", ClaimStrategy: bmdb.ClaimPlainLimit + 1}, "ClaimStrategy 2 is not a known strategy"},
		{bmdb.SessionConfig{Component: "c", ClaimStrategy: -1}, "ClaimStrategy -1 is not a known strategy"},
		{bmdb.SessionConfig{Component: "c", ScanLimit: 1}, ""},
		{bmdb.SessionConfig{Component: "c", ScanLimit: -1}, "ScanLimit must be >= 0 (0 = default), got -1"},
	} {
		err := tt.cfg.Validate()
		if tt.wantErr == "" && err != nil || tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
			t.Errorf("%+v.Validate() = %v, want %q", tt.cfg, err, tt.wantErr)
		}
	}
}

// TestSessionStartRecordsWhoRuns checks what a session records about its
// process for operators: what it was given, else the host name, the pid and
// the binary's module version, and the lease (the default when none is
// given) from which the database computes the deadline.
func TestSessionStartRecordsWhoRuns(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	host, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	version := "unknown"
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		version = bi.Main.Version
	}
	for _, tt := range []struct {
		cfg                   bmdb.SessionConfig
		wantHost, wantVersion string
		wantLease             time.Duration
	}{
		{bmdb.SessionConfig{Component: "defaults"}, host, version, bmdb.DefaultLease},
		{bmdb.SessionConfig{Component: "given", Hostname: "node-7", Version: "v1.2.3", Lease: time.Minute}, "node-7", "v1.2.3", time.Minute},
	} {
		s, err := db.StartSession(t.Context(), tt.cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = s.Close(context.Background()) })
		var (
			gotHost, gotVersion string
			pid                 int32
			leaseMs             int64
			exact               bool
		)
		if err := db.Pool.QueryRow(t.Context(), `SELECT hostname, version, pid, lease_ms, deadline = created_at + lease_ms * interval '1 millisecond'
			FROM sessions WHERE session_id = $1`, s.ID()).Scan(&gotHost, &gotVersion, &pid, &leaseMs, &exact); err != nil {
			t.Fatal(err)
		}
		if gotHost != tt.wantHost || gotVersion != tt.wantVersion || int(pid) != os.Getpid() ||
			time.Duration(leaseMs)*time.Millisecond != tt.wantLease || !exact {
			t.Errorf("%s: recorded host %q, version %q, pid %d, lease %dms (deadline one lease after the start: %v); want %q, %q, %d, %s",
				tt.cfg.Component, gotHost, gotVersion, pid, leaseMs, exact, tt.wantHost, tt.wantVersion, os.Getpid(), tt.wantLease)
		}
	}
}

// TestKeepSessionReturns checks when KeepSession returns and what: fn's
// result while its session is alive, and a new session instead when fn
// returns because it found its session expired before renewal noticed.
func TestKeepSessionReturns(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	boom := errors.New("fn failed")
	cfg := bmdb.SessionConfig{Component: "keeper", Lease: time.Minute} // no renewal during the test
	for _, tt := range []struct {
		name string
		fn   func(t *testing.T, call int, s *bmdb.Session) error
		want error
		runs int // calls of fn, each with a new session
	}{
		{"fn returns nil", func(*testing.T, int, *bmdb.Session) error { return nil }, nil, 1},
		{"fn fails", func(*testing.T, int, *bmdb.Session) error { return boom }, boom, 1},
		{"fn finds its session expired", func(t *testing.T, call int, s *bmdb.Session) error {
			if call > 1 {
				return nil
			}
			db.Exec(t, "UPDATE sessions SET deadline = now() - interval '1 millisecond' WHERE session_id = $1", s.ID())
			_, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"))
			if !errors.Is(err, bmdb.ErrSessionExpired) {
				t.Errorf("Work on a session the database expired: %v, want ErrSessionExpired", err)
			}
			return err
		}, nil, 2},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var ids []uuid.UUID
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			err := db.KeepSession(ctx, cfg, func(ctx context.Context, s *bmdb.Session) error {
				ids = append(ids, s.ID())
				if len(ids) > tt.runs {
					cancel() // KeepSession should have returned: stop it, so that the test can say so
					return nil
				}
				return tt.fn(t, len(ids), s)
			})
			if !errors.Is(err, tt.want) || (tt.want == nil && err != nil) {
				t.Errorf("KeepSession() = %v, want %v", err, tt.want)
			}
			if len(ids) != tt.runs || tt.runs == 2 && ids[0] == ids[1] {
				t.Errorf("fn ran with sessions %v, want %d different ones", ids, tt.runs)
			}
			for _, id := range ids {
				if closed := bmdbtest.Scalar[bool](t, db, "SELECT closed_at IS NOT NULL FROM sessions WHERE session_id = $1", id); !closed {
					t.Errorf("session %s not closed when KeepSession returned", id)
				}
			}
		})
	}
	t.Run("invalid config", func(t *testing.T) {
		err := db.KeepSession(t.Context(), bmdb.SessionConfig{}, func(context.Context, *bmdb.Session) error {
			t.Error("fn ran with an invalid config")
			return nil
		})
		if err == nil || !strings.Contains(err.Error(), "Component is required") {
			t.Errorf("KeepSession(invalid config) = %v, want the validation error", err)
		}
	})
}

// TestDeleteSessions checks which sessions the janitor's DeleteSessions
// removes: ended (closed, or past the deadline) longer than the retention
// ago, and holding no work.
func TestDeleteSessions(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	live := bmdbtest.Session(t, db, "live", time.Minute)
	bmdbtest.AddMachine(t, db, live, "p")
	start := func(component string) *bmdb.Session {
		t.Helper()
		s, err := db.StartSession(t.Context(), bmdb.SessionConfig{Component: component, Lease: time.Minute})
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	closedLongAgo, closedJustNow, expiredWithWork := start("closed-long-ago"), start("closed-just-now"), start("expired-with-work")
	for _, s := range []*bmdb.Session{closedLongAgo, closedJustNow} {
		if err := s.Close(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
	db.Exec(t, "UPDATE sessions SET closed_at = now() - interval '2 hours' WHERE session_id = $1", closedLongAgo.ID())
	if _, err := expiredWithWork.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p")); err != nil {
		t.Fatal(err)
	}
	db.Exec(t, "UPDATE sessions SET deadline = now() - interval '2 hours' WHERE session_id = $1", expiredWithWork.ID())

	if _, err := db.DeleteSessions(t.Context(), -time.Second); err == nil || !strings.Contains(err.Error(), "retention must be >= 0") {
		t.Errorf("DeleteSessions(-1s) = %v, want an error about the retention", err)
	}
	remaining := func() []string {
		t.Helper()
		return bmdbtest.Scalar[[]string](t, db, "SELECT array_agg(component ORDER BY component) FROM sessions")
	}
	for _, step := range []struct {
		retention time.Duration
		deleted   int64
		left      []string
	}{
		{time.Hour, 1, []string{"closed-just-now", "expired-with-work", "live"}},
		{0, 1, []string{"expired-with-work", "live"}},
	} {
		n, err := db.DeleteSessions(t.Context(), step.retention)
		if err != nil || n != step.deleted {
			t.Errorf("DeleteSessions(%s) = %d, %v; want %d", step.retention, n, err, step.deleted)
		}
		if diff := cmp.Diff(step.left, remaining()); diff != "" {
			t.Errorf("sessions left after DeleteSessions(%s) (-want +got):\n%s", step.retention, diff)
		}
	}
	// Once its work has expired, the dead session goes too.
	if _, err := db.ExpireWork(t.Context()); err != nil {
		t.Fatal(err)
	}
	if n, err := db.DeleteSessions(t.Context(), time.Hour); err != nil || n != 1 {
		t.Errorf("DeleteSessions after expiring the dead session's work = %d, %v; want 1", n, err)
	}
	_ = expiredWithWork.Close(t.Context())
}
