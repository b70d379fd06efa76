package ipmi_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/bougou/go-ipmi/pkg/client"
	"github.com/bougou/go-ipmi/pkg/types"

	"github.com/shepherd/shepherd/internal/secret"
	"github.com/shepherd/shepherd/power"
	"github.com/shepherd/shepherd/power/ipmi"
	"github.com/shepherd/shepherd/power/ipmi/ipmisim"
)

func newDriver(t *testing.T, spec power.Spec) *ipmi.Driver {
	t.Helper()
	d, err := ipmi.New(spec)
	if err != nil {
		t.Fatalf("New(%s) error = %v", spec, err)
	}
	return d
}

// callCtx bounds one driver call in a test.
func callCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func wantState(t *testing.T, d *ipmi.Driver, bmc *ipmisim.BMC, want power.State) {
	t.Helper()
	got, err := d.State(callCtx(t))
	if err != nil || got != want {
		t.Fatalf("State() = %q, %v; want %q, nil", got, err, want)
	}
	if got, err := bmc.Power(); err != nil || got != want {
		t.Fatalf("simulator's recorded power = %q, %v; want %q", got, err, want)
	}
	// ipmitool, another client, reads what the driver set.
	out, err := bmc.Ipmitool(callCtx(t), "chassis", "power", "status")
	if err != nil {
		t.Fatal(err)
	}
	if wantOut := "Chassis Power is " + string(want); !strings.Contains(out, wantOut) {
		t.Fatalf("ipmitool chassis power status = %q, want %q", out, wantOut)
	}
}

func lines(t *testing.T, path string) []string {
	t.Helper()
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	} else if err != nil {
		t.Fatal(err)
	}
	return strings.Fields(string(data))
}

// TestOffOn: Off and On run the BMC's power commands (the hook and the
// caller's command), State reads the result, and ipmitool agrees.
func TestOffOn(t *testing.T) {
	t.Parallel()
	side := filepath.Join(t.TempDir(), "side-effects")
	bmc := ipmisim.Start(t, ipmisim.Config{
		On:       true,
		PowerOn:  []string{"sh", "-c", "echo on >>" + side},
		PowerOff: []string{"sh", "-c", "echo off >>" + side},
	})
	d := newDriver(t, bmc.Spec())
	wantState(t, d, bmc, power.On)

	if err := d.Off(callCtx(t)); err != nil {
		t.Fatalf("Off() error = %v", err)
	}
	wantState(t, d, bmc, power.Off)
	if got := lines(t, side); !slices.Equal(got, []string{"off"}) {
		t.Fatalf("power commands run after Off = %q, want [off]", got)
	}

	if err := d.On(callCtx(t)); err != nil {
		t.Fatalf("On() error = %v", err)
	}
	wantState(t, d, bmc, power.On)
	if got := lines(t, side); !slices.Equal(got, []string{"off", "on"}) {
		t.Fatalf("power commands run after Off, On = %q, want [off on]", got)
	}
	calls, err := bmc.Calls()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(calls, "set power 0") || !slices.Contains(calls, "set power 1") {
		t.Fatalf("hook calls = %q, want set power 0 and set power 1 among them", calls)
	}
}

// TestOffWhenOff: ipmi_sim, like most BMCs, accepts power down on a machine
// that is off, so the driver returns nil (ErrWrongState only comes from a
// BMC that answers 0xD5).
func TestOffWhenOff(t *testing.T) {
	t.Parallel()
	bmc := ipmisim.Start(t, ipmisim.Config{})
	d := newDriver(t, bmc.Spec())
	wantState(t, d, bmc, power.Off)
	if err := d.Off(callCtx(t)); err != nil {
		t.Fatalf("Off() on a machine that is off: error = %v, want nil", err)
	}
	wantState(t, d, bmc, power.Off)
}

