package fakemetal

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"golang.org/x/time/rate"
)

func TestAuth(t *testing.T) {
	t.Parallel()
	// Every request with the right token would get a fault, and the budget
	// is one request: a bad token must get 401 all the same, and spend
	// nothing.
	e := newEnv(t, Config{Budget: 1, Burst: 1, Faults: Faults{Rate: 1, TooManyRequests: 1}})
	e.fake.AddProject("p")
	for _, token := range []string{"", "wrong", testToken + "x"} {
		r, err := e.send(t.Context(), token, http.MethodGet, "/projects/p/devices", nil)
		if err != nil {
			t.Fatal(err)
		}
		r.wantError(t, http.StatusUnauthorized, "invalid token")
		if r.header.Get("X-RateLimit-Remaining") != "" {
			t.Errorf("401 carries the account's X-RateLimit-Remaining")
		}
	}
	e.do(http.MethodGet, "/projects/p/devices", nil).want(t, http.StatusTooManyRequests) // the injected fault
	reqs := e.fake.Requests()
	if len(reqs) != 4 {
		t.Fatalf("%d requests logged, want 4", len(reqs))
	}
	for _, r := range reqs[:3] {
		if r.TokenOK || r.Fault != "" || r.Status != http.StatusUnauthorized {
			t.Errorf("bad-token request logged as %+v", r)
		}
	}
	if r := reqs[3]; !r.TokenOK || r.Fault != FaultTooManyRequests {
		t.Errorf("good-token request logged as %+v, want an injected 429 (the budget was not spent by bad tokens)", r)
	}
	if v := e.fake.Check(); len(v) != 0 {
		t.Errorf("Check() = %q, want nothing: bad tokens are not the account's", v)
	}
}

func TestBudget(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	e := newEnv(t, Config{Clock: clock.Now, Budget: 2, Burst: 3, Tolerance: -1})
	res := e.fake.AddReservations("p", "c3.small.x86", "fr2", "fr", 1)[0]

	for i := range 3 {
		r := e.do(http.MethodGet, "/projects/p/devices", nil).want(t, http.StatusOK)
		if l, rem := r.header.Get("X-RateLimit-Limit"), r.header.Get("X-RateLimit-Remaining"); l != "3" || rem != strconv.Itoa(2-i) {
			t.Fatalf("request %d: X-RateLimit-Limit %q Remaining %q, want 3 and %d", i, l, rem, 2-i)
		}
		if reset := r.header.Get("X-RateLimit-Reset"); reset == "" {
			t.Fatalf("request %d: no X-RateLimit-Reset", i)
		}
	}
	// The fourth is over budget, and not processed.
	r := e.do(http.MethodPost, "/projects/p/devices", createBody("h", res))
	r.wantError(t, http.StatusTooManyRequests, "too many requests")
	if ra, rem := r.header.Get("Retry-After"), r.header.Get("X-RateLimit-Remaining"); ra != "1" || rem != "0" {
		t.Fatalf("Retry-After %q X-RateLimit-Remaining %q, want 1 and 0", ra, rem)
	}
	if ds := e.fake.Devices("p"); len(ds) != 0 {
		t.Fatalf("a request over budget created %d devices", len(ds))
	}
	if last := e.fake.Requests()[3]; last.Fault != FaultOverBudget || last.Status != 429 || last.RetryAfter != time.Second {
		t.Fatalf("logged %+v", last)
	}
	v := e.fake.Check()
	if len(v) != 1 || !strings.Contains(v[0], "request 4 (POST "+PathPrefix+"/projects/p/devices): over budget") {
		t.Fatalf("Check() = %q, want request 4 over budget", v)
	}

	// Retrying at once ignores the Retry-After.
	e.do(http.MethodGet, "/projects/p/devices", nil).want(t, http.StatusTooManyRequests)
	v = e.fake.Check()
	if len(v) != 2 || !strings.Contains(v[1], "request 5") || !strings.Contains(v[1], "retry-after not honoured") {
		t.Fatalf("Check() = %q, want request 5 reported for not honouring Retry-After", v)
	}

	// Waiting as told is fine, and the bucket has refilled.
	clock.Advance(time.Second)
	e.do(http.MethodPost, "/projects/p/devices", createBody("h", res)).want(t, http.StatusCreated)
	if v := e.fake.Check(); len(v) != 2 {
		t.Fatalf("Check() = %q, want the 2 earlier violations only", v)
	}
}

