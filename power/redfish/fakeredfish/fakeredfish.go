// Package fakeredfish is a Redfish BMC in process, served over real TLS on
// 127.0.0.1, for the tests of power/redfish and for end-to-end tests that
// need a machine with a BMC. It implements what real BMCs serve and what
// Redfish clients rely on: the service root (with or without a
// SessionService), the Systems collection, one ComputerSystem with its
// PowerState, Boot override and Reset action annotated with
// ResetType@Redfish.AllowableValues, session login (X-Auth-Token and
// Location) and logout, basic authentication, OData annotations, and
// Redfish error bodies ({"error":{"code","message","@Message.ExtendedInfo"}})
// with the Base registry's message ids.
//
// Its faithfulness is checked against third-party clients (Debian's
// python3-sushy and redfishtool), not only against our own driver: a fake
// that only our driver understands would prove nothing.
//
// Profiles reproduce the differences between vendors that matter to a power
// driver (session service or none, TLS 1.2 only, which reset types are
// allowed, how a redundant reset is answered, how a login names its
// session, whether a body must be labelled JSON), and fault injection
// reproduces what BMCs in service do: answer 503 for a while, accept a
// reset and drop it, take seconds to power off, run out of session slots,
// expire sessions, or never answer at all.
package fakeredfish

import (
	"cmp"
	"crypto/rand"
	"crypto/subtle"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log"
	"maps"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Redfish power states, as the ComputerSystem's PowerState reports them.
const (
	On          = "On"
	Off         = "Off"
	PoweringOn  = "PoweringOn"
	PoweringOff = "PoweringOff"
)

// Config says which BMC to start.
type Config struct {
	// Profile is the kind of BMC; the zero Profile is OpenBMC().
	Profile Profile
	// Username and Password are the only credentials accepted; defaults
	// "admin" and "fake-bmc-password".
	Username, Password string
	// PowerState is the initial power state, On or Off; default Off.
	PowerState string
	// Transition is how long the system stays PoweringOn or PoweringOff
	// after a reset before reaching On or Off; 0 (the default) changes the
	// state at once. SetTransition changes it later.
	Transition time.Duration
	// OnPowerChange, if set, is called with the new PowerState on every
	// change of it (PoweringOff, Off, PoweringOn, On), in order, never
	// concurrently, and without the BMC's lock held, so it may call the
	// BMC's methods. End-to-end tests use it to stop and start a simulated
	// machine's sshd.
	OnPowerChange func(state string)
}

// BMC is a running fake Redfish BMC. Its methods are safe for concurrent
// use.
type BMC struct {
	cfg    Config
	srv    *httptest.Server
	caPEM  []byte
	closed chan struct{} // closed by Close, releases hanging requests

	hookMu sync.Mutex // serialises OnPowerChange calls

	mu              sync.Mutex
	state           string
	transition      time.Duration
	timer           *time.Timer // pending end of a transition
	gen             int         // increases with every reset that changes state, so a stale timer does nothing
	pending         []string    // state changes not yet passed to OnPowerChange
	boot            bootOverride
	sessions        map[string]string // token -> session id
	nextSession     int
	sessionsCreated int
	resets          map[string]int
	failNext        int
	dropResets      bool
	hang            func(*http.Request) bool
	echo            bool
	omitTokens      bool
	tokens          []string // every session token issued
}

type bootOverride struct {
	Enabled, Target string
}

// Start starts a BMC listening on 127.0.0.1 on a free port, with a new CA
// of its own. Close it when done.
func Start(cfg Config) (*BMC, error) {
	if cfg.Profile.Name == "" {
		cfg.Profile = OpenBMC()
	}
	cfg.Profile.SystemID = cmp.Or(cfg.Profile.SystemID, "1")
	cfg.Username = cmp.Or(cfg.Username, "admin")
	cfg.Password = cmp.Or(cfg.Password, "fake-bmc-password")
	cfg.PowerState = cmp.Or(cfg.PowerState, Off)
	if cfg.PowerState != On && cfg.PowerState != Off {
		return nil, fmt.Errorf("fakeredfish: PowerState %q: want %q or %q", cfg.PowerState, On, Off)
	}
	if cfg.Transition < 0 {
		return nil, fmt.Errorf("fakeredfish: Transition %s: want >= 0", cfg.Transition)
	}
	cert, caPEM, err := newCertificate(cfg.Profile.Name)
	if err != nil {
		return nil, fmt.Errorf("fakeredfish: %w", err)
	}
	b := &BMC{
		cfg:        cfg,
		caPEM:      caPEM,
		closed:     make(chan struct{}),
		state:      cfg.PowerState,
		transition: cfg.Transition,
		boot:       bootOverride{Enabled: "Disabled", Target: "None"},
		sessions:   make(map[string]string),
		resets:     make(map[string]int),
	}
	b.srv = httptest.NewUnstartedServer(http.HandlerFunc(b.serve))
	b.srv.TLS = &tls.Config{
		Certificates: []tls.Certificate{cert},
		MinVersion:   tls.VersionTLS12,
		MaxVersion:   cfg.Profile.TLSMaxVersion,
	}
	// Handshakes that clients abort (a test of a wrong CA) are expected;
	// they are not worth a line on the test's output.
	b.srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	b.srv.StartTLS()
	return b, nil
}

// Close stops the BMC: requests held by HangRequests end, and pending
// transitions are abandoned. OnPowerChange is not called after Close
// returns.
func (b *BMC) Close() {
	b.mu.Lock()
	select {
	case <-b.closed:
		b.mu.Unlock()
		return
	default:
	}
	close(b.closed)
	if b.timer != nil {
		b.timer.Stop()
	}
	b.gen++
	b.mu.Unlock()
	b.srv.CloseClientConnections()
	b.srv.Close()
	b.hookMu.Lock() // wait for a hook call in progress
	defer b.hookMu.Unlock()
}

// URL is the BMC's base URL, https://127.0.0.1:PORT.
func (b *BMC) URL() string { return b.srv.URL }

// Host is the BMC's address, 127.0.0.1.
func (b *BMC) Host() string { return b.srv.Listener.Addr().(*net.TCPAddr).IP.String() }

// Port is the BMC's TCP port.
func (b *BMC) Port() int { return b.srv.Listener.Addr().(*net.TCPAddr).Port }

// Username is the user name the BMC accepts.
func (b *BMC) Username() string { return b.cfg.Username }

// Password is the password the BMC accepts.
func (b *BMC) Password() string { return b.cfg.Password }

// Profile is the profile the BMC runs.
func (b *BMC) Profile() Profile { return b.cfg.Profile }

// CAPEM is the PEM of the CA that signed the BMC's certificate.
func (b *BMC) CAPEM() []byte { return append([]byte(nil), b.caPEM...) }

// WriteCAFile writes CAPEM to path (mode 0644), for clients that take a CA
// file.
func (b *BMC) WriteCAFile(path string) error {
	if err := os.WriteFile(path, b.caPEM, 0o644); err != nil {
		return fmt.Errorf("fakeredfish: writing CA file: %w", err)
	}
	return nil
}

// PowerState is the system's current PowerState: On, Off, PoweringOn or
// PoweringOff.
func (b *BMC) PowerState() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.state
}

