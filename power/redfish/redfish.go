// Package redfish is the power.Driver for BMCs that speak Redfish, built on
// github.com/stmcginnis/gofish. Each call connects, does one thing, and
// logs out again.
//
// Decisions, and why:
//
//   - Sessions are always logged out, also when the call fails or its
//     context ends: logging out gets a context of its own with a short
//     timeout (LogoutTimeout). BMCs have a handful of session slots and
//     keep an abandoned session for up to 30 minutes; a driver that leaks
//     them locks every client out. The one session that cannot be logged
//     out is one the BMC created while the context ended before its answer
//     (with the token) arrived.
//   - Authentication: Spec.Auth "basic" sends the credentials with every
//     request; "session" logs in; "" logs in when the service root links a
//     SessionService or Links.Sessions and uses basic authentication
//     otherwise, because many BMCs in service offer no session service.
//     Login and logout are done here rather than by gofish, whose Logout
//     ignores its error and waits without a deadline.
//   - TLS: the certificate is verified against Spec.CAFile, or the system's
//     roots without one; InsecureSkipVerify only when the Spec says so.
//     TLS 1.2 is the minimum, not 1.3, because many BMCs speak only 1.2.
//     HTTP/1.1 only, no proxy from the environment.
//   - The system is the only, or the first, member of the Systems
//     collection: a BMC manages one machine.
//   - State maps PowerState so that a transition counts as the state it
//     comes from: PoweringOn is off and PoweringOff is on (and Paused is
//     on). Power is not yet on while PoweringOn, and still on while
//     PoweringOff, when the OS may still be writing to disks; a caller
//     waiting for off must keep waiting, and a caller that sends Off to a
//     machine still PoweringOff (it may stay there when a graceful
//     shutdown hangs) is right to.
//   - Reset types come from what the system advertises
//     (ResetType@Redfish.AllowableValues, or its ActionInfo): On sends On,
//     else ForceOn; Off sends ForceOff, else Off, else PushPowerButton.
//     A system that advertises nothing gets On and ForceOff, the types
//     every BMC implements. If none of those is allowed the call fails with
//     ErrUnsupported naming what was advertised. PushPowerButton toggles,
//     so Off never presses it for a machine already off or powering off
//     (ErrWrongState instead); and a short press asks the OS to shut down,
//     which a hung OS ignores: the Controller then reports ErrNotReached.
//   - A reset the BMC refuses (400 or 409) while the system already is in,
//     or is heading to, the state asked for returns ErrWrongState (iDRAC:
//     409 "Server is already powered ON."). A BMC that accepts such a reset
//     (OpenBMC) gives nil. So ErrWrongState always means the BMC said so.
//   - Errors: 401 and 403 are ErrAuth, 503 and 429 ErrBusy, no answer
//     (refused, reset, timeout, dropped handshake, the call's deadline) is
//     ErrUnreachable, a certificate that does not verify is ErrCertificate.
//     A cancelled context gives context.Canceled; a passed deadline gives
//     ErrUnreachable and context.DeadlineExceeded. Messages keep the BMC's
//     words (the Redfish error's message and each @Message.ExtendedInfo
//     message, where iDRAC puts the real reason) and never contain the
//     password or a session token.
//   - ctx bounds every call: every request, the dial and the TLS handshake
//     use it, so a BMC that accepts a connection and never answers holds a
//     call only until ctx ends. The Controller gives every call a timeout;
//     a caller without one can wait forever on such a BMC.
package redfish

import (
	"cmp"
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/stmcginnis/gofish/schemas"

	"github.com/shepherd/shepherd/power"
)

// Config holds the driver's settings beyond the Spec.
type Config struct {
	// Logger receives the failures that a call does not return (a failed
	// logout); default slog.Default().
	Logger *slog.Logger
	// LogoutTimeout bounds logging out, which runs after the call's context
	// may have ended; default 5s.
	LogoutTimeout time.Duration
	// DialTimeout bounds connecting to the BMC, in addition to the call's
	// context; default 10s.
	DialTimeout time.Duration
}

