package manager_test

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/logtest"
	"github.com/shepherd/shepherd/internal/metricstest"
	"github.com/shepherd/shepherd/internal/tcpproxy"
	"github.com/shepherd/shepherd/manager"
)

// startAgentOf is the FinishFunc of a successful agent start of t's machine.
func startAgentOf(task *manager.Task) manager.FinishFunc {
	return func(ctx context.Context, tx *bmdb.Tx) error {
		return tx.SetAgentStarted(ctx, task.Machine.MachineID, make([]byte, 32))
	}
}

// TestRunnerAdmit: while the loop's Admit says no, its workers claim
// nothing, not even to look for candidates; once it says yes, they do.
func TestRunnerAdmit(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	setup := bmdbtest.Session(t, db, "setup", time.Minute)
	id := bmdbtest.AddMachine(t, db, setup, "lab")
	var admit atomic.Bool
	var asked, done atomic.Int64
	loop := testLoop()
	loop.Admit = func(context.Context) bool {
		asked.Add(1)
		return admit.Load()
	}
	loop.Do = func(_ context.Context, task *manager.Task) (manager.FinishFunc, error) {
		done.Add(1)
		return startAgentOf(task), nil
	}
	reg := prometheus.NewRegistry()
	r, err := manager.NewRunner("admit", manager.LoopConfig{Parallelism: 2, IdleSleep: 20 * time.Millisecond}, loop, db.DB, reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	startRunner(t, r)
	bmdbtest.WaitFor(t, 60*time.Second, "the workers asked 20 times", func(context.Context) (bool, error) {
		return asked.Load() >= 20, nil
	})
	claims := func(result string) float64 {
		return metricstest.Value(t, reg, "shepherd_loop_claims_total", "result", result)
	}
	if done.Load() != 0 || claims("claimed") != 0 || claims("nothing_to_do") != 0 {
		t.Fatalf("while Admit said no: %d machines processed, %v claimed, %v empty claims; want nothing", done.Load(), claims("claimed"), claims("nothing_to_do"))
	}
	if h := events(t, db, id); len(h) != 0 {
		t.Fatalf("history of the machine while Admit said no: %+v", h)
	}
	admit.Store(true)
	bmdbtest.WaitFor(t, 60*time.Second, "the machine's agent started once Admit said yes", func(ctx context.Context) (bool, error) {
		_, _, err := db.GetAgentStarted(ctx, id)
		return err == nil, nil
	})
	bmdbtest.WaitFor(t, 60*time.Second, "a worker finds nothing more to do", func(context.Context) (bool, error) {
		return claims("nothing_to_do") >= 1, nil
	})
	if got := claims("claimed"); got != 1 {
		t.Errorf("%v claims, want 1", got)
	}
}

// TestRunnerRecordsRefusedEnds: when the tag change of a successful Do is
// refused, the work fails with a cause that says so; when the database
// keeps refusing to record a failure (here a trigger refuses the machine's
// backoff), the work is canceled after maxFailRefusals attempts, so that
// the machine is not held.
func TestRunnerRecordsRefusedEnds(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	db := bmdbtest.NewWithConfig(t, bmdb.Config{Registerer: reg})
	setup := bmdbtest.Session(t, db, "setup", time.Minute)
	refused, unrecordable := bmdbtest.AddMachine(t, db, setup, "lab"), bmdbtest.AddMachine(t, db, setup, "lab")
	db.Exec(t, `CREATE FUNCTION refuse_backoff() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.machine_id = '`+unrecordable.String()+`' THEN
				RAISE EXCEPTION 'no backoff for this machine';
			END IF;
			RETURN NEW;
		END $$`)
	db.Exec(t, "CREATE TRIGGER refuse_backoff BEFORE INSERT OR UPDATE ON work_backoff FOR EACH ROW EXECUTE FUNCTION refuse_backoff()")

	var calls atomic.Int64
	loop := testLoop()
	loop.Do = func(ctx context.Context, task *manager.Task) (manager.FinishFunc, error) {
		switch task.Machine.MachineID {
		case refused:
			return func(context.Context, *bmdb.Tx) error { return errors.New("tag refused") }, nil
		case unrecordable:
			if calls.Add(1) == 1 {
				return nil, errors.New("boom")
			}
			<-ctx.Done() // claimed again after the cancel: hold it until the test ends
			return nil, ctx.Err()
		}
		return nil, errors.New("unexpected machine")
	}
	logs := logtest.New()
	r, err := manager.NewRunner("refusals", manager.LoopConfig{Parallelism: 2, IdleSleep: 20 * time.Millisecond, Lease: 10 * time.Second},
		loop, db.DB, reg, logs.Logger())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	claims := func(result string) float64 {
		return metricstest.Value(t, reg, "shepherd_loop_claims_total", "process", "AgentStart", "result", result)
	}
	bmdbtest.WaitFor(t, 60*time.Second, "both machines' first work ended", func(ctx context.Context) (bool, error) {
		return lastEvent(t, db, refused) == bmdb.EventFailed && calls.Load() >= 2 && claims("failed") >= 1 && claims("canceled") >= 1, nil
	})
	retries := metricstest.Value(t, reg, "shepherd_loop_end_retries_total", "process", "AgentStart")
	if claims("failed") != 1 || claims("canceled") != 1 || claims("finished") != 0 {
		t.Errorf("claims ended: failed %v, canceled %v, finished %v; want 1, 1, 0", claims("failed"), claims("canceled"), claims("finished"))
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	h := events(t, db, refused)
	if last := h[len(h)-1]; last.Event != bmdb.EventFailed || !strings.HasPrefix(last.Cause, "recording the result: ") || !strings.Contains(last.Cause, "tag refused") {
		t.Errorf("work of the machine whose tag change was refused ended %s %q, want Failed, recording the result", last.Event, last.Cause)
	}
	if b, err := db.GetBackoff(t.Context(), refused, bmdb.ProcessAgentStart); err != nil || b.Attempts != 1 {
		t.Errorf("backoff after a refused tag change: %+v, %v", b, err)
	}
	var ends []bmdb.Event
	for _, e := range events(t, db, unrecordable) {
		if e.Event != bmdb.EventStarted {
			ends = append(ends, e.Event)
		}
	}
	if len(ends) == 0 || ends[0] != bmdb.EventCanceled {
		t.Errorf("the work whose failure could not be recorded ended %v, want Canceled first", ends)
	}
	if _, err := db.GetBackoff(t.Context(), unrecordable, bmdb.ProcessAgentStart); !errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("backoff of the machine whose failure was refused: %v", err)
	}
	// Two refusals were retried; the third became the cancel.
	if retries != 2 {
		t.Errorf("%v retried ends, want 2", retries)
	}
	if got := logs.With("recording a failure was refused, canceling the work instead"); len(got) != 1 ||
		got[0].Attr("machine_id") != unrecordable.String() || !strings.Contains(got[0].Attr("record_err"), "no backoff for this machine") {
		t.Errorf("lines about the refused failure: %+v", got)
	}
}

// lastEvent is the machine's last history event, or "".
func lastEvent(t *testing.T, db *bmdbtest.DB, id uuid.UUID) bmdb.Event {
	t.Helper()
	h := events(t, db, id)
	if len(h) == 0 {
		return ""
	}
	return h[len(h)-1].Event
}

// TestRunnerClaimErrors: a claim that fails because the database cannot be
// reached is counted and logged, and the workers carry on once it is back.
// The failures of every worker make one line per interval
// (internal/ratelog), not one each (issue 13 item 8).
func TestRunnerClaimErrors(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	db, proxy := bmdbtest.NewBehindProxy(t, bmdb.Config{})
	loop := testLoop()
	logs := logtest.New()
	r, err := manager.NewRunner("claim-errors", manager.LoopConfig{Parallelism: 4, IdleSleep: 20 * time.Millisecond, Lease: 30 * time.Second},
		loop, db.DB, reg, logs.Logger())
	if err != nil {
		t.Fatal(err)
	}
	startRunner(t, r)
	claims := func(result string) float64 {
		return metricstest.Value(t, reg, "shepherd_loop_claims_total", "result", result)
	}
	bmdbtest.WaitFor(t, 60*time.Second, "a claim found nothing", func(context.Context) (bool, error) {
		return claims("nothing_to_do") >= 1, nil
	})
	if got := logs.With("claiming work"); len(got) != 0 {
		t.Fatalf("claim errors logged while the database answered: %+v", got)
	}
	proxy.SetMode(tcpproxy.Reset)
	outage := time.Now()
	bmdbtest.WaitFor(t, 60*time.Second, "failed claims counted and logged", func(context.Context) (bool, error) {
		return claims("error") >= 12 && len(logs.With("claiming work")) >= 1, nil
	})
	proxy.SetMode(tcpproxy.Pass)
	// One line at once, then at most one per 10 s interval.
	if n, most := len(logs.With("claiming work")), 1+int(time.Since(outage)/(10*time.Second)); n > most {
		t.Errorf("%d lines about %v failed claims in %s, want at most %d", n, claims("error"), time.Since(outage).Round(time.Millisecond), most)
	}
	after := claims("nothing_to_do")
	bmdbtest.WaitFor(t, 60*time.Second, "claims again once the database is back", func(context.Context) (bool, error) {
		return claims("nothing_to_do") > after, nil
	})
	if l := logs.With("claiming work")[0]; l.Level != slog.LevelError || l.Attr("process") != "AgentStart" || l.Attr("err") == "" {
		t.Errorf("claim error line %+v, want an error naming the process and the error", l)
	}
}

// TestRunnerEndsAClaimThatCommitsAsItStops stops a runner while its claim is
// past its snapshot but not committed (a trigger on the work insert waits
// for a lock the test holds). The claim must run to its answer rather than
// be abandoned (an abandoned claim may commit after the session's close),
// and the worker must then cancel what it claimed, saying the loop is
// stopping: the machine is left free, with no live work and no backoff.
func TestRunnerEndsAClaimThatCommitsAsItStops(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	setup := bmdbtest.Session(t, db, "setup", time.Minute)
	id := bmdbtest.AddMachine(t, db, setup, "lab")
	gate := bmdbtest.HoldInserts(t, db, "work", bmdbtest.BeforeInsert, "")
	var done atomic.Int64
	loop := testLoop()
	loop.Do = func(_ context.Context, task *manager.Task) (manager.FinishFunc, error) {
		done.Add(1)
		return startAgentOf(task), nil
	}
	r, err := manager.NewRunner("stopping-loop", manager.LoopConfig{Parallelism: 1, IdleSleep: 20 * time.Millisecond}, loop, db.DB, prometheus.NewRegistry(), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	ran := make(chan error, 1)
	go func() { ran <- r.Run(ctx) }()
	gate.WaitHeld(t)
	cancel()
	gate.Open(t)
	if err := <-ran; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if n := done.Load(); n != 0 {
		t.Errorf("Do ran %d times for a claim made as the loop stopped, want 0", n)
	}
	h := events(t, db, id)
	var got []string
	for _, e := range h {
		if e.Process == bmdb.ProcessAgentStart {
			got = append(got, string(e.Event)+": "+e.Cause)
		}
	}
	want := []string{"Started: ", "Canceled: the stopping-loop is stopping (the claim committed as it stopped)"}
	if !slices.Equal(got, want) {
		t.Errorf("history of the machine claimed as the loop stopped:\n got %q\nwant %q", got, want)
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work"); n != 0 {
		t.Errorf("%d work rows after the runner stopped, want 0", n)
	}
	if _, err := db.GetBackoff(t.Context(), id, bmdb.ProcessAgentStart); !errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("stopping backed the machine off: %v", err)
	}
}