// SetPowerState sets the power state at once, as a person at the machine
// would, cancelling a transition in progress. OnPowerChange is called if it
// changed.
func (b *BMC) SetPowerState(state string) error {
	if state != On && state != Off {
		return fmt.Errorf("fakeredfish: power state %q: want %q or %q", state, On, Off)
	}
	b.mu.Lock()
	b.gen++
	if b.timer != nil {
		b.timer.Stop()
	}
	b.setStateLocked(state)
	b.mu.Unlock()
	b.flushHooks()
	return nil
}

// BootOverride is the system's Boot.BootSourceOverrideEnabled and
// Boot.BootSourceOverrideTarget.
func (b *BMC) BootOverride() (enabled, target string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.boot.Enabled, b.boot.Target
}

// OpenSessions is the number of sessions logged in and not logged out.
func (b *BMC) OpenSessions() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.sessions)
}

// SessionsCreated is the number of session logins that succeeded.
func (b *BMC) SessionsCreated() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.sessionsCreated
}

// Resets counts the resets received by type: every authenticated reset
// request of an allowed type, including those dropped (DropResets) or
// refused as redundant.
func (b *BMC) Resets() map[string]int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return maps.Clone(b.resets)
}

// FailNext answers the next n requests, whatever they are, with 503
// Service Unavailable and a Retry-After, as a BMC does while its web server
// restarts or it is busy.
func (b *BMC) FailNext(n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.failNext = n
}

// DropResets makes the BMC accept resets (204, counted in Resets) without
// ever changing the power state, as BMCs whose command to the host was
// lost do.
func (b *BMC) DropResets(drop bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.dropResets = drop
}

// SetTransition sets how long later resets stay PoweringOn or PoweringOff.
func (b *BMC) SetTransition(d time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.transition = d
}

// SetMaxSessions sets how many sessions may be open at once; 0 means no
// limit.
func (b *BMC) SetMaxSessions(n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.cfg.Profile.MaxSessions = n
}

