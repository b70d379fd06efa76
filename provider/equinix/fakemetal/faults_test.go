package fakemetal

import (
	"context"
	"errors"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"
)

// lastRequest is the latest entry of the request log.
func (e *env) lastRequest() Request {
	reqs := e.fake.Requests()
	if len(reqs) == 0 {
		e.t.Fatal("the request log is empty")
	}
	return reqs[len(reqs)-1]
}

func TestFaultTooManyRequests(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{Tolerance: -1, Faults: Faults{Rate: 1, TooManyRequests: 1, RetryAfter: 1500 * time.Millisecond}})
	res := e.fake.AddReservations("p", "c3.small.x86", "fr2", "fr", 1)[0]
	r := e.do(http.MethodPost, "/projects/p/devices", createBody("h", res))
	r.wantError(t, http.StatusTooManyRequests, "too many requests")
	if ra := r.header.Get("Retry-After"); ra != "2" {
		t.Fatalf("Retry-After %q, want 2 (1.5s rounded up)", ra)
	}
	if ds := e.fake.Devices("p"); len(ds) != 0 {
		t.Fatalf("an injected 429 created a device")
	}
	if last := e.lastRequest(); last.Fault != FaultTooManyRequests || last.Status != 429 || last.RetryAfter != 2*time.Second {
		t.Fatalf("logged %+v", last)
	}
	if v := e.fake.Check(); len(v) != 0 {
		t.Fatalf("Check() = %q after one request", v)
	}
	// A client that retries at once is refused, as the account is
	// rate-limited until the Retry-After has passed, and reported.
	r = e.do(http.MethodGet, "/projects/p/devices", nil)
	r.wantError(t, http.StatusTooManyRequests, "too many requests")
	if ra := r.header.Get("Retry-After"); ra != "2" && ra != "1" {
		t.Fatalf("Retry-After %q, want what is left of the first", ra)
	}
	if last := e.lastRequest(); last.Fault != FaultOverBudget {
		t.Fatalf("logged %+v", last)
	}
	if v := e.fake.Check(); len(v) != 1 || !strings.Contains(v[0], "retry-after not honoured") {
		t.Fatalf("Check() = %q, want the immediate retry reported", v)
	}
}

func TestFaultServerError(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{Faults: Faults{Rate: 1, ServerError: 1}})
	res := e.fake.AddReservations("p", "c3.small.x86", "fr2", "fr", 1)[0]
	seen := map[int]bool{}
	for range 20 {
		r := e.do(http.MethodPost, "/projects/p/devices", createBody("h", res))
		if r.status != 500 && r.status != 503 {
			t.Fatalf("status %d, want 500 or 503", r.status)
		}
		seen[r.status] = true
		if f := e.lastRequest().Fault; f != FaultServerError {
			t.Fatalf("logged fault %q", f)
		}
	}
	if !seen[500] || !seen[503] {
		t.Errorf("20 server errors were all %v", seen)
	}
	if ds := e.fake.Devices("p"); len(ds) != 0 {
		t.Fatalf("injected 5xx created %d devices", len(ds))
	}
}

func TestFaultTimeout(t *testing.T) {
	t.Parallel()

	t.Run("answers 504 after Slow", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, Config{Faults: Faults{Rate: 1, Timeout: 1, Slow: 20 * time.Millisecond}})
		res := e.fake.AddReservations("p", "c3.small.x86", "fr2", "fr", 1)[0]
		e.do(http.MethodPost, "/projects/p/devices", createBody("h", res)).wantError(t, http.StatusGatewayTimeout, "timeout")
		if last := e.lastRequest(); last.Fault != FaultTimeout || last.Status != 504 || last.Done.Sub(last.At) < 20*time.Millisecond {
			t.Fatalf("logged %+v", last)
		}
		if ds := e.fake.Devices("p"); len(ds) != 0 {
			t.Fatalf("a timed-out create created a device")
		}
	})

	t.Run("holds until the client gives up", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, Config{Faults: Faults{Rate: 1, Timeout: 1, Slow: time.Hour}})
		res := e.fake.AddReservations("p", "c3.small.x86", "fr2", "fr", 1)[0]
		ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
		defer cancel()
		if _, err := e.send(ctx, testToken, http.MethodPost, "/projects/p/devices", createBody("h", res)); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("err = %v, want the client's deadline", err)
		}
		waitFor(t, 5*time.Second, "the held request ends", func() bool { return !e.lastRequest().Done.IsZero() })
		if last := e.lastRequest(); last.Fault != FaultTimeout || last.Status != 0 {
			t.Fatalf("logged %+v, want a timeout without an answer", last)
		}
		if ds := e.fake.Devices("p"); len(ds) != 0 {
			t.Fatalf("a timed-out create created a device")
		}
	})

	t.Run("Close releases held requests", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t, Config{Faults: Faults{Rate: 1, Timeout: 1, Slow: time.Hour}})
		e.fake.AddProject("p")
		got := make(chan reply, 1)
		go func() {
			r, _ := e.send(t.Context(), testToken, http.MethodGet, "/projects/p/devices", nil)
			got <- r
		}()
		waitFor(t, 5*time.Second, "the request is held", func() bool { return len(e.fake.Requests()) == 1 })
		e.fake.Close()
		select {
		case r := <-got:
			r.want(t, http.StatusGatewayTimeout)
		case <-time.After(10 * time.Second):
			t.Fatal("Close did not release the held request")
		}
	})
}