// TestPoliteClient is a client that keeps to the budget and honours every
// Retry-After while 30% of its requests get a 429: Check finds nothing.
func TestPoliteClient(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	e := newEnv(t, Config{
		Clock: clock.Now, Budget: 2, Burst: 1, Tolerance: -1, Seed: 7,
		Faults: Faults{Rate: 0.3, TooManyRequests: 1, RetryAfter: 1500 * time.Millisecond},
	})
	e.fake.AddProject("p")
	var retried int
	for range 40 {
		clock.Advance(500 * time.Millisecond) // one request per token
		for {
			r := e.do(http.MethodGet, "/projects/p/devices", nil)
			if r.status != http.StatusTooManyRequests {
				r.want(t, http.StatusOK)
				break
			}
			secs, err := strconv.Atoi(r.header.Get("Retry-After"))
			if err != nil || secs != 2 {
				t.Fatalf("Retry-After %q, want 2 (1.5s rounded up)", r.header.Get("Retry-After"))
			}
			retried++
			clock.Advance(time.Duration(secs) * time.Second)
		}
	}
	if retried == 0 {
		t.Fatalf("no 429 in 40 requests at a fault rate of 0.3")
	}
	if v := e.fake.Check(); len(v) != 0 {
		t.Fatalf("Check() = %q, want nothing for a polite client", v)
	}
}

