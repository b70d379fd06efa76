package metal

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
)

// failTimes answers the first n requests for path with status, then lets
// the API answer.
func failTimes(n int, status int, path string) func(http.ResponseWriter, *http.Request) bool {
	var mu sync.Mutex
	left := n
	return func(w http.ResponseWriter, r *http.Request) bool {
		if r.URL.Path != "/metal/v1"+path {
			return false
		}
		mu.Lock()
		defer mu.Unlock()
		if left == 0 {
			return false
		}
		left--
		writeJSON(w, status, errorBody("injected "+http.StatusText(status)))
		return true
	}
}

func TestServerErrorRetriedThenSuccess(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	id := f.addDevice(testProject, "d1", "")
	f.setIntercept(failTimes(2, http.StatusServiceUnavailable, "/devices/"+id))
	c, reg := newTestClient(t, f.baseURL(), nil)

	d, err := c.GetDevice(t.Context(), id)
	if err != nil {
		t.Fatalf("GetDevice: %v", err)
	}
	if d.ID != id {
		t.Errorf("GetDevice returned %q, want %q", d.ID, id)
	}
	if n := len(f.requests(http.MethodGet, "/devices/"+id)); n != 3 {
		t.Errorf("server saw %d requests, want 3 (two 503s, one success)", n)
	}
	if got := metricValue(t, reg, "shepherd_metal_retries_total", map[string]string{"endpoint": epDevice}); got != 2 {
		t.Errorf("retries_total = %v, want 2", got)
	}
	if got := metricValue(t, reg, "shepherd_metal_requests_total",
		map[string]string{"endpoint": epDevice, "method": "GET", "status": "503"}); got != 2 {
		t.Errorf("requests_total{status=503} = %v, want 2", got)
	}
	if got := metricValue(t, reg, "shepherd_metal_request_duration_seconds", map[string]string{"endpoint": epDevice}); got != 3 {
		t.Errorf("request_duration_seconds count = %v, want 3", got)
	}
}

// TestServerErrorBacksOffUntilDeadline runs the client's real backoff
// schedule on the bubble's virtual clock: after the n-th failure it waits
// between half and all of min(250ms<<(n-1), 10s), and it gives up, without
// sleeping, as soon as the next wait would pass RetryDeadline.
func TestServerErrorBacksOffUntilDeadline(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		f := newMemFake(t)
		f.setIntercept(failTimes(1<<30, http.StatusBadGateway, "/devices/x"))
		const deadline = time.Minute
		c, _ := f.client(t, func(c *Config) { c.RetryDeadline = deadline })
		c.backoffBase, c.backoffMax = backoffBase, backoffMax

		start := time.Now()
		_, err := c.GetDevice(t.Context(), "x")
		took := time.Since(start)
		if err == nil {
			t.Fatal("GetDevice succeeded against a server that always fails")
		}
		if !hasStatus(err, http.StatusBadGateway) || IsPermanent(err) ||
			!strings.Contains(err.Error(), "the call's deadline would pass before the next attempt") {
			t.Errorf("error = %v, want the last 502 answer, not permanent, saying the deadline would pass", err)
		}
		hits := f.requests(http.MethodGet, "/devices/x")
		if len(hits) < 2 {
			t.Fatalf("server saw %d requests, want retries", len(hits))
		}
		if at := hits[0].at.Sub(start); at != 0 {
			t.Errorf("first attempt %s after the call, want at once", at)
		}
		for i := 1; i < len(hits); i++ {
			nominal := min(backoffBase<<(i-1), backoffMax)
			if gap := hits[i].at.Sub(hits[i-1].at); gap < nominal/2 || gap > nominal {
				t.Errorf("attempt %d came %s after attempt %d, want the backoff of [%s, %s]", i+1, gap, i, nominal/2, nominal)
			}
		}
		if last := hits[len(hits)-1].at.Sub(start); took != last {
			t.Errorf("GetDevice returned %s after the call, the last attempt was at %s: want it to give up at once", took, last)
		}
		if next := min(backoffBase<<(len(hits)-1), backoffMax); took > deadline || deadline-took >= next {
			t.Errorf("gave up %s after the call with a %s RetryDeadline; the next backoff (at most %s) still fit",
				took, deadline, next)
		}
		t.Logf("%d attempts in %s", len(hits), took)
	})
}

