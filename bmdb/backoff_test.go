package bmdb_test

import (
	"context"
	"errors"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/metricstest"
)

func TestBackoffPolicyNext(t *testing.T) {
	t.Parallel()
	s := time.Second
	tests := []struct {
		name   string
		policy bmdb.BackoffPolicy
		want   []time.Duration // intervals of failures 1, 2, 3, ...
	}{
		{"agent start default", bmdb.AgentStartBackoff(),
			[]time.Duration{5 * s, 10 * s, 20 * s, 40 * s, 80 * s, 160 * s, 320 * s, 640 * s, 1280 * s, 2560 * s, 5120 * s, 10240 * s,
				4 * time.Hour, 4 * time.Hour}},
		{"recovery default", bmdb.RecoveryBackoff(),
			[]time.Duration{60 * s, 72 * s, 87 * s, 105 * s, 126 * s}},
		{"rounds up to whole seconds so it always grows", bmdb.BackoffPolicy{Initial: s, Exponent: 1.1},
			[]time.Duration{s, 2 * s, 3 * s, 4 * s, 5 * s, 6 * s, 7 * s, 8 * s, 9 * s, 10 * s, 11 * s, 13 * s}},
		{"sub-second initial", bmdb.BackoffPolicy{Initial: 200 * time.Millisecond, Exponent: 2},
			[]time.Duration{200 * time.Millisecond, s, 2 * s, 4 * s}},
		{"capped", bmdb.BackoffPolicy{Initial: 10 * s, Maximum: 25 * s, Exponent: 2},
			[]time.Duration{10 * s, 20 * s, 25 * s, 25 * s}},
		{"cap below the next step", bmdb.BackoffPolicy{Initial: 10 * s, Maximum: 10 * s, Exponent: 3},
			[]time.Duration{10 * s, 10 * s, 10 * s}},
		{"exponent 1 is constant", bmdb.BackoffPolicy{Initial: 7 * s, Exponent: 1},
			[]time.Duration{7 * s, 7 * s, 7 * s}},
		{"exponent 1 is constant, not rounded up", bmdb.BackoffPolicy{Initial: 1500 * time.Millisecond, Exponent: 1},
			[]time.Duration{1500 * time.Millisecond, 1500 * time.Millisecond}},
		{"exponent 0 is constant", bmdb.BackoffPolicy{Initial: 7 * s},
			[]time.Duration{7 * s, 7 * s, 7 * s}},
		{"exponent below 1 is constant", bmdb.BackoffPolicy{Initial: 7 * s, Exponent: 0.5},
			[]time.Duration{7 * s, 7 * s, 7 * s}},
		{"huge growth saturates at the cap", bmdb.BackoffPolicy{Initial: time.Hour, Maximum: 24 * time.Hour, Exponent: 1e6},
			[]time.Duration{time.Hour, 24 * time.Hour, 24 * time.Hour}},
		// 3600 s × 1e9 does not fit a time.Duration: no wrap-around.
		{"growth beyond time.Duration saturates at the cap", bmdb.BackoffPolicy{Initial: time.Hour, Maximum: 24 * time.Hour, Exponent: 1e9},
			[]time.Duration{time.Hour, 24 * time.Hour}},
		{"growth beyond time.Duration without a cap saturates", bmdb.BackoffPolicy{Initial: time.Hour, Exponent: 1e9},
			[]time.Duration{time.Hour, math.MaxInt64, math.MaxInt64}},
		{"cap reached exactly", bmdb.BackoffPolicy{Initial: 10 * s, Maximum: 20 * s, Exponent: 2},
			[]time.Duration{10 * s, 20 * s, 20 * s}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := tt.policy.Validate(); err != nil {
				t.Fatal(err)
			}
			var got []time.Duration
			var last time.Duration
			for range tt.want {
				last = tt.policy.Next(last)
				got = append(got, last)
			}
			if diff := cmp.Diff(tt.want, got); diff != "" {
				t.Errorf("intervals (-want +got):\n%s", diff)
			}
		})
	}
}

