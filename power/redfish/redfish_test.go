package redfish_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/shepherd/shepherd/internal/eventually"
	"github.com/shepherd/shepherd/internal/secret"
	"github.com/shepherd/shepherd/power"
	"github.com/shepherd/shepherd/power/redfish"
	"github.com/shepherd/shepherd/power/redfish/fakeredfish"
)

// callTimeout bounds each driver call in these tests; a call that needs it
// has hung.
const callTimeout = 20 * time.Second

func startBMC(t *testing.T, cfg fakeredfish.Config) *fakeredfish.BMC {
	t.Helper()
	b, err := fakeredfish.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	return b
}

// specFor returns the Spec of b, trusting b's CA, with auth mode auth.
func specFor(t *testing.T, b *fakeredfish.BMC, auth string) power.Spec {
	t.Helper()
	ca := filepath.Join(t.TempDir(), "ca.pem")
	if err := b.WriteCAFile(ca); err != nil {
		t.Fatal(err)
	}
	return power.Spec{
		Driver: power.DriverRedfish, Address: b.Host(), Port: b.Port(),
		Username: b.Username(), Password: secret.New(b.Password()),
		CAFile: ca, Auth: auth,
	}
}

func newDriver(t *testing.T, spec power.Spec) *redfish.Driver {
	t.Helper()
	d, err := redfish.New(spec)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func callCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), callTimeout)
	t.Cleanup(cancel)
	return ctx
}

// noSessionsLeft fails unless every session the driver opened is logged out
// by the time its call returned: logout is part of the call.
func noSessionsLeft(t *testing.T, b *fakeredfish.BMC, after string) {
	t.Helper()
	if n := b.OpenSessions(); n != 0 {
		t.Fatalf("after %s: %d sessions still open on the BMC, want 0", after, n)
	}
}

func wantState(t *testing.T, d *redfish.Driver, want power.State) {
	t.Helper()
	got, err := d.State(callCtx(t))
	if err != nil {
		t.Fatalf("State: %v", err)
	}
	if got != want {
		t.Fatalf("State = %s, want %s", got, want)
	}
}

// TestProfiles runs State, On, Off and SetNextBoot against every BMC
// profile and checks what reached the BMC: the power state, the one reset
// type each profile should get, the boot override, and that every session
// was logged out.
func TestProfiles(t *testing.T) {
	t.Parallel()
	wantResets := map[string]struct{ on, off string }{
		"openbmc":             {"On", "ForceOff"},
		"idrac":               {"On", "ForceOff"},
		"basic-only":          {"On", "ForceOff"},
		"no-forceoff":         {"On", "PushPowerButton"},
		"no-allowable-values": {"On", "ForceOff"},
	}
	for _, p := range fakeredfish.Profiles() {
		t.Run(p.Name, func(t *testing.T) {
			t.Parallel()
			want, ok := wantResets[p.Name]
			if !ok {
				t.Fatalf("no expected reset types for profile %q", p.Name)
			}
			b := startBMC(t, fakeredfish.Config{Profile: p})
			d := newDriver(t, specFor(t, b, power.AuthAuto))

			wantState(t, d, power.Off)
			noSessionsLeft(t, b, "State")
			if err := d.On(callCtx(t)); err != nil {
				t.Fatalf("On: %v", err)
			}
			noSessionsLeft(t, b, "On")
			if got := b.PowerState(); got != fakeredfish.On {
				t.Fatalf("after On the BMC's PowerState is %s", got)
			}
			wantState(t, d, power.On)
			if err := d.Off(callCtx(t)); err != nil {
				t.Fatalf("Off: %v", err)
			}
			noSessionsLeft(t, b, "Off")
			if got := b.PowerState(); got != fakeredfish.Off {
				t.Fatalf("after Off the BMC's PowerState is %s", got)
			}
			if diff := cmp.Diff(map[string]int{want.on: 1, want.off: 1}, b.Resets()); diff != "" {
				t.Errorf("resets received (-want +got):\n%s", diff)
			}

			for _, tc := range []struct {
				dev    power.BootDevice
				target string
			}{{power.BootPXE, "Pxe"}, {power.BootDisk, "Hdd"}} {
				if err := d.SetNextBoot(callCtx(t), tc.dev); err != nil {
					t.Fatalf("SetNextBoot(%s): %v", tc.dev, err)
				}
				noSessionsLeft(t, b, "SetNextBoot")
				if enabled, target := b.BootOverride(); enabled != "Once" || target != tc.target {
					t.Fatalf("after SetNextBoot(%s): boot override %s/%s, want Once/%s", tc.dev, enabled, target, tc.target)
				}
			}
			// Auto mode logs in exactly when the BMC offers sessions.
			if got := b.SessionsCreated() > 0; got != p.SessionService {
				t.Errorf("sessions created: %d, but the profile's SessionService is %v", b.SessionsCreated(), p.SessionService)
			}
		})
	}
}

