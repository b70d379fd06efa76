// Package ipmi is the power.Driver for BMCs that speak IPMI v2.0 over LAN
// (RMCP+), built on github.com/bougou/go-ipmi.
//
// # A session per call
//
// Every call opens its own RMCP+ session, sends one command and closes the
// session again before it returns, also when the command failed or ctx
// ended. A BMC has a small session table (ipmi_sim's holds 63, many real
// BMCs 4 to 16) and frees a session it was not told to close only after an
// inactivity timeout of a minute or more, so a long-lived session shared by
// calls, or one leaked by a call that failed, would sooner or later lock
// Shepherd (and the operator's own ipmitool) out of the BMC. A session costs
// four round trips; power commands are rare and paced by power.Controller,
// so that cost does not matter.
//
// The session is closed with a context of its own, bounded by closeTimeout,
// because the caller's ctx may be the reason the call is ending. A session is
// only closed when one was opened: after a BMC that never answered, or one
// that refused the credentials, there is nothing to close and nothing is
// sent, so a dead BMC does not make the call outlive its ctx.
//
// # Cipher suite
//
// power.Spec.CipherSuite 0 means 3 (RAKP-HMAC-SHA1, HMAC-SHA1-96, AES-CBC-128),
// which every IPMI 2.0 BMC offers; 17 (RAKP-HMAC-SHA256,
// HMAC-SHA256-128, AES-CBC-128) is used only when asked for. The suite is
// never negotiated: go-ipmi's negotiation asks for Get Channel Cipher Suites,
// which some BMCs (ipmi_sim among them) never answer, costing every call
// several timeouts, and a BMC that does not offer the configured suite should
// fail loudly (ErrUnsupported) rather than quietly get a weaker one.
//
// The session asks for the Operator privilege, the least that chassis
// control and boot options need, so an account limited to Operator works
// and an Administrator account is not used beyond what is needed.
//
// # Errors
//
// Errors wrap one of power's classes and keep the BMC's words (the RMCP+
// status or the completion code and its meaning). RMCP+ session-setup status
// codes are read from the BMC's replies as they arrive, because go-ipmi
// does not always return them (a truncated Open Session reply, as ipmi_sim
// sends when it refuses a cipher suite or has no free session, becomes a
// decoding error). No error or log line carries the password.
package ipmi

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/bougou/go-ipmi/pkg/client"
	"github.com/bougou/go-ipmi/pkg/command/chassis"
	"github.com/bougou/go-ipmi/pkg/rmcpplus"
	"github.com/bougou/go-ipmi/pkg/types"

	"github.com/shepherd/shepherd/power"
)

// Limits of IPMI v2.0 user credentials (IPMI v2.0 §13.28, §22.29): longer
// ones cannot be sent, and go-ipmi would silently cut a password to 20
// bytes, so New rejects them rather than fail every login.
const (
	maxUsernameLen = rmcpplus.MaxUserNameLength // 16
	maxPasswordLen = 20
)

// closeTimeout bounds closing a session, which gets a context of its own
// (the caller's may have ended). A live BMC answers Close Session in
// milliseconds; this allows one retry of a lost datagram and no more, so a
// BMC that died in mid-call delays the return by at most this much.
const closeTimeout = 2 * time.Second

// attemptTimeout is how long one request waits for its reply before it is
// sent again (at most attemptRetries more times, within ctx): ipmitool's
// lanplus defaults, which real BMCs are tuned for.
const (
	attemptTimeout = time.Second
	attemptRetries = 4
)

// defaultCipherSuite is used when power.Spec.CipherSuite is 0.
const defaultCipherSuite = 3

// Driver controls one BMC over IPMI v2.0 LAN. It holds no connection between
// calls and is safe for concurrent use, though power.Controller serialises
// the calls to one BMC anyway.
type Driver struct {
	spec power.Spec // validated; CipherSuite is 3 or 17
	host string
	port int
}

var (
	_ power.Driver     = (*Driver)(nil)
	_ power.BootSetter = (*Driver)(nil)
)