// TestPowerCommandFails: when the BMC cannot switch the power (its power
// command failed: completion code FFh), On fails with the BMC's words and
// the state stays as it was.
func TestPowerCommandFails(t *testing.T) {
	t.Parallel()
	bmc := ipmisim.Start(t, ipmisim.Config{PowerOn: []string{"false"}})
	d := newDriver(t, bmc.Spec())
	err := d.On(callCtx(t))
	if err == nil {
		t.Fatal("On() error = nil, want the BMC's failure")
	}
	if !strings.Contains(err.Error(), "0xff") {
		t.Errorf("On() error = %q, want the completion code 0xff in it", err)
	}
	if got := power.Class(err); got != "other" {
		t.Errorf("Class(%v) = %q, want other", err, got)
	}
	wantState(t, d, bmc, power.Off)
}

// TestSetNextBoot: the boot flags reach the BMC as a one-time boot device,
// as ipmitool reads them back.
func TestSetNextBoot(t *testing.T) {
	t.Parallel()
	bmc := ipmisim.Start(t, ipmisim.Config{})
	d := newDriver(t, bmc.Spec())
	for _, tt := range []struct {
		dev      power.BootDevice
		ipmitool string
	}{
		{power.BootPXE, "Force PXE"},
		{power.BootDisk, "Force Boot from default Hard-Drive"},
		{power.BootPXE, "Force PXE"},
	} {
		if err := d.SetNextBoot(callCtx(t), tt.dev); err != nil {
			t.Fatalf("SetNextBoot(%s) error = %v", tt.dev, err)
		}
		if got, err := bmc.NextBoot(); err != nil || got != tt.dev {
			t.Fatalf("after SetNextBoot(%s) the simulator's boot device = %q, %v", tt.dev, got, err)
		}
		out, err := bmc.Ipmitool(callCtx(t), "chassis", "bootparam", "get", "5")
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(out, tt.ipmitool) || !strings.Contains(out, "Options apply to only next boot") {
			t.Fatalf("after SetNextBoot(%s) ipmitool reads:\n%s\nwant %q, for the next boot only", tt.dev, out, tt.ipmitool)
		}
	}
	err := d.SetNextBoot(callCtx(t), "cdrom")
	if !errors.Is(err, power.ErrUnsupported) {
		t.Fatalf("SetNextBoot(cdrom) error = %v, want ErrUnsupported", err)
	}
}

// TestAuth: a wrong password or an unknown user is ErrAuth, with the BMC's
// reason, and no error carries a password.
func TestAuth(t *testing.T) {
	t.Parallel()
	bmc := ipmisim.Start(t, ipmisim.Config{})
	const wrong = "Wr0ng-Passw0rd-42"
	for _, tt := range []struct {
		name, user, password, words string
	}{
		{"wrong password", bmc.Username, wrong, "RAKP"},
		{"unknown user", "nobody", wrong, "Unauthorized name"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			spec := bmc.Spec()
			spec.Username, spec.Password = tt.user, secret.New(tt.password)
			_, err := newDriver(t, spec).State(callCtx(t))
			if !errors.Is(err, power.ErrAuth) {
				t.Fatalf("State() error = %v, want ErrAuth", err)
			}
			if !strings.Contains(err.Error(), tt.words) {
				t.Errorf("State() error = %q, want the BMC's reason %q in it", err, tt.words)
			}
			for _, pw := range []string{tt.password, bmc.Password.Reveal()} {
				if strings.Contains(err.Error(), pw) || strings.Contains(fmtAll(err), pw) {
					t.Fatalf("State() error contains a password: %q", err)
				}
			}
		})
	}
}

// fmtAll is the text of err and of every error it wraps.
func fmtAll(err error) string {
	var s strings.Builder
	for err != nil {
		s.WriteString(err.Error())
		if u, ok := err.(interface{ Unwrap() []error }); ok {
			for _, e := range u.Unwrap() {
				s.WriteString(fmtAll(e))
			}
			break
		}
		err = errors.Unwrap(err)
	}
	return s.String()
}

