package metal

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"
)

const (
	// backoffBase and backoffMax shape the wait before repeating a request
	// after a transient failure: 250ms doubling up to 10s, each with equal
	// jitter (half fixed, half random), so that callers failing together do
	// not retry together and every wait is at least half its nominal value.
	backoffBase = 250 * time.Millisecond
	backoffMax  = 10 * time.Second

	// maxRateLimitWait caps how long one 429 blocks the client, so a bogus
	// Retry-After cannot stop every control loop for days. Should the API
	// really mean longer, its next 429 says so again.
	maxRateLimitWait = 10 * time.Minute

	// maxBodyBytes bounds a response body. A page of MaxPerPage devices is a
	// few MB; more is a broken or hostile server.
	maxBodyBytes = 64 << 20

	// maxListObjects bounds one listing, far above any real project, so
	// that a server whose page links never end, and which does not say how
	// long its listing is, cannot keep a caller listing forever: at the
	// default page size it is 100,000 pages. A listing whose API reports
	// its length is bounded by that length (listAll).
	maxListObjects = 10_000_000

	userAgent = "shepherd-metal/1"
)

// Budget is an API account's request budget: every request of a Client
// waits for it. Wait returns when a request may be sent, or an error if
// ctx ends first or its deadline would pass while waiting. Pause holds every
// request of the account's users until d from now: the API answered 429
// with Retry-After d. A budget shared by several processes (Config.
// SharedBudget) makes the pause theirs too; the Client pauses itself in any
// case.
type Budget interface {
	Wait(ctx context.Context) error
	Pause(ctx context.Context, d time.Duration) error
}

// localBudget is the budget of an account only this process uses: a token
// bucket in memory. The Client's own pause is all the pause it needs.
type localBudget struct{ *rate.Limiter }

func (localBudget) Pause(context.Context, time.Duration) error { return nil }

// Client speaks to the Equinix Metal API on behalf of one account. It is
// safe for concurrent use, and meant to be shared: the account's request
// budget, its concurrency bound and any 429 pause apply to all its callers.
type Client struct {
	cfg     Config  // with defaults; Token cleared
	token   *secret // a pointer, so that printing a Client value by reflection shows an address
	base    *url.URL
	http    *http.Client
	budget  Budget
	slots   chan struct{} // one token per request in flight
	pause   pause
	metrics *metrics
	log     *slog.Logger

	// Test knobs, set only by tests before the first call.
	backoffBase, backoffMax time.Duration
	maxPages                int // maxListObjects in pages of cfg.PerPage
}

// New returns a client for the account cfg.Token belongs to. It sends no
// request.
func New(cfg Config) (*Client, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults() // a copy; the caller's value is untouched
	base, err := url.Parse(cfg.BaseURL)
	if err != nil {
		return nil, errors.New("metal: BaseURL is not a valid URL") // Validate checked it already
	}
	m, err := newMetrics(cfg.Registerer)
	if err != nil {
		return nil, err
	}
	budget := Budget(localBudget{rate.NewLimiter(rate.Limit(cfg.RequestsPerSecond), cfg.Burst)})
	if cfg.SharedBudget != nil {
		if budget, err = cfg.SharedBudget(cfg.Account(), cfg.RequestsPerSecond, cfg.Burst); err != nil {
			return nil, fmt.Errorf("metal: the shared request budget: %w", err)
		}
	}
	c := &Client{
		token:       newSecret(cfg.Token),
		base:        base,
		budget:      budget,
		slots:       make(chan struct{}, cfg.MaxConcurrency),
		metrics:     m,
		log:         cfg.Logger,
		backoffBase: backoffBase,
		backoffMax:  backoffMax,
		maxPages:    (maxListObjects + cfg.PerPage - 1) / cfg.PerPage,
	}
	if c.log == nil {
		c.log = slog.New(slog.DiscardHandler)
	}
	c.log = c.log.With(slog.String("component", "metal"))

	var hc http.Client
	if cfg.HTTPClient != nil {
		hc = *cfg.HTTPClient // a shallow copy: the caller's client keeps its redirect policy
	} else {
		hc.Transport = defaultTransport(cfg.MaxConcurrency)
	}
	// Following a redirect would send the token to wherever it points.
	hc.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	c.http = &hc

	cfg.Token = ""
	cfg.HTTPClient, cfg.Registerer, cfg.Logger, cfg.SharedBudget = nil, nil, nil, nil
	c.cfg = cfg
	return c, nil
}

