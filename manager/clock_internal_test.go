package manager

// Tests of the control loops' own clocks: schedules, pauses and caches whose
// time is Go's. They run in a synctest bubble, where time is virtual and
// only moves when every goroutine of the bubble waits, so the durations they
// assert are exact whatever the load on the machine. Where the real code
// asks the database, these tests stand a function in for it (the breaker's
// read, the updater's isChanging, the attempt of retryEnd).

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"testing"
	"testing/synctest"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/internal/logtest"
	"github.com/shepherd/shepherd/provider"
)

func TestJitter(t *testing.T) {
	t.Parallel()
	for _, d := range []time.Duration{0, 1} {
		if got := jitter(d); got != d {
			t.Errorf("jitter(%s) = %s, want it unchanged", d, got)
		}
	}
	for _, d := range []time.Duration{2, time.Second} {
		below, above := false, false
		for range 1000 {
			got := jitter(d)
			if got < d/2 || got >= d+d/2 {
				t.Fatalf("jitter(%s) = %s, want within [%s, %s)", d, got, d/2, d+d/2)
			}
			below = below || got < d
			above = above || got >= d
		}
		if !below || !above {
			t.Errorf("1000 jitters of %s all fall on one side of it (some below %v, some at or above %v)", d, below, above)
		}
	}
}

func TestSleep(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		sleep(t.Context(), time.Minute)
		if got := time.Since(start); got != time.Minute {
			t.Errorf("sleep(1m) took %s", got)
		}
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		start = time.Now()
		sleep(ctx, time.Hour)
		if got := time.Since(start); got != 10*time.Second {
			t.Errorf("sleep(1h) with a context ending in 10s took %s", got)
		}
	})
}

// named is a provider that has nothing but a name.
type named struct {
	provider.Provider
	name string
}

func (n named) Name() string { return n.name }

// testBreaker returns a breaker of provider "lab" that reads its state
// with read, its metrics on reg, its log lines to logs.
func testBreaker(t *testing.T, reg *prometheus.Registry, logs *logtest.Recorder, read func(context.Context) (BreakerState, error)) *breaker {
	t.Helper()
	rc := &Recoverer{p: named{name: "lab"}, log: logs.Logger(), cfg: RecovererConfig{}.withBreakerDefaults()}
	b, err := newBreaker(rc, reg)
	if err != nil {
		t.Fatal(err)
	}
	b.read = read
	return b
}