// TestCipherSuite: 0 means 3 and works; ipmi_sim does not offer 17, and
// asking for it fails at once as ErrUnsupported with the BMC's words.
func TestCipherSuite(t *testing.T) {
	t.Parallel()
	bmc := ipmisim.Start(t, ipmisim.Config{})
	for _, cs := range []int{0, 3} {
		spec := bmc.Spec()
		spec.CipherSuite = cs
		if _, err := newDriver(t, spec).State(callCtx(t)); err != nil {
			t.Fatalf("State() with cipher suite %d: error = %v", cs, err)
		}
	}
	spec := bmc.Spec()
	spec.CipherSuite = 17
	start := time.Now()
	_, err := newDriver(t, spec).State(callCtx(t))
	if !errors.Is(err, power.ErrUnsupported) {
		t.Fatalf("State() with cipher suite 17: error = %v, want ErrUnsupported", err)
	}
	if !strings.Contains(err.Error(), "Invalid authentication algorithm") {
		t.Errorf("State() with cipher suite 17: error = %q, want the BMC's reason", err)
	}
	// No retries of a refusal: the BMC answered at once.
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("State() with cipher suite 17 took %s, want an answer at once", d)
	}
}

// TestSessionsClosed: every call closes its session, so many more calls
// than ipmi_sim's 63 session slots all succeed and leave none open.
func TestSessionsClosed(t *testing.T) {
	t.Parallel()
	bmc := ipmisim.Start(t, ipmisim.Config{})
	d := newDriver(t, bmc.Spec())
	const calls = 70 // > 63 slots: leaked sessions would exhaust the table
	for i := range calls {
		var err error
		if i%10 == 9 {
			_, err = d.State(callCtx(t))
		} else {
			err = d.Off(callCtx(t))
		}
		if err != nil {
			t.Fatalf("call %d of %d: error = %v", i+1, calls, err)
		}
	}
	n, err := bmc.ActiveSessions(callCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	if n != 1 { // ipmitool's own
		t.Fatalf("after %d calls the BMC has %d sessions open, want only ipmitool's", calls, n)
	}
}

// TestOutOfSessions: a BMC whose session table is full answers Open
// Session with "insufficient resources", which is ErrBusy; once sessions
// are freed the driver gets in again.
func TestOutOfSessions(t *testing.T) {
	t.Parallel()
	bmc := ipmisim.Start(t, ipmisim.Config{})
	var held []*client.Client
	closeHeld := func() {
		for _, c := range held {
			_ = c.Close(context.Background())
		}
		held = nil
	}
	t.Cleanup(closeHeld)
	for len(held) < 100 {
		c, err := client.NewClient(bmc.Addr.Addr().String(), int(bmc.Addr.Port()), bmc.Username, bmc.Password.Reveal())
		if err != nil {
			t.Fatal(err)
		}
		c.WithCipherSuiteID(types.CipherSuiteID3)
		if err := c.Connect(callCtx(t)); err != nil {
			cctx, cancel := context.WithCancel(t.Context())
			cancel()
			_ = c.Close(cctx)
			break
		}
		held = append(held, c)
	}
	if len(held) == 100 {
		t.Fatal("the simulator opened 100 sessions; want it to run out sooner")
	}
	d := newDriver(t, bmc.Spec())
	_, err := d.State(callCtx(t))
	if !errors.Is(err, power.ErrBusy) || !strings.Contains(err.Error(), "Insufficient resources") {
		t.Fatalf("State() with %d sessions held: error = %v, want ErrBusy with the BMC's reason", len(held), err)
	}
	closeHeld()
	if _, err := d.State(callCtx(t)); err != nil {
		t.Fatalf("State() after the sessions were closed: error = %v", err)
	}
}

// blackHole is a UDP socket that reads datagrams and never answers, as a
// BMC behind a dropping firewall. got receives one value per datagram.
func blackHole(t *testing.T) (addr *net.UDPAddr, got <-chan struct{}) {
	t.Helper()
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ch := make(chan struct{}, 1000)
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 2048)
		for {
			if _, _, err := pc.ReadFrom(buf); err != nil {
				return
			}
			select {
			case ch <- struct{}{}:
			default:
			}
		}
	}()
	t.Cleanup(func() {
		pc.Close()
		<-done
	})
	return pc.LocalAddr().(*net.UDPAddr), ch
}

