// Package power controls a machine's power out of band, through its BMC, so
// that a machine whose kernel hung, whose network is down or whose sshd died
// can still be restarted (SPEC §8, the recovery ladder's third rung).
//
// A Driver speaks one BMC protocol (power/ipmi, power/redfish) and does one
// thing per call, opening and closing its session inside the call. What is
// common to every protocol lives here, in Controller: calls to one BMC are
// serialised and spaced by a minimum interval (faster commands crash some
// BMCs), every call has a timeout, and a power cycle is one shared sequence
// (read, off, wait for off, on, wait for on, re-send a command the BMC
// accepted and then dropped, give up after a bound).
//
// Errors carry a class that callers act on, tested with errors.Is: ErrAuth
// is never retried (BMCs lock accounts after a few failures), ErrBusy and
// ErrUnreachable are retried within a bound, ErrWrongState means the machine
// is already where the command would take it, ErrUnsupported that the BMC
// cannot do it, ErrNotReached that the BMC accepted a command and the state
// never changed.
package power

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"

	"github.com/shepherd/shepherd/internal/secret"
)

// State is a machine's power state as its BMC reports it.
type State string

// Power states. Drivers map their protocol's states (IPMI's chassis power
// bit, Redfish's PowerState, whose PoweringOn/PoweringOff count as the state
// they come from) onto these.
const (
	On  State = "on"
	Off State = "off"
)

// BootDevice is a device to boot from once, on the next boot.
type BootDevice string

// Boot devices every driver that sets a boot device understands.
const (
	BootPXE  BootDevice = "pxe"
	BootDisk BootDevice = "disk"
)

// Driver controls one BMC. Each method opens what it needs (an RMCP+ or a
// Redfish session), does one thing, and closes it again before returning,
// also when ctx ends. Errors wrap one of the classes below where one
// applies.
type Driver interface {
	// State reads the power state.
	State(ctx context.Context) (State, error)
	// On powers the machine on. A machine already on: nil or ErrWrongState.
	On(ctx context.Context) error
	// Off powers the machine off at once (not a graceful shutdown: the OS is
	// presumed hung). A machine already off: nil or ErrWrongState.
	Off(ctx context.Context) error
}

// BootSetter is implemented by drivers that can choose the next boot's
// device (for a reinstall over PXE).
type BootSetter interface {
	SetNextBoot(ctx context.Context, dev BootDevice) error
}

// Error classes. Drivers wrap them (fmt.Errorf("...: %w", ErrBusy)) so that
// the message keeps the BMC's own words and errors.Is finds the class.
var (
	// ErrAuth: the BMC refused the credentials. Never retried: BMCs lock an
	// account after a few failures.
	ErrAuth = errors.New("BMC refused the credentials")
	// ErrUnreachable: no answer (refused, timed out, black-holed, TLS
	// failure other than a bad certificate).
	ErrUnreachable = errors.New("BMC unreachable")
	// ErrBusy: the BMC is up but cannot take the command now (sessions
	// exhausted, node busy, HTTP 503).
	ErrBusy = errors.New("BMC busy")
	// ErrWrongState: the machine is already in the state the command asks
	// for (IPMI completion code 0xD5, Redfish "already off").
	ErrWrongState = errors.New("machine already in that power state")
	// ErrUnsupported: the BMC does not offer the action.
	ErrUnsupported = errors.New("BMC does not support the action")
	// ErrNotReached: the BMC accepted the commands but the power state never
	// became the one asked for.
	ErrNotReached = errors.New("power state never changed")
	// ErrCertificate: the BMC's TLS certificate did not verify against the
	// configured CA. Not retried: it needs an operator.
	ErrCertificate = errors.New("BMC certificate not trusted")
)

// Class names err's class for metrics, history and the CLI: "auth",
// "unreachable", "busy", "wrong_state", "unsupported", "not_reached",
// "certificate", "canceled", or "other".
func Class(err error) string {
	switch {
	case err == nil:
		return ""
	case errors.Is(err, ErrAuth):
		return "auth"
	case errors.Is(err, ErrCertificate):
		return "certificate"
	case errors.Is(err, ErrBusy):
		return "busy"
	case errors.Is(err, ErrWrongState):
		return "wrong_state"
	case errors.Is(err, ErrUnsupported):
		return "unsupported"
	case errors.Is(err, ErrNotReached):
		return "not_reached"
	case errors.Is(err, ErrUnreachable):
		return "unreachable"
	case errors.Is(err, context.Canceled):
		return "canceled"
	}
	return "other"
}

