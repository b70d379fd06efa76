// Package fakemetal is a fake of the Equinix Metal v1 API (SPEC §5.3): the
// subset of endpoints in the wire contract (notes/metal-wire.md), served
// under /metal/v1 by an http.Handler, with pagination, state transitions
// that take time, a per-account request budget and injectable faults (429
// with Retry-After, 5xx, timeouts, responses lost after a successful
// create). Tests run it behind an httptest.Server and talk to it over real
// HTTP; `shepherd dev --provider=equinix` runs it in-process.
//
// The fake is as strict as the real API where the real API is strict (401,
// 404, 422, 429) and a little stricter where that finds client bugs early:
// a request body with a field the wire contract does not name is refused
// with 422, so a client that drifts from the contract finds out in tests.
//
// Like a rate-limited account of the real API, the account stays refused
// (429) after any 429 until its Retry-After has passed. Besides answering,
// the fake judges its client: Check lists every request that arrived over
// the budget or before a Retry-After had passed (SPEC §8 R4), and the
// request log (Requests) records each request with its status and the
// fault it got. Neither ever holds the API token.
//
// State transitions (queued → provisioning → active, reboots, reinstalls)
// are deadlines evaluated when a device is read, so the fake runs no
// goroutine of its own; only requests held by a timeout fault wait, and
// Close releases them.
package fakemetal

import (
	"cmp"
	"crypto/subtle"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"
)

// PathPrefix starts the path of every endpoint the fake serves.
const PathPrefix = "/metal/v1"

// Fault kinds, as recorded in Request.Fault.
const (
	// FaultTooManyRequests is an injected 429 with Retry-After; the request
	// is not processed.
	FaultTooManyRequests = "429"
	// FaultServerError is an injected 500 or 503; the request is not
	// processed.
	FaultServerError = "5xx"
	// FaultTimeout holds the request for Faults.Slow or until the client
	// gives up, then answers 504 (if anyone still listens); the request is
	// not processed.
	FaultTimeout = "timeout"
	// FaultLostCreate creates the device, then closes the connection
	// without an answer. Only device creation gets it.
	FaultLostCreate = "lost-create"
	// FaultOverBudget is the answer to a request beyond the account's
	// budget, or sent before an earlier 429's Retry-After had passed: 429
	// with Retry-After, not processed. Unlike the others it is not
	// injected: the client caused it, and Check reports it.
	FaultOverBudget = "over-budget"
)

// Config configures a fake. Zero values mean defaults.
type Config struct {
	// Token is the API token every request must carry in X-Auth-Token; a
	// request without it, or with another, gets 401. Required.
	Token string
	// ProvisionDelay is how long a new device takes to become active: it is
	// queued for the first half and provisioning for the second; default 2s.
	ProvisionDelay time.Duration
	// RebootDelay is how long a reboot takes (powering_off for the first
	// half, powering_on for the second, then active); power_off and
	// power_on take as long; default 1s.
	RebootDelay time.Duration
	// ReinstallDelay is how long a device stays reinstalling; default 2s.
	ReinstallDelay time.Duration
	// Budget is the account's request rate in requests per second: the
	// rate at which its token bucket refills. A request that finds the
	// bucket empty gets 429 with Retry-After and is not processed.
	// Default 0: unlimited. Whatever the budget, after any 429 (injected
	// or not) the account is refused until its Retry-After has passed,
	// like an account the real API has rate-limited.
	Budget float64
	// Burst is the capacity of the account's token bucket, which starts
	// full; default 1.
	Burst int
	// Tolerance is the clock slack granted to the client for network and
	// scheduling jitter between its own limiter and ours: a request that
	// would be within budget this much later is accepted, and a request
	// that arrives this soon after a 429's request is taken to have been in
	// flight already: it is refused, but Check does not count it as a
	// Retry-After violation. Default 50ms; negative means none (for tests
	// that drive Clock by hand).
	Tolerance time.Duration
	// Faults are the injected faults at start; see SetFaults.
	Faults Faults
	// Address gives the n-th device created (n counts from 1, devices added
	// with AddDevice included) its public management address. Nil, or an
	// invalid address returned, gives unique documentation addresses:
	// 198.51.100.0/24, 203.0.113.0/24 and 192.0.2.0/24, then 198.18.0.0/15.
	Address func(deviceID string, n int) netip.Addr
	// Now is the API's clock: created_at, updated_at and state transitions.
	// Nil means time.Now. Tests move it to make devices active.
	Now func() time.Time
	// Clock is the clock of the budget, of Retry-After and of the request
	// log. Nil means time.Now. It is separate from Now so that a test that
	// moves Now for state transitions does not starve the token bucket or
	// make a client that waits in real time look impolite.
	Clock func() time.Time
	// Seed makes fault injection reproducible: the same seed and the same
	// sequence of requests get the same faults.
	Seed int64
	// RequestLogSize bounds the request log kept for Requests and Check;
	// the oldest requests are dropped first. Default 100,000.
	RequestLogSize int
}