func defaultTransport(maxConns int) *http.Transport {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.DialContext = (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext
	t.TLSHandshakeTimeout = 10 * time.Second
	t.ExpectContinueTimeout = time.Second
	t.IdleConnTimeout = 90 * time.Second
	t.MaxIdleConnsPerHost = maxConns
	return t
}

// CloseIdleConnections closes the idle keep-alive connections of the
// client's transport and so ends their goroutines; call it when done with
// the client. The client stays usable.
func (c *Client) CloseIdleConnections() { c.http.CloseIdleConnections() }

// String describes the client without its token.
func (c *Client) String() string {
	return fmt.Sprintf("metal.Client{BaseURL:%q Token:%s}", c.cfg.BaseURL, redacted)
}

// Format prints String for every verb, so no verb reaches the token
// through reflection.
func (c *Client) Format(f fmt.State, _ rune) { _, _ = io.WriteString(f, c.String()) }

// LogValue logs the client without its token.
func (c *Client) LogValue() slog.Value { return slog.StringValue(c.String()) }

// pause is the client-wide "send nothing before" time set by a 429.
type pause struct {
	mu    sync.Mutex
	until time.Time
}

// extend moves the pause's end to t unless it already ends later.
func (p *pause) extend(t time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if t.After(p.until) {
		p.until = t
	}
}

func (p *pause) end() time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.until
}

// wait returns once the pause has ended, or an error if ctx ends first or
// the pause outlasts ctx's deadline (then waiting is pointless).
func (p *pause) wait(ctx context.Context) error {
	for {
		until := p.end()
		d := time.Until(until)
		if d <= 0 {
			return nil
		}
		if dl, ok := ctx.Deadline(); ok && until.After(dl) {
			return fmt.Errorf("%w by the API until %s, past the call's deadline", ErrRateLimited, until.Format(time.RFC3339))
		}
		if err := sleep(ctx, d); err != nil {
			return err
		}
		// Another 429 may have extended the pause meanwhile: look again.
	}
}

// sleep waits for d or until ctx ends.
func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return context.Cause(ctx)
	case <-t.C:
		return nil
	}
}

// backoff returns the jittered wait before the n-th repetition (n >= 1)
// after a transient failure.
func (c *Client) backoff(n int) time.Duration {
	d := c.backoffMax
	if n < 32 {
		d = min(c.backoffBase<<(n-1), c.backoffMax)
	}
	half := d / 2
	return half + rand.N(half+1)
}

// waitBackoff sleeps the n-th backoff, or returns an error at once if ctx's
// deadline would pass during it.
func (c *Client) waitBackoff(ctx context.Context, n int) error {
	d := c.backoff(n)
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < d {
		return errors.New("the call's deadline would pass before the next attempt")
	}
	return sleep(ctx, d)
}

// request is one API call: a method on a path, and what the attempts
// found out.
type request struct {
	method   string
	endpoint string // path template, for metrics and logs
	path     string // path below the base URL, escaped, with any query
	body     []byte // nil: none
	// repeatable says that sending the request again after an ambiguous
	// failure is harmless. A request that is not gets ErrOutcomeUnknown
	// after one, and its caller decides.
	repeatable bool

	// ambiguous is set once an attempt failed after the server may have
	// acted on the request.
	ambiguous bool
}

// outcome classifies one attempt.
type outcome int

