package manager

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/logtest"
)

// rebootCounter is a provider whose reboots and reinstalls only count.
type rebootCounter struct {
	named
	reboots chan string
}

func (r rebootCounter) RebootMachine(_ context.Context, id string) error {
	r.reboots <- id
	return nil
}

func (r rebootCounter) ReinstallMachine(_ context.Context, id string) error {
	r.reboots <- id
	return nil
}

// TestBreakerHeldRebootIsRecordedAsHeld: a reboot the circuit breaker's
// budget refuses at admission (another worker took the window's last
// restart after this one claimed) ends the work as Held with a cause that
// names the breaker and its figures, not as Canceled (issue 13 item 5).
func TestBreakerHeldRebootIsRecordedAsHeld(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "lab", Stale: 1, Healthy: 9})
	ids, err := db.ListCandidates(t.Context(), bmdb.ProcessRecovery, bmdb.RecoveryCandidates("lab", 0, 0), 10)
	if err != nil || len(ids) != 1 {
		t.Fatalf("silent machines: %v, %v; want 1", ids, err)
	}
	silent := ids[0]
	// The window's one restart went to another machine.
	refs, err := db.ListProvided(t.Context(), "lab")
	if err != nil {
		t.Fatal(err)
	}
	other := refs[0].MachineID
	if other == silent {
		other = refs[1].MachineID
	}
	db.Exec(t, `INSERT INTO recovery_admissions (machine_id, provider, admitted_at, reached, failed) VALUES ($1, 'lab', now(), true, false)`, other)

	p := rebootCounter{named: named{name: "lab"}, reboots: make(chan string, 10)}
	logs := logtest.New()
	rc, err := NewRecoverer(RecovererConfig{
		Loop:                LoopConfig{Parallelism: 1, IdleSleep: time.Hour},
		MaxRebootsPerWindow: 1,
	}, db.DB, p, prometheus.NewRegistry(), logs.Logger())
	if err != nil {
		t.Fatal(err)
	}
	// The breaker's view predates the other restart: it lets the
	// recoverer claim.
	rc.breaker.read = func(context.Context) (BreakerState, error) {
		return BreakerState{Provided: 10, Started: 10, Silent: 1, Budget: 1, Window: 10 * time.Minute}, nil
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- rc.Run(ctx) }()
	var last bmdb.HistoryEvent
	bmdbtest.WaitFor(t, 60*time.Second, "the recovery ended", func(ctx context.Context) (bool, error) {
		// The first end of the recovery (the stubbed breaker lets the
		// worker claim the machine again at once).
		h, err := db.History(ctx, bmdb.HistoryFilter{MachineID: silent, Process: bmdb.ProcessRecovery})
		for _, e := range h {
			if e.Event != bmdb.EventStarted {
				last = e
				return true, err
			}
		}
		return false, err
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if len(p.reboots) != 0 {
		t.Errorf("%d restarts past the breaker", len(p.reboots))
	}
	want := "held by the circuit breaker: 1 restarts of lab's machines admitted in the last 10m0s, the budget of the window is 1; " +
		"the reboot rung waits for the window to move on: held back by a safety limit"
	if last.Event != bmdb.EventHeld || last.Cause != want {
		t.Errorf("the refused recovery ended %s %q, want %s %q", last.Event, last.Cause, bmdb.EventHeld, want)
	}
	if b, err := db.GetBackoff(t.Context(), silent, bmdb.ProcessRecovery); err == nil {
		t.Errorf("a held recovery backed the machine off: %+v", b)
	}
	if l := logs.With("held back"); len(l) == 0 || !strings.Contains(l[0].Attr("cause"), "circuit breaker") {
		t.Errorf("the held line does not name the breaker: %v", logs.With("held back"))
	}
}

// TestBreakerFailuresAreFlushedAtStop: the lines about failed breaker
// reads that the rate limit held back are logged, with their count, when
// the recoverer stops, not lost (or logged after it stopped).
func TestBreakerFailuresAreFlushedAtStop(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	logs := logtest.New()
	rc, err := NewRecoverer(RecovererConfig{Loop: LoopConfig{Parallelism: 1, IdleSleep: time.Millisecond}},
		db.DB, rebootCounter{named: named{name: "lab"}}, prometheus.NewRegistry(), logs.Logger())
	if err != nil {
		t.Fatal(err)
	}
	reads := make(chan struct{}, 100)
	rc.breaker.read = func(context.Context) (BreakerState, error) {
		select {
		case reads <- struct{}{}:
		default:
		}
		return BreakerState{}, errors.New("database down")
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- rc.Run(ctx) }()
	for range 3 { // the first read is logged, the next ones held back
		<-reads
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	l := logs.With("checking the circuit breaker")
	if len(l) != 2 || l[1].Attr("repeated") == "" {
		t.Errorf("lines about failed breaker reads when Run returned: %+v, want the first and one with the count held back", l)
	}
}