// Validate names the first bad field and its value. It changes nothing.
func (c Config) Validate() error {
	switch {
	case c.Token == "":
		return errors.New("fakemetal: Token is required")
	case c.ProvisionDelay < 0:
		return fmt.Errorf("fakemetal: ProvisionDelay must be >= 0 (0 = default 2s), got %s", c.ProvisionDelay)
	case c.RebootDelay < 0:
		return fmt.Errorf("fakemetal: RebootDelay must be >= 0 (0 = default 1s), got %s", c.RebootDelay)
	case c.ReinstallDelay < 0:
		return fmt.Errorf("fakemetal: ReinstallDelay must be >= 0 (0 = default 2s), got %s", c.ReinstallDelay)
	case c.Budget < 0 || math.IsNaN(c.Budget) || math.IsInf(c.Budget, 0):
		return fmt.Errorf("fakemetal: Budget must be a finite number >= 0 (0 = unlimited), got %v", c.Budget)
	case c.Burst < 0:
		return fmt.Errorf("fakemetal: Burst must be >= 0 (0 = 1), got %d", c.Burst)
	case c.RequestLogSize < 0:
		return fmt.Errorf("fakemetal: RequestLogSize must be >= 0 (0 = default 100000), got %d", c.RequestLogSize)
	}
	if err := c.Faults.Validate(); err != nil {
		return err
	}
	return nil
}

// Faults says which requests get an injected fault. Faults never apply to
// a request with a bad token, nor to one refused for being over budget.
type Faults struct {
	// Rate is the share (0..1) of requests that get a fault.
	Rate float64
	// TooManyRequests, ServerError, Timeout and LostCreate weigh the kinds
	// of fault against each other; 0 means never that kind. All zero with
	// Rate > 0 means an equal mix. A request draws only among the kinds
	// that apply to it (LostCreate applies to device creation only); a
	// request for which no weighted kind applies gets no fault.
	TooManyRequests, ServerError, Timeout, LostCreate float64
	// RetryAfter is the Retry-After of injected 429s, rounded up to whole
	// seconds; default 1s.
	RetryAfter time.Duration
	// Slow is how long a Timeout fault holds the request (unless the client
	// gives up first) before answering 504; default 35s.
	Slow time.Duration
}

// Validate names the first bad field and its value. It changes nothing.
func (f Faults) Validate() error {
	bad := func(v float64) bool { return v < 0 || math.IsNaN(v) || math.IsInf(v, 0) }
	switch {
	case bad(f.Rate) || f.Rate > 1:
		return fmt.Errorf("fakemetal: Faults.Rate must be 0..1, got %v", f.Rate)
	case bad(f.TooManyRequests):
		return fmt.Errorf("fakemetal: Faults.TooManyRequests must be a finite weight >= 0, got %v", f.TooManyRequests)
	case bad(f.ServerError):
		return fmt.Errorf("fakemetal: Faults.ServerError must be a finite weight >= 0, got %v", f.ServerError)
	case bad(f.Timeout):
		return fmt.Errorf("fakemetal: Faults.Timeout must be a finite weight >= 0, got %v", f.Timeout)
	case bad(f.LostCreate):
		return fmt.Errorf("fakemetal: Faults.LostCreate must be a finite weight >= 0, got %v", f.LostCreate)
	case f.RetryAfter < 0:
		return fmt.Errorf("fakemetal: Faults.RetryAfter must be >= 0 (0 = default 1s), got %s", f.RetryAfter)
	case f.Slow < 0:
		return fmt.Errorf("fakemetal: Faults.Slow must be >= 0 (0 = default 35s), got %s", f.Slow)
	}
	return nil
}

// defaultTolerance absorbs the jitter between a client's limiter and ours
// on one busy machine under the race detector (goroutine scheduling, GC
// assists), which reaches milliseconds. It is small against a Retry-After
// (at least 1s): a client that ignores one keeps being refused, and what it
// sends after the first 50ms is reported.
const defaultTolerance = 50 * time.Millisecond

// maxBody bounds request bodies; the largest real one (a create with
// userdata) is far smaller.
const maxBody = 1 << 20