// New returns a Driver for spec, which must be valid and name the ipmi
// driver. Port 0 means 623; CipherSuite 0 means 3.
func New(spec power.Spec) (*Driver, error) {
	if spec.Driver != power.DriverIPMI {
		return nil, fmt.Errorf("ipmi: driver %q: want %q", spec.Driver, power.DriverIPMI)
	}
	if err := spec.Validate(); err != nil {
		return nil, fmt.Errorf("ipmi: BMC %s: %w", spec, err)
	}
	if n := len(spec.Username); n > maxUsernameLen {
		return nil, fmt.Errorf("ipmi: BMC %s: username is %d bytes, IPMI allows at most %d", spec, n, maxUsernameLen)
	}
	if n := len(spec.Password.Reveal()); n > maxPasswordLen {
		return nil, fmt.Errorf("ipmi: BMC %s: password is %d bytes, IPMI v2.0 allows at most %d", spec, n, maxPasswordLen)
	}
	spec.CipherSuite = cmp.Or(spec.CipherSuite, defaultCipherSuite)
	host, portStr, err := net.SplitHostPort(spec.Endpoint())
	if err != nil {
		return nil, fmt.Errorf("ipmi: BMC %s: %w", spec, err)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil {
		return nil, fmt.Errorf("ipmi: BMC %s: port %q: %w", spec, portStr, err)
	}
	return &Driver{spec: spec, host: host, port: port}, nil
}

// State reads the chassis power state (Get Chassis Status, the power-on
// bit).
func (d *Driver) State(ctx context.Context) (power.State, error) {
	var st power.State
	err := d.do(ctx, "reading chassis status", func(ctx context.Context, c *client.Client) error {
		res, err := c.GetChassisStatus(ctx)
		if err != nil {
			return err
		}
		st = power.Off
		if res.PowerIsOn {
			st = power.On
		}
		return nil
	})
	if err != nil {
		return "", err
	}
	return st, nil
}

// On sends Chassis Control "power up". A machine already on: most BMCs
// (and ipmi_sim) answer success, and the call returns nil; a BMC that
// answers 0xD5 gives power.ErrWrongState.
func (d *Driver) On(ctx context.Context) error {
	return d.control(ctx, chassis.ChassisControlPowerUp, "powering on")
}

// Off sends Chassis Control "power down": an immediate hard off, not an ACPI
// shutdown. A machine already off: most BMCs (and ipmi_sim) answer success,
// and the call returns nil; a BMC that answers 0xD5 gives
// power.ErrWrongState.
func (d *Driver) Off(ctx context.Context) error {
	return d.control(ctx, chassis.ChassisControlPowerDown, "powering off")
}

func (d *Driver) control(ctx context.Context, ctl chassis.ChassisControl, what string) error {
	return d.do(ctx, what, func(ctx context.Context, c *client.Client) error {
		_, err := c.ChassisControl(ctx, ctl)
		return err
	})
}

// SetNextBoot sets the boot flags (System Boot Options parameter 5) for the
// next boot only: PXE or the default hard disk, in legacy BIOS mode, as
// `ipmitool chassis bootdev pxe|disk` does. The BMC clears them after one
// boot (or after 60 s without one, unless the BIOS acknowledges them).
func (d *Driver) SetNextBoot(ctx context.Context, dev power.BootDevice) error {
	var sel types.BootDeviceSelector
	switch dev {
	case power.BootPXE:
		sel = types.BootDeviceSelectorForcePXE
	case power.BootDisk:
		sel = types.BootDeviceSelectorForceHardDrive
	default:
		return fmt.Errorf("ipmi: setting next boot at %s: boot device %q: want %q or %q: %w",
			d.spec, dev, power.BootPXE, power.BootDisk, power.ErrUnsupported)
	}
	return d.do(ctx, "setting next boot to "+string(dev), func(ctx context.Context, c *client.Client) error {
		return c.SetBootDevice(ctx, sel, types.BIOSBootTypeLegacy, false)
	})
}

// do opens a session, runs fn in it and closes the session, returning fn's
// or the session setup's error, classified.
func (d *Driver) do(ctx context.Context, what string, fn func(context.Context, *client.Client) error) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("ipmi: %s at %s: %w", what, d.spec, err)
	}
	w := &wire{}
	c, err := client.NewClient(d.host, d.port, d.spec.Username, d.spec.Password.Reveal())
	if err != nil {
		return d.fail(ctx, what, w, err)
	}
	c.WithUDPProxy(&dialer{ctx: ctx, endpoint: d.spec.Endpoint(), w: w}).
		WithCipherSuiteID(types.CipherSuiteID(d.spec.CipherSuite)).
		WithMaxPrivilegeLevel(types.PrivilegeLevelOperator).
		WithTimeout(attemptTimeout).
		WithRetry(attemptRetries)

	// go-ipmi returns from a request when ctx ends but leaves its reader
	// blocked until the read deadline, holding the lock that closing the
	// session needs; expiring the deadline frees it at once.
	stop := context.AfterFunc(ctx, w.expire)
	err = c.Connect(ctx)
	connected := err == nil
	if connected {
		err = fn(ctx, c)
	}
	stop()

	// A failed Close Session does not fail the call: the command's outcome
	// is what the caller asked about, and the BMC drops the session by
	// itself after its inactivity timeout.
	_ = d.close(ctx, c, w, connected)
	if err != nil {
		return d.fail(ctx, what, w, err)
	}
	return nil
}