// ExpireSessions ends every open session, as a BMC does when a session's
// timeout passes or the BMC restarts: a later request with its token is
// 401, and a logout of it with basic credentials is 404.
func (b *BMC) ExpireSessions() {
	b.mu.Lock()
	defer b.mu.Unlock()
	clear(b.sessions)
}

// OmitTokens makes logins create the session but answer without the
// X-Auth-Token header, as broken firmware does: a client can log the
// session out only with basic credentials.
func (b *BMC) OmitTokens(omit bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.omitTokens = omit
}

// HangRequests makes every request for which match returns true go
// unanswered until the client gives up or the BMC is closed, as a BMC whose
// web server accepted a connection and then stalled does. nil ends it.
func (b *BMC) HangRequests(match func(r *http.Request) bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.hang = match
}

// EchoRequests makes error answers repeat the request in their message,
// its credentials, session token and body included, as some BMC firmware
// does. Tests use it to check that a client keeps secrets out of its
// errors.
func (b *BMC) EchoRequests(echo bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.echo = echo
}

// Tokens returns every session token the BMC has issued, for tests that
// check a client never shows one.
func (b *BMC) Tokens() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.tokens)
}

// setStateLocked changes the state and queues the hook call.
func (b *BMC) setStateLocked(state string) {
	if b.state == state {
		return
	}
	b.state = state
	if b.cfg.OnPowerChange != nil {
		b.pending = append(b.pending, state)
	}
}

// flushHooks passes queued state changes to OnPowerChange in order. Changes
// are queued under mu and drained under hookMu, so two callers cannot
// reorder them.
func (b *BMC) flushHooks() {
	b.hookMu.Lock()
	defer b.hookMu.Unlock()
	for {
		b.mu.Lock()
		select {
		case <-b.closed:
			b.pending = nil
		default:
		}
		if len(b.pending) == 0 {
			b.mu.Unlock()
			return
		}
		s := b.pending[0]
		b.pending = b.pending[1:]
		b.mu.Unlock()
		b.cfg.OnPowerChange(s)
	}
}

// poweredTowardsOn reports whether the system is on or heading there.
func poweredTowardsOn(state string) bool { return state == On || state == PoweringOn }

// powerLocked moves the system towards on or off: through PoweringOn or
// PoweringOff for the transition time, or at once.
func (b *BMC) powerLocked(on bool) {
	b.gen++
	if b.timer != nil {
		b.timer.Stop()
		b.timer = nil
	}
	final, between := Off, PoweringOff
	if on {
		final, between = On, PoweringOn
	}
	if b.transition <= 0 {
		b.setStateLocked(final)
		return
	}
	b.setStateLocked(between)
	gen := b.gen
	b.timer = time.AfterFunc(b.transition, func() {
		b.mu.Lock()
		if b.gen != gen {
			b.mu.Unlock()
			return
		}
		b.timer = nil
		b.setStateLocked(final)
		b.mu.Unlock()
		b.flushHooks()
	})
}

// newToken returns 16 random bytes in hex.
func newToken() string {
	var buf [16]byte
	_, _ = rand.Read(buf[:])
	return hex.EncodeToString(buf[:])
}

// checkCredentials compares in constant time, as a BMC should.
func (b *BMC) checkCredentials(user, password string) bool {
	u := subtle.ConstantTimeCompare([]byte(user), []byte(b.cfg.Username))
	p := subtle.ConstantTimeCompare([]byte(password), []byte(b.cfg.Password))
	return u&p == 1
}

// errClosed is returned by waits that end because the BMC closed.
var errClosed = errors.New("fakeredfish: closed")

// waitHang holds a request until its client goes away or the BMC closes.
func (b *BMC) waitHang(r *http.Request) error {
	select {
	case <-r.Context().Done():
		return r.Context().Err()
	case <-b.closed:
		return errClosed
	}
}

// sessionPath is the URI of session id.
func sessionPath(id string) string { return sessionsPath + "/" + id }

const (
	rootPath           = "/redfish/v1"
	systemsPath        = rootPath + "/Systems"
	sessionServicePath = rootPath + "/SessionService"
	sessionsPath       = sessionServicePath + "/Sessions"
)

// systemPath is the URI of the one ComputerSystem.
func (b *BMC) systemPath() string { return systemsPath + "/" + b.cfg.Profile.SystemID }

// resetPath is the target of the system's Reset action.
func (b *BMC) resetPath() string { return b.systemPath() + "/Actions/ComputerSystem.Reset" }

// itoa is strconv.Itoa, short.
func itoa(i int) string { return strconv.Itoa(i) }

// trimSlash drops a trailing slash: Redfish URIs are the same with and
// without it.
func trimSlash(p string) string {
	if len(p) > 1 {
		return strings.TrimSuffix(p, "/")
	}
	return p
}