// Server is the fake API. Its methods are safe for concurrent use.
type Server struct {
	cfg       Config
	tolerance time.Duration // cfg.Tolerance resolved: >= 0

	closeOnce sync.Once
	closed    chan struct{} // closed by Close: held requests give up

	mu           sync.Mutex
	faults       Faults
	rng          *rand.Rand
	bucket       *bucket // nil: unlimited
	projects     map[string]*project
	devices      map[string]*device
	reservations map[string]*reservation
	sshKeys      map[string]*sshKey
	created      int       // devices created so far, for Config.Address
	limitedUntil time.Time // by Config.Clock: when the Retry-After of every 429 so far has passed
	seq          int       // requests so far
	log          []*record
}

// New returns a fake serving an empty account: add projects, reservations
// and devices with AddProject, AddReservations and AddDevice.
func New(cfg Config) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.ProvisionDelay = cmp.Or(cfg.ProvisionDelay, 2*time.Second)
	cfg.RebootDelay = cmp.Or(cfg.RebootDelay, time.Second)
	cfg.ReinstallDelay = cmp.Or(cfg.ReinstallDelay, 2*time.Second)
	cfg.Burst = cmp.Or(cfg.Burst, 1)
	cfg.RequestLogSize = cmp.Or(cfg.RequestLogSize, 100_000)
	if cfg.Address == nil {
		cfg.Address = func(_ string, n int) netip.Addr { return documentationAddr(n) }
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Clock == nil {
		cfg.Clock = time.Now
	}
	s := &Server{
		cfg:          cfg,
		tolerance:    max(cmp.Or(cfg.Tolerance, defaultTolerance), 0),
		closed:       make(chan struct{}),
		faults:       cfg.Faults,
		rng:          rand.New(rand.NewPCG(uint64(cfg.Seed), 0x6d6574616c)), // "metal"
		projects:     make(map[string]*project),
		devices:      make(map[string]*device),
		reservations: make(map[string]*reservation),
		sshKeys:      make(map[string]*sshKey),
	}
	if cfg.Budget > 0 {
		s.bucket = newBucket(cfg.Budget, cfg.Burst, s.tolerance, cfg.Clock())
	}
	return s, nil
}

// SetFaults replaces the injected faults from the next request on. Invalid
// faults (see Faults.Validate) panic: they are a bug in the test.
func (s *Server) SetFaults(f Faults) {
	if err := f.Validate(); err != nil {
		panic(err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faults = f
}

// Close releases the requests a timeout fault holds (they answer 504 at
// once) and makes later timeout faults answer without waiting, so that an
// httptest.Server in front of the fake can close without waiting for
// Faults.Slow. The fake keeps serving otherwise. Close it before the HTTP
// server in front of it.
func (s *Server) Close() {
	s.closeOnce.Do(func() { close(s.closed) })
}

// record is one entry of the request log. Once the record is in the log,
// its fields are read and written under s.mu.
type record struct {
	seq        int
	method     string
	path       string
	query      string
	tokenOK    bool
	at         time.Time // arrival, by Config.Clock
	done       time.Time // answer written (or given up), by Config.Clock; zero while in flight
	status     int       // 0: no answer (in flight, connection closed, client gone)
	fault      string
	retryAfter time.Duration // of a 429
	// inWindow: refused because it arrived before an earlier 429's
	// Retry-After had passed (fault FaultOverBudget, bucket untouched).
	inWindow bool
}

// decision is what ServeHTTP decided for a request before processing it.
type decision struct {
	fault      string
	retryAfter time.Duration // for 429s
	status5xx  int           // for FaultServerError
	slow       time.Duration // for FaultTimeout
	limit      *limitHeaders // nil: no budget
}

// ServeHTTP answers one API request.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rec := &record{
		method:  r.Method,
		path:    r.URL.Path,
		query:   r.URL.RawQuery,
		tokenOK: subtle.ConstantTimeCompare([]byte(r.Header.Get("X-Auth-Token")), []byte(s.cfg.Token)) == 1,
	}
	// Read the body before anything else: it is needed anyway, and only
	// once it is read does net/http notice a client that hangs up, which a
	// held request must see.
	body, bodyErr := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	rt, params, pathOK := match(r.Method, r.URL.EscapedPath())

	s.mu.Lock()
	d := s.admit(rec, rt != nil && rt.create)
	s.mu.Unlock()

	status := s.serve(w, r, rec, d, rt, params, pathOK, body, bodyErr)

	s.mu.Lock()
	rec.status = status
	rec.done = s.cfg.Clock()
	s.mu.Unlock()
}