// close closes the session if the BMC had opened one (it answered RAKP
// message 3, or Connect succeeded), with a context of its own, and always
// the socket. It reports Close Session's error.
func (d *Driver) close(ctx context.Context, c *client.Client, w *wire, connected bool) error {
	if !connected && !w.sessionOpened() {
		w.closeConn()
		return nil
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), closeTimeout)
	defer cancel()
	err := c.Close(cctx) // also closes the socket
	w.closeConn()        // in case Close failed before it got there
	return err
}

// fail wraps err with what was being done, the BMC and err's class.
func (d *Driver) fail(ctx context.Context, what string, w *wire, err error) error {
	ctxErr := ctx.Err()
	if dl, ok := ctx.Deadline(); ok && ctxErr == nil && !time.Now().Before(dl) {
		// The read deadline go-ipmi took from ctx passed a moment before
		// ctx's own timer fired.
		ctxErr = context.DeadlineExceeded
	}
	words, class := classify(ctxErr, w, err)
	msg := err.Error()
	if words != "" {
		msg = words + ": " + msg
	}
	// go-ipmi never puts the password in an error; make sure of it.
	if pw := d.spec.Password.Reveal(); pw != "" && strings.Contains(msg, pw) {
		msg = "(error text withheld: it contained the password)"
	}
	prefix := fmt.Sprintf("ipmi: %s at %s", what, d.spec)
	switch {
	case class != nil && ctxErr != nil:
		return fmt.Errorf("%s: %s: %w (%w)", prefix, msg, class, ctxErr)
	case class != nil:
		return fmt.Errorf("%s: %s: %w", prefix, msg, class)
	case ctxErr != nil:
		return fmt.Errorf("%s: %s: %w", prefix, msg, ctxErr)
	}
	return fmt.Errorf("%s: %s", prefix, msg)
}

// classify finds err's class and, where the BMC said something that err's
// text may have lost, the BMC's words. ctxErr is the call's context's
// error.
func classify(ctxErr error, w *wire, err error) (words string, class error) {
	// An RMCP+ status seen on the wire is the BMC's own answer, whatever
	// go-ipmi made of it.
	if st, ok := w.rmcpStatus(); ok {
		words = fmt.Sprintf("BMC answered RMCP+ status %02xh (%s)", uint8(st), st)
		return words, rmcpStatusClass(st)
	}
	var respErr *types.ResponseError
	if errors.As(err, &respErr) {
		if c := completionCodeClass(respErr.CompletionCode()); c != nil {
			return "", c
		}
	}
	// go-ipmi joins the errors of session setup with %v, losing their
	// chain, so its RAKP mismatch (wrong password: the BMC's RAKP message 2
	// was keyed with another) is only found by its text.
	if strings.Contains(err.Error(), client.ErrRAKPAuthentication.Error()) {
		return "BMC's RAKP authentication code does not match the password", power.ErrAuth
	}
	var dnsErr *net.DNSError
	switch {
	case errors.Is(ctxErr, context.Canceled):
		return "", nil // the caller's doing, not the BMC's: Class says "canceled"
	case ctxErr != nil:
		return "no answer before the deadline", power.ErrUnreachable
	case errors.As(err, &dnsErr):
		return "cannot resolve the BMC's address", power.ErrUnreachable
	case errors.Is(err, syscall.ECONNREFUSED), w.lastReadErr() == syscall.ECONNREFUSED:
		return "nothing listens on the BMC's port (ICMP port unreachable)", power.ErrUnreachable
	case isNetErr(err), w.readTimedOut():
		return "no answer", power.ErrUnreachable
	}
	return "", nil
}

// isNetErr reports whether err is a network failure: a timeout, a failed
// resolution or a failed send or receive.
func isNetErr(err error) bool {
	var ne net.Error
	var dnsErr *net.DNSError
	var opErr *net.OpError
	return errors.As(err, &ne) && ne.Timeout() || errors.As(err, &dnsErr) || errors.As(err, &opErr)
}

// rmcpStatusClass maps an RMCP+ Open Session or RAKP status code (IPMI v2.0
// table 13-15) to a class.
func rmcpStatusClass(st types.RmcpStatusCode) error {
	switch st {
	case types.RmcpStatusCodeNoResToCreateSess, types.RmcpStatusCodeNoResToCreateSessAtRole:
		return power.ErrBusy // out of sessions
	case types.RmcpStatusCodeInvalidRole, types.RmcpStatusCodeUnauthorizedRoleOfPriLevel,
		types.RmcpStatusCodeInvalidNameLength, types.RmcpStatusCodeUnauthorizedName,
		types.RmcpStatusCodeUnauthorizedGUID, types.RmcpStatusCodeInvalidIntegrityCheckValue:
		return power.ErrAuth
	case types.RmcpStatusCodeInvalidAuthAlg, types.RmcpStatusCodeInvalidIntegrityAlg,
		types.RmcpStatusCodeNoMatchingAuthPayload, types.RmcpStatusCodeNoMatchingIntegrityPayload,
		types.RmcpStatusCodeInvalidConfidentAlg, types.RmcpStatusCodeNoCipherSuiteMatch:
		return power.ErrUnsupported // the cipher suite is not offered
	}
	return nil
}