func TestPermanentErrorsNotRetried(t *testing.T) {
	t.Parallel()
	for _, status := range []int{400, 401, 403, 404, 422, 409} {
		t.Run(fmt.Sprint(status), func(t *testing.T) {
			t.Parallel()
			f := newFake(t)
			f.setIntercept(failTimes(1<<30, status, "/devices/x"))
			c, reg := newTestClient(t, f.baseURL(), nil)

			_, err := c.GetDevice(t.Context(), "x")
			var ae *APIError
			if !errors.As(err, &ae) || ae.Status != status || ae.Method != "GET" || ae.Path != "/devices/x" {
				t.Fatalf("GetDevice error = %#v, want an *APIError GET /devices/x %d", err, status)
			}
			if want := []string{"injected " + http.StatusText(status)}; !slices.Equal(ae.Messages, want) {
				t.Errorf("Messages = %q, want %q", ae.Messages, want)
			}
			if want := fmt.Sprintf("metal: GET /devices/x: %d %s: injected", status, http.StatusText(status)); !strings.HasPrefix(err.Error(), want) {
				t.Errorf("Error() = %q, want it to start with %q", err, want)
			}
			if got, want := errors.Is(err, ErrNotFound), status == 404; got != want {
				t.Errorf("errors.Is(err, ErrNotFound) = %v, want %v", got, want)
			}
			if got, want := IsPermanent(err), status != 409; got != want {
				t.Errorf("IsPermanent = %v, want %v", got, want)
			}
			if n := len(f.requests(http.MethodGet, "/devices/x")); n != 1 {
				t.Errorf("server saw %d requests, want 1: %d is not retried", n, status)
			}
			if got := metricValue(t, reg, "shepherd_metal_retries_total", nil); got != 0 {
				t.Errorf("retries_total = %v, want 0", got)
			}
		})
	}
}

// TestAttemptTimeoutRetried: an attempt the server never answers ends
// after exactly CallTimeout, and the next goes out one backoff later.
func TestAttemptTimeoutRetried(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		f := newMemFake(t)
		id := f.addDevice(testProject, "d1", "")
		var calls atomic.Int32
		f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
			if calls.Add(1) > 1 {
				return false
			}
			<-r.Context().Done() // hang until the client gives up on the attempt
			return true
		})
		const callTimeout = 30 * time.Second
		c, reg := f.client(t, func(c *Config) { c.CallTimeout, c.RetryDeadline = callTimeout, time.Minute })
		c.backoffBase, c.backoffMax = backoffBase, backoffMax

		start := time.Now()
		if _, err := c.GetDevice(t.Context(), id); err != nil {
			t.Fatalf("GetDevice: %v", err)
		}
		if n := calls.Load(); n != 2 {
			t.Errorf("server saw %d requests, want 2 (one timed out)", n)
		}
		hits := f.requests(http.MethodGet, "/devices/"+id)
		if len(hits) != 2 {
			t.Fatalf("server saw %d requests, want 2", len(hits))
		}
		if at := hits[1].at.Sub(start); at < callTimeout+backoffBase/2 || at > callTimeout+backoffBase {
			t.Errorf("second attempt %s after the call, want CallTimeout (%s) plus the first backoff [%s, %s]",
				at, callTimeout, backoffBase/2, backoffBase)
		}
		if got := metricValue(t, reg, "shepherd_metal_requests_total", map[string]string{"status": statusError}); got != 1 {
			t.Errorf("requests_total{status=error} = %v, want 1", got)
		}
	})
}

func TestContextCanceledStopsRetries(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	var calls atomic.Int32
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		if calls.Add(1) == 2 {
			cancel()
		}
		writeJSON(w, http.StatusInternalServerError, errorBody("broken"))
		return true
	})
	c, _ := newTestClient(t, f.baseURL(), nil)
	_, err := c.GetDevice(ctx, "x")
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("GetDevice error = %v, want context.Canceled", err)
	}
}