// admit logs the request's arrival and decides, under s.mu, what it gets.
func (s *Server) admit(rec *record, create bool) decision {
	s.seq++
	rec.seq = s.seq
	rec.at = s.cfg.Clock()
	s.log = append(s.log, rec)
	if n := s.cfg.RequestLogSize; len(s.log) >= 2*n {
		s.log = append([]*record(nil), s.log[len(s.log)-n:]...)
	}
	d := s.decide(rec, create)
	if d.retryAfter > 0 {
		// A 429: the account is refused until its Retry-After has passed,
		// counted from the request's arrival, so that a client counting
		// from when it read the answer (later) never arrives too early.
		if end := rec.at.Add(d.retryAfter); end.After(s.limitedUntil) {
			s.limitedUntil = end
		}
	}
	rec.fault, rec.retryAfter = d.fault, d.retryAfter
	return d
}

// decide decides, under s.mu, whether the budget admits the request and
// which fault it gets.
func (s *Server) decide(rec *record, create bool) decision {
	var d decision
	if !rec.tokenOK {
		return d
	}
	if rec.at.Before(s.limitedUntil) {
		if s.bucket != nil {
			lh := s.bucket.headers(rec.at)
			d.limit = &lh
		}
		d.fault = FaultOverBudget
		d.retryAfter = wholeSeconds(s.limitedUntil.Sub(rec.at))
		rec.inWindow = true
		return d
	}
	if s.bucket != nil {
		ok, wait := s.bucket.take(rec.at)
		lh := s.bucket.headers(rec.at)
		d.limit = &lh
		if !ok {
			d.fault = FaultOverBudget
			d.retryAfter = wholeSeconds(wait)
			return d
		}
	}
	f := s.faults
	// Draw both numbers for every request, so that the faults a request
	// gets depend only on the seed and its position in the sequence.
	hit, which, code := s.rng.Float64(), s.rng.Float64(), s.rng.IntN(2)
	if hit >= f.Rate {
		return d
	}
	d.fault = pickFault(f, create, which)
	switch d.fault {
	case FaultTooManyRequests:
		d.retryAfter = wholeSeconds(cmp.Or(f.RetryAfter, time.Second))
	case FaultServerError:
		d.status5xx = []int{http.StatusInternalServerError, http.StatusServiceUnavailable}[code]
	case FaultTimeout:
		d.slow = cmp.Or(f.Slow, 35*time.Second)
	}
	return d
}

// pickFault chooses, by u in [0,1), among the fault kinds that apply to
// the request in proportion to their weights; "" if none applies.
func pickFault(f Faults, create bool, u float64) string {
	kinds := []struct {
		name   string
		weight float64
	}{
		{FaultTooManyRequests, f.TooManyRequests},
		{FaultServerError, f.ServerError},
		{FaultTimeout, f.Timeout},
		{FaultLostCreate, f.LostCreate},
	}
	if f.TooManyRequests+f.ServerError+f.Timeout+f.LostCreate == 0 {
		for i := range kinds {
			kinds[i].weight = 1
		}
	}
	if !create {
		kinds = kinds[:3]
	}
	var total float64
	for _, k := range kinds {
		total += k.weight
	}
	if total == 0 {
		return ""
	}
	x := u * total
	for _, k := range kinds {
		if x < k.weight {
			return k.name
		}
		x -= k.weight
	}
	return kinds[len(kinds)-1].name // u*total rounded up to total
}

// wholeSeconds rounds d up to whole seconds, at least one: Retry-After
// carries whole seconds, and rounding down would invite an early retry.
func wholeSeconds(d time.Duration) time.Duration {
	return max(time.Second, (d + time.Second - 1).Truncate(time.Second))
}

