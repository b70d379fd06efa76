// Package ipmisim runs real IPMI BMCs for tests: one OpenIPMI ipmi_sim
// process per simulated machine, listening for IPMI v2.0 LAN (RMCP+) on
// 127.0.0.1 and a free UDP port, with its own user and password.
//
// Its chassis power is a hook script (ipmi_sim's chassis_control program)
// that runs a command the test chooses on power on and power off (the
// end-to-end tests stop and start a machine's sshd with it), and records the
// power state, the next boot device and every call it got in files, so a test
// can see what the BMC was asked to do. ipmi_sim runs the hook synchronously
// and answers the IPMI command only after it returned: a slow command makes a
// slow BMC.
//
// ipmi_sim and ipmitool come from Debian's openipmi and ipmitool packages,
// which scripts/require-openipmi installs. A missing ipmi_sim fails the test
// (it is not skipped): the IPMI driver must not go untested because a
// machine lacks a package.
//
// Facts about ipmi_sim (OpenIPMI 2.0.33) that the tests rely on: it offers
// cipher suites 0 to 3 and refuses 17 (Open Session status 04h, "invalid
// authentication algorithm"); it has a session table of 63 slots and frees a
// session that was not closed only after 30 to 60 s of inactivity; it does
// not answer Get Channel Cipher Suites, which costs ipmitool 10 s unless it
// is given -C; it sets SO_REUSEADDR, so a second ipmi_sim on a taken port
// starts without an error and steals some of the first one's datagrams (so
// Start checks that the BMC answering is its own).
package ipmisim

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/bougou/go-ipmi/pkg/client"
	"github.com/bougou/go-ipmi/pkg/types"

	"github.com/shepherd/shepherd/internal/secret"
	"github.com/shepherd/shepherd/internal/shellquote"
	"github.com/shepherd/shepherd/power"
)

// RequireScript is the script that installs ipmi_sim and ipmitool; messages
// about a missing binary name it.
const RequireScript = "scripts/require-openipmi"

// Config describes one simulated BMC. The zero value is a BMC of a machine
// that is off, with user "shepherd" and a random password, whose power
// commands only record the state.
type Config struct {
	// Username is the IPMI user; default "shepherd". At most 15 bytes,
	// one less than IPMI allows: ipmi_sim (OpenIPMI 2.0.33) takes a
	// 16-byte name from lan.conf but never lets it log in.
	Username string
	// Password is the user's password; default random. At most 19 bytes,
	// one less than IPMI allows: with a 20-byte password in lan.conf
	// ipmi_sim answers nothing at all.
	Password string
	// On is the machine's power state at start; default off. The
	// PowerOn command is not run for it.
	On bool
	// PowerOn is a command (program and arguments, run without a shell)
	// that the BMC runs when it powers the machine on, before it records
	// the machine as on; empty means none. If it fails, the power command
	// fails (completion code FFh) and the state stays as it was. Its output
	// goes to the hook's log (Dir/hook.log); it must not stay in the
	// foreground, since ipmi_sim waits for it.
	PowerOn []string
	// PowerOff is PowerOn's counterpart for power off.
	PowerOff []string
}

// BMC is one running ipmi_sim. Stop (also run at test cleanup) ends it.
type BMC struct {
	// Addr is where the BMC listens for RMCP+ (127.0.0.1 and a UDP port).
	Addr netip.AddrPort
	// Username and Password are the BMC user's credentials.
	Username string
	Password secret.String
	// Dir holds the configuration, the hook, its state and logs.
	Dir string

	stopOnce sync.Once
	cmd      *exec.Cmd
	done     chan struct{} // closed when ipmi_sim has exited
}

// ports are the UDP ports given to BMCs of this process, so that two BMCs
// started at once never get the same one (ipmi_sim would not notice).
var ports = struct {
	sync.Mutex
	used map[uint16]bool
}{used: map[uint16]bool{}}