func specAt(addr *net.UDPAddr) power.Spec {
	return power.Spec{Driver: power.DriverIPMI, Address: addr.IP.String(), Port: addr.Port,
		Username: "shepherd", Password: secret.New("some-password")}
}

// TestUnreachable: a BMC that never answers is ErrUnreachable by the
// deadline, not after go-ipmi's retries (5 s per step); a closed port is
// ErrUnreachable at once.
func TestUnreachable(t *testing.T) {
	t.Parallel()
	t.Run("black hole", func(t *testing.T) {
		t.Parallel()
		addr, got := blackHole(t)
		d := newDriver(t, specAt(addr))
		const timeout = 300 * time.Millisecond
		ctx, cancel := context.WithTimeout(t.Context(), timeout)
		defer cancel()
		start := time.Now()
		_, err := d.State(ctx)
		elapsed := time.Since(start)
		if !errors.Is(err, power.ErrUnreachable) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("State() error = %v, want ErrUnreachable and DeadlineExceeded", err)
		}
		if elapsed > timeout+500*time.Millisecond {
			t.Fatalf("State() returned %s after its %s deadline", elapsed-timeout, timeout)
		}
		select {
		case <-got:
		default:
			t.Fatal("the black hole got no datagram: the driver sent nothing there")
		}
	})
	t.Run("nothing listening", func(t *testing.T) {
		t.Parallel()
		pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := pc.LocalAddr().(*net.UDPAddr)
		pc.Close()
		start := time.Now()
		err = newDriver(t, specAt(addr)).Off(callCtx(t))
		if !errors.Is(err, power.ErrUnreachable) || !strings.Contains(err.Error(), "refused") {
			t.Fatalf("Off() error = %v, want ErrUnreachable, connection refused", err)
		}
		if d := time.Since(start); d > 2*time.Second {
			t.Errorf("Off() took %s to find nothing listening", d)
		}
	})
	t.Run("simulator stopped", func(t *testing.T) {
		t.Parallel()
		bmc := ipmisim.Start(t, ipmisim.Config{})
		d := newDriver(t, bmc.Spec())
		wantState(t, d, bmc, power.Off)
		bmc.Stop()
		_, err := d.State(callCtx(t))
		if !errors.Is(err, power.ErrUnreachable) {
			t.Fatalf("State() of a stopped BMC: error = %v, want ErrUnreachable", err)
		}
	})
}