// TestAuthModes: "basic" never logs in even where sessions are offered,
// "session" logs in once per call, and "session" against a BMC without a
// session service is ErrUnsupported rather than a silent fallback.
func TestAuthModes(t *testing.T) {
	t.Parallel()
	t.Run("basic on a BMC with sessions", func(t *testing.T) {
		t.Parallel()
		b := startBMC(t, fakeredfish.Config{Profile: fakeredfish.OpenBMC()})
		wantState(t, newDriver(t, specFor(t, b, power.AuthBasic)), power.Off)
		if n := b.SessionsCreated(); n != 0 {
			t.Fatalf("basic auth created %d sessions", n)
		}
	})
	t.Run("session", func(t *testing.T) {
		t.Parallel()
		b := startBMC(t, fakeredfish.Config{Profile: fakeredfish.IDRAC()})
		d := newDriver(t, specFor(t, b, power.AuthSession))
		wantState(t, d, power.Off)
		wantState(t, d, power.Off)
		if n := b.SessionsCreated(); n != 2 {
			t.Fatalf("two calls created %d sessions, want 2", n)
		}
		noSessionsLeft(t, b, "two State calls")
	})
	t.Run("session without a session service", func(t *testing.T) {
		t.Parallel()
		b := startBMC(t, fakeredfish.Config{Profile: fakeredfish.BasicOnly()})
		_, err := newDriver(t, specFor(t, b, power.AuthSession)).State(callCtx(t))
		if !errors.Is(err, power.ErrUnsupported) {
			t.Fatalf("State error = %v, want ErrUnsupported", err)
		}
	})
}