// startTimeout bounds one try at starting ipmi_sim, until it answers a
// login. It starts in milliseconds; the rest is for a loaded machine.
const startTimeout = 10 * time.Second

// Start starts a BMC for cfg and stops it at the test's cleanup. It fails
// the test if ipmi_sim is missing or does not come up.
func Start(t testing.TB, cfg Config) *BMC {
	t.Helper()
	path, err := exec.LookPath("ipmi_sim")
	if err != nil {
		t.Fatalf("ipmisim: ipmi_sim, OpenIPMI's BMC simulator, is not installed (%v): run %s (it installs Debian's openipmi and ipmitool)", err, RequireScript)
	}
	if cfg.Username == "" {
		cfg.Username = "shepherd"
	}
	if cfg.Password == "" {
		cfg.Password = randomPassword(t)
	}
	if len(cfg.Username) > 15 || len(cfg.Password) > 19 {
		t.Fatalf("ipmisim: username (%d bytes) must be at most 15, password (%d bytes) at most 19: ipmi_sim fails with IPMI's own limits", len(cfg.Username), len(cfg.Password))
	}
	for _, s := range []string{cfg.Username, cfg.Password} {
		if strings.ContainsAny(s, "\" \t\n\\") {
			t.Fatalf("ipmisim: username and password must not contain quotes, blanks or backslashes (lan.conf cannot hold them)")
		}
	}
	dir := t.TempDir()
	if strings.ContainsAny(dir, "\" \t\n\\'") {
		t.Fatalf("ipmisim: directory %q has characters lan.conf cannot quote", dir)
	}
	b := &BMC{Username: cfg.Username, Password: secret.New(cfg.Password), Dir: dir}
	if err := b.writeFiles(cfg); err != nil {
		t.Fatalf("ipmisim: %v", err)
	}
	var lastErr error
	for range 3 { // a new port each time: another BMC may have taken the last one
		port, err := reservePort()
		if err != nil {
			t.Fatalf("ipmisim: %v", err)
		}
		b.Addr = netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, 1}), port)
		lastErr = b.start(t.Context(), path)
		if lastErr == nil {
			t.Cleanup(func() {
				b.Stop()
				releasePort(port)
			})
			return b
		}
		releasePort(port)
		if t.Context().Err() != nil {
			break
		}
	}
	t.Fatalf("ipmisim: starting ipmi_sim: %v\n%s", lastErr, b.logTail())
	return nil
}

// randomPassword returns 16 random letters and digits.
func randomPassword(t testing.TB) string {
	const alphabet = "abcdefghijkmnopqrstuvwxyzABCDEFGHJKLMNPQRSTUVWXYZ23456789"
	var buf [16]byte
	if _, err := rand.Read(buf[:]); err != nil {
		t.Fatalf("ipmisim: %v", err)
	}
	for i := range buf {
		buf[i] = alphabet[int(buf[i])%len(alphabet)]
	}
	return string(buf[:])
}

// reservePort asks the kernel for a UDP port that is free now and that no
// other BMC of this process has.
func reservePort() (uint16, error) {
	ports.Lock()
	defer ports.Unlock()
	for range 100 {
		pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
		if err != nil {
			return 0, fmt.Errorf("finding a free UDP port: %w", err)
		}
		port := uint16(pc.LocalAddr().(*net.UDPAddr).Port)
		if err := pc.Close(); err != nil {
			return 0, fmt.Errorf("closing the probe of UDP port %d: %w", port, err)
		}
		if !ports.used[port] {
			ports.used[port] = true
			return port, nil
		}
	}
	return 0, errors.New("no free UDP port after 100 tries")
}

func releasePort(port uint16) {
	ports.Lock()
	defer ports.Unlock()
	delete(ports.used, port)
}

func (b *BMC) path(name string) string { return filepath.Join(b.Dir, name) }