func TestBackoffPolicyValidate(t *testing.T) {
	t.Parallel()
	// Each refusal names the field, so an operator knows what to fix.
	bad := map[string]struct {
		policy bmdb.BackoffPolicy
		want   string
	}{
		"no initial":        {bmdb.BackoffPolicy{}, "Initial must be > 0, got 0s"},
		"negative initial":  {bmdb.BackoffPolicy{Initial: -time.Second}, "Initial must be > 0, got -1s"},
		"maximum < initial": {bmdb.BackoffPolicy{Initial: time.Minute, Maximum: time.Second}, "Maximum 1s is below Initial 1m0s"},
		"negative maximum":  {bmdb.BackoffPolicy{Initial: time.Second, Maximum: -time.Second}, "Maximum must be >= 0 (0 = no cap), got -1s"},
		"negative exponent": {bmdb.BackoffPolicy{Initial: time.Second, Exponent: -2}, "Exponent must be a finite number >= 0, got -2"},
		"NaN exponent":      {bmdb.BackoffPolicy{Initial: time.Second, Exponent: math.NaN()}, "Exponent must be a finite number >= 0, got NaN"},
		"infinite exponent": {bmdb.BackoffPolicy{Initial: time.Second, Exponent: math.Inf(1)}, "Exponent must be a finite number >= 0, got +Inf"},
		"jitter above 1":    {bmdb.BackoffPolicy{Initial: time.Second, Jitter: 1.5}, "Jitter must be within [0, 1], got 1.5"},
		"negative jitter":   {bmdb.BackoffPolicy{Initial: time.Second, Jitter: -0.1}, "Jitter must be within [0, 1], got -0.1"},
		"NaN jitter":        {bmdb.BackoffPolicy{Initial: time.Second, Jitter: math.NaN()}, "Jitter must be within [0, 1], got NaN"},
		"negative attempts": {bmdb.BackoffPolicy{Initial: time.Second, MaxAttempts: -1}, "MaxAttempts must be >= 0 (0 = never quarantine), got -1"},
	}
	for name, tt := range bad {
		if err := tt.policy.Validate(); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: Validate() = %v, want an error containing %q", name, err, tt.want)
		}
	}
	good := map[string]bmdb.BackoffPolicy{
		"defaults":          {Initial: time.Second},
		"maximum = initial": {Initial: time.Minute, Maximum: time.Minute},
		"no jitter given":   {Initial: time.Second, Jitter: 0},
		"jitter 1":          {Initial: time.Second, Jitter: 1},
		"exponent 0":        {Initial: time.Second, Exponent: 0},
		"never quarantine":  {Initial: time.Second, MaxAttempts: 0},
		"agent start":       bmdb.AgentStartBackoff(),
		"recovery":          bmdb.RecoveryBackoff(),
	}
	for name, p := range good {
		if err := p.Validate(); err != nil {
			t.Errorf("%s: Validate() = %v, want nil", name, err)
		}
	}
}

// failOnce claims the machine for process and fails it with policy, after
// letting any earlier backoff run out (by moving it into the past: waiting
// minutes would prove nothing more).
func failOnce(t *testing.T, db *bmdbtest.DB, s *bmdb.Session, process bmdb.Process, cands bmdb.Candidates, policy bmdb.BackoffPolicy, cause string) bmdb.Backoff {
	t.Helper()
	db.Exec(t, "UPDATE work_backoff SET backoff_until = now() - interval '1 millisecond'")
	w, err := s.Work(t.Context(), process, cands)
	if err != nil {
		t.Fatalf("Work: %v", err)
	}
	b, err := w.Fail(t.Context(), policy, cause)
	if err != nil {
		t.Fatalf("Fail: %v", err)
	}
	return b
}