// Driver names.
const (
	DriverIPMI    = "ipmi"
	DriverRedfish = "redfish"
)

// Redfish authentication modes (Spec.Auth).
const (
	// AuthAuto uses a session when the service offers a SessionService and
	// basic authentication otherwise.
	AuthAuto = ""
	// AuthBasic sends the credentials with every request.
	AuthBasic = "basic"
	// AuthSession logs in, and always logs out again.
	AuthSession = "session"
)

// Spec says how to reach one BMC: the static inventory's bmc block, or a
// simulated BMC. Its Password never prints (secret.String).
type Spec struct {
	// Driver is DriverIPMI or DriverRedfish.
	Driver string
	// Address is the BMC's host name or IP address.
	Address string
	// Port is the BMC's port; 0 means the driver's default (623 for IPMI,
	// 443 for Redfish).
	Port     int
	Username string
	Password secret.String
	// CipherSuite is IPMI's RMCP+ cipher suite: 3 (HMAC-SHA1, AES-128, the
	// default, which every IPMI 2.0 BMC offers) or 17 (HMAC-SHA256,
	// AES-128).
	CipherSuite int
	// CAFile is a PEM file of the CAs a Redfish BMC's certificate must chain
	// to; empty means the system's roots.
	CAFile string
	// InsecureSkipVerify accepts any Redfish BMC certificate. Only for a
	// machine whose entry explicitly allows it.
	InsecureSkipVerify bool
	// Auth is the Redfish authentication mode: AuthAuto, AuthBasic or
	// AuthSession.
	Auth string
}

// Default ports.
const (
	DefaultIPMIPort    = 623
	DefaultRedfishPort = 443
)

// Validate checks s and says what is wrong with which field.
func (s Spec) Validate() error {
	var errs []error
	switch s.Driver {
	case DriverIPMI:
		if s.CipherSuite != 0 && s.CipherSuite != 3 && s.CipherSuite != 17 {
			errs = append(errs, fmt.Errorf("cipher_suite %d: want 3 or 17", s.CipherSuite))
		}
		if s.CAFile != "" || s.InsecureSkipVerify || s.Auth != "" {
			errs = append(errs, errors.New("ca_file, insecure_skip_verify and auth are for redfish, not ipmi"))
		}
	case DriverRedfish:
		if s.CipherSuite != 0 {
			errs = append(errs, errors.New("cipher_suite is for ipmi, not redfish"))
		}
		if s.Auth != AuthAuto && s.Auth != AuthBasic && s.Auth != AuthSession {
			errs = append(errs, fmt.Errorf("auth %q: want %q or %q (or nothing: a session when offered)", s.Auth, AuthBasic, AuthSession))
		}
		if s.CAFile != "" && s.InsecureSkipVerify {
			errs = append(errs, errors.New("ca_file and insecure_skip_verify exclude each other"))
		}
	case "":
		errs = append(errs, errors.New("driver missing: want ipmi or redfish"))
	default:
		errs = append(errs, fmt.Errorf("driver %q: want ipmi or redfish", s.Driver))
	}
	if s.Address == "" {
		errs = append(errs, errors.New("address missing"))
	}
	if s.Port < 0 || s.Port > 65535 {
		errs = append(errs, fmt.Errorf("port %d: want 1-65535", s.Port))
	}
	if s.Username == "" {
		errs = append(errs, errors.New("username missing"))
	}
	if s.Password.Empty() {
		errs = append(errs, errors.New("password missing"))
	}
	return errors.Join(errs...)
}

// Endpoint returns the BMC's host:port, with the driver's default port when
// Port is 0.
func (s Spec) Endpoint() string {
	port := s.Port
	if port == 0 {
		port = DefaultIPMIPort
		if s.Driver == DriverRedfish {
			port = DefaultRedfishPort
		}
	}
	return net.JoinHostPort(s.Address, strconv.Itoa(port))
}

// String names the BMC for logs and history: driver, user and endpoint,
// never the password.
func (s Spec) String() string {
	return fmt.Sprintf("%s://%s@%s", s.Driver, s.Username, s.Endpoint())
}