// writeFiles writes the hook, its initial state and the emulator commands;
// lan.conf is written by start, for its port.
func (b *BMC) writeFiles(cfg Config) error {
	state := "0"
	if cfg.On {
		state = "1"
	}
	files := []struct {
		name string
		data string
		mode os.FileMode
	}{
		{"power", state + "\n", 0o600},
		{"boot", "none\n", 0o600},
		{"calls", "", 0o600},
		{"hook", hookScript(b.Dir, cfg.PowerOn, cfg.PowerOff), 0o700},
		// One BMC at IPMB address 20h (ipmi_sim starts with none), as the
		// sample ipmisim1.emu of OpenIPMI sets it up.
		{"bmc.emu", "mc_setbmc 0x20\nmc_add 0x20 0 no-device-sdrs 0x23 9 8 0x9f 0x1291 0xf02 persist_sdr\nmc_enable 0x20\n", 0o600},
	}
	for _, f := range files {
		if err := os.WriteFile(b.path(f.name), []byte(f.data), f.mode); err != nil {
			return err
		}
	}
	return os.Mkdir(b.path("state"), 0o700)
}

// lanConf is ipmi_lan(5)'s configuration: one LAN channel on b.Addr, the
// hook as chassis control, and one user allowed up to Administrator.
func (b *BMC) lanConf() string {
	return fmt.Sprintf(`# Written by ipmisim; see ipmi_lan(5).
name "ipmisim"
set_working_mc 0x20
  startlan 1
    addr %s %d
    priv_limit admin
    allowed_auths_callback md5
    allowed_auths_user md5
    allowed_auths_operator md5
    allowed_auths_admin md5
    guid %x
  endlan
  chassis_control "%s 0x20"
  user 2 true "%s" "%s" admin 10 md5
`, b.Addr.Addr(), b.Addr.Port(), []byte(fmt.Sprintf("ipmisim%09d", b.Addr.Port())), b.path("hook"), b.Username, b.Password.Reveal())
}

// hookScript is the chassis_control program ipmi_sim runs (through sh) as
//
//	hook DEVICE get PARAM...          (prints PARAM:VALUE lines)
//	hook DEVICE set PARAM VALUE...
//
// with PARAM power (0 or 1), boot (none, pxe, default, cdrom, bios), reset,
// shutdown or identify. It logs every call to calls, runs the power
// commands and keeps the state in the files power and boot.
func hookScript(dir string, on, off []string) string {
	return `#!/bin/sh
# Written by ipmisim: ipmi_sim's chassis_control program.
dir=` + shellquote.Quote(dir) + `
shift # the device (IPMB address)
echo "$*" >>"$dir/calls"
power_on() { ` + shellCommand(on) + `; }
power_off() { ` + shellCommand(off) + `; }
record() { printf '%s\n' "$2" >"$dir/$1.tmp" && mv "$dir/$1.tmp" "$dir/$1"; }
op=$1
shift
case $op in
get)
	for p in "$@"; do
		case $p in
		power|boot) printf '%s:%s\n' "$p" "$(cat "$dir/$p")" ;;
		*) echo "ipmisim hook: cannot get $p"; exit 1 ;;
		esac
	done
	;;
set)
	while [ $# -ge 2 ]; do
		p=$1 v=$2
		shift 2
		case $p in
		power)
			if [ "$v" = 1 ]; then
				power_on >>"$dir/hook.log" 2>&1 </dev/null || { echo "ipmisim hook: power on command failed"; exit 1; }
			else
				power_off >>"$dir/hook.log" 2>&1 </dev/null || { echo "ipmisim hook: power off command failed"; exit 1; }
			fi
			record power "$v"
			;;
		boot) record boot "$v" ;;
		identify) shift ;; # interval, then force
		reset|shutdown) ;;
		*) echo "ipmisim hook: cannot set $p"; exit 1 ;;
		esac
	done
	;;
*)
	echo "ipmisim hook: unknown operation $op"
	exit 1
	;;
esac
`
}