// TestRedundantReset: a BMC that refuses a reset to the state the system is
// already in (iDRAC's 409) gives ErrWrongState with the BMC's words; one
// that accepts it (OpenBMC) gives nil. The power button is never pressed
// for a machine already off, since it would turn it on.
func TestRedundantReset(t *testing.T) {
	t.Parallel()
	t.Run("idrac refuses", func(t *testing.T) {
		t.Parallel()
		b := startBMC(t, fakeredfish.Config{Profile: fakeredfish.IDRAC(), PowerState: fakeredfish.On})
		err := newDriver(t, specFor(t, b, power.AuthAuto)).On(callCtx(t))
		if !errors.Is(err, power.ErrWrongState) {
			t.Fatalf("On error = %v, want ErrWrongState", err)
		}
		// iDRAC's top-level message is a general one: the reason, with its
		// id, is only in @Message.ExtendedInfo.
		if !strings.Contains(err.Error(), "IDRAC.2.8.PSU501: Server is already powered ON.") {
			t.Errorf("error %q lacks the BMC's message id and message from @Message.ExtendedInfo", err)
		}
		noSessionsLeft(t, b, "a refused On")
	})
	t.Run("ilo refuses with 400", func(t *testing.T) {
		t.Parallel()
		p := fakeredfish.OpenBMC()
		p.RefuseRedundantReset, p.RedundantResetBadRequest = true, true // as HPE iLO does
		b := startBMC(t, fakeredfish.Config{Profile: p})
		err := newDriver(t, specFor(t, b, power.AuthAuto)).Off(callCtx(t))
		if !errors.Is(err, power.ErrWrongState) || !strings.Contains(err.Error(), "HTTP 400") {
			t.Fatalf("Off error = %v, want ErrWrongState from an HTTP 400", err)
		}
	})
	t.Run("openbmc accepts", func(t *testing.T) {
		t.Parallel()
		b := startBMC(t, fakeredfish.Config{Profile: fakeredfish.OpenBMC()})
		if err := newDriver(t, specFor(t, b, power.AuthAuto)).Off(callCtx(t)); err != nil {
			t.Fatalf("Off of a machine already off: %v, want nil", err)
		}
	})
	t.Run("power button not pressed when off", func(t *testing.T) {
		t.Parallel()
		b := startBMC(t, fakeredfish.Config{Profile: fakeredfish.NoForceOff()})
		err := newDriver(t, specFor(t, b, power.AuthAuto)).Off(callCtx(t))
		if !errors.Is(err, power.ErrWrongState) {
			t.Fatalf("Off error = %v, want ErrWrongState", err)
		}
		if n := len(b.Resets()); n != 0 || b.PowerState() != fakeredfish.Off {
			t.Fatalf("resets %v sent, power %s; want none and Off", b.Resets(), b.PowerState())
		}
	})
}

// TestUnsupportedResetTypes: a system that allows none of the preferred
// reset types gives ErrUnsupported naming what it allows, and nothing is
// sent.
func TestUnsupportedResetTypes(t *testing.T) {
	t.Parallel()
	p := fakeredfish.OpenBMC()
	p.ResetTypes = []string{"GracefulShutdown", "GracefulRestart", "Nmi"}
	b := startBMC(t, fakeredfish.Config{Profile: p, PowerState: fakeredfish.On})
	d := newDriver(t, specFor(t, b, power.AuthAuto))
	for name, call := range map[string]func(context.Context) error{"On": d.On, "Off": d.Off} {
		err := call(callCtx(t))
		if !errors.Is(err, power.ErrUnsupported) {
			t.Fatalf("%s error = %v, want ErrUnsupported", name, err)
		}
		if !strings.Contains(err.Error(), "GracefulShutdown, GracefulRestart, Nmi") {
			t.Errorf("%s error %q does not name the allowed types", name, err)
		}
	}
	if r := b.Resets(); len(r) != 0 {
		t.Fatalf("resets sent: %v", r)
	}
}

// TestTLS: a TLS 1.2-only BMC works; a certificate from another CA, or a
// private CA checked against the system's roots, is ErrCertificate; and
// InsecureSkipVerify, only when set, accepts it.
func TestTLS(t *testing.T) {
	t.Parallel()
	b := startBMC(t, fakeredfish.Config{Profile: fakeredfish.IDRAC()})
	other := startBMC(t, fakeredfish.Config{})

	t.Run("TLS 1.2 only", func(t *testing.T) {
		t.Parallel()
		wantState(t, newDriver(t, specFor(t, b, power.AuthAuto)), power.Off)
	})
	t.Run("wrong CA", func(t *testing.T) {
		t.Parallel()
		spec := specFor(t, b, power.AuthAuto)
		spec.CAFile = specFor(t, other, "").CAFile
		_, err := newDriver(t, spec).State(callCtx(t))
		if !errors.Is(err, power.ErrCertificate) {
			t.Fatalf("State error = %v, want ErrCertificate", err)
		}
	})
	t.Run("system roots", func(t *testing.T) {
		t.Parallel()
		spec := specFor(t, b, power.AuthAuto)
		spec.CAFile = ""
		_, err := newDriver(t, spec).State(callCtx(t))
		if !errors.Is(err, power.ErrCertificate) {
			t.Fatalf("State error = %v, want ErrCertificate", err)
		}
	})
	t.Run("InsecureSkipVerify", func(t *testing.T) {
		t.Parallel()
		spec := specFor(t, b, power.AuthAuto)
		spec.CAFile, spec.InsecureSkipVerify = "", true
		wantState(t, newDriver(t, spec), power.Off)
	})
}