// TestBreakerRefresh: the breaker reads the fleet's state at most every
// breakerRefresh, unless an admission found the budget used up, which
// makes it read at once; what it read decides allow and budget, and the
// gauges show it.
func TestBreakerRefresh(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		ctx := t.Context()
		reads := 0
		st := BreakerState{RebootsInWindow: 2, Budget: 5}
		var readErr error
		reg := prometheus.NewRegistry()
		h := logtest.New()
		b := testBreaker(t, reg, h, func(context.Context) (BreakerState, error) {
			reads++
			return st, readErr
		})
		check := func(when string, wantAllow bool, wantMax int64, wantReads int) {
			t.Helper()
			if got := b.allow(ctx); got != wantAllow {
				t.Errorf("%s: allow() = %v, want %v", when, got, wantAllow)
			}
			if got, err := b.budget(ctx); err != nil || got != wantMax {
				t.Errorf("%s: budget() = %d, %v; want %d", when, got, err, wantMax)
			}
			if reads != wantReads {
				t.Errorf("%s: %d reads of the fleet's state, want %d", when, reads, wantReads)
			}
		}
		check("first look", true, 5, 1)
		if got := testutil.ToFloat64(b.rebootsG); got != 2 {
			t.Errorf("reboots gauge %v, want 2", got)
		}
		if got := testutil.ToFloat64(b.budgetG); got != 5 {
			t.Errorf("budget gauge %v, want 5", got)
		}

		// The budget is used up, as seen from the database; the breaker
		// keeps what it read for breakerRefresh.
		st = BreakerState{RebootsInWindow: 5, Budget: 6, Paused: "reboot_budget"}
		time.Sleep(breakerRefresh - time.Nanosecond)
		check("just before breakerRefresh", true, 5, 1)
		time.Sleep(time.Nanosecond)
		check("at breakerRefresh", false, 6, 2)
		paused := func(reason string) float64 { return testutil.ToFloat64(b.pausedGauge.WithLabelValues(reason)) }
		if paused("reboot_budget") != 1 || paused("silent_fraction") != 0 {
			t.Errorf("paused gauges: reboot_budget %v, silent_fraction %v; want 1 and 0", paused("reboot_budget"), paused("silent_fraction"))
		}

		// An admission that finds the budget used up reads at once.
		st = BreakerState{Silent: 30, Started: 100, Budget: 6, Paused: "silent_fraction"}
		time.Sleep(time.Second)
		b.refused(ctx)
		check("after a refused admission", false, 6, 3)
		if paused("reboot_budget") != 0 || paused("silent_fraction") != 1 {
			t.Errorf("paused gauges: reboot_budget %v, silent_fraction %v; want 0 and 1", paused("reboot_budget"), paused("silent_fraction"))
		}

		if got := h.With("checking the circuit breaker"); len(got) != 0 {
			t.Errorf("warnings about reading the breaker while it could be read: %+v", got)
		}

		// A database that cannot say admits nothing, and is warned about.
		readErr = errors.New("database down")
		time.Sleep(breakerRefresh)
		if b.allow(ctx) {
			t.Error("allow() = true while the state cannot be read")
		}
		if _, err := b.budget(ctx); !errors.Is(err, readErr) {
			t.Errorf("budget() error = %v, want %v", err, readErr)
		}
		b.refused(ctx)
		if reads != 6 {
			t.Errorf("%d reads, want 6 (a failed read is tried again each time)", reads)
		}
		// One line per interval: refused's failure is held back, counted.
		if got := h.With("checking the circuit breaker"); len(got) != 1 || got[0].Level != slog.LevelWarn || got[0].Attrs["err"].String() != "database down" {
			t.Errorf("warnings about failed reads: %+v, want one (the second is within the interval)", got)
		}
		readErr = nil
		st = BreakerState{Budget: 6}
		check("after the database came back", true, 6, 7)
	})
}

// TestBreakerLogs: the breaker says when it starts holding reboots back,
// when the reason changes, once a minute while it holds them, and when it
// allows them again, and nothing otherwise.
func TestBreakerLogs(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		ctx := t.Context()
		h := logtest.New()
		var st BreakerState
		b := testBreaker(t, prometheus.NewRegistry(), h, func(context.Context) (BreakerState, error) { return st, nil })
		start := time.Now()
		refreshAt := func(at time.Duration, s BreakerState) {
			t.Helper()
			time.Sleep(at - time.Since(start))
			st = s
			b.refused(ctx)
		}
		budget := BreakerState{RebootsInWindow: 5, Budget: 5, Paused: "reboot_budget"}
		silent := BreakerState{Silent: 40, Started: 100, Budget: 5, Paused: "silent_fraction"}
		refreshAt(0, BreakerState{Budget: 5})
		for at := 2 * time.Second; at <= 64*time.Second; at += 2 * time.Second {
			refreshAt(at, budget)
		}
		refreshAt(66*time.Second, silent)
		refreshAt(68*time.Second, silent)
		refreshAt(70*time.Second, BreakerState{Budget: 5})
		refreshAt(72*time.Second, BreakerState{Budget: 5})

		var got []string
		for _, r := range h.With("circuit breaker holds reboots back") {
			got = append(got, fmt.Sprintf("%s %s", r.Time.Sub(start), r.Attrs["reason"]))
		}
		want := []string{"2s reboot_budget", "1m2s reboot_budget", "1m6s silent_fraction"}
		if !slices.Equal(got, want) {
			t.Errorf("pause lines at %q, want %q", got, want)
		}
		got = nil
		for _, r := range h.With("circuit breaker allows reboots again") {
			got = append(got, r.Time.Sub(start).String())
		}
		if want := []string{"1m10s"}; !slices.Equal(got, want) {
			t.Errorf("resume lines at %q, want %q", got, want)
		}
	})
}

