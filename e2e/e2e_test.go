// Package e2e holds end-to-end tests of the shepherd and shepherd-agent
// binaries: built from this tree, run as separate processes against a real
// PostgreSQL, real SSH servers and real TLS.
package e2e

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

var (
	buildOnce sync.Once
	binDir    string
	buildErr  error
)

func TestMain(m *testing.M) {
	bmdbtest.Main(m, func() {
		if binDir != "" {
			os.RemoveAll(binDir)
		}
	})
}

// binaries builds shepherd and the static shepherd-agent once per run and
// returns their directory.
func binaries(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		if binDir, buildErr = os.MkdirTemp("", "shepherd-e2e-"); buildErr != nil {
			return
		}
		// The postgres user (who runs test clusters when we are root) never
		// needs this directory, but SSH servers' users may: keep it readable.
		if buildErr = os.Chmod(binDir, 0o755); buildErr != nil {
			return
		}
		for _, b := range []struct{ name, pkg string }{
			{"shepherd", "github.com/shepherd/shepherd/cmd/shepherd"},
			{"shepherd-agent", "github.com/shepherd/shepherd/cmd/shepherd-agent"},
		} {
			cmd := exec.Command("go", "build", "-o", filepath.Join(binDir, b.name), b.pkg)
			cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
			if out, err := cmd.CombinedOutput(); err != nil {
				buildErr = fmt.Errorf("building %s: %v\n%s", b.name, err, out)
				return
			}
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binDir
}

// process is a running shepherd binary.
type process struct {
	cmd    *exec.Cmd
	log    *bytes.Buffer
	mu     *sync.Mutex
	exited chan struct{} // closed once the process exited, after err is set
	err    error         // cmd.Wait's: nil for status 0
	// handled is set when the test itself ends the process or judges how
	// it ended (kill, wait): stop leaves the exit to it.
	handled atomic.Bool
}

type lockedBuffer struct {
	mu  *sync.Mutex
	buf *bytes.Buffer
}

func (b lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

// startShepherd runs `shepherd args...` until the test ends, and keeps its
// output for failure messages. At the end of the test stop ends it with
// SIGTERM and fails the test if it did not exit cleanly (see stop).
func startShepherd(t *testing.T, args ...string) *process {
	t.Helper()
	p := &process{log: &bytes.Buffer{}, mu: &sync.Mutex{}, exited: make(chan struct{})}
	p.cmd = exec.Command(filepath.Join(binaries(t), "shepherd"), args...)
	w := lockedBuffer{mu: p.mu, buf: p.log}
	p.cmd.Stdout, p.cmd.Stderr = w, w
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		p.stop(t, "shepherd "+strings.Join(args[:min(3, len(args))], " "))
		if t.Failed() {
			t.Logf("shepherd %s output:\n%s", strings.Join(args[:min(2, len(args))], " "), p.output())
		}
	})
	return p
}

func (p *process) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.log.String()
}

// stopTimeout bounds a clean shutdown after SIGTERM: every component's
// own cleanup timeout is shorter.
const stopTimeout = 30 * time.Second

// stop ends the process with SIGTERM, unless the test handled its end
// itself, and fails the test if the process had exited before (a crash),
// exits with anything but status 0 (a crash or a failed shutdown), or is
// still running stopTimeout after the signal (a hang at shutdown; it is
// killed then).
func (p *process) stop(t *testing.T, what string) {
	t.Helper()
	if p.handled.Load() {
		return
	}
	select {
	case <-p.exited:
		t.Errorf("%s exited before the test stopped it: %v", what, exitStatus(p.err))
		return
	default:
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Errorf("sending SIGTERM to %s: %v", what, err)
	}
	select {
	case <-p.exited:
		if p.err != nil {
			t.Errorf("%s exited with %v after SIGTERM, want a clean shutdown (status 0)", what, exitStatus(p.err))
		}
	case <-time.After(stopTimeout):
		_ = p.cmd.Process.Kill()
		<-p.exited
		t.Errorf("%s did not exit within %s of SIGTERM: it hangs at shutdown (killed)", what, stopTimeout)
	}
}

// exitStatus describes how a process ended, from cmd.Wait's error.
func exitStatus(err error) string {
	if err == nil {
		return "status 0"
	}
	return err.Error() // "exit status 1", "signal: killed"
}

// exitedEarly fails the test at once if the process has exited: it was
// meant to run until the test stops it.
func (p *process) exitedEarly(t *testing.T) {
	t.Helper()
	select {
	case <-p.exited:
		p.handled.Store(true)
		t.Fatalf("shepherd exited early (%s)", exitStatus(p.err))
	default:
	}
}

// wait waits up to timeout for the process to exit, which the test
// caused, and returns cmd.Wait's error for the test to judge; it fails the
// test (and kills the process) if it still runs then.
func (p *process) wait(t *testing.T, timeout time.Duration, what string) error {
	t.Helper()
	p.handled.Store(true)
	select {
	case <-p.exited:
		return p.err
	case <-time.After(timeout):
		_ = p.cmd.Process.Kill()
		<-p.exited
		t.Fatalf("shepherd still ran %s %s (killed)", timeout, what)
		return nil
	}
}

// kill ends the process with SIGKILL, like a crash, and waits for it.
func (p *process) kill(t *testing.T) {
	t.Helper()
	p.handled.Store(true)
	_ = p.cmd.Process.Kill()
	select {
	case <-p.exited:
	case <-time.After(stopTimeout):
		t.Fatalf("shepherd still runs %s after SIGKILL", stopTimeout)
	}
}

// waitStates polls the fleet's derived states until ok says they are right.
func waitStates(t *testing.T, db *bmdbtest.DB, providerName string, timeout time.Duration, what string, ok func(map[bmdb.MachineState]int64) bool) {
	t.Helper()
	var last map[bmdb.MachineState]int64
	bmdbtest.WaitFor(t, timeout, what, func(ctx context.Context) (bool, error) {
		st, err := db.FleetStates(ctx, providerName, 0, 0)
		if err != nil {
			return false, err
		}
		last = st
		if ok(st) {
			return true, nil
		}
		return false, fmt.Errorf("states %v", last)
	})
}