// TestSecretsNeverInErrors: with a BMC that echoes requests (headers and
// body) in its error messages, a wrong password is ErrAuth in both auth
// modes, and neither the password, its basic-auth encoding, nor a session
// token appears in the error.
func TestSecretsNeverInErrors(t *testing.T) {
	t.Parallel()
	const wrong = "wrong-password-S3cr3t"
	for _, auth := range []string{power.AuthBasic, power.AuthSession} {
		t.Run("wrong password "+auth, func(t *testing.T) {
			t.Parallel()
			b := startBMC(t, fakeredfish.Config{Profile: fakeredfish.OpenBMC()})
			b.EchoRequests(true)
			spec := specFor(t, b, auth)
			spec.Password = secret.New(wrong)
			_, err := newDriver(t, spec).State(callCtx(t))
			if !errors.Is(err, power.ErrAuth) {
				t.Fatalf("State error = %v, want ErrAuth", err)
			}
			if !strings.Contains(err.Error(), "authorization error") {
				t.Errorf("error %q lacks the BMC's message", err)
			}
			if !strings.Contains(err.Error(), "REDACTED") {
				t.Errorf("error %q: the BMC echoed the credentials, and nothing was redacted: the test proves nothing", err)
			}
			if strings.Contains(err.Error(), wrong) || strings.Contains(err.Error(), "Basic ") && !strings.Contains(err.Error(), "Basic REDACTED") {
				t.Fatalf("error shows the credentials: %q", err)
			}
		})
	}
	t.Run("session token", func(t *testing.T) {
		t.Parallel()
		b := startBMC(t, fakeredfish.Config{Profile: fakeredfish.IDRAC(), PowerState: fakeredfish.On})
		b.EchoRequests(true)
		err := newDriver(t, specFor(t, b, power.AuthSession)).On(callCtx(t)) // refused: already on
		if err == nil {
			t.Fatal("On of a machine already on: nil error from a BMC that refuses it")
		}
		tokens := b.Tokens()
		if len(tokens) != 1 {
			t.Fatalf("%d sessions created, want 1", len(tokens))
		}
		if strings.Contains(err.Error(), tokens[0]) || strings.Contains(err.Error(), b.Password()) {
			t.Fatalf("error shows the token or the password: %q", err)
		}
		if !strings.Contains(err.Error(), "X-Auth-Token: REDACTED") {
			t.Errorf("error %q: the BMC echoed the token, and it was not redacted where expected", err)
		}
	})
}