// TestRetryEndPauses: while the database is unreachable, ending work is
// retried after jittered pauses that double from endPauseMin up to
// endPauseMax, and never beyond a tenth of the lease (nor below
// endPauseMin); each attempt gets one lease and is not cut short by the
// worker's cancellation; and the warning is logged on the first attempt
// and every tenth.
func TestRetryEndPauses(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		lease time.Duration
		want  []time.Duration // the pauses (before jitter), the last one repeating
	}{
		{500 * time.Millisecond, []time.Duration{100 * time.Millisecond}},
		{2 * time.Second, []time.Duration{100 * time.Millisecond, 200 * time.Millisecond}},
		{2 * time.Minute, []time.Duration{100 * time.Millisecond, 200 * time.Millisecond, 400 * time.Millisecond,
			800 * time.Millisecond, 1600 * time.Millisecond, 3200 * time.Millisecond, 5 * time.Second}},
	} {
		t.Run(tt.lease.String(), func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				const failures = 25
				m, err := newLoopMetrics(nil, "test")
				if err != nil {
					t.Fatal(err)
				}
				r := &Runner{cfg: LoopConfig{Lease: tt.lease}, metrics: m}
				h := logtest.New()
				ctx, cancel := context.WithCancel(t.Context())
				cancel() // the worker stops: the end is still recorded
				var at []time.Time
				e := ending{kind: endFinish}
				r.retryEnd(ctx, nil, h.Logger(), &e, func(actx context.Context) error {
					at = append(at, time.Now())
					if err := actx.Err(); err != nil {
						t.Errorf("attempt %d starts with its context done: %v", len(at), err)
					}
					if d, ok := actx.Deadline(); !ok || time.Until(d) != tt.lease {
						t.Errorf("attempt %d has deadline %v (set %v), want one lease (%s) from now", len(at), d, ok, tt.lease)
					}
					if len(at) <= failures {
						return errors.New("connection refused")
					}
					return nil
				})
				if len(at) != failures+1 {
					t.Fatalf("%d attempts, want %d", len(at), failures+1)
				}
				for i := 1; i < len(at); i++ {
					p := tt.want[min(i-1, len(tt.want)-1)]
					if gap := at[i].Sub(at[i-1]); gap < p/2 || gap >= p+p/2 {
						t.Errorf("pause before attempt %d: %s, want within [%s, %s)", i+1, gap, p/2, p+p/2)
					}
				}
				if got := testutil.ToFloat64(m.endRetries); got != failures {
					t.Errorf("end retries metric %v, want %d", got, failures)
				}
				var logged []int64
				for _, rec := range h.With("ending work failed, retrying while the session lives") {
					logged = append(logged, rec.Attrs["attempt"].Int64())
				}
				if want := []int64{1, 10, 20}; !slices.Equal(logged, want) {
					t.Errorf("warnings logged at attempts %v, want %v", logged, want)
				}
				if got := testutil.ToFloat64(m.claims.WithLabelValues("lost")); got != 0 {
					t.Errorf("lost claims %v, want 0", got)
				}
			})
		})
	}
}

// TestRetryEndGivesUp: retrying ends when the session is lost (its work is
// free for others then), or when the database says the work is gone; each
// is counted as lost.
func TestRetryEndGivesUp(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name     string
		err      func(attempt int) error
		loseAt   int // close the session's channel at this attempt (0: never)
		attempts int
		log      string
	}{
		{"session lost while retrying", func(int) error { return errors.New("connection refused") }, 3, 3,
			"session ended before the work could be ended; it is released with the session"},
		{"session expired", func(int) error { return fmt.Errorf("finishing: %w", bmdb.ErrSessionExpired) }, 0, 1,
			"work lost with the session before it could be ended"},
		{"work ended by an earlier attempt", func(n int) error {
			if n == 1 {
				return errors.New("connection reset")
			}
			return fmt.Errorf("failing: %w", bmdb.ErrWorkEnded)
		}, 0, 2, "work had already ended"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				m, err := newLoopMetrics(nil, "test")
				if err != nil {
					t.Fatal(err)
				}
				r := &Runner{cfg: LoopConfig{Lease: time.Minute}, metrics: m}
				h := logtest.New()
				lost := make(chan struct{})
				n := 0
				e := ending{kind: endFail, cause: errors.New("boom")}
				r.retryEnd(t.Context(), lost, h.Logger(), &e, func(context.Context) error {
					n++
					if n == tt.loseAt {
						close(lost)
					}
					if n > 10 {
						return nil // a retry that should not have been
					}
					return tt.err(n)
				})
				if n != tt.attempts {
					t.Errorf("%d attempts, want %d", n, tt.attempts)
				}
				if got := testutil.ToFloat64(m.claims.WithLabelValues("lost")); got != 1 {
					t.Errorf("lost claims %v, want 1", got)
				}
				if got := h.With(tt.log); len(got) != 1 {
					t.Errorf("%d lines %q, want 1", len(got), tt.log)
				}
			})
		})
	}
}