// TestRateLimitPausesEveryCaller has one caller get a 429 with
// Retry-After: 3, then starts more callers while it waits, and checks that
// every request after the 429, that caller's and theirs, reaches the
// server exactly when the pause ends, and succeeds.
func TestRateLimitPausesEveryCaller(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		f := newMemFake(t)
		id := f.addDevice(testProject, "d1", "")
		var limited atomic.Bool
		f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
			if limited.Swap(true) {
				return false
			}
			w.Header().Set("Retry-After", "3")
			w.Header().Set("X-RateLimit-Remaining", "0")
			writeJSON(w, http.StatusTooManyRequests, errorBody("rate limited"))
			return true
		})
		c, reg := f.client(t, nil)
		c.backoffBase, c.backoffMax = backoffBase, backoffMax // below Retry-After: the pause is the 3s asked for

		start := time.Now()
		var wg sync.WaitGroup
		errs := make(chan error, 10)
		wg.Go(func() {
			_, err := c.GetDevice(t.Context(), id)
			errs <- err
		})
		synctest.Wait() // the first caller got its 429 and waits
		if got := metricValue(t, reg, "shepherd_metal_rate_limited_total", nil); got != 1 {
			t.Fatalf("rate_limited_total = %v after the first call waits, want 1", got)
		}
		time.Sleep(time.Second) // the others come in the middle of the pause
		for i := range 6 {
			wg.Go(func() {
				var err error
				if i%2 == 0 {
					_, err = c.ListDevices(t.Context(), testProject)
				} else {
					_, err = c.GetDevice(t.Context(), id)
				}
				errs <- err
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Errorf("call failed: %v", err)
			}
		}
		hits := f.allHits()
		if len(hits) != 8 {
			t.Errorf("server saw %d requests, want 8 (the 429 and 7 successes)", len(hits))
		}
		for i, h := range hits {
			want := 3 * time.Second
			if i == 0 {
				want = 0
			}
			if at := h.at.Sub(start); at != want {
				t.Errorf("request %d (%s %s) arrived %s after the first, want %s", i, h.method, h.path, at, want)
			}
		}
	})
}

// TestRateLimitWithoutDeadlineRoom: a 429 asking for a pause past the
// call's deadline fails the call at once, and the calls that follow
// during the pause, without a request.
func TestRateLimitWithoutDeadlineRoom(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		f := newMemFake(t)
		f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
			w.Header().Set("Retry-After", "60")
			writeJSON(w, http.StatusTooManyRequests, errorBody("slow down"))
			return true
		})
		c, _ := f.client(t, func(c *Config) { c.RetryDeadline = time.Second })
		start := time.Now()
		_, err := c.GetDevice(t.Context(), "x")
		if !hasStatus(err, http.StatusTooManyRequests) || !errors.Is(err, ErrRateLimited) ||
			!strings.Contains(err.Error(), "past the call's deadline") {
			t.Fatalf("GetDevice error = %v, want the 429, paused past the deadline", err)
		}
		if took := time.Since(start); took != 0 {
			t.Errorf("GetDevice took %s to find that it cannot wait 60s within 1s, want no time", took)
		}
		// The pause holds for other callers too: they fail at once, unsent.
		time.Sleep(30 * time.Second)
		if _, err := c.GetDevice(t.Context(), "y"); !errors.Is(err, ErrRateLimited) {
			t.Errorf("GetDevice 30s later: error = %v, want ErrRateLimited", err)
		}
		if took := time.Since(start); took != 30*time.Second {
			t.Errorf("the second GetDevice returned %s after the first began, want 30s: at once", took)
		}
		if n := len(f.allHits()); n != 1 {
			t.Errorf("server saw %d requests, want 1", n)
		}
		// Once the pause is over, requests go out again.
		time.Sleep(30 * time.Second)
		if _, err := c.GetDevice(t.Context(), "z"); !hasStatus(err, http.StatusTooManyRequests) {
			t.Errorf("GetDevice after the pause: error = %v, want the server's next 429", err)
		}
		if n := len(f.allHits()); n != 2 {
			t.Errorf("server saw %d requests, want 2", n)
		}
	})
}

