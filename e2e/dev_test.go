package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestDev runs `shepherd dev` as the README's run command does: a private
// PostgreSQL in a fresh data directory, the simulated fleet (or the
// equinix provider against the in-process fake Metal API), progress on
// the terminal until every machine is Healthy; then Ctrl-C must stop it
// cleanly and leave no PostgreSQL process behind.
func TestDev(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		provider string
		machines int
	}{
		{"sim", 50},
		{"equinix", 10},
	} {
		t.Run(tt.provider, func(t *testing.T) {
			t.Parallel()
			// Not under t.TempDir(), whose mode 0700 keeps the postgres
			// user (the cluster's owner when tests run as root) out.
			dataDir, err := os.MkdirTemp("", "shepherd-dev-test-")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { os.RemoveAll(dataDir) })
			if err := os.Chmod(dataDir, 0o755); err != nil {
				t.Fatal(err)
			}
			p := startShepherd(t, "dev", "--data-dir", dataDir, "--provider", tt.provider, "--machines", fmt.Sprint(tt.machines))
			want := fmt.Sprintf("all %d machines are Healthy", tt.machines)
			// SPEC §6: 50 machines Healthy within 60 s of the start (the
			// binary is built already; PostgreSQL's initdb is included).
			deadline := time.Now().Add(60 * time.Second)
			for !strings.Contains(p.output(), want) {
				if time.Now().After(deadline) {
					t.Fatalf("no %q within 60 s", want)
				}
				select {
				case <-p.exited:
					p.exitedEarly(t)
				case <-time.After(50 * time.Millisecond):
				}
			}
			if out := p.output(); !strings.Contains(out, "fleet: ") || !strings.Contains(out, "Healthy") {
				t.Errorf("no progress lines on the terminal:\n%s", out)
			}
			if tt.provider == "equinix" {
				tryEquinixCLI(t, p.output(), tt.machines)
			}
			if err := p.cmd.Process.Signal(syscall.SIGINT); err != nil {
				t.Fatal(err)
			}
			if err := p.wait(t, 30*time.Second, "after Ctrl-C"); err != nil {
				t.Errorf("shepherd dev after Ctrl-C: %s, want a clean exit (status 0)", exitStatus(err))
			}
			if !strings.Contains(p.output(), "stopped, PostgreSQL included") {
				t.Errorf("shepherd dev did not report stopping PostgreSQL:\n%s", p.output())
			}
			if pids := processesMentioning(dataDir); len(pids) > 0 {
				t.Errorf("processes left running with the data directory %s: %v", dataDir, pids)
			}
		})
	}
}

// tryEquinixCLI runs the equinix CLI command line `shepherd dev
// --provider=equinix` printed for its fake Metal API, as an operator
// would paste it, and checks that it lists the fleet's devices.
func tryEquinixCLI(t *testing.T, out string, machines int) {
	t.Helper()
	m := regexp.MustCompile(`(?m)^    shepherd (equinix .*)$`).FindStringSubmatch(out)
	if m == nil {
		t.Errorf("shepherd dev --provider=equinix printed no equinix command line:\n%s", out)
		return
	}
	args, err := shellWords(m[1])
	if err != nil {
		t.Fatalf("the printed command line %q: %v", m[1], err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	list, err := exec.CommandContext(ctx, filepath.Join(binaries(t), "shepherd"), args...).CombinedOutput()
	if err != nil {
		t.Fatalf("the printed command line %q: %v\n%s", m[1], err, list)
	}
	if n := strings.Count(string(list), " true "); n != machines {
		t.Errorf("the printed command line listed %d devices of ours, want %d:\n%s", n, machines, list)
	}
}

// shellWords splits a command line as a POSIX shell does, for the
// quoting shepherd prints: words separated by spaces, single quotes.
func shellWords(line string) ([]string, error) {
	var words []string
	var w strings.Builder
	inWord, quoted := false, false
	for _, r := range line {
		switch {
		case quoted && r == '\'':
			quoted = false
		case quoted:
			w.WriteRune(r)
		case r == '\'':
			quoted, inWord = true, true
		case r == ' ':
			if inWord {
				words = append(words, w.String())
				w.Reset()
				inWord = false
			}
		case r == '"' || r == '\\' || r == '$' || r == '`':
			return nil, fmt.Errorf("unexpected %q outside single quotes", r)
		default:
			w.WriteRune(r)
			inWord = true
		}
	}
	if quoted {
		return nil, fmt.Errorf("unterminated single quote")
	}
	if inWord {
		words = append(words, w.String())
	}
	return words, nil
}

// processesMentioning lists the processes whose command line contains s.
func processesMentioning(s string) []string {
	var out []string
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		if line := strings.ReplaceAll(string(cmdline), "\x00", " "); strings.Contains(line, s) {
			out = append(out, e.Name()+": "+line)
		}
	}
	return out
}