// serve answers the request as decided and returns the status sent, 0 if
// none was.
func (s *Server) serve(w http.ResponseWriter, r *http.Request, rec *record, d decision, rt *route, params []string, pathOK bool, body []byte, bodyErr error) int {
	h := w.Header()
	if !rec.tokenOK {
		return writeError(w, http.StatusUnauthorized, "invalid token")
	}
	if d.limit != nil {
		h.Set("X-RateLimit-Limit", strconv.Itoa(d.limit.limit))
		h.Set("X-RateLimit-Remaining", strconv.Itoa(d.limit.remaining))
		h.Set("X-RateLimit-Reset", strconv.Itoa(d.limit.reset))
	}
	switch d.fault {
	case FaultOverBudget, FaultTooManyRequests:
		secs := strconv.Itoa(int(d.retryAfter / time.Second))
		h.Set("Retry-After", secs)
		h.Set("X-RateLimit-Remaining", "0")
		h.Set("X-RateLimit-Reset", secs)
		return writeError(w, http.StatusTooManyRequests, "too many requests, retry after "+secs+"s")
	case FaultServerError:
		return writeError(w, d.status5xx, http.StatusText(d.status5xx))
	case FaultTimeout:
		t := time.NewTimer(d.slow)
		defer t.Stop()
		select {
		case <-r.Context().Done():
			return 0 // the client gave up; nobody reads an answer
		case <-t.C:
		case <-s.closed:
		}
		return writeError(w, http.StatusGatewayTimeout, "gateway timeout")
	}
	if rt == nil {
		if pathOK {
			return writeError(w, http.StatusMethodNotAllowed, "method not allowed")
		}
		return writeError(w, http.StatusNotFound, "not found")
	}
	if bodyErr != nil {
		return writeError(w, http.StatusBadRequest, "reading request body: "+bodyErr.Error())
	}
	resp := rt.handle(s, call{r: r, params: params, body: body})
	if d.fault == FaultLostCreate {
		if resp.status == http.StatusCreated {
			loseConnection(w)
			return 0
		}
		// Nothing was created, so there is nothing to lose: answer.
		s.mu.Lock()
		rec.fault = ""
		s.mu.Unlock()
	}
	return resp.write(w)
}

// loseConnection closes the client's connection without an answer, as a
// proxy or a network fault would after the API did the work.
func loseConnection(w http.ResponseWriter) {
	if hj, ok := w.(http.Hijacker); ok {
		if conn, _, err := hj.Hijack(); err == nil {
			conn.Close()
			return
		}
	}
	// HTTP/2 or a recorder: net/http's servers abort the response (and the
	// connection or stream) without logging.
	panic(http.ErrAbortHandler)
}

// route is one endpoint of the wire contract.
type route struct {
	method  string
	pattern []string // path segments after PathPrefix; "*" matches one segment, a parameter
	handle  func(s *Server, c call) response
	create  bool // device creation: the only endpoint a lost-create fault applies to
}

// call is one request as a handler sees it.
type call struct {
	r      *http.Request
	params []string // the segments matched by "*", in order
	body   []byte
}

var routes = []route{
	{method: http.MethodGet, pattern: []string{"projects", "*", "devices"}, handle: (*Server).listDevices},
	{method: http.MethodPost, pattern: []string{"projects", "*", "devices"}, handle: (*Server).createDevice, create: true},
	{method: http.MethodGet, pattern: []string{"devices", "*"}, handle: (*Server).getDevice},
	{method: http.MethodDelete, pattern: []string{"devices", "*"}, handle: (*Server).deleteDevice},
	{method: http.MethodPost, pattern: []string{"devices", "*", "actions"}, handle: (*Server).deviceAction},
	{method: http.MethodGet, pattern: []string{"projects", "*", "hardware-reservations"}, handle: (*Server).listReservations},
	{method: http.MethodGet, pattern: []string{"hardware-reservations", "*"}, handle: (*Server).getReservation},
	{method: http.MethodPost, pattern: []string{"hardware-reservations", "*", "move"}, handle: (*Server).moveReservation},
	{method: http.MethodGet, pattern: []string{"projects", "*", "ssh-keys"}, handle: (*Server).listSSHKeys},
	{method: http.MethodPost, pattern: []string{"projects", "*", "ssh-keys"}, handle: (*Server).createSSHKey},
	{method: http.MethodPut, pattern: []string{"ssh-keys", "*"}, handle: (*Server).updateSSHKey},
}

// match finds the route for method and escaped path. With no route,
// pathOK says whether the path exists for another method (405, not 404).
func match(method, escapedPath string) (rt *route, params []string, pathOK bool) {
	rest, ok := strings.CutPrefix(escapedPath, PathPrefix+"/")
	if !ok {
		return nil, nil, false
	}
	segs := strings.Split(rest, "/")
	for i, seg := range segs {
		u, err := url.PathUnescape(seg)
		if err != nil || u == "" {
			return nil, nil, false
		}
		segs[i] = u
	}
	for i := range routes {
		p, ok := matchPattern(routes[i].pattern, segs)
		if !ok {
			continue
		}
		if routes[i].method == method {
			return &routes[i], p, true
		}
		pathOK = true
	}
	return nil, nil, pathOK
}

func matchPattern(pattern, segs []string) ([]string, bool) {
	if len(pattern) != len(segs) {
		return nil, false
	}
	var params []string
	for i, p := range pattern {
		switch {
		case p == "*":
			params = append(params, segs[i])
		case p != segs[i]:
			return nil, false
		}
	}
	return params, true
}