// shellCommand quotes argv for sh, or is ":" (do nothing) when it is empty.
func shellCommand(argv []string) string {
	if len(argv) == 0 {
		return ":"
	}
	return shellquote.Join(argv...)
}

// start writes lan.conf for b.Addr, starts ipmi_sim and waits until it
// lets b's user log in (which proves that the BMC on the port is this one).
func (b *BMC) start(ctx context.Context, path string) error {
	if err := os.WriteFile(b.path("lan.conf"), []byte(b.lanConf()), 0o600); err != nil {
		return err
	}
	logf, err := os.OpenFile(b.path("ipmi_sim.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer logf.Close() // the child has its own copy
	fmt.Fprintf(logf, "--- ipmisim: starting %s on %s at %s ---\n", path, b.Addr, time.Now().Format(time.RFC3339Nano))
	// -n: no console on stdin/stdout; -s: persistent state (users, SDRs)
	// in our directory, not /var/ipmi_sim.
	cmd := exec.Command(path, "-n", "-c", b.path("lan.conf"), "-f", b.path("bmc.emu"), "-s", b.path("state"))
	cmd.Dir = b.Dir
	cmd.Stdout, cmd.Stderr = logf, logf
	// Kill ipmi_sim if the test process dies without cleaning up.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", path, err)
	}
	done := make(chan struct{})
	var waitErr error
	go func() {
		waitErr = cmd.Wait()
		close(done)
	}()

	ctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		err := b.login(ctx)
		if err == nil {
			b.cmd, b.done = cmd, done
			return nil
		}
		select {
		case <-done:
			return fmt.Errorf("ipmi_sim exited before it answered (%v); last login error: %v", waitErr, err)
		case <-ctx.Done():
			_ = cmd.Process.Kill()
			<-done
			return fmt.Errorf("ipmi_sim on %s did not let %s log in within %s: %v", b.Addr, b.Username, startTimeout, err)
		case <-tick.C:
		}
	}
}

// login opens and closes an RMCP+ session as b's user.
func (b *BMC) login(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	c, err := client.NewClient(b.Addr.Addr().String(), int(b.Addr.Port()), b.Username, b.Password.Reveal())
	if err != nil {
		return err
	}
	c.WithCipherSuiteID(types.CipherSuiteID3).WithTimeout(100 * time.Millisecond).WithRetry(0)
	if err := c.Connect(ctx); err != nil {
		closeCtx, cancel := context.WithCancel(context.Background())
		cancel() // nothing to close on the BMC: only the socket
		_ = c.Close(closeCtx)
		return err
	}
	return c.Close(ctx)
}

// Freeze stops ipmi_sim (SIGSTOP) without ending it: a hung BMC, which
// takes datagrams and never answers, until Stop.
func (b *BMC) Freeze() error {
	if err := b.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		return fmt.Errorf("ipmisim: freezing: %w", err)
	}
	return nil
}

// Stop ends ipmi_sim (SIGTERM, then SIGKILL after 5 s), frozen or not, and
// waits for it. Calls after the first do nothing.
func (b *BMC) Stop() {
	b.stopOnce.Do(func() {
		if b.cmd == nil {
			return
		}
		_ = b.cmd.Process.Signal(syscall.SIGTERM)
		_ = b.cmd.Process.Signal(syscall.SIGCONT) // a frozen one takes the SIGTERM now
		select {
		case <-b.done:
		case <-time.After(5 * time.Second):
			_ = b.cmd.Process.Kill()
			<-b.done
		}
	})
}

// Spec returns the power.Spec for reaching the BMC as its user.
func (b *BMC) Spec() power.Spec {
	return power.Spec{
		Driver:   power.DriverIPMI,
		Address:  b.Addr.Addr().String(),
		Port:     int(b.Addr.Port()),
		Username: b.Username,
		Password: b.Password,
	}
}