// TestBusy: a 503 is ErrBusy with the BMC's words, and so is a login
// refused because every session slot is taken.
func TestBusy(t *testing.T) {
	t.Parallel()
	t.Run("503", func(t *testing.T) {
		t.Parallel()
		b := startBMC(t, fakeredfish.Config{Profile: fakeredfish.OpenBMC()})
		d := newDriver(t, specFor(t, b, power.AuthAuto))
		b.FailNext(1)
		_, err := d.State(callCtx(t))
		if !errors.Is(err, power.ErrBusy) || !strings.Contains(err.Error(), "temporarily unavailable") {
			t.Fatalf("State error = %v, want ErrBusy with the BMC's message", err)
		}
		wantState(t, d, power.Off) // the next call goes through
		noSessionsLeft(t, b, "a 503 and a State")
	})
	t.Run("session limit", func(t *testing.T) {
		t.Parallel()
		b := startBMC(t, fakeredfish.Config{Profile: fakeredfish.OpenBMC()})
		d := newDriver(t, specFor(t, b, power.AuthAuto))
		b.SetMaxSessions(1)
		// Another client holds the one slot for the length of a call.
		held := make(chan struct{})
		release := make(chan struct{})
		var once sync.Once
		b.HangRequests(func(r *http.Request) bool {
			if r.Method != http.MethodGet || !strings.Contains(r.URL.Path, "/Systems/") {
				return false
			}
			once.Do(func() { close(held) })
			<-release
			return false
		})
		firstErr := make(chan error, 1)
		go func() { _, err := d.State(callCtx(t)); firstErr <- err }()
		select {
		case <-held:
		case err := <-firstErr: // else this test would wait for held forever
			t.Fatalf("the call meant to hold the slot ended before reading the system: %v", err)
		}
		_, err := d.State(callCtx(t))
		close(release)
		if !errors.Is(err, power.ErrBusy) || !strings.Contains(err.Error(), "SessionLimitExceeded") {
			t.Fatalf("State with no session slot free: error = %v, want ErrBusy naming SessionLimitExceeded", err)
		}
		if err := <-firstErr; err != nil {
			t.Fatalf("the call holding the slot: %v", err)
		}
		noSessionsLeft(t, b, "both calls")
	})
}

// TestLoginAnswers: the session is found, used and logged out however the
// BMC names it: a Location with a path (bmcweb), an absolute URL (HPE
// iLO), or only the body's @odata.id; and a root that links the
// SessionService but not Links.Sessions gets a login at the standard path.
func TestLoginAnswers(t *testing.T) {
	t.Parallel()
	for name, mod := range map[string]func(p *fakeredfish.Profile){
		"location path":       func(*fakeredfish.Profile) {},
		"location absolute":   func(p *fakeredfish.Profile) { p.SessionLocation = fakeredfish.LocationAbsolute },
		"body only":           func(p *fakeredfish.Profile) { p.SessionLocation = fakeredfish.LocationNone },
		"no Links.Sessions":   func(p *fakeredfish.Profile) { p.NoSessionsLink = true },
		"only SessionService": func(p *fakeredfish.Profile) { p.NoSessionsLink, p.SessionLocation = true, fakeredfish.LocationNone },
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			p := fakeredfish.OpenBMC()
			mod(&p)
			b := startBMC(t, fakeredfish.Config{Profile: p})
			wantState(t, newDriver(t, specFor(t, b, power.AuthAuto)), power.Off)
			if n := b.SessionsCreated(); n != 1 {
				t.Fatalf("%d sessions created, want 1", n)
			}
			noSessionsLeft(t, b, "State")
		})
	}
}