// TestUpdaterWait: the updater waits its period, jittered; a stable wait
// looks at the BMDB every ChangingPeriod (jittered) and ends as soon as a
// machine is changing, and never runs past its deadline.
func TestUpdaterWait(t *testing.T) {
	t.Parallel()
	const changing, stable = 10 * time.Second, 5 * time.Minute
	type poll struct {
		changing bool
		err      error
	}
	for _, tt := range []struct {
		name   string
		period time.Duration
		polls  []poll // answers of the BMDB, in order; then "not changing"
		// stopAfter ends the context this long into the wait (0: never).
		stopAfter time.Duration
		// endsAtPoll: the wait ends right after this poll (0: at its deadline).
		endsAtPoll int
	}{
		{name: "changing period: a plain sleep", period: changing},
		{name: "stable period, nothing changes", period: stable},
		{name: "stable period, a machine starts changing", period: stable,
			polls: []poll{{false, nil}, {false, nil}, {true, nil}}, endsAtPoll: 3},
		{name: "stable period, the BMDB cannot say", period: stable,
			polls: []poll{{true, errors.New("database down")}, {true, errors.New("database down")}}},
		{name: "stopped during a stable wait", period: stable, stopAfter: 25 * time.Second},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				u := &Updater{cfg: UpdaterConfig{ChangingPeriod: changing, StablePeriod: stable}, log: slog.New(slog.DiscardHandler)}
				ctx := t.Context()
				if tt.stopAfter > 0 {
					var cancel context.CancelFunc
					ctx, cancel = context.WithTimeout(ctx, tt.stopAfter)
					defer cancel()
				}
				start := time.Now()
				var polls []time.Duration
				u.isChanging = func(pctx context.Context) (bool, error) {
					polls = append(polls, time.Since(start))
					if pctx.Err() != nil {
						t.Errorf("polled at %s with the context done", time.Since(start))
					}
					if len(polls) > 1000 {
						return true, nil // a wait that never ends; the checks below fail
					}
					if i := len(polls) - 1; i < len(tt.polls) {
						return tt.polls[i].changing, tt.polls[i].err
					}
					return false, nil
				}
				u.wait(ctx, tt.period)
				took := time.Since(start)

				switch {
				case tt.stopAfter > 0:
					if took != tt.stopAfter {
						t.Errorf("the wait ended %s in, want when the context ended (%s)", took, tt.stopAfter)
					}
				case tt.endsAtPoll > 0:
					if len(polls) != tt.endsAtPoll || took != polls[len(polls)-1] {
						t.Errorf("the wait ended %s in after polls at %v, want it to end at poll %d", took, polls, tt.endsAtPoll)
					}
				default:
					if took < tt.period/2 || took >= tt.period+tt.period/2 {
						t.Errorf("the wait took %s, want within [%s, %s)", took, tt.period/2, tt.period+tt.period/2)
					}
				}
				if tt.period <= changing {
					if len(polls) != 0 {
						t.Errorf("a wait of the changing period looked at the BMDB %d times", len(polls))
					}
					return
				}
				last := time.Duration(0)
				for i, p := range polls {
					if gap := p - last; gap < changing/2 || gap >= changing+changing/2 {
						if i != len(polls)-1 || tt.endsAtPoll > 0 || tt.stopAfter > 0 {
							t.Errorf("poll %d came %s after the one before, want within [%s, %s)", i+1, gap, changing/2, changing+changing/2)
						}
					}
					last = p
				}
				if max := int(took/(changing/2)) + 1; len(polls) > max {
					t.Errorf("%d polls in %s, want at most %d", len(polls), took, max)
				}
				if tt.stopAfter == 0 && tt.endsAtPoll == 0 && took-last >= changing+changing/2 {
					t.Errorf("the last poll was at %s, the wait ended at %s: a stable wait must keep looking", last, took)
				}
			})
		})
	}
}