// Power returns the power state the hook last recorded.
func (b *BMC) Power() (power.State, error) {
	data, err := os.ReadFile(b.path("power"))
	if err != nil {
		return "", fmt.Errorf("ipmisim: reading the power state: %w", err)
	}
	switch s := strings.TrimSpace(string(data)); s {
	case "1":
		return power.On, nil
	case "0":
		return power.Off, nil
	default:
		return "", fmt.Errorf("ipmisim: power state file holds %q", s)
	}
}

// NextBoot returns the boot device the boot flags last asked for:
// power.BootPXE, power.BootDisk (ipmi_sim's "default", the hard disk), ""
// for none, or ipmi_sim's own name for another device.
func (b *BMC) NextBoot() (power.BootDevice, error) {
	data, err := os.ReadFile(b.path("boot"))
	if err != nil {
		return "", fmt.Errorf("ipmisim: reading the boot device: %w", err)
	}
	switch s := strings.TrimSpace(string(data)); s {
	case "pxe":
		return power.BootPXE, nil
	case "default":
		return power.BootDisk, nil
	case "none":
		return "", nil
	default:
		return power.BootDevice(s), nil
	}
}

// Calls returns the calls the hook got, oldest first, without the device:
// "get power", "set power 0", "set boot pxe".
func (b *BMC) Calls() ([]string, error) {
	data, err := os.ReadFile(b.path("calls"))
	if err != nil {
		return nil, fmt.Errorf("ipmisim: reading the hook's calls: %w", err)
	}
	if len(data) == 0 {
		return nil, nil // no call yet: not one empty call
	}
	return strings.Split(strings.TrimSuffix(string(data), "\n"), "\n"), nil
}

// Ipmitool runs `ipmitool -I lanplus` against the BMC as its user (the
// password passes in the environment, not on the command line) and returns
// its output.
func (b *BMC) Ipmitool(ctx context.Context, args ...string) (string, error) {
	path, err := exec.LookPath("ipmitool")
	if err != nil {
		return "", fmt.Errorf("ipmisim: ipmitool is not installed (%v): run %s", err, RequireScript)
	}
	// -C 3: without a cipher suite ipmitool asks for the list, which
	// ipmi_sim never sends, and waits 10 s for it.
	full := append([]string{"-I", "lanplus", "-C", "3", "-H", b.Addr.Addr().String(),
		"-p", strconv.Itoa(int(b.Addr.Port())), "-U", b.Username, "-E"}, args...)
	cmd := exec.CommandContext(ctx, path, full...)
	cmd.Env = append(os.Environ(), "IPMI_PASSWORD="+b.Password.Reveal())
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("ipmisim: ipmitool %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(out.String()))
	}
	return out.String(), nil
}

// ActiveSessions returns the BMC's count of open sessions, read with
// ipmitool (whose own session counts as one).
func (b *BMC) ActiveSessions(ctx context.Context) (int, error) {
	out, err := b.Ipmitool(ctx, "session", "info", "active")
	if err != nil {
		return 0, err
	}
	for line := range strings.SplitSeq(out, "\n") {
		k, v, ok := strings.Cut(line, ":")
		if ok && strings.TrimSpace(k) == "active sessions" {
			return strconv.Atoi(strings.TrimSpace(v))
		}
	}
	return 0, fmt.Errorf("ipmisim: no active session count in ipmitool's output:\n%s", out)
}

// logTail returns the end of ipmi_sim's log and the hook's log, for failure
// messages.
func (b *BMC) logTail() string {
	var s strings.Builder
	for _, name := range []string{"ipmi_sim.log", "hook.log"} {
		data, err := os.ReadFile(b.path(name))
		if err != nil {
			continue
		}
		if len(data) > 4000 {
			data = data[len(data)-4000:]
		}
		fmt.Fprintf(&s, "--- %s ---\n%s", name, data)
	}
	return s.String()
}
