package fakemetal

import (
	"fmt"
	"math"
	"slices"
	"time"
)

// bucket is the account's token bucket: it holds up to burst tokens and
// gains rate tokens per second; each admitted request takes one.
type bucket struct {
	rate      float64
	burst     float64
	tolerance time.Duration
	tokens    float64 // may dip below 0 by tolerance*rate: requests admitted on slack
	last      time.Time
}

func newBucket(rate float64, burst int, tolerance time.Duration, now time.Time) *bucket {
	return &bucket{rate: rate, burst: float64(burst), tolerance: tolerance, tokens: float64(burst), last: now}
}

// maxWait bounds the waits the bucket computes, so that a tiny rate cannot
// overflow a time.Duration.
const maxWait = 24 * time.Hour

func (b *bucket) refill(now time.Time) {
	if now.After(b.last) {
		b.tokens = min(b.burst, b.tokens+now.Sub(b.last).Seconds()*b.rate)
		b.last = now
	}
}

// take admits a request arriving at now and takes its token, or says how
// long until a token would be there.
func (b *bucket) take(now time.Time) (ok bool, wait time.Duration) {
	b.refill(now)
	// The epsilon forgives float rounding: a token that is due exactly now
	// is there.
	if missing := 1 - b.tokens; missing > 1e-9 {
		wait = b.duration(missing)
		if wait > b.tolerance {
			return false, wait
		}
	}
	b.tokens--
	return true, 0
}

// duration is how long the bucket takes to gain n tokens.
func (b *bucket) duration(n float64) time.Duration {
	s := n / b.rate
	if s >= maxWait.Seconds() {
		return maxWait
	}
	return time.Duration(math.Ceil(s * float64(time.Second)))
}

// limitHeaders are the X-RateLimit-* values of an answer.
type limitHeaders struct {
	limit     int // the bucket's capacity
	remaining int // whole tokens left
	reset     int // seconds until the bucket is full again
}

func (b *bucket) headers(now time.Time) limitHeaders {
	b.refill(now)
	return limitHeaders{
		limit:     int(b.burst),
		remaining: max(0, int(math.Floor(b.tokens))),
		reset:     int(math.Ceil(b.duration(b.burst - b.tokens).Seconds())),
	}
}

// Request is one entry of the request log. It never holds the token.
type Request struct {
	Seq    int       // 1 for the first request the fake received
	At     time.Time // arrival, by Config.Clock
	Done   time.Time // when the answer was written or abandoned, by Config.Clock; zero while in flight
	Method string
	Path   string // URL path, without the query
	Query  string // raw query, e.g. "page=2&per_page=100"
	// Status is the status answered; 0 if none was: in flight, the
	// connection was closed (FaultLostCreate), or the client gave up.
	Status int
	// Fault is the fault the request got: "" or one of the Fault* constants.
	Fault      string
	TokenOK    bool          // the request carried the right token
	RetryAfter time.Duration // the Retry-After of a 429
}

// Requests returns the request log, oldest first (at most
// Config.RequestLogSize of the latest requests).
func (s *Server) Requests() []Request {
	s.mu.Lock()
	defer s.mu.Unlock()
	log := s.log
	if n := s.cfg.RequestLogSize; len(log) > n {
		log = log[len(log)-n:]
	}
	out := make([]Request, len(log))
	for i, r := range log {
		out[i] = Request{
			Seq: r.seq, At: r.at, Done: r.done, Method: r.method, Path: r.path, Query: r.query,
			Status: r.status, Fault: r.fault, TokenOK: r.tokenOK, RetryAfter: r.retryAfter,
		}
	}
	return out
}

// Check judges the client by the request log and returns one line per
// violation, empty if the client behaved:
//   - "over budget": the request arrived when the account's token bucket
//     was empty (beyond Config.Tolerance);
//   - "retry-after not honoured": the request arrived after a 429
//     (injected or over budget) and before its Retry-After had passed,
//     counted from the arrival of the 429's request. A request arriving
//     within Config.Tolerance of that is excused: it was in flight already.
//
// Requests with a bad token are not the account's and are never
// violations.
func (s *Server) Check() []string {
	s.mu.Lock()
	log := make([]record, len(s.log))
	for i, r := range s.log {
		log[i] = *r
	}
	tolerance := s.tolerance
	s.mu.Unlock()

	type window struct {
		seq        int
		start, end time.Time
		retryAfter time.Duration
	}
	var windows []window
	for _, r := range log {
		if r.tokenOK && r.retryAfter > 0 { // a 429; Retry-After counts from its arrival
			windows = append(windows, window{r.seq, r.at, r.at.Add(r.retryAfter), r.retryAfter})
		}
	}
	// Arrival times grow with seq (both are taken under s.mu), so a window
	// that ended before one request arrived ended before all later ones:
	// the sweep keeps only the windows still open, a handful.
	var violations []string
	var open []window
	next := 0
	for _, r := range log {
		// Windows of earlier requests only: a request that arrived before
		// the 429's own request cannot be a reaction to it.
		for ; next < len(windows) && windows[next].seq < r.seq; next++ {
			open = append(open, windows[next])
		}
		open = slices.DeleteFunc(open, func(w window) bool { return !r.at.Before(w.end) })
		if !r.tokenOK {
			continue
		}
		what := fmt.Sprintf("request %d (%s %s)", r.seq, r.method, r.path)
		reported := false
		for _, w := range open {
			if !r.at.Before(w.start.Add(tolerance)) {
				violations = append(violations, fmt.Sprintf(
					"%s: retry-after not honoured: arrived %s after request %d, answered 429 with Retry-After %s",
					what, r.at.Sub(w.start), w.seq, w.retryAfter))
				reported = true
				break
			}
		}
		if !reported && r.fault == FaultOverBudget && !r.inWindow {
			violations = append(violations, what+": over budget: the account's token bucket was empty")
		}
	}
	return violations
}