// Option changes a Config.
type Option func(*Config)

// WithLogger sets Config.Logger.
func WithLogger(l *slog.Logger) Option { return func(c *Config) { c.Logger = l } }

// WithLogoutTimeout sets Config.LogoutTimeout.
func WithLogoutTimeout(d time.Duration) Option { return func(c *Config) { c.LogoutTimeout = d } }

// Driver controls one Redfish BMC. It holds no connection between calls, and
// its methods may be called concurrently (the Controller serialises calls
// to one BMC anyway).
type Driver struct {
	spec     power.Spec
	cfg      Config
	endpoint string // https://host:port
	tls      *tls.Config
	dialer   *net.Dialer
	log      *slog.Logger
}

var (
	_ power.Driver     = (*Driver)(nil)
	_ power.BootSetter = (*Driver)(nil)
)

// New returns a driver for the BMC spec describes. It validates spec and
// reads spec.CAFile now, so that a bad inventory entry fails at start.
func New(spec power.Spec, opts ...Option) (*Driver, error) {
	if err := spec.Validate(); err != nil {
		return nil, fmt.Errorf("redfish: %s: %w", spec, err)
	}
	if spec.Driver != power.DriverRedfish {
		return nil, fmt.Errorf("redfish: %s: driver is %q, not %q", spec, spec.Driver, power.DriverRedfish)
	}
	var cfg Config
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.LogoutTimeout < 0 || cfg.DialTimeout < 0 {
		return nil, fmt.Errorf("redfish: LogoutTimeout %s and DialTimeout %s must be >= 0", cfg.LogoutTimeout, cfg.DialTimeout)
	}
	cfg.Logger = cmp.Or(cfg.Logger, slog.Default())
	cfg.LogoutTimeout = cmp.Or(cfg.LogoutTimeout, 5*time.Second)
	cfg.DialTimeout = cmp.Or(cfg.DialTimeout, 10*time.Second)
	tc := &tls.Config{
		MinVersion:         tls.VersionTLS12, // many BMCs speak nothing newer
		InsecureSkipVerify: spec.InsecureSkipVerify,
	}
	if spec.CAFile != "" {
		pem, err := os.ReadFile(spec.CAFile)
		if err != nil {
			return nil, fmt.Errorf("redfish: %s: reading ca_file: %w", spec, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("redfish: %s: ca_file %s holds no PEM certificate", spec, spec.CAFile)
		}
		tc.RootCAs = pool
	}
	return &Driver{
		spec:     spec,
		cfg:      cfg,
		endpoint: "https://" + spec.Endpoint(),
		tls:      tc,
		dialer:   &net.Dialer{Timeout: cfg.DialTimeout},
		log:      cfg.Logger.With(slog.String("component", "redfish")),
	}, nil
}

// do connects, runs fn on the system, and closes the call whatever
// happened.
func (d *Driver) do(ctx context.Context, fn func(c *call, sys *schemas.ComputerSystem) error) error {
	c, err := d.connect(ctx)
	if err != nil {
		return err
	}
	defer c.close()
	sys, err := c.system()
	if err != nil {
		return err
	}
	return fn(c, sys)
}

// State reads the system's PowerState.
func (d *Driver) State(ctx context.Context) (power.State, error) {
	var st power.State
	err := d.do(ctx, func(c *call, sys *schemas.ComputerSystem) error {
		var err error
		st, err = stateOf(sys.PowerState)
		if err != nil {
			return fmt.Errorf("redfish %s: %w", d.spec.Endpoint(), err)
		}
		return nil
	})
	return st, err
}

// stateOf maps a Redfish PowerState onto power's; see the package doc.
func stateOf(ps schemas.PowerState) (power.State, error) {
	switch ps {
	case schemas.OnPowerState, schemas.PoweringOffPowerState, schemas.PausedPowerState:
		return power.On, nil
	case schemas.OffPowerState, schemas.PoweringOnPowerState:
		return power.Off, nil
	}
	return "", fmt.Errorf("BMC reports an unknown PowerState %q", ps)
}

// Reset type preferences, most preferred first. PushPowerButton is last
// and only for off: it toggles.
var (
	onTypes  = []schemas.ResetType{schemas.OnResetType, schemas.ForceOnResetType}
	offTypes = []schemas.ResetType{schemas.ForceOffResetType, "Off", schemas.PushPowerButtonResetType}
)

// On powers the system on.
func (d *Driver) On(ctx context.Context) error {
	return d.do(ctx, func(c *call, sys *schemas.ComputerSystem) error {
		return c.reset(sys, true)
	})
}

// Off powers the system off at once.
func (d *Driver) Off(ctx context.Context) error {
	return d.do(ctx, func(c *call, sys *schemas.ComputerSystem) error {
		return c.reset(sys, false)
	})
}

// chooseReset picks the first of prefs that allowed contains; an empty
// allowed list means the system did not say, and gets prefs[0].
func chooseReset(allowed, prefs []schemas.ResetType) (schemas.ResetType, bool) {
	if len(allowed) == 0 {
		return prefs[0], true
	}
	for _, p := range prefs {
		if slices.Contains(allowed, p) {
			return p, true
		}
	}
	return "", false
}

// reset sends the reset that powers the system on or off.
func (c *call) reset(sys *schemas.ComputerSystem, on bool) error {
	what, prefs, already := "powering off", offTypes, []schemas.PowerState{schemas.OffPowerState, schemas.PoweringOffPowerState}
	if on {
		what, prefs, already = "powering on", onTypes, []schemas.PowerState{schemas.OnPowerState, schemas.PoweringOnPowerState}
	}
	allowed, err := sys.GetSupportedResetTypes()
	if err != nil {
		return c.classify(what+": reading the allowed reset types", err)
	}
	rt, ok := chooseReset(allowed, prefs)
	if !ok {
		names := make([]string, len(allowed))
		for i, a := range allowed {
			names[i] = string(a)
		}
		return fmt.Errorf("redfish %s: %s: the system allows reset types [%s], none of %v: %w",
			c.d.spec.Endpoint(), what, strings.Join(names, ", "), prefs, power.ErrUnsupported)
	}
	isAlready := slices.Contains(already, sys.PowerState)
	if rt == schemas.PushPowerButtonResetType && isAlready {
		return fmt.Errorf("redfish %s: %s: system is %s; not pressing the power button, which would toggle it: %w",
			c.d.spec.Endpoint(), what, sys.PowerState, power.ErrWrongState)
	}
	if _, err := sys.Reset(rt); err != nil {
		werr := c.classify(fmt.Sprintf("%s (reset %s, system %s)", what, rt, sys.PowerState), err)
		if st := statusOf(err); isAlready && (st == 400 || st == 409) && c.ctx.Err() == nil {
			return fmt.Errorf("%w: %w", werr, power.ErrWrongState)
		}
		return werr
	}
	return nil
}

// SetNextBoot makes the next boot, only, boot from dev.
func (d *Driver) SetNextBoot(ctx context.Context, dev power.BootDevice) error {
	var target schemas.BootSource
	switch dev {
	case power.BootPXE:
		target = schemas.PxeBootSource
	case power.BootDisk:
		target = schemas.HddBootSource
	default:
		return fmt.Errorf("redfish %s: boot device %q: want %q or %q: %w", d.spec.Endpoint(), dev, power.BootPXE, power.BootDisk, power.ErrUnsupported)
	}
	return d.do(ctx, func(c *call, sys *schemas.ComputerSystem) error {
		err := sys.SetBoot(&schemas.Boot{
			BootSourceOverrideTarget:  target,
			BootSourceOverrideEnabled: schemas.OnceBootSourceOverrideEnabled,
		})
		return c.classify(fmt.Sprintf("setting the next boot to %s", target), err)
	})
}