// syncBuffer is a bytes.Buffer safe for a logger and a test to share.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// TestLogout: a session is logged out with its token; a login answered
// without a token fails (the driver cannot use the session) and logs the
// session out with basic credentials. A logout the BMC answers 404 (the
// session is already gone) is no failure: nothing is logged. One it
// refuses (503) does not fail the call, which did its work, but is logged
// as a warning naming the session, without its token.
func TestLogout(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		noToken  bool                   // the BMC sends no X-Auth-Token
		atLogout func(*fakeredfish.BMC) // called as the logout arrives
		wantErr  string                 // in State's error; "" for none
		wantWarn bool
		wantLeft int // sessions left open
	}{
		{name: "token"},
		{name: "no token", noToken: true, wantErr: "no X-Auth-Token"},
		{name: "no token, session gone", noToken: true, atLogout: (*fakeredfish.BMC).ExpireSessions, wantErr: "no X-Auth-Token"},
		{name: "busy", atLogout: func(b *fakeredfish.BMC) { b.FailNext(1) }, wantWarn: true, wantLeft: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := startBMC(t, fakeredfish.Config{Profile: fakeredfish.OpenBMC()})
			b.OmitTokens(tc.noToken)
			var logouts atomic.Int32
			b.HangRequests(func(r *http.Request) bool {
				if r.Method == http.MethodDelete {
					logouts.Add(1)
					if tc.atLogout != nil {
						tc.atLogout(b)
					}
				}
				return false
			})
			var log syncBuffer
			d, err := redfish.New(specFor(t, b, power.AuthSession), redfish.WithLogger(slog.New(slog.NewTextHandler(&log, nil))))
			if err != nil {
				t.Fatal(err)
			}
			_, err = d.State(callCtx(t))
			if tc.wantErr == "" && err != nil || tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) {
				t.Fatalf("State error = %v, want %q", err, tc.wantErr)
			}
			if n := logouts.Load(); n != 1 {
				t.Fatalf("%d logouts, want 1", n)
			}
			if n := b.OpenSessions(); n != tc.wantLeft {
				t.Errorf("%d sessions left open, want %d", n, tc.wantLeft)
			}
			got := log.String()
			if warned := strings.Contains(got, "logging out of the BMC failed"); warned != tc.wantWarn {
				t.Fatalf("warned = %v, want %v; log:\n%s", warned, tc.wantWarn, got)
			}
			if tc.wantWarn {
				if !strings.Contains(got, "session=/redfish/v1/SessionService/Sessions/1") || !strings.Contains(got, "503") {
					t.Errorf("warning does not name the session and the BMC's answer:\n%s", got)
				}
				if tok := b.Tokens(); len(tok) != 1 || strings.Contains(got, tok[0]) {
					t.Errorf("tokens %v: want one, not in the log:\n%s", tok, got)
				}
			}
		})
	}
}

// TestContextEndsCallAndLogsOut: a BMC that stops answering after login
// holds a call only until its context ends, by deadline or cancel, and the
// session is logged out anyway.
func TestContextEndsCallAndLogsOut(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		wantErr []error
	}{
		{"deadline", []error{power.ErrUnreachable, context.DeadlineExceeded}},
		{"cancel", []error{context.Canceled}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b := startBMC(t, fakeredfish.Config{Profile: fakeredfish.OpenBMC()})
			hung := make(chan struct{})
			var once sync.Once
			b.HangRequests(func(r *http.Request) bool {
				if r.Method == http.MethodGet && strings.Contains(r.URL.Path, "/Systems/") {
					once.Do(func() { close(hung) })
					return true
				}
				return false
			})
			d := newDriver(t, specFor(t, b, power.AuthSession))
			var ctx context.Context
			var cancel context.CancelFunc
			if tc.name == "deadline" {
				ctx, cancel = context.WithTimeout(t.Context(), 300*time.Millisecond)
			} else {
				ctx, cancel = context.WithCancel(t.Context())
				go func() {
					select {
					case <-hung:
						cancel()
					case <-t.Context().Done():
					}
				}()
			}
			defer cancel()
			start := time.Now()
			_, err := d.State(ctx)
			for _, want := range tc.wantErr {
				if !errors.Is(err, want) {
					t.Fatalf("State error = %v, want %v", err, want)
				}
			}
			if took := time.Since(start); took > 5*time.Second {
				t.Fatalf("State took %s after its context ended", took)
			}
			if n := b.SessionsCreated(); n != 1 {
				t.Fatalf("%d sessions created, want 1 (the test must hang after login)", n)
			}
			noSessionsLeft(t, b, "a call whose context ended")
		})
	}
}