const (
	done      outcome = iota // 2xx, decoded
	final                    // an answer or error that retrying cannot change
	transient                // network error, attempt timeout, 408, 5xx: retry after a backoff
	limited                  // 429: retry after the client-wide pause
	unsent                   // the call ended, or would, before the request could be sent
)

// do sends r until it succeeds, fails for good, or its deadline passes,
// and decodes a 2xx answer's body into out unless out is nil.
func (c *Client) do(ctx context.Context, r *request, out any) error {
	ctx, cancel := context.WithTimeout(ctx, c.cfg.RetryDeadline)
	defer cancel()
	var last error           // the last failed attempt's error
	failures, limits := 0, 0 // transient failures and 429s so far
	for attempt := 1; ; attempt++ {
		if attempt > 1 {
			c.metrics.retries.WithLabelValues(r.endpoint).Inc()
		}
		oc, wait, err := c.attempt(ctx, r, out)
		switch oc {
		case done:
			return nil
		case final:
			return err
		case unsent:
			if last == nil {
				return err
			}
			return fmt.Errorf("%w (giving up after %d attempts; last error: %w)", err, attempt-1, last)
		case limited:
			last = err
			limits++
			if wait < 0 { // the answer did not say
				wait = time.Second
			}
			// Never less than the backoff, so that a server answering 429
			// with Retry-After: 0 again and again is not hammered.
			wait = max(wait, c.backoff(limits))
			until := time.Now().Add(wait)
			c.pause.extend(until)
			if perr := c.budget.Pause(ctx, wait); perr != nil {
				// This process pauses all the same; only other processes
				// may not learn of the 429.
				c.log.WarnContext(ctx, "metal: telling the shared request budget of a 429 failed", slog.Any("err", perr))
			}
			c.log.DebugContext(ctx, "metal request rate limited, pausing the client",
				slog.String("method", r.method), slog.String("endpoint", r.endpoint), slog.String("path", r.path),
				slog.Int("attempt", attempt), slog.Duration("wait", time.Until(until)))
			if dl, ok := ctx.Deadline(); ok && c.pause.end().After(dl) {
				// Waiting cannot help: the call would end before the pause.
				return fmt.Errorf("%w (the client is paused until %s, past the call's deadline)",
					err, c.pause.end().Format(time.RFC3339))
			}
		case transient:
			if !r.repeatable && r.ambiguous {
				return fmt.Errorf("%w: %w", ErrOutcomeUnknown, err)
			}
			if ctx.Err() != nil {
				// The call's end cut this attempt short; the one before
				// says more about why we are still trying.
				if last == nil {
					return err
				}
				return fmt.Errorf("metal: %s %s: giving up after %d attempts: %w (last error: %w)",
					r.method, r.path, attempt, context.Cause(ctx), last)
			}
			last = err
			failures++
			c.log.DebugContext(ctx, "metal request failed, retrying",
				slog.String("method", r.method), slog.String("endpoint", r.endpoint), slog.String("path", r.path),
				slog.Int("attempt", attempt), slog.Any("err", err))
			if werr := c.waitBackoff(ctx, failures); werr != nil {
				return fmt.Errorf("%w (giving up after %d attempts: %w)", err, attempt, werr)
			}
		}
	}
}