func TestBackoffInDatabase(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	db := bmdbtest.NewWithConfig(t, bmdb.Config{Registerer: reg})
	s := bmdbtest.Session(t, db, "test", time.Minute)
	id := bmdbtest.AddMachine(t, db, s, "p")
	cands := bmdb.AgentStartCandidates("p")
	policy := bmdb.BackoffPolicy{Initial: 10 * time.Second, Maximum: time.Minute, Exponent: 2, Jitter: 0.5, MaxAttempts: 5}

	wantIntervals := []time.Duration{10 * time.Second, 20 * time.Second, 40 * time.Second, time.Minute}
	for i, want := range wantIntervals {
		before := bmdbtest.Scalar[time.Time](t, db, "SELECT now()")
		b := failOnce(t, db, s, bmdb.ProcessAgentStart, cands, policy, "ssh: connection refused")
		after := bmdbtest.Scalar[time.Time](t, db, "SELECT now()")
		if b.Interval != want || b.Attempts != i+1 || b.Quarantined {
			t.Fatalf("failure %d: backoff %+v, want interval %s, attempts %d, not quarantined", i+1, b, want, i+1)
		}
		// Jitter stretches the wait by up to 50 %, never shortens it.
		if lo, hi := before.Add(want), after.Add(want+want/2); b.Until.Before(lo) || b.Until.After(hi) {
			t.Fatalf("failure %d: until %s outside [%s, %s]", i+1, b.Until, lo, hi)
		}
		// While backed off, the machine is no candidate for this process.
		if _, err := s.Work(t.Context(), bmdb.ProcessAgentStart, cands); !errors.Is(err, bmdb.ErrNothingToDo) {
			t.Fatalf("Work while backed off: %v, want ErrNothingToDo", err)
		}
		stored, err := db.GetBackoff(t.Context(), id, bmdb.ProcessAgentStart)
		if err != nil {
			t.Fatal(err)
		}
		if stored.Interval != want || stored.Attempts != i+1 || stored.Cause != "ssh: connection refused" || stored.Quarantined || !stored.Until.Equal(b.Until) {
			t.Fatalf("failure %d: stored %+v, returned %+v", i+1, stored, b)
		}
	}
	if got := metricstest.Value(t, reg, "shepherd_bmdb_work_quarantined_total"); got != 0 {
		t.Errorf("work_quarantined_total = %v before the fifth failure, want 0", got)
	}

	// The fifth failure in a row quarantines: the machine stays out even
	// after the backoff runs out, until an operator resets it.
	b := failOnce(t, db, s, bmdb.ProcessAgentStart, cands, policy, "ssh: host key mismatch")
	if !b.Quarantined || b.Attempts != 5 {
		t.Fatalf("fifth failure: %+v, want quarantined after 5 attempts", b)
	}
	if stored, err := db.GetBackoff(t.Context(), id, bmdb.ProcessAgentStart); err != nil || !stored.Quarantined || stored.Attempts != 5 {
		t.Fatalf("stored after the fifth failure: %+v, %v; want quarantined after 5 attempts", stored, err)
	}
	if got := metricstest.Value(t, reg, "shepherd_bmdb_work_quarantined_total", "process", "AgentStart"); got != 1 {
		t.Errorf("work_quarantined_total = %v after the fifth failure, want 1", got)
	}
	db.Exec(t, "UPDATE work_backoff SET backoff_until = now() - interval '1 hour'")
	if _, err := s.Work(t.Context(), bmdb.ProcessAgentStart, cands); !errors.Is(err, bmdb.ErrNothingToDo) {
		t.Fatalf("Work on a quarantined machine: %v, want ErrNothingToDo", err)
	}
	if err := db.ResetBackoff(t.Context(), id, bmdb.ProcessAgentStart, "operator alice: replaced the NIC"); err != nil {
		t.Fatal(err)
	}
	if err := db.ResetBackoff(t.Context(), id, bmdb.ProcessAgentStart, "again"); !errors.Is(err, bmdb.ErrNotFound) {
		t.Fatalf("second reset: %v, want ErrNotFound", err)
	}
	// After the reset the count starts over.
	b = failOnce(t, db, s, bmdb.ProcessAgentStart, cands, policy, "flaky")
	if b.Attempts != 1 || b.Interval != 10*time.Second || b.Quarantined {
		t.Fatalf("first failure after reset: %+v", b)
	}
	// A success clears the backoff; a cancel leaves it alone.
	db.Exec(t, "UPDATE work_backoff SET backoff_until = now() - interval '1 millisecond'")
	w, err := s.Work(t.Context(), bmdb.ProcessAgentStart, cands)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Cancel(t.Context()); err != nil {
		t.Fatal(err)
	}
	if got, err := db.GetBackoff(t.Context(), id, bmdb.ProcessAgentStart); err != nil || got.Attempts != 1 {
		t.Fatalf("backoff after Cancel: %+v, %v; want it untouched", got, err)
	}
	w, err = s.Work(t.Context(), bmdb.ProcessAgentStart, cands)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Finish(t.Context(), nil); err != nil {
		t.Fatal(err)
	}
	if _, err := db.GetBackoff(t.Context(), id, bmdb.ProcessAgentStart); !errors.Is(err, bmdb.ErrNotFound) {
		t.Fatalf("backoff after Finish: %v, want ErrNotFound", err)
	}

	var events []bmdb.Event
	h, err := db.History(t.Context(), bmdb.HistoryFilter{MachineID: id})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range h {
		events = append(events, e.Event)
	}
	want := []bmdb.Event{
		"Started", "Failed", "Started", "Failed", "Started", "Failed", "Started", "Failed",
		"Started", "Failed", "Quarantined", "Reset", "Started", "Failed", "Started", "Canceled", "Started", "Finished",
	}
	if diff := cmp.Diff(want, events); diff != "" {
		t.Errorf("history (-want +got):\n%s", diff)
	}
	for _, e := range h {
		if e.Event == bmdb.EventReset && (e.Cause != "operator alice: replaced the NIC" || e.SessionID != nil) {
			t.Errorf("Reset row %+v, want the operator's cause and no session", e)
		}
	}
}