// TestCancel: cancelling ctx ends a call at once, whether the BMC never
// answers or is in the middle of a command, and the session the call
// opened is still closed.
func TestCancel(t *testing.T) {
	t.Parallel()
	t.Run("black hole", func(t *testing.T) {
		t.Parallel()
		addr, got := blackHole(t)
		d := newDriver(t, specAt(addr))
		ctx, cancel := context.WithCancel(t.Context())
		errc := make(chan error, 1)
		go func() { errc <- d.On(ctx) }()
		<-got // the driver is waiting for an answer
		cancel()
		cancelled := time.Now()
		select {
		case err := <-errc:
			if !errors.Is(err, context.Canceled) || power.Class(err) != "canceled" {
				t.Fatalf("On() error = %v (class %s), want context.Canceled", err, power.Class(err))
			}
			if d := time.Since(cancelled); d > 300*time.Millisecond {
				t.Fatalf("On() returned %s after ctx was cancelled", d)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("On() did not return within 5 s of ctx being cancelled")
		}
	})
	t.Run("busy BMC", func(t *testing.T) {
		t.Parallel()
		// The power off command waits for release, so ipmi_sim is stuck
		// in the middle of the driver's Off until the test lets it go.
		dir := t.TempDir()
		release := filepath.Join(dir, "release")
		started := filepath.Join(dir, "started")
		bmc := ipmisim.Start(t, ipmisim.Config{On: true, PowerOff: []string{"sh", "-c",
			`touch "$1"; while [ ! -e "$2" ]; do sleep 0.01; done`, "sh", started, release}})
		t.Cleanup(func() { _ = os.WriteFile(release, nil, 0o600) })
		d := newDriver(t, bmc.Spec())
		ctx, cancel := context.WithCancel(t.Context())
		errc := make(chan error, 1)
		go func() { errc <- d.Off(ctx) }()
		waitFor(t, 10*time.Second, "the power off command started", func() bool {
			_, err := os.Stat(started)
			return err == nil
		})
		cancel()
		cancelled := time.Now()
		var err error
		select {
		case err = <-errc:
		case <-time.After(10 * time.Second):
			t.Fatal("Off() did not return within 10 s of ctx being cancelled")
		}
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("Off() error = %v, want context.Canceled", err)
		}
		// The BMC cannot answer Close Session while it is stuck, so the
		// call waits for it no longer than the close timeout (2 s).
		if d := time.Since(cancelled); d > 3*time.Second {
			t.Fatalf("Off() returned %s after ctx was cancelled", d)
		}
		if err := os.WriteFile(release, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		// The Close Session the driver sent is handled once the BMC is
		// free again: only ipmitool's own session is left.
		waitFor(t, 10*time.Second, "the cancelled call's session is closed", func() bool {
			n, err := bmc.ActiveSessions(t.Context())
			return err == nil && n == 1
		})
		wantState(t, d, bmc, power.Off)
	})
}

// waitFor polls cond until it is true, failing the test at the deadline.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), timeout)
	defer cancel()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("%s: still false after %s", what, timeout)
		case <-tick.C:
		}
	}
}

// TestNew: New refuses specs the driver cannot use, naming the problem.
func TestNew(t *testing.T) {
	t.Parallel()
	good := power.Spec{Driver: power.DriverIPMI, Address: "10.0.0.7", Username: "admin", Password: secret.New("pw")}
	for _, tt := range []struct {
		name   string
		change func(*power.Spec)
		want   string
	}{
		{"redfish", func(s *power.Spec) { s.Driver = power.DriverRedfish }, `driver "redfish"`},
		{"no password", func(s *power.Spec) { s.Password = secret.String{} }, "password missing"},
		{"cipher suite 5", func(s *power.Spec) { s.CipherSuite = 5 }, "cipher_suite 5"},
		{"long user", func(s *power.Spec) { s.Username = strings.Repeat("u", 17) }, "username is 17 bytes"},
		{"long password", func(s *power.Spec) { s.Password = secret.New(strings.Repeat("p", 21)) }, "password is 21 bytes"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			spec := good
			tt.change(&spec)
			_, err := ipmi.New(spec)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("New() error = %v, want one saying %q", err, tt.want)
			}
			if strings.Contains(err.Error(), strings.Repeat("p", 21)) {
				t.Fatalf("New() error contains the password: %v", err)
			}
		})
	}
	if _, err := ipmi.New(good); err != nil {
		t.Fatalf("New(%s) error = %v", good, err)
	}
	// IPMI's limits themselves are allowed. (ipmi_sim cannot take
	// credentials that long, so no test logs in with them: see ipmisim.Config.)
	atLimits := good
	atLimits.Username, atLimits.Password = strings.Repeat("u", 16), secret.New(strings.Repeat("p", 20))
	if _, err := ipmi.New(atLimits); err != nil {
		t.Fatalf("New() with a 16-byte username and a 20-byte password: error = %v", err)
	}
}

// TestPasswordNeverInError: an error whose text happens to contain the
// password (here a word that the error of a closed port has) is withheld,
// and keeps its class.
func TestPasswordNeverInError(t *testing.T) {
	t.Parallel()
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := pc.LocalAddr().(*net.UDPAddr)
	pc.Close()
	spec := specAt(addr)
	spec.Password = secret.New("refused")
	err = newDriver(t, spec).Off(callCtx(t))
	if !errors.Is(err, power.ErrUnreachable) {
		t.Fatalf("Off() error = %v, want ErrUnreachable", err)
	}
	if strings.Contains(err.Error(), "refused") || !strings.Contains(err.Error(), "withheld") {
		t.Fatalf("Off() error = %q, want its text withheld: it contains the password", err)
	}
}

