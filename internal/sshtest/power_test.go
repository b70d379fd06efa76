package sshtest

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/internal/eventually"
)

// startDaemon starts a detached `sleep` on c the way an agent starts its
// daemon (setsid, in the background, so that it outlives the session and
// leaves its process tree), and returns its pid.
func startDaemon(t *testing.T, c *ssh.Client) int {
	t.Helper()
	out := mustRun(t, c, "setsid sleep 300 >/dev/null 2>&1 </dev/null & echo $!")
	pid, err := strconv.Atoi(strings.TrimSpace(out))
	if err != nil {
		t.Fatalf("starting a daemon printed %q, want its pid", out)
	}
	return pid
}

// startUnmarked runs `sleep 300` with an empty environment in a session on
// c that stays open, and returns its pid once it runs so.
func startUnmarked(t *testing.T, c *ssh.Client) int {
	t.Helper()
	sess, err := c.NewSession()
	if err != nil {
		t.Fatal(err)
	}
	out, err := sess.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := sess.Start("echo $$; exec env -i sleep 300"); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("reading the pid of the session's shell: %v", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(line))
	if err != nil {
		t.Fatalf("the session's shell printed %q, want its pid", line)
	}
	// The shell execs env, which execs sleep: the pid stays.
	eventually.Holds(t, 10*time.Second, fmt.Sprintf("process %d running sleep without an environment", pid), func(context.Context) (bool, error) {
		cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err != nil || string(cmdline) != "sleep\x00300\x00" {
			return false, fmt.Errorf("cmdline %q: %v", cmdline, err)
		}
		environ, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", pid))
		return err == nil && len(environ) == 0, fmt.Errorf("environ %q: %v", environ, err)
	})
	return pid
}

// waitRuns waits until pid is among m's processes: a daemon just started
// may be in the midst of exec, without its environment (see Processes).
func waitRuns(t *testing.T, m *Machine, pid int) {
	t.Helper()
	eventually.Holds(t, 10*time.Second, fmt.Sprintf("process %d among the processes of %s", pid, m), func(context.Context) (bool, error) {
		return m.Runs(pid), nil
	})
}

// waitClosed waits up to 10 s for c's connection to end.
func waitClosed(t *testing.T, c *ssh.Client) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- c.Wait() }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		c.Close()
		<-done
		t.Error("an SSH connection to the machine was still open 10s after power off")
	}
}

// mustBeRefused fails the test unless a TCP connection to m is refused.
func mustBeRefused(t *testing.T, m *Machine) {
	t.Helper()
	conn, err := net.DialTimeout("tcp", m.Addr.String(), 5*time.Second)
	if err == nil {
		conn.Close()
		t.Fatalf("%s accepted a connection while off", m)
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Fatalf("connecting to %s while off: %v, want connection refused", m, err)
	}
}

// TestMachinePowerOffAndOn: power off kills sshd, the sessions, a detached
// daemon and a process that cleared its environment, and resets the open
// connection; power on brings sshd back with the same host key, and nothing
// else.
func TestMachinePowerOffAndOn(t *testing.T) {
	t.Parallel()
	key := NewKey(t)
	m := StartMachine(t, Config{AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})
	hostKey := m.HostKey
	c := mustDial(t, m.Host, key)
	daemon := startDaemon(t, c)
	// A command that clears its environment loses the mark; it is still a
	// descendant of the session, which is how power off finds it.
	unmarked := startUnmarked(t, c)
	waitRuns(t, m, daemon)
	waitRuns(t, m, unmarked)

	if err := m.PowerOff(t.Context()); err != nil {
		t.Fatal(err)
	}
	if m.Powered() {
		t.Error("Powered() = true after PowerOff")
	}
	if p := m.Processes(); len(p) > 0 {
		t.Errorf("processes %v still run after PowerOff", p)
	}
	for _, pid := range []int{daemon, unmarked} {
		if processAlive(pid, "sleep") {
			t.Errorf("process %d survived power off", pid)
		}
	}
	waitClosed(t, c)
	mustBeRefused(t, m)
	if err := m.PowerOff(t.Context()); err != nil {
		t.Errorf("PowerOff of a machine that is off: %v", err)
	}

	if err := m.PowerOn(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := m.PowerOn(t.Context()); err != nil {
		t.Errorf("PowerOn of a machine that is on: %v", err)
	}
	if !m.Powered() {
		t.Error("Powered() = false after PowerOn")
	}
	c2, err := dial(t.Context(), m.Host, m.User, key, hostKey)
	if err != nil {
		t.Fatalf("logging in with the host key pinned before power off: %v", err)
	}
	defer c2.Close()
	mustRun(t, c2, "true")
	if processAlive(daemon, "sleep") {
		t.Error("the daemon came back with power on")
	}
}

// TestMachinesAreSeparate: powering one machine off leaves another, and its
// daemon, alone.
func TestMachinesAreSeparate(t *testing.T) {
	t.Parallel()
	key := NewKey(t)
	cfg := Config{AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}}
	a, b := StartMachine(t, cfg), StartMachine(t, cfg)
	daemon := startDaemon(t, mustDial(t, b.Host, key))
	waitRuns(t, b, daemon)
	if err := a.PowerOff(t.Context()); err != nil {
		t.Fatal(err)
	}
	if !b.Runs(daemon) {
		t.Errorf("powering %s off killed the daemon of %s", a, b)
	}
	mustRun(t, mustDial(t, b.Host, key), "true")
}