// attempt sends r once. For limited it also returns how long the answer
// asks us to pause, or -1 if it did not say.
func (c *Client) attempt(ctx context.Context, r *request, out any) (outcome, time.Duration, error) {
	// Take a slot first and a budget token last, right before sending, so
	// requests queued for a slot cannot hoard tokens and then go out in a
	// burst larger than the bucket allows.
	select {
	case c.slots <- struct{}{}:
	case <-ctx.Done():
		return unsent, 0, fmt.Errorf("metal: %s %s: waiting for a request slot: %w", r.method, r.path, context.Cause(ctx))
	}
	defer func() { <-c.slots }()
	for {
		if err := c.pause.wait(ctx); err != nil {
			return unsent, 0, fmt.Errorf("metal: %s %s: %w", r.method, r.path, err)
		}
		// Wait fails at once if the wait would outlast ctx's deadline.
		if err := c.budget.Wait(ctx); err != nil {
			return unsent, 0, fmt.Errorf("metal: %s %s: waiting for the request budget: %w", r.method, r.path, err)
		}
		if !time.Now().Before(c.pause.end()) {
			break
		}
		// A 429 arrived while we waited for the budget: wait for it too.
	}

	actx, cancel := context.WithTimeout(ctx, c.cfg.CallTimeout)
	defer cancel()
	// Until the request's headers are written, a failure certainly left
	// the server untouched (no connection, the call ended while waiting
	// for one), and even a create may be sent again.
	var wrote atomic.Bool
	actx = httptrace.WithClientTrace(actx, &httptrace.ClientTrace{WroteHeaders: func() { wrote.Store(true) }})
	var body io.Reader
	if r.body != nil {
		body = bytes.NewReader(r.body)
	}
	req, err := http.NewRequestWithContext(actx, r.method, c.cfg.BaseURL+r.path, body)
	if err != nil {
		return final, 0, fmt.Errorf("metal: %s %s: building request: %w", r.method, r.path, err)
	}
	req.Header.Set("X-Auth-Token", string(*c.token))
	req.Header.Set("Accept", "application/json")
	req.Header.Set("User-Agent", userAgent)
	if r.body != nil {
		req.Header.Set("Content-Type", "application/json")
	}

	start := time.Now()
	resp, err := c.http.Do(req)
	if err != nil {
		c.observe(r, statusError, start)
		if wrote.Load() {
			r.ambiguous = true // the request may have reached the server
		}
		return transient, 0, fmt.Errorf("metal: %s %s: %w", r.method, r.path, c.transportError(ctx, actx, err))
	}
	data, rerr := io.ReadAll(io.LimitReader(resp.Body, maxBodyBytes+1))
	_ = resp.Body.Close()
	c.observe(r, strconv.Itoa(resp.StatusCode), start)

	switch code := resp.StatusCode; {
	case code == http.StatusTooManyRequests:
		c.metrics.rateLimited.Inc()
		return limited, rateLimitWait(resp.Header, time.Now()), &APIError{
			Method: r.method, Path: r.path, Status: code, Messages: c.messages(data)}
	case rerr != nil:
		r.ambiguous = true
		return transient, 0, fmt.Errorf("metal: %s %s: reading the %d answer: %w", r.method, r.path, code,
			c.transportError(ctx, actx, rerr))
	case code >= 200 && code < 300:
		if len(data) > maxBodyBytes {
			return final, 0, fmt.Errorf("metal: %s %s: answer larger than %d bytes", r.method, r.path, maxBodyBytes)
		}
		if out == nil {
			return done, 0, nil
		}
		if err := decodeAnswer(data, out); err != nil {
			err = fmt.Errorf("metal: %s %s: decoding the %d answer: %w", r.method, r.path, code, err)
			if !r.repeatable {
				// The server acted, but we cannot tell on what.
				r.ambiguous = true
				return transient, 0, err
			}
			return final, 0, err
		}
		return done, 0, nil
	}
	apiErr := &APIError{Method: r.method, Path: r.path, Status: resp.StatusCode, Messages: c.messages(data)}
	if resp.StatusCode >= 500 || resp.StatusCode == http.StatusRequestTimeout {
		r.ambiguous = r.ambiguous || resp.StatusCode >= 500
		return transient, 0, apiErr
	}
	return final, 0, apiErr
}

// object is an API object, which the API always names by its id.
type object interface{ objectID() string }

func (d *Device) objectID() string              { return d.ID }
func (r *HardwareReservation) objectID() string { return r.ID }
func (k *SSHKey) objectID() string              { return k.ID }