func TestRateLimitWait(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	tests := []struct {
		name    string
		headers map[string]string
		want    time.Duration
	}{
		{"none", nil, -1},
		{"seconds", map[string]string{"Retry-After": "3"}, 3 * time.Second},
		{"zero", map[string]string{"Retry-After": "0"}, 0},
		{"fraction", map[string]string{"Retry-After": "1.5"}, 1500 * time.Millisecond},
		{"http date", map[string]string{"Retry-After": now.Add(7 * time.Second).Format(http.TimeFormat)}, 7 * time.Second},
		{"past date", map[string]string{"Retry-After": now.Add(-time.Hour).Format(http.TimeFormat)}, 0},
		{"reset only", map[string]string{"X-RateLimit-Reset": "4"}, 4 * time.Second},
		{"later of both", map[string]string{"Retry-After": "2", "X-RateLimit-Reset": "5"}, 5 * time.Second},
		{"retry-after later", map[string]string{"Retry-After": "9", "X-RateLimit-Reset": "5"}, 9 * time.Second},
		{"capped", map[string]string{"Retry-After": "999999999"}, maxRateLimitWait},
		{"garbage", map[string]string{"Retry-After": "soon", "X-RateLimit-Reset": "-3"}, -1},
		{"NaN", map[string]string{"Retry-After": "NaN"}, -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			h := http.Header{}
			for k, v := range tt.headers {
				h.Set(k, v)
			}
			if got := rateLimitWait(h, now); got != tt.want {
				t.Errorf("rateLimitWait(%v) = %s, want %s", tt.headers, got, tt.want)
			}
		})
	}
}

// TestBudget checks on the server side that requests arrive exactly as
// fast as the token bucket allows: 20 per second, burst 1, so the one
// token at once and then one every 50ms.
func TestBudget(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		f := newMemFake(t)
		id := f.addDevice(testProject, "d1", "")
		c, _ := f.client(t, func(c *Config) { c.RequestsPerSecond, c.Burst = 20, 1 })

		const n = 10
		start := time.Now()
		var wg sync.WaitGroup
		for range n {
			wg.Go(func() {
				if _, err := c.GetDevice(t.Context(), id); err != nil {
					t.Errorf("GetDevice: %v", err)
				}
			})
		}
		wg.Wait()
		hits := f.allHits()
		if len(hits) != n {
			t.Fatalf("server saw %d requests, want %d", len(hits), n)
		}
		const interval = 50 * time.Millisecond
		for i, h := range hits {
			if d := h.at.Sub(start); d != time.Duration(i)*interval {
				t.Errorf("request %d arrived %s after the start, want %s", i, d, time.Duration(i)*interval)
			}
		}
	})
}

func TestConcurrencyBound(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	id := f.addDevice(testProject, "d1", "")
	const limit = 3
	var inFlight, most atomic.Int32
	release := make(chan struct{})
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		n := inFlight.Add(1)
		defer inFlight.Add(-1)
		for {
			m := most.Load()
			if n <= m || most.CompareAndSwap(m, n) {
				break
			}
		}
		<-release
		return false
	})
	c, _ := newTestClient(t, f.baseURL(), func(c *Config) { c.MaxConcurrency = limit })

	var wg sync.WaitGroup
	for range 10 {
		wg.Go(func() {
			if _, err := c.GetDevice(t.Context(), id); err != nil {
				t.Errorf("GetDevice: %v", err)
			}
		})
	}
	waitFor(t, 5*time.Second, "requests in flight reach the limit", func() bool { return inFlight.Load() == limit })
	close(release)
	wg.Wait()
	if got := most.Load(); got != limit {
		t.Errorf("at most %d requests were in flight, want %d", got, limit)
	}
	if n := len(f.allHits()); n != 10 {
		t.Errorf("server saw %d requests, want 10", n)
	}
}