// TestBackoffWithoutQuarantine checks that a policy with MaxAttempts 0 never
// quarantines, however often the machine fails.
func TestBackoffWithoutQuarantine(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	bmdbtest.AddMachine(t, db, s, "p")
	policy := bmdb.BackoffPolicy{Initial: time.Minute, Exponent: 2}
	for i := 1; i <= 3; i++ {
		b := failOnce(t, db, s, bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"), policy, "boom")
		if b.Quarantined || b.Attempts != i {
			t.Fatalf("failure %d: %+v, want %d attempts and no quarantine", i, b, i)
		}
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work_history WHERE event = 'Quarantined'"); n != 0 {
		t.Errorf("%d Quarantined history rows, want none", n)
	}
}

// TestJitterSpreadsRetries fails many machines at once and checks that their
// retries are spread over the jitter window, not bunched at one instant.
func TestJitterSpreadsRetries(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name   string
		jitter float64
		window float64 // seconds of the jitter window after 100 s
	}{
		{"jitter 0.2", 0.2, 20},
		{"default jitter", 0, 100 * bmdb.DefaultJitter},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			db := bmdbtest.New(t)
			s := bmdbtest.Session(t, db, "test", time.Minute)
			const n = 200
			for range n {
				bmdbtest.AddMachine(t, db, s, "p")
			}
			policy := bmdb.BackoffPolicy{Initial: 100 * time.Second, Jitter: tt.jitter}
			for range n {
				w, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"))
				if err != nil {
					t.Fatal(err)
				}
				if _, err := w.Fail(context.WithoutCancel(t.Context()), policy, "boom"); err != nil {
					t.Fatal(err)
				}
			}
			// Every wait lies within [100 s, 100 s + window] of its failure,
			// and the waits cover most of that window.
			var lo, hi float64
			if err := db.Pool.QueryRow(t.Context(), `
				SELECT min(extract(epoch FROM b.backoff_until - h.at)), max(extract(epoch FROM b.backoff_until - h.at))
				FROM work_backoff b JOIN work_history h ON h.machine_id = b.machine_id AND h.event = 'Failed'`).Scan(&lo, &hi); err != nil {
				t.Fatal(err)
			}
			if lo < 100 || hi > 100+tt.window {
				t.Errorf("waits span [%.2f s, %.2f s], want within [100 s, %.0f s]", lo, hi, 100+tt.window)
			}
			if hi-lo < tt.window/2 {
				t.Errorf("waits span only %.2f s of the %.0f s jitter window", hi-lo, tt.window)
			}
		})
	}
}

func TestParseBackoff(t *testing.T) {
	t.Parallel()
	p, err := bmdb.ParseBackoff(" 5s, 4h ,2,20")
	if err != nil {
		t.Fatal(err)
	}
	if p != bmdb.AgentStartBackoff() {
		t.Errorf("parsed %v, want %v", p, bmdb.AgentStartBackoff())
	}
	if again, err := bmdb.ParseBackoff(p.String()); err != nil || again != p {
		t.Errorf("String %q parses back to %v, %v", p.String(), again, err)
	}
	// As a flag: Set replaces the policy only with a valid one.
	var flag bmdb.BackoffPolicy
	if err := flag.Set("1m,1h,2,5"); err != nil || flag != (bmdb.BackoffPolicy{Initial: time.Minute, Maximum: time.Hour, Exponent: 2, MaxAttempts: 5}) {
		t.Errorf("Set(1m,1h,2,5): %v, %v", flag, err)
	}
	if err := flag.Set("1m,1h,2"); err == nil || flag.Initial != time.Minute {
		t.Errorf("Set of an invalid policy: %v, policy now %v; want an error and the policy unchanged", err, flag)
	}
	if flag.Type() == "" {
		t.Error("Type() is empty")
	}
	for in, want := range map[string]string{
		"5m,4h,1.2":       "want initial,maximum,exponent,attempts",
		"5x,4h,1.2,20":    `initial "5x"`,
		"5m,forever,1,20": `maximum "forever"`,
		"5m,4h,fast,20":   `exponent "fast"`,
		"5m,4h,1.2,many":  `attempts "many"`,
		"0s,4h,1.2,20":    "Initial must be > 0",
		"5m,4h,NaN,20":    "Exponent",
		"5m,4h,1.2,-1":    "MaxAttempts",
	} {
		if _, err := bmdb.ParseBackoff(in); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseBackoff(%q) = %v, want an error with %q", in, err, want)
		}
	}
}
