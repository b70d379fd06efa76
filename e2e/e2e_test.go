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
	cmd  *exec.Cmd
	log  *bytes.Buffer
	mu   *sync.Mutex
	done chan error
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

// startShepherd runs `shepherd args...` until the test ends (SIGTERM, then
// SIGKILL) and keeps its output for failure messages.
func startShepherd(t *testing.T, args ...string) *process {
	t.Helper()
	p := &process{log: &bytes.Buffer{}, mu: &sync.Mutex{}, done: make(chan error, 1)}
	p.cmd = exec.Command(filepath.Join(binaries(t), "shepherd"), args...)
	w := lockedBuffer{mu: p.mu, buf: p.log}
	p.cmd.Stdout, p.cmd.Stderr = w, w
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		p.stop(t)
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

// stop ends the process with SIGTERM and waits for it (SIGKILL after 30 s).
func (p *process) stop(t *testing.T) {
	if p.cmd.ProcessState != nil {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
		t.Errorf("shepherd ignored SIGTERM for 30 s")
	}
}

// kill ends the process with SIGKILL, like a crash, and waits for it.
func (p *process) kill() {
	_ = p.cmd.Process.Kill()
	<-p.done
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