func TestRedirectNotFollowed(t *testing.T) {
	t.Parallel()
	var elsewhere atomic.Int32
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		elsewhere.Add(1)
	}))
	t.Cleanup(other.Close)
	f := newFake(t)
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		http.Redirect(w, r, other.URL+"/steal", http.StatusFound)
		return true
	})
	c, _ := newTestClient(t, f.baseURL(), nil)
	_, err := c.GetDevice(t.Context(), "x")
	if !hasStatus(err, http.StatusFound) {
		t.Errorf("GetDevice error = %v, want the 302 as an APIError", err)
	}
	if n := elsewhere.Load(); n != 0 {
		t.Errorf("the redirect target got %d requests", n)
	}
}

func TestMetricsSharedRegisterer(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	id := f.addDevice(testProject, "d1", "")
	reg := prometheus.NewRegistry()
	for range 2 {
		c, _ := newTestClient(t, f.baseURL(), func(c *Config) { c.Registerer = reg })
		if _, err := c.GetDevice(t.Context(), id); err != nil {
			t.Fatal(err)
		}
	}
	if got := metricValue(t, reg, "shepherd_metal_requests_total",
		map[string]string{"endpoint": epDevice, "status": "200"}); got != 2 {
		t.Errorf("requests_total = %v, want 2 (both clients)", got)
	}
	// Every series exists before its first event.
	if got := metricValue(t, reg, "shepherd_metal_retries_total", map[string]string{"endpoint": epReservationMove}); got != 0 {
		t.Errorf("retries_total{move} = %v, want 0", got)
	}
	mfs, _ := reg.Gather()
	var names []string
	for _, mf := range mfs {
		names = append(names, mf.GetName())
	}
	for _, want := range []string{"shepherd_metal_requests_total", "shepherd_metal_request_duration_seconds",
		"shepherd_metal_rate_limited_total", "shepherd_metal_retries_total"} {
		if !slices.Contains(names, want) {
			t.Errorf("metric %s not registered; have %v", want, names)
		}
	}

	// A different collector under one of our names is an error, not a panic.
	clash := prometheus.NewRegistry()
	clash.MustRegister(prometheus.NewGauge(prometheus.GaugeOpts{Name: "shepherd_metal_rate_limited_total", Help: "x"}))
	if _, err := New(Config{Token: testToken, Registerer: clash}); err == nil {
		t.Error("New succeeded with a clashing metric")
	}
}

// TestTokenNeverLeaks runs failures of every kind with debug logging and
// checks errors, logs and metrics for the token, including a server that
// echoes it back.
func TestTokenNeverLeaks(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	var calls atomic.Int32
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		tok := r.Header.Get("X-Auth-Token")
		switch r.URL.Path {
		case "/metal/v1/devices/echo-json":
			writeJSON(w, http.StatusUnauthorized, errorBody("token "+tok+" is invalid", "really: "+tok))
		case "/metal/v1/devices/echo-html":
			w.WriteHeader(http.StatusBadGateway)
			fmt.Fprintf(w, "<html>%s upstream %s failed</html>", strings.Repeat("x", 180), tok)
		case "/metal/v1/devices/echo-429":
			if calls.Add(1) > 1 {
				return false
			}
			w.Header().Set("Retry-After", "0")
			writeJSON(w, http.StatusTooManyRequests, errorBody("slow down "+tok))
		case "/metal/v1/devices/hang":
			<-r.Context().Done()
		default:
			return false
		}
		return true
	})
	var logs syncBuffer
	reg := prometheus.NewRegistry()
	c, _ := newTestClient(t, f.baseURL(), func(c *Config) {
		c.Logger = slog.New(slog.NewJSONHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
		c.Registerer = reg
		c.CallTimeout = 200 * time.Millisecond
		c.RetryDeadline = 600 * time.Millisecond
	})
	var errs []error
	for _, id := range []string{"echo-json", "echo-html", "echo-429", "hang", "missing"} {
		_, err := c.GetDevice(t.Context(), id)
		errs = append(errs, err)
	}
	_, err := c.CreateDevice(t.Context(), testProject, CreateDeviceRequest{HardwareReservationID: "nope"}, "w")
	errs = append(errs, err)
	// A server that is gone: connection refused.
	c2, _ := newTestClient(t, "http://metal.invalid/metal/v1", func(c *Config) {
		c.HTTPClient = refusingClient()
		c.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
		c.RetryDeadline = 200 * time.Millisecond
	})
	_, err = c2.ListDevices(t.Context(), testProject)
	errs = append(errs, err)

	for i, err := range errs {
		if err == nil {
			t.Errorf("call %d succeeded, want an error", i)
			continue
		}
		t.Logf("error %d: %v", i, err)
		for _, s := range []string{err.Error(), fmt.Sprintf("%+v", err), fmt.Sprintf("%#v", err)} {
			if strings.Contains(s, testToken[:8]) {
				t.Errorf("error %d contains the token: %s", i, s)
			}
		}
	}
	if !strings.Contains(errs[0].Error(), "token REDACTED is invalid") {
		t.Errorf("echoed message = %v, want the token replaced by REDACTED", errs[0])
	}
	out := logs.String()
	if !strings.Contains(out, "retrying") {
		t.Errorf("no debug lines about retries were logged:\n%s", out)
	}
	if strings.Contains(out, testToken[:8]) {
		t.Errorf("the logs contain the token:\n%s", out)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if s := mf.String(); strings.Contains(s, testToken[:8]) {
			t.Errorf("metric contains the token: %s", s)
		}
	}
}