// udpSocketsTo counts this host's UDP sockets connected to addr
// (/proc/net/udp lists them with their remote address).
func udpSocketsTo(t *testing.T, addr netip.AddrPort) int {
	t.Helper()
	data, err := os.ReadFile("/proc/net/udp")
	if err != nil {
		t.Fatal(err)
	}
	ip := addr.Addr().As4() // /proc/net/udp writes the address in host order (little endian)
	want := fmt.Sprintf("%02X%02X%02X%02X:%04X", ip[3], ip[2], ip[1], ip[0], addr.Port())
	n := 0
	for _, line := range strings.Split(string(data), "\n")[1:] {
		if f := strings.Fields(line); len(f) > 2 && f[2] == want {
			n++
		}
	}
	return n
}

// TestSocketClosed: a call closes its socket whether or not the BMC
// opened a session: after a refused login as after a command.
func TestSocketClosed(t *testing.T) {
	t.Parallel()
	bmc := ipmisim.Start(t, ipmisim.Config{})
	wrongPassword := bmc.Spec()
	wrongPassword.Password = secret.New("Wr0ng-Passw0rd-42")
	unknownUser := bmc.Spec()
	unknownUser.Username = "nobody"
	for _, spec := range []power.Spec{wrongPassword, unknownUser, bmc.Spec()} {
		_, err := newDriver(t, spec).State(callCtx(t))
		if spec.Password.Reveal() == bmc.Password.Reveal() && spec.Username == bmc.Username {
			if err != nil {
				t.Fatalf("State() error = %v", err)
			}
		} else if !errors.Is(err, power.ErrAuth) {
			t.Fatalf("State() as %s error = %v, want ErrAuth", spec.Username, err)
		}
		if n := udpSocketsTo(t, bmc.Addr); n != 0 {
			t.Fatalf("after State() as %s, %d sockets to the BMC are open, want 0", spec.Username, n)
		}
	}
}

// TestBMCGoneInSetup: a BMC that goes away in the middle of session setup
// (it answered the first request, then its port is closed) is
// ErrUnreachable, though go-ipmi keeps only the text of session setup's
// errors: the refusal is read off the socket.
func TestBMCGoneInSetup(t *testing.T) {
	t.Parallel()
	bmc := ipmisim.Start(t, ipmisim.Config{})
	proxy := relayOnce(t, bmc.Addr)
	spec := bmc.Spec()
	spec.Address, spec.Port = proxy.IP.String(), proxy.Port
	start := time.Now()
	_, err := newDriver(t, spec).State(callCtx(t))
	if !errors.Is(err, power.ErrUnreachable) || !strings.Contains(err.Error(), "nothing listens") {
		t.Fatalf("State() error = %v, want ErrUnreachable, nothing listens", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("State() took %s to find the BMC gone", d)
	}
}

// relayOnce listens on a UDP port of its own, relays the first datagram it
// gets to bmc and bmc's answer back, and then closes its port, as a BMC
// that died after one answer.
func relayOnce(t *testing.T, bmc netip.AddrPort) *net.UDPAddr {
	t.Helper()
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	up, err := net.DialUDP("udp4", nil, net.UDPAddrFromAddrPort(bmc))
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer pc.Close()
		defer up.Close()
		buf := make([]byte, 2048)
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			return
		}
		if _, err := up.Write(buf[:n]); err != nil {
			return
		}
		_ = up.SetReadDeadline(time.Now().Add(10 * time.Second))
		if n, err = up.Read(buf); err != nil {
			return
		}
		_, _ = pc.WriteTo(buf[:n], from)
	}()
	t.Cleanup(func() {
		pc.Close()
		up.Close()
		<-done
	})
	return pc.LocalAddr().(*net.UDPAddr)
}