// decodeAnswer decodes a 2xx answer's body into out. An answer that should
// hold an object must name it: an empty body, null or {} would otherwise
// decode to a zero object, a device or reservation without an id that a
// caller would take for the API's answer.
func decodeAnswer(data []byte, out any) error {
	if err := json.Unmarshal(data, out); err != nil {
		return err
	}
	if o, ok := out.(object); ok && o.objectID() == "" {
		return errors.New("the answer names no object (it has no id)")
	}
	return nil
}

// transportError drops the URL net/http puts in its errors (it says
// nothing our message does not) and says whether the call (ctx) or the
// attempt (actx) ended.
func (c *Client) transportError(ctx, actx context.Context, err error) error {
	if ue, ok := errors.AsType[*url.Error](err); ok {
		err = ue.Err
	}
	switch {
	case ctx.Err() != nil:
		return fmt.Errorf("the call ended: %w", err)
	case errors.Is(actx.Err(), context.DeadlineExceeded):
		return fmt.Errorf("attempt timed out after %s: %w", c.cfg.CallTimeout, err)
	}
	return err
}

func (c *Client) observe(r *request, status string, start time.Time) {
	c.metrics.requests.WithLabelValues(r.endpoint, r.method, status).Inc()
	c.metrics.duration.WithLabelValues(r.endpoint).Observe(time.Since(start).Seconds())
}

// An error answer's messages end up in logs, errors and history causes, so
// they are bounded: at most maxMessages of them, each at most maxExcerpt
// bytes (then "..."), and a count of those left out.
const (
	maxMessages = 5
	maxExcerpt  = 200
)

// messages extracts the API's error messages from an error body, or a
// short excerpt of a body that is not the API's JSON (a proxy's HTML
// page), scrubbed of the token in case a server echoes it.
func (c *Client) messages(body []byte) []string {
	var e struct {
		Errors []string `json:"errors"`
		Error  string   `json:"error"`
	}
	var msgs []string
	if json.Unmarshal(body, &e) == nil {
		msgs = e.Errors
		if e.Error != "" {
			msgs = append(msgs, e.Error)
		}
	} else if s := strings.TrimSpace(string(body)); s != "" {
		msgs = []string{s}
	}
	var out []string
	for i, m := range msgs {
		if i == maxMessages {
			out = append(out, fmt.Sprintf("(%d more)", len(msgs)-maxMessages))
			break
		}
		m = c.token.scrub(m) // before cutting, which could leave a part of the token
		if len(m) > maxExcerpt {
			m = strings.ToValidUTF8(m[:maxExcerpt], "") + "..."
		}
		out = append(out, m)
	}
	return out
}

// rateLimitWait is how long a 429 answer asks us to wait: the later of
// Retry-After (seconds or an HTTP date) and X-RateLimit-Reset (seconds
// until the window resets), at most maxRateLimitWait; -1 if it has
// neither.
func rateLimitWait(h http.Header, now time.Time) time.Duration {
	wait := time.Duration(-1)
	if v := strings.TrimSpace(h.Get("Retry-After")); v != "" {
		if d, ok := parseSeconds(v); ok {
			wait = d
		} else if t, err := http.ParseTime(v); err == nil {
			wait = max(t.Sub(now), 0)
		}
	}
	if v := strings.TrimSpace(h.Get("X-RateLimit-Reset")); v != "" {
		if d, ok := parseSeconds(v); ok {
			wait = max(wait, d)
		}
	}
	return min(wait, maxRateLimitWait)
}

// parseSeconds parses a non-negative number of seconds; fractions are
// accepted in case a server sends them.
func parseSeconds(s string) (time.Duration, bool) {
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsNaN(f) || f < 0 {
		return 0, false
	}
	if f >= maxRateLimitWait.Seconds() {
		return maxRateLimitWait, true
	}
	return time.Duration(f * float64(time.Second)), true
}