// completionCodeClass maps an IPMI completion code to a class.
func completionCodeClass(cc types.CompletionCode) error {
	switch cc {
	case types.CodeNodeBusy, types.CodeOutOfSpace:
		return power.ErrBusy
	case types.CodeNotSupported: // 0xD5: not supported in the present state
		return power.ErrWrongState
	case types.CodeInvalidCommand:
		return power.ErrUnsupported
	case types.CodeInsufficientPrivilege:
		// The account may log in but not do this: an operator must
		// change it, retrying cannot help.
		return power.ErrAuth
	}
	return nil
}

// dialer gives go-ipmi its UDP socket (go-ipmi's proxy hook), so that the
// call owns the socket: it watches the BMC's replies and can expire or
// close the socket whatever go-ipmi is doing.
type dialer struct {
	ctx      context.Context
	endpoint string // host:port, IPv6 bracketed (go-ipmi's own dial does not bracket)
	w        *wire
}

// Dial ignores go-ipmi's address in favour of the spec's endpoint.
func (d *dialer) Dial(network, _ string) (net.Conn, error) {
	var nd net.Dialer
	conn, err := nd.DialContext(d.ctx, network, d.endpoint)
	if err != nil {
		return nil, err
	}
	d.w.setConn(conn)
	return &wireConn{Conn: conn, w: d.w}, nil
}

// wire is what one call saw on its socket.
type wire struct {
	mu        sync.Mutex
	conn      net.Conn
	status    types.RmcpStatusCode // first non-zero RMCP+ session-setup status
	hasStatus bool
	opened    bool  // a RAKP message 4 with status 0 arrived: the BMC holds a session
	readErr   error // the last read's error, unwrapped to its errno where it has one
	timedOut  bool  // some read timed out
}

func (w *wire) setConn(c net.Conn) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.conn = c
}

// expire makes a blocked read return now.
func (w *wire) expire() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.conn != nil {
		_ = w.conn.SetReadDeadline(time.Now())
	}
}

func (w *wire) closeConn() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.conn != nil {
		_ = w.conn.Close()
	}
}

func (w *wire) sessionOpened() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.opened
}

func (w *wire) rmcpStatus() (types.RmcpStatusCode, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.status, w.hasStatus
}

func (w *wire) lastReadErr() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.readErr
}

func (w *wire) readTimedOut() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.timedOut
}

// RMCP+ session-setup payload types (IPMI v2.0 table 13-16) whose second
// payload byte is an RMCP+ status code.
const (
	payloadOpenSessionResponse = 0x11
	payloadRAKP2               = 0x13
	payloadRAKP4               = 0x15
)

// observe records what a datagram from the BMC says about session setup.
// An RMCP+ packet is the RMCP header (4 bytes), then auth type 06h, the
// payload type, the session ID and sequence (4 bytes each), the payload
// length (2) and the payload: message tag, status code, ...
func (w *wire) observe(p []byte) {
	const payloadAt = 4 + 1 + 1 + 4 + 4 + 2
	if len(p) < payloadAt+2 || p[0] != 0x06 || p[3] != 0x07 || p[4] != 0x06 {
		return
	}
	pt := p[5] & 0x3f
	if pt != payloadOpenSessionResponse && pt != payloadRAKP2 && pt != payloadRAKP4 {
		return
	}
	st := types.RmcpStatusCode(p[payloadAt+1])
	w.mu.Lock()
	defer w.mu.Unlock()
	if st != types.RmcpStatusCodeNoErrors && !w.hasStatus {
		w.status, w.hasStatus = st, true
	}
	if pt == payloadRAKP4 && st == types.RmcpStatusCodeNoErrors {
		w.opened = true
	}
}

func (w *wire) observeErr(err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.readErr = err
	var errno syscall.Errno
	if errors.As(err, &errno) {
		w.readErr = errno
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		w.timedOut = true
	}
}

// wireConn is the socket go-ipmi uses, reporting every read to its wire.
type wireConn struct {
	net.Conn
	w *wire
}

func (c *wireConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if n > 0 {
		c.w.observe(b[:n])
	}
	if err != nil {
		c.w.observeErr(err)
	}
	return n, err
}