// TestUnreachable: a refused connection is ErrUnreachable at once, and a
// peer that accepts TCP and never writes (a black hole, or a BMC whose web
// server hung) holds a call only until its deadline.
func TestUnreachable(t *testing.T) {
	t.Parallel()
	spec := func(addr net.Addr) power.Spec {
		a := addr.(*net.TCPAddr)
		return power.Spec{Driver: power.DriverRedfish, Address: a.IP.String(), Port: a.Port,
			Username: "admin", Password: secret.New("pw"), InsecureSkipVerify: true}
	}
	t.Run("refused", func(t *testing.T) {
		t.Parallel()
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := ln.Addr()
		ln.Close()
		_, err = newDriver(t, spec(addr)).State(callCtx(t))
		if !errors.Is(err, power.ErrUnreachable) || errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("State error = %v, want ErrUnreachable before any deadline", err)
		}
	})
	t.Run("black hole", func(t *testing.T) {
		t.Parallel()
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		var mu sync.Mutex
		var conns []net.Conn
		done := make(chan struct{})
		go func() {
			defer close(done)
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				mu.Lock()
				conns = append(conns, c) // held open, never written to
				mu.Unlock()
			}
		}()
		t.Cleanup(func() {
			ln.Close()
			<-done
			mu.Lock()
			for _, c := range conns {
				c.Close()
			}
			mu.Unlock()
		})
		ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
		defer cancel()
		start := time.Now()
		_, err = newDriver(t, spec(ln.Addr())).State(ctx)
		if !errors.Is(err, power.ErrUnreachable) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("State error = %v, want ErrUnreachable and DeadlineExceeded", err)
		}
		if took := time.Since(start); took > 5*time.Second {
			t.Fatalf("State took %s against a 300ms deadline", took)
		}
	})
}

// TestSlowTransition: PoweringOff counts as on and PoweringOn as off, until
// the BMC reaches the final state.
func TestSlowTransition(t *testing.T) {
	t.Parallel()
	b := startBMC(t, fakeredfish.Config{Profile: fakeredfish.OpenBMC(), PowerState: fakeredfish.On, Transition: time.Hour})
	d := newDriver(t, specFor(t, b, power.AuthAuto))
	if err := d.Off(callCtx(t)); err != nil {
		t.Fatal(err)
	}
	if got := b.PowerState(); got != fakeredfish.PoweringOff {
		t.Fatalf("BMC PowerState = %s, want PoweringOff", got)
	}
	wantState(t, d, power.On)
	b.SetTransition(50 * time.Millisecond)
	if err := d.On(callCtx(t)); err != nil {
		t.Fatal(err)
	}
	eventually.Holds(t, 10*time.Second, "the BMC reaches On", func(context.Context) (bool, error) {
		return b.PowerState() == fakeredfish.On, nil
	})
	wantState(t, d, power.On)
	b.SetTransition(time.Hour)
	if err := d.Off(callCtx(t)); err != nil {
		t.Fatal(err)
	}
	if err := b.SetPowerState(fakeredfish.Off); err != nil {
		t.Fatal(err)
	}
	wantState(t, d, power.Off)
	if err := d.On(callCtx(t)); err != nil {
		t.Fatal(err)
	}
	if got := b.PowerState(); got != fakeredfish.PoweringOn {
		t.Fatalf("BMC PowerState = %s, want PoweringOn", got)
	}
	wantState(t, d, power.Off)
	if got := maps.Clone(b.Resets()); got["ForceOff"] != 2 || got["On"] != 2 {
		t.Fatalf("resets = %v, want 2 ForceOff and 2 On", got)
	}
}

// TestNewRejectsBadSpecs: New validates the spec and reads the CA file.
func TestNewRejectsBadSpecs(t *testing.T) {
	t.Parallel()
	good := power.Spec{Driver: power.DriverRedfish, Address: "bmc", Username: "u", Password: secret.New("p")}
	if _, err := redfish.New(good); err != nil {
		t.Fatalf("New(%v): %v", good, err)
	}
	for name, mod := range map[string]func(*power.Spec){
		"ipmi driver":     func(s *power.Spec) { s.Driver = power.DriverIPMI },
		"missing CA file": func(s *power.Spec) { s.CAFile = filepath.Join(t.TempDir(), "none.pem") },
		"no password":     func(s *power.Spec) { s.Password = secret.String{} },
	} {
		s := good
		mod(&s)
		if _, err := redfish.New(s); err == nil {
			t.Errorf("%s: New succeeded", name)
		}
	}
}