// TestCheckExcusesRequestsInFlight: a request that arrives within
// Tolerance of a 429's request was in flight already; one that arrives
// later, before the Retry-After has passed, did not honour it.
func TestCheckExcusesRequestsInFlight(t *testing.T) {
	t.Parallel()
	s, err := New(Config{Token: "x", Tolerance: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	ms := func(n int) time.Time { return t0.Add(time.Duration(n) * time.Millisecond) }
	rec := func(seq int, at time.Time) *record {
		return &record{seq: seq, method: "GET", path: "/x", tokenOK: true, at: at, done: at, status: 200}
	}
	limited := rec(1, t0)
	limited.status, limited.retryAfter, limited.fault = 429, time.Second, FaultTooManyRequests
	concurrent := rec(2, t0)   // arrived with it
	inFlight := rec(3, ms(10)) // within tolerance: refused, not a violation
	inFlight.status, inFlight.fault, inFlight.inWindow, inFlight.retryAfter = 429, FaultOverBudget, true, time.Second
	badToken := rec(4, ms(20)) // not the account's
	badToken.tokenOK = false
	overBudget := rec(7, ms(1020)) // the bucket was empty
	overBudget.status, overBudget.fault, overBudget.retryAfter = 429, FaultOverBudget, time.Second
	s.log = []*record{
		limited, concurrent, inFlight, badToken,
		rec(5, ms(100)),  // well after the answer: a violation
		rec(6, ms(1010)), // after every Retry-After (the one of request 3 ends at +1010ms)
		overBudget,
	}
	v := s.Check()
	if len(v) != 2 ||
		!strings.HasPrefix(v[0], "request 5 (GET /x): retry-after not honoured: arrived 100ms after request 1, answered 429 with Retry-After 1s") ||
		!strings.HasPrefix(v[1], "request 7 (GET /x): over budget") {
		t.Fatalf("Check() = %q, want request 5 (retry-after) and 7 (over budget)", v)
	}
}

func TestBucketTolerance(t *testing.T) {
	t.Parallel()
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	b := newBucket(10, 1, 20*time.Millisecond, t0)
	if ok, _ := b.take(t0); !ok {
		t.Fatal("the first request of a full bucket was refused")
	}
	// The next token is due at +100ms: +85ms is within 20ms of it. The one
	// after is due at +200ms all the same (the early request borrowed), so
	// +150ms is not.
	if ok, _ := b.take(t0.Add(85 * time.Millisecond)); !ok {
		t.Fatal("a request 15ms early was refused despite 20ms tolerance")
	}
	ok, wait := b.take(t0.Add(150 * time.Millisecond))
	if ok || wait != 50*time.Millisecond {
		t.Fatalf("take at +150ms = %v, %s; want refused, 50ms to wait", ok, wait)
	}
	if ok, _ := b.take(t0.Add(185 * time.Millisecond)); !ok {
		t.Fatal("a request 15ms early was refused despite 20ms tolerance")
	}
	if got := wholeSeconds(wait); got != time.Second {
		t.Fatalf("wholeSeconds(%s) = %s, want 1s", wait, got)
	}
	for _, tc := range []struct{ in, want time.Duration }{{0, time.Second}, {time.Second, time.Second}, {1001 * time.Millisecond, 2 * time.Second}} {
		if got := wholeSeconds(tc.in); got != tc.want {
			t.Errorf("wholeSeconds(%s) = %s, want %s", tc.in, got, tc.want)
		}
	}
}

func TestRequestLog(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{RequestLogSize: 4})
	e.fake.AddProject("p")
	e.do(http.MethodGet, "/projects/p/devices?page=1&per_page=100", nil).want(t, http.StatusOK)
	e.do(http.MethodGet, "/nope", nil).want(t, http.StatusNotFound)
	e.do(http.MethodPut, "/projects/p/devices", nil).want(t, http.StatusMethodNotAllowed)
	if _, err := e.send(t.Context(), "bad", http.MethodGet, "/devices/x", nil); err != nil {
		t.Fatal(err)
	}
	type entry struct {
		Seq            int
		Method, Path   string
		Query          string
		Status         int
		Fault          string
		TokenOK        bool
		HasAt, HasDone bool
	}
	var got []entry
	for _, r := range e.fake.Requests() {
		got = append(got, entry{r.Seq, r.Method, r.Path, r.Query, r.Status, r.Fault, r.TokenOK, !r.At.IsZero(), !r.Done.Before(r.At)})
	}
	want := []entry{
		{1, "GET", PathPrefix + "/projects/p/devices", "page=1&per_page=100", 200, "", true, true, true},
		{2, "GET", PathPrefix + "/nope", "", 404, "", true, true, true},
		{3, "PUT", PathPrefix + "/projects/p/devices", "", 405, "", true, true, true},
		{4, "GET", PathPrefix + "/devices/x", "", 401, "", false, true, true},
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("Requests() =\n%+v\nwant\n%+v", got, want)
	}
	// The log keeps the latest RequestLogSize requests.
	for range 5 {
		e.do(http.MethodGet, "/projects/p/devices", nil)
	}
	if reqs := e.fake.Requests(); len(reqs) != 4 || reqs[0].Seq != 6 || reqs[3].Seq != 9 {
		t.Fatalf("after 9 requests the log holds %d, from %d", len(reqs), reqs[0].Seq)
	}
	if dump := fmt.Sprintf("%+v %q", e.fake.Requests(), e.fake.Check()); strings.Contains(dump, testToken) {
		t.Fatalf("the token appears in the request log or Check")
	}
}

// TestConcurrentPoliteClient is the situation of SPEC §8 R4: four workers
// share one limiter at the account's budget and one pause that every 429
// extends, while some requests get a 429 or a 5xx. Requests already in
// flight when a 429 comes are refused too, but Check must find nothing: the
// client did all it could. It runs on virtual time (testing/synctest) over
// in-memory connections: on the real clock a loaded machine delays a
// request past the fake's tolerance and the test would judge the scheduler,
// not the client.
func TestConcurrentPoliteClient(t *testing.T) {
	t.Parallel()
	synctest.Test(t, testConcurrentPoliteClient)
}

func testConcurrentPoliteClient(t *testing.T) {
	e := newPipeEnv(t, Config{
		Budget: 40, Burst: 4, Seed: 3,
		Faults: Faults{Rate: 0.08, TooManyRequests: 1, ServerError: 2},
	})
	e.fake.AddProject("p")
	ctx := t.Context()
	lim := rate.NewLimiter(40, 4)
	var (
		mu         sync.Mutex
		pauseUntil time.Time
		limited    int
	)
	pause := func() time.Duration {
		mu.Lock()
		defer mu.Unlock()
		return time.Until(pauseUntil)
	}
	jobs := make(chan int)
	var wg sync.WaitGroup
	errs := make(chan error, 40)
	for range 4 {
		wg.Go(func() {
			for job := range jobs {
				for attempt := 1; ; attempt++ {
					if attempt > 50 { // a client that ignores 429s may never get through
						errs <- fmt.Errorf("job %d: no answer but 429 or 5xx in 50 attempts", job)
						break
					}
					if d := pause(); d > 0 {
						select {
						case <-time.After(d):
						case <-ctx.Done():
							return
						}
					}
					if err := lim.Wait(ctx); err != nil {
						return
					}
					if pause() > 0 { // a 429 came while we waited for a token
						continue
					}
					r, err := e.send(ctx, testToken, http.MethodGet, "/projects/p/devices", nil)
					if err != nil {
						errs <- err
						return
					}
					if r.status == http.StatusTooManyRequests {
						secs, _ := strconv.Atoi(r.header.Get("Retry-After"))
						mu.Lock()
						limited++
						if until := time.Now().Add(time.Duration(secs) * time.Second); until.After(pauseUntil) {
							pauseUntil = until
						}
						mu.Unlock()
						continue
					}
					if r.status == http.StatusOK {
						break
					}
				}
			}
		})
	}
	for i := range 40 {
		jobs <- i
	}
	close(jobs)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if limited == 0 {
		t.Fatalf("no 429 in 40 requests; pick another seed")
	}
	if v := e.fake.Check(); len(v) != 0 {
		t.Fatalf("Check() = %q, want nothing for a polite client", v)
	}
	t.Logf("%d requests, %d answered 429", len(e.fake.Requests()), limited)
}