func TestFaultLostCreate(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{Faults: Faults{Rate: 1, LostCreate: 1}})
	ids := e.fake.AddReservations("p", "c3.small.x86", "fr2", "fr", 2)
	res, taken := ids[0], ids[1]
	e.fake.AddDevice("p", DeviceSpec{Hostname: "other", ReservationID: taken})

	// Only creation gets this fault: everything else is answered.
	e.do(http.MethodGet, "/projects/p/devices", nil).want(t, http.StatusOK)
	if f := e.lastRequest().Fault; f != "" {
		t.Fatalf("a list got fault %q", f)
	}

	_, err := e.send(t.Context(), testToken, http.MethodPost, "/projects/p/devices", createBody("mine", res))
	if err == nil {
		t.Fatal("the create was answered; want the connection closed without an answer")
	}
	var mine []Device
	for _, d := range e.fake.Devices("p") {
		if d.Hostname == "mine" {
			mine = append(mine, d)
		}
	}
	if len(mine) != 1 || mine[0].ReservationID != res || !slices.Equal(mine[0].Tags, []string{"shepherd"}) {
		t.Fatalf("devices named mine: %+v, want one on reservation %s", mine, res)
	}
	if last := e.lastRequest(); last.Fault != FaultLostCreate || last.Status != 0 || last.Method != http.MethodPost {
		t.Fatalf("logged %+v", last)
	}

	// A create that fails has nothing to lose: it is answered.
	e.do(http.MethodPost, "/projects/p/devices", createBody("again", res)).wantError(t, http.StatusUnprocessableEntity, "already has a device")
	if f := e.lastRequest().Fault; f != "" {
		t.Fatalf("a refused create is logged with fault %q", f)
	}
}

func TestSetFaults(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{})
	e.fake.AddProject("p")
	e.do(http.MethodGet, "/projects/p/devices", nil).want(t, http.StatusOK)
	e.fake.SetFaults(Faults{Rate: 1, ServerError: 1})
	if r := e.do(http.MethodGet, "/projects/p/devices", nil); r.status < 500 {
		t.Fatalf("status %d after SetFaults, want 5xx", r.status)
	}
	e.fake.SetFaults(Faults{})
	e.do(http.MethodGet, "/projects/p/devices", nil).want(t, http.StatusOK)

	defer func() {
		if recover() == nil {
			t.Fatal("SetFaults accepted a rate of 2")
		}
	}()
	e.fake.SetFaults(Faults{Rate: 2})
}

// TestFaultsAreReproducible: the same seed and requests get the same
// faults; an equal mix reaches every kind that applies.
func TestFaultsAreReproducible(t *testing.T) {
	t.Parallel()
	run := func(seed int64) []string {
		// The client waits out every Retry-After, on a clock of its own,
		// so that every request draws a fault.
		clock := newFakeClock()
		e := newEnv(t, Config{Seed: seed, Clock: clock.Now, Faults: Faults{Rate: 0.5, Slow: time.Millisecond}})
		e.fake.AddProject("p")
		for range 60 {
			clock.Advance(time.Second)
			e.do(http.MethodGet, "/projects/p/devices", nil)
		}
		var faults []string
		for _, r := range e.fake.Requests() {
			faults = append(faults, r.Fault)
		}
		return faults
	}
	a, b := run(42), run(42)
	if !slices.Equal(a, b) {
		t.Fatalf("seed 42 gave\n%q\nthen\n%q", a, b)
	}
	for _, kind := range []string{"", FaultTooManyRequests, FaultServerError, FaultTimeout} {
		if !slices.Contains(a, kind) {
			t.Errorf("no request got fault %q in %q", kind, a)
		}
	}
	if slices.Contains(a, FaultLostCreate) {
		t.Errorf("a list got a lost-create fault")
	}
	if slices.Equal(a, run(43)) {
		t.Errorf("seeds 42 and 43 gave the same faults")
	}
}

func TestPickFault(t *testing.T) {
	t.Parallel()
	tests := []struct {
		f      Faults
		create bool
		u      float64
		want   string
	}{
		{Faults{}, true, 0.1, FaultTooManyRequests},
		{Faults{}, true, 0.99, FaultLostCreate},
		{Faults{}, false, 0.99, FaultTimeout},
		{Faults{LostCreate: 1}, false, 0.5, ""},
		{Faults{LostCreate: 1}, true, 0.5, FaultLostCreate},
		{Faults{ServerError: 3, Timeout: 1}, false, 0.74, FaultServerError},
		{Faults{ServerError: 3, Timeout: 1}, false, 0.76, FaultTimeout},
	}
	for _, tt := range tests {
		if got := pickFault(tt.f, tt.create, tt.u); got != tt.want {
			t.Errorf("pickFault(%+v, create=%v, %v) = %q, want %q", tt.f, tt.create, tt.u, got, tt.want)
		}
	}
}