// runPowerCommand runs argv as a process of its own, as ipmi_sim runs its
// chassis hook, and returns its stderr and error.
func runPowerCommand(t *testing.T, argv []string) (string, error) {
	t.Helper()
	cmd := exec.CommandContext(t.Context(), argv[0], argv[1:]...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err := cmd.Run()
	return stderr.String(), err
}

// TestMachinePowerCommands: the commands for a BMC simulator's hook power
// the machine off and on from another process, return only once the change
// is done, and fail with the reason when it fails.
func TestMachinePowerCommands(t *testing.T) {
	t.Parallel()
	key := NewKey(t)
	m := StartMachine(t, Config{AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})
	on, off := m.PowerCommands()
	daemon := startDaemon(t, mustDial(t, m.Host, key))
	waitRuns(t, m, daemon)

	if out, err := runPowerCommand(t, off); err != nil {
		t.Fatalf("power off command: %v: %s", err, out)
	}
	if m.Powered() || m.Runs(daemon) {
		t.Fatalf("after the power off command returned: powered %v, daemon running %v; want off, gone", m.Powered(), m.Runs(daemon))
	}
	mustBeRefused(t, m)

	// Another process on the machine's port makes power on fail, as a
	// machine that does not boot; the command says why.
	l, err := net.Listen("tcp", m.Addr.String())
	if err != nil {
		t.Fatal(err)
	}
	out, err := runPowerCommand(t, on)
	l.Close()
	if err == nil || !strings.Contains(out, "powering on") {
		t.Fatalf("power on command with the port taken: %v, stderr %q; want a failure that says powering on failed", err, out)
	}
	if m.Powered() {
		t.Fatal("Powered() = true after a failed power on")
	}

	if out, err := runPowerCommand(t, on); err != nil {
		t.Fatalf("power on command: %v: %s", err, out)
	}
	if !m.Powered() {
		t.Fatal("Powered() = false after the power on command returned")
	}
	mustRun(t, mustDial(t, m.Host, key), "true")
}

// TestRedfishPowerHook: the hook follows the final states and ignores the
// transitional ones.
func TestRedfishPowerHook(t *testing.T) {
	t.Parallel()
	key := NewKey(t)
	m := StartMachine(t, Config{AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})
	hook := m.RedfishPowerHook(t)
	for _, step := range []struct {
		state string
		want  bool
	}{{"PoweringOff", true}, {"Off", false}, {"PoweringOn", false}, {"On", true}} {
		hook(step.state)
		if got := m.Powered(); got != step.want {
			t.Fatalf("after state %s: Powered() = %v, want %v", step.state, got, step.want)
		}
	}
	mustRun(t, mustDial(t, m.Host, key), "true")
}

// TestMachineNeedsOpenSSH: a Machine cannot run on the in-process server.
func TestMachineNeedsOpenSSH(t *testing.T) {
	t.Parallel()
	f := &fatalRecorder{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		StartMachine(f, Config{Kind: Gliderlabs})
	}()
	<-done
	if !strings.Contains(f.msg, "OpenSSH") {
		t.Fatalf("StartMachine with Gliderlabs: %q, want a failure naming OpenSSH", f.msg)
	}
}

// fatalRecorder records Fatalf instead of failing the test.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (f *fatalRecorder) Helper() {}

func (f *fatalRecorder) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}