// TestUnsentRequestIsRetried: a POST that never reached the server
// (connection refused) is repeated, and its failure is not an open
// outcome.
func TestUnsentRequestIsRetried(t *testing.T) {
	t.Parallel()
	c, reg := newTestClient(t, "http://metal.invalid/metal/v1", func(c *Config) {
		c.HTTPClient = refusingClient()
		c.RetryDeadline = 200 * time.Millisecond
	})
	_, err := c.CreateSSHKey(t.Context(), testProject, label, key1)
	if err == nil || errors.Is(err, ErrOutcomeUnknown) {
		t.Fatalf("CreateSSHKey error = %v, want a connection error that is not ErrOutcomeUnknown", err)
	}
	if got := metricValue(t, reg, "shepherd_metal_requests_total",
		map[string]string{"endpoint": epProjectSSHKeys, "method": "POST", "status": statusError}); got < 2 {
		t.Errorf("requests_total{POST, error} = %v, want several attempts", got)
	}
}

// An error answer's messages reach logs, errors and history causes: a
// server that sends thousands of them, or one of megabytes, must not make an
// error of that size. At most maxMessages are kept, each cut to an excerpt,
// and the error says how many were left out.
func TestErrorMessagesBounded(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	msgs := make([]string, 1000)
	for i := range msgs {
		msgs[i] = fmt.Sprintf("message %d %s", i, strings.Repeat("é", 5000))
	}
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		writeJSON(w, http.StatusBadRequest, errorBody(msgs...))
		return true
	})
	c, _ := newTestClient(t, f.baseURL(), nil)
	_, err := c.GetDevice(t.Context(), "d1")
	var ae *APIError
	if !errors.As(err, &ae) {
		t.Fatalf("GetDevice: %v, want an *APIError", err)
	}
	if len(ae.Messages) != maxMessages+1 {
		t.Fatalf("%d messages kept, want %d and a count of the rest", len(ae.Messages), maxMessages+1)
	}
	for i, m := range ae.Messages[:maxMessages] {
		if !strings.HasPrefix(m, fmt.Sprintf("message %d ", i)) || len(m) > maxExcerpt+len("...") || !utf8.ValidString(m) {
			t.Errorf("message %d: %d bytes, valid UTF-8 %v: %.40q", i, len(m), utf8.ValidString(m), m)
		}
	}
	if last, want := ae.Messages[maxMessages], fmt.Sprintf("(%d more)", len(msgs)-maxMessages); last != want {
		t.Errorf("last message %q, want %q", last, want)
	}
	if n := len(err.Error()); n > 2000 {
		t.Errorf("error of %d bytes", n)
	}
}
