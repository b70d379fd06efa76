package sshtest

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/pkg/sftp"
	"go.uber.org/goleak"
	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/internal/eventually"
	"github.com/shepherd/shepherd/internal/shellquote"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// forEachKind runs f as a parallel subtest for every kind of server that
// can run here (failing when SHEPHERD_REQUIRE_SSHD=1 and sshd is missing).
func forEachKind(t *testing.T, f func(t *testing.T, kind Kind)) {
	t.Helper()
	for _, k := range Kinds(t) {
		t.Run(string(k), func(t *testing.T) {
			t.Parallel()
			f(t, k)
		})
	}
}

// errHostKeyMismatch is what the tests' host key callback returns for a key
// other than the pinned one.
var errHostKeyMismatch = errors.New("host key mismatch")

// pinnedHostKey accepts only want.
func pinnedHostKey(want ssh.PublicKey) ssh.HostKeyCallback {
	return func(_ string, _ net.Addr, got ssh.PublicKey) error {
		if !keysEqual(got, want) {
			return fmt.Errorf("%w: got %s, want %s", errHostKeyMismatch, ssh.FingerprintSHA256(got), ssh.FingerprintSHA256(want))
		}
		return nil
	}
}

// dial logs in to h as user with key, accepting only hostKey, within 10 s.
func dial(ctx context.Context, h *Host, user string, key ssh.Signer, hostKey ssh.PublicKey) (*ssh.Client, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", h.Addr.String())
	if err != nil {
		return nil, err
	}
	deadline, _ := ctx.Deadline()
	_ = conn.SetDeadline(deadline)
	c, chans, reqs, err := ssh.NewClientConn(conn, h.Addr.String(), &ssh.ClientConfig{
		User:              user,
		Auth:              []ssh.AuthMethod{ssh.PublicKeys(key)},
		HostKeyCallback:   pinnedHostKey(hostKey),
		HostKeyAlgorithms: algorithmsOf(hostKey),
	})
	if err != nil {
		conn.Close()
		return nil, err
	}
	_ = conn.SetDeadline(time.Time{})
	return ssh.NewClient(c, chans, reqs), nil
}

// algorithmsOf returns the host key algorithms that make a server present
// key: for RSA the SHA-2 signatures OpenSSH accepts.
func algorithmsOf(key ssh.PublicKey) []string {
	if key.Type() == ssh.KeyAlgoRSA {
		return []string{ssh.KeyAlgoRSASHA512, ssh.KeyAlgoRSASHA256}
	}
	return []string{key.Type()}
}

// mustDial logs in to h with key and its current host key, and closes the
// client when the test ends.
func mustDial(t *testing.T, h *Host, key ssh.Signer) *ssh.Client {
	t.Helper()
	c, err := dial(t.Context(), h, h.User, key, h.HostKey)
	if err != nil {
		t.Fatalf("logging in to %s: %v", h, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// run runs cmd in a new session with stdin and returns its output and exit
// status.
func run(t *testing.T, c *ssh.Client, cmd, stdin string) (stdout, stderr string, status int) {
	t.Helper()
	sess, err := c.NewSession()
	if err != nil {
		t.Fatalf("opening session: %v", err)
	}
	defer sess.Close()
	var out, errOut bytes.Buffer
	sess.Stdout, sess.Stderr = &out, &errOut
	if stdin != "" {
		sess.Stdin = strings.NewReader(stdin)
	}
	err = sess.Run(cmd)
	var ee *ssh.ExitError
	switch {
	case errors.As(err, &ee):
		status = ee.ExitStatus()
	case err != nil:
		t.Fatalf("running %q: %v (stderr: %q)", cmd, err, errOut.String())
	}
	return out.String(), errOut.String(), status
}

// mustRun runs cmd and fails the test unless it exits 0.
func mustRun(t *testing.T, c *ssh.Client, cmd string) string {
	t.Helper()
	out, errOut, status := run(t, c, cmd, "")
	if status != 0 {
		t.Fatalf("%q exited with status %d; stderr: %q", cmd, status, errOut)
	}
	return out
}

// newSFTP opens an SFTP session on c, closed when the test ends.
func newSFTP(t *testing.T, c *ssh.Client) *sftp.Client {
	t.Helper()
	sc, err := sftp.NewClient(c)
	if err != nil {
		t.Fatalf("starting sftp: %v", err)
	}
	t.Cleanup(func() { sc.Close() })
	return sc
}

// upload writes data to path the way the initializer installs the agent:
// into a temporary name, then chmod, then an atomic rename over path.
func upload(t *testing.T, sc *sftp.Client, path string, data []byte, mode os.FileMode) {
	t.Helper()
	tmp := path + ".upload-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	f, err := sc.Create(tmp)
	if err != nil {
		t.Fatalf("creating %s: %v", tmp, err)
	}
	if _, err := f.Write(data); err != nil {
		t.Fatalf("writing %s: %v", tmp, err)
	}
	if err := f.Close(); err != nil {
		t.Fatalf("closing %s: %v", tmp, err)
	}
	if err := sc.Chmod(tmp, mode); err != nil {
		t.Fatalf("chmod %s: %v", tmp, err)
	}
	if err := sc.PosixRename(tmp, path); err != nil {
		t.Fatalf("renaming %s to %s: %v", tmp, path, err)
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	key := NewKey(t).PublicKey()
	tests := []struct {
		name    string
		cfg     Config
		wantErr string
	}{
		{"zero", Config{}, ""},
		{"openssh", Config{Kind: OpenSSH, AuthorizedKeys: []ssh.PublicKey{key}}, ""},
		{"gliderlabs", Config{Kind: Gliderlabs}, ""},
		{"unknown kind", Config{Kind: "dropbear"}, `Kind must be "openssh", "gliderlabs" or empty, got "dropbear"`},
		{"nil key", Config{AuthorizedKeys: []ssh.PublicKey{key, nil}}, "AuthorizedKeys[1] is nil"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.cfg.Validate()
			switch {
			case tt.wantErr == "" && err != nil:
				t.Errorf("Validate() = %v, want nil", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Errorf("Validate() = %v, want an error containing %q", err, tt.wantErr)
			}
		})
	}
}

func TestConfigArgQuoting(t *testing.T) {
	t.Parallel()
	got, err := configArg(`/tmp/a b#c"d\e`)
	if want := `"/tmp/a b#c\"d\\e"`; err != nil || got != want {
		t.Errorf("configArg() = %q, %v; want %q, nil", got, err, want)
	}
	if _, err := configArg("/tmp/a\nb"); err == nil {
		t.Error("configArg() accepted a newline")
	}
}

func TestKindSelection(t *testing.T) {
	t.Parallel()
	found := func() (string, error) { return "/usr/sbin/sshd", nil }
	missing := func() (string, error) { return "", errors.New("no OpenSSH server") }
	tests := []struct {
		name     string
		kind     Kind
		find     func() (string, error)
		required bool
		want     Kind   // "" when an error is wanted
		wantAll  []Kind // what Kinds returns; nil when it fails
	}{
		{"default with sshd", "", found, false, OpenSSH, []Kind{OpenSSH, Gliderlabs}},
		{"default without sshd", "", missing, false, Gliderlabs, []Kind{Gliderlabs}},
		{"default without sshd, required", "", missing, true, "", nil},
		{"openssh without sshd", OpenSSH, missing, false, "", []Kind{Gliderlabs}},
		{"gliderlabs without sshd, required", Gliderlabs, missing, true, Gliderlabs, nil},
		{"gliderlabs with sshd", Gliderlabs, found, true, Gliderlabs, []Kind{OpenSSH, Gliderlabs}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, _, err := resolveKind(tt.kind, tt.find, tt.required)
			if got != tt.want || (err != nil) != (tt.want == "") {
				t.Errorf("resolveKind(%q) = %q, %v; want %q", tt.kind, got, err, tt.want)
			}
			all, err := availableKinds(tt.find, tt.required)
			if !slices.Equal(all, tt.wantAll) || (err != nil) != (tt.wantAll == nil) {
				t.Errorf("availableKinds() = %v, %v; want %v", all, err, tt.wantAll)
			}
		})
	}
}

func TestFindSSHD(t *testing.T) {
	t.Parallel()
	notFound := func(string) (string, error) { return "", exec.ErrNotFound }
	if _, err := findSSHD("/nonexistent/sshd", notFound); err == nil || !strings.Contains(err.Error(), "install openssh-server") {
		t.Errorf("findSSHD without sshd: %v, want an error saying what to install", err)
	}
	onPath := func(string) (string, error) { return "bin/sshd", nil }
	if got, err := findSSHD("/nonexistent/sshd", onPath); err != nil || !filepath.IsAbs(got) {
		t.Errorf("findSSHD with a relative PATH entry = %q, %v; want an absolute path", got, err)
	}
}

// TestCommandsAndSFTP checks what the initializer does on every machine:
// log in, run commands, upload and run a file.
func TestCommandsAndSFTP(t *testing.T) {
	t.Parallel()
	forEachKind(t, func(t *testing.T, kind Kind) {
		key := NewKey(t)
		start := time.Now()
		hosts := Start(t, 3, Config{Kind: kind, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})
		t.Logf("started 3 %s servers in %s", kind, time.Since(start))
		ports := map[uint16]bool{}
		for i, h := range hosts {
			if h.Kind != kind || !h.Addr.Addr().IsLoopback() || ports[h.Addr.Port()] {
				t.Fatalf("host %d: Kind %q, Addr %s: want kind %q on a distinct loopback port", i, h.Kind, h.Addr, kind)
			}
			ports[h.Addr.Port()] = true
			if (kind == OpenSSH) != (h.PIDFile() != "") {
				t.Errorf("host %d: PIDFile() = %q for kind %s", i, h.PIDFile(), kind)
			}
		}
		for i, h := range hosts {
			t.Run(fmt.Sprint("host", i), func(t *testing.T) {
				t.Parallel()
				step := time.Now()
				logStep := func(what string) {
					t.Logf("%s took %s", what, time.Since(step))
					step = time.Now()
				}
				c := mustDial(t, h, key)
				logStep("login")

				stdout, stderr, status := run(t, c, "echo hello; echo err >&2; exit 3", "")
				if stdout != "hello\n" || stderr != "err\n" || status != 3 {
					t.Errorf("run = (%q, %q, %d), want (%q, %q, 3)", stdout, stderr, status, "hello\n", "err\n")
				}
				const input = "line one\nline two\n"
				if stdout, _, status := run(t, c, "cat", input); stdout != input || status != 0 {
					t.Errorf("cat = (%q, %d), want (%q, 0)", stdout, status, input)
				}
				logStep("two commands")

				sc := newSFTP(t, c)
				payload := make([]byte, 2<<20)
				if _, err := rand.Read(payload); err != nil {
					t.Fatal(err)
				}
				target := filepath.Join(h.Dir, "payload")
				if err := os.WriteFile(target, []byte("old version"), 0o644); err != nil {
					t.Fatal(err)
				}
				logStep("starting sftp")
				upload(t, sc, target, payload, 0o755) // replaces the old version
				logStep("uploading 2 MiB")
				sum := sha256.Sum256(payload)
				want := hex.EncodeToString(sum[:]) + " 755\n"
				q := shellquote.Quote(target)
				if got := mustRun(t, c, "echo $(sha256sum < "+q+" | cut -d' ' -f1) $(stat -c %a "+q+")"); got != want {
					t.Errorf("uploaded payload: sha256 and mode %q, want %q", got, want)
				}
				logStep("checking the upload")

				script := filepath.Join(h.Dir, "script")
				upload(t, sc, script, []byte("#!/bin/sh\necho script-ran\n"), 0o755)
				if got := mustRun(t, c, shellquote.Quote(script)); got != "script-ran\n" {
					t.Errorf("running uploaded script: output %q, want %q", got, "script-ran\n")
				}
				logStep("uploading and running a script")
			})
		}
	})
}

// TestSFTPRenameOverExisting pins down the documented difference: a plain
// SFTP rename onto an existing file fails on OpenSSH but not on Gliderlabs.
func TestSFTPRenameOverExisting(t *testing.T) {
	t.Parallel()
	forEachKind(t, func(t *testing.T, kind Kind) {
		key := NewKey(t)
		h := Start(t, 1, Config{Kind: kind, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})[0]
		sc := newSFTP(t, mustDial(t, h, key))
		from, to := filepath.Join(h.Dir, "from"), filepath.Join(h.Dir, "to")
		for _, p := range []string{from, to} {
			if err := os.WriteFile(p, []byte(p), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		err := sc.Rename(from, to)
		if kind == OpenSSH && err == nil {
			t.Error("OpenSSH: Rename onto an existing file succeeded; the package doc says it fails")
		}
		if kind == Gliderlabs && err != nil {
			t.Errorf("Gliderlabs: Rename onto an existing file: %v; the package doc says it succeeds", err)
		}
	})
}

func TestUnauthorizedLoginRefused(t *testing.T) {
	t.Parallel()
	forEachKind(t, func(t *testing.T, kind Kind) {
		key, other := NewKey(t), NewKey(t)
		h := Start(t, 1, Config{Kind: kind, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})[0]
		if c, err := dial(t.Context(), h, h.User, other, h.HostKey); err == nil {
			c.Close()
			t.Error("a key not in AuthorizedKeys logged in")
		} else if !strings.Contains(err.Error(), "unable to authenticate") {
			t.Errorf("login with an unauthorized key: %v, want an authentication failure", err)
		}
		if c, err := dial(t.Context(), h, "sshtest-no-such-user", key, h.HostKey); err == nil {
			c.Close()
			t.Error("an unknown user logged in")
		}
		// The refusals must not stop the authorized key from logging in.
		mustRun(t, mustDial(t, h, key), "true")
	})
}

func TestRestartAndChangeHostKey(t *testing.T) {
	t.Parallel()
	forEachKind(t, func(t *testing.T, kind Kind) {
		key := NewKey(t)
		h := Start(t, 1, Config{Kind: kind, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})[0]
		addr, oldKey, oldKeys := h.Addr, h.HostKey, h.Keys()
		established := mustDial(t, h, key)
		oldPID := readPID(t, h)

		start := time.Now()
		h.Restart(t)
		t.Logf("Restart took %s", time.Since(start))
		if h.Addr != addr || !keysEqual(h.HostKey, oldKey) {
			t.Fatalf("after Restart: %s with key %s, want %s with key %s", h.Addr, ssh.FingerprintSHA256(h.HostKey), addr, ssh.FingerprintSHA256(oldKey))
		}
		if kind == OpenSSH {
			if pid := readPID(t, h); pid == oldPID {
				t.Errorf("after Restart sshd still has pid %d, want a new process", pid)
			}
		}
		c, err := dial(t.Context(), h, h.User, key, oldKey)
		if err != nil {
			t.Fatalf("logging in after Restart with the old host key: %v", err)
		}
		defer c.Close()
		mustRun(t, c, "true")
		if got := mustRun(t, established, "echo still here"); got != "still here\n" {
			t.Errorf("connection established before Restart: got %q", got)
		}

		start = time.Now()
		newKey := h.ChangeHostKey(t)
		t.Logf("ChangeHostKey took %s", time.Since(start))
		if keysEqual(newKey, oldKey) || !keysEqual(h.HostKey, newKey) || h.Addr != addr {
			t.Fatalf("ChangeHostKey: returned %s, HostKey %s, Addr %s; want a new key in HostKey on %s",
				ssh.FingerprintSHA256(newKey), ssh.FingerprintSHA256(h.HostKey), h.Addr, addr)
		}
		if c, err := dial(t.Context(), h, h.User, key, oldKey); !errors.Is(err, errHostKeyMismatch) {
			if c != nil {
				c.Close()
			}
			t.Errorf("logging in with the old host key after ChangeHostKey: %v, want %v", err, errHostKeyMismatch)
		}
		c2, err := dial(t.Context(), h, h.User, key, newKey)
		if err != nil {
			t.Fatalf("logging in with the new host key: %v", err)
		}
		defer c2.Close()
		mustRun(t, c2, "true")

		// The rotation undone: the old keys serve again, the new ones not.
		h.SetHostKeys(t, oldKeys)
		if !keysEqual(h.HostKey, oldKey) {
			t.Fatalf("SetHostKeys: HostKey %s, want the old %s", ssh.FingerprintSHA256(h.HostKey), ssh.FingerprintSHA256(oldKey))
		}
		if c, err := dial(t.Context(), h, h.User, key, newKey); !errors.Is(err, errHostKeyMismatch) {
			if c != nil {
				c.Close()
			}
			t.Errorf("logging in with the rotated key after SetHostKeys: %v, want %v", err, errHostKeyMismatch)
		}
		c3, err := dial(t.Context(), h, h.User, key, oldKey)
		if err != nil {
			t.Fatalf("logging in with the restored key: %v", err)
		}
		defer c3.Close()
		mustRun(t, c3, "true")
	})
}

// readPID returns sshd's pid from its pid file, or 0 for Gliderlabs.
func readPID(t *testing.T, h *Host) int {
	t.Helper()
	if h.PIDFile() == "" {
		return 0
	}
	data, err := os.ReadFile(h.PIDFile())
	if err != nil {
		t.Fatalf("reading sshd pid file: %v", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil {
		t.Fatalf("sshd pid file holds %q: %v", data, err)
	}
	return pid
}

// processAlive reports whether pid runs (and is not a zombie) with
// cmdline containing want.
func processAlive(pid int, want string) bool {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// The state follows the parenthesized command name.
	if i := bytes.LastIndexByte(stat, ')'); i < 0 || i+2 >= len(stat) || stat[i+2] == 'Z' {
		return false
	}
	cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	return err == nil && strings.Contains(strings.ReplaceAll(string(cmdline), "\x00", " "), want)
}

// TestDetachedProcessOutlivesSession checks that starting a daemon the way
// the agent does returns promptly and leaves the daemon running.
func TestDetachedProcessOutlivesSession(t *testing.T) {
	t.Parallel()
	forEachKind(t, func(t *testing.T, kind Kind) {
		key := NewKey(t)
		h := Start(t, 1, Config{Kind: kind, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})[0]
		c, err := dial(t.Context(), h, h.User, key, h.HostKey)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		// The login shell's startup files (bash reads ~/.bashrc for commands
		// run by sshd) can make any command slow; measure them with a
		// command that starts nothing, and allow 5 s on top of that.
		start := time.Now()
		mustRun(t, c, "true")
		baseline := time.Since(start)
		start = time.Now()
		out := mustRun(t, c, "setsid sh -c 'sleep 30' >/dev/null 2>&1 < /dev/null & echo $!")
		took := time.Since(start)
		t.Logf("starting the detached process took %s (a plain command: %s)", took, baseline)
		pid, err := strconv.Atoi(strings.TrimSpace(out))
		if err != nil {
			t.Fatalf("command printed %q, want a pid", out)
		}
		t.Cleanup(func() {
			// setsid made it a process group leader: kill the group, in case
			// sh did not exec sleep.
			_ = syscall.Kill(-pid, syscall.SIGKILL)
			_ = syscall.Kill(pid, syscall.SIGKILL)
		})
		if took >= baseline+5*time.Second {
			t.Errorf("starting a detached process took %s (a plain command %s), want well under 5s more", took, baseline)
		}
		c.Close()
		// A new login proves the server has moved on from the old session.
		mustRun(t, mustDial(t, h, key), "true")
		if !processAlive(pid, "sleep") {
			t.Errorf("detached process %d did not survive its session", pid)
		}
	})
}

// TestStopWithSessionRunning stops a server while a session's command runs
// and a background process holds its stdout: the stop must not wait for
// them, nor leak goroutines (checked by TestMain).
func TestStopWithSessionRunning(t *testing.T) {
	t.Parallel()
	forEachKind(t, func(t *testing.T, kind Kind) {
		key := NewKey(t)
		var c *ssh.Client
		var pid int
		t.Cleanup(func() {
			if pid > 0 {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		})
		t.Cleanup(func() {
			if c != nil {
				c.Close()
			}
		})
		var bodyDone, stopped time.Time
		t.Run("inner", func(t *testing.T) {
			t.Cleanup(func() { stopped = time.Now() }) // runs after the server's cleanup
			h := Start(t, 1, Config{Kind: kind, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})[0]
			var err error
			if c, err = dial(t.Context(), h, h.User, key, h.HostKey); err != nil {
				t.Fatal(err)
			}
			sess, err := c.NewSession()
			if err != nil {
				t.Fatal(err)
			}
			stdout, err := sess.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := sess.Start("sleep 30 & echo $!; exec cat"); err != nil {
				t.Fatal(err)
			}
			line, err := bufio.NewReader(stdout).ReadString('\n')
			if err != nil {
				t.Fatalf("reading the background pid: %v", err)
			}
			if pid, err = strconv.Atoi(strings.TrimSpace(line)); err != nil {
				t.Fatalf("command printed %q, want a pid", line)
			}
			bodyDone = time.Now()
		})
		took := stopped.Sub(bodyDone)
		t.Logf("stopping the server took %s", took)
		if took >= 5*time.Second {
			t.Errorf("stopping the server with a session running took %s", took)
		}
	})
}

// TestSIGHUPThroughSSH restarts sshd the way a test's reboot command does:
// from a command run through it. sshd re-executes itself with the same pid.
func TestSIGHUPThroughSSH(t *testing.T) {
	t.Parallel()
	forEachKind(t, func(t *testing.T, kind Kind) {
		key := NewKey(t)
		h := Start(t, 1, Config{Kind: kind, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})[0]
		if kind != OpenSSH {
			if h.PIDFile() != "" {
				t.Errorf("PIDFile() = %q, want empty for %s", h.PIDFile(), kind)
			}
			return
		}
		pid := readPID(t, h)
		mustRun(t, mustDial(t, h, key), "kill -HUP $(cat "+shellquote.Quote(h.PIDFile())+")")
		start := time.Now()
		eventually.Holds(t, 10*time.Second, "login after SIGHUP", func(ctx context.Context) (bool, error) {
			// Only log in: a command's duration depends on the login shell's
			// startup files, not on sshd.
			c, err := dial(ctx, h, h.User, key, h.HostKey)
			if err != nil {
				return false, err
			}
			if err := c.Close(); err != nil {
				return false, err
			}
			return true, nil
		})
		t.Logf("sshd accepted logins again %s after SIGHUP", time.Since(start))
		mustRun(t, mustDial(t, h, key), "true")
		if got := readPID(t, h); got != pid {
			t.Errorf("after SIGHUP sshd has pid %d, want %d (re-executed in place)", got, pid)
		}
		if log, err := os.ReadFile(h.LogPath()); err != nil || !bytes.Contains(log, []byte("Received SIGHUP; restarting.")) {
			t.Errorf("sshd log does not show the SIGHUP restart (read error: %v)", err)
		}
		// The re-executed sshd is still ours to restart and stop.
		h.Restart(t)
		mustRun(t, mustDial(t, h, key), "true")
	})
}

// TestCleanupStopsServer checks that a test's servers are gone after it.
func TestCleanupStopsServer(t *testing.T) {
	t.Parallel()
	forEachKind(t, func(t *testing.T, kind Kind) {
		key := NewKey(t)
		var h *Host
		var pid int
		t.Run("inner", func(t *testing.T) {
			h = Start(t, 1, Config{Kind: kind, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})[0]
			pid = readPID(t, h)
			mustRun(t, mustDial(t, h, key), "true")
		})
		var d net.Dialer
		if c, err := d.DialContext(t.Context(), "tcp", h.Addr.String()); err == nil {
			c.Close()
			t.Errorf("%s still accepts connections after its test ended", h.Addr)
		}
		if kind == OpenSSH {
			if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
				t.Errorf("sshd pid %d after its test ended: kill -0 = %v, want ESRCH", pid, err)
			}
			if left := h.sshd.leftovers(); len(left) > 0 {
				t.Errorf("sshd processes %v left after the test ended", left)
			}
		}
	})
}

// TestOddDirectoryNames runs servers in a directory whose name needs
// quoting in sshd_config and holds a %-token.
func TestOddDirectoryNames(t *testing.T) {
	// Not parallel: t.Setenv changes the process environment.
	parent, err := os.MkdirTemp("", "sshtest-odd-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(parent) })
	odd := filepath.Join(parent, `a dir #1 100%u 'single' "double" back\slash`)
	if err := os.Mkdir(odd, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv("TMPDIR", odd)
	for _, kind := range Kinds(t) {
		t.Run(string(kind), func(t *testing.T) {
			key := NewKey(t)
			h := Start(t, 1, Config{Kind: kind, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})[0]
			if !strings.HasPrefix(h.Dir, odd) {
				t.Fatalf("Dir = %q, want it under %q", h.Dir, odd)
			}
			c := mustDial(t, h, key)
			upload(t, newSFTP(t, c), filepath.Join(h.Dir, "f"), []byte("#!/bin/sh\necho odd-ok\n"), 0o755)
			if got := mustRun(t, c, shellquote.Quote(filepath.Join(h.Dir, "f"))); got != "odd-ok\n" {
				t.Errorf("got %q", got)
			}
			h.Restart(t)
			mustRun(t, mustDial(t, h, key), "true")
		})
	}
}

// TestAllHostKeyTypes checks that a server with every host key type
// presents each of them to a client that asks for its algorithm, and that
// a client that does not ask gets a key other than HostKey: the trap the
// option exists to set.
func TestAllHostKeyTypes(t *testing.T) {
	t.Parallel()
	forEachKind(t, func(t *testing.T, kind Kind) {
		key := NewKey(t)
		h := Start(t, 1, Config{Kind: kind, AllHostKeyTypes: true, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})[0]
		var types []string
		for _, k := range h.HostKeys {
			types = append(types, k.Type())
		}
		if want := []string{ssh.KeyAlgoED25519, ssh.KeyAlgoECDSA256, ssh.KeyAlgoRSA}; !slices.Equal(types, want) || !keysEqual(h.HostKey, h.HostKeys[0]) {
			t.Fatalf("HostKeys are of types %v, want %v with HostKey first", types, want)
		}
		for _, k := range h.HostKeys {
			c, err := dial(t.Context(), h, h.User, key, k)
			if err != nil {
				t.Errorf("logging in expecting the %s key: %v", k.Type(), err)
				continue
			}
			c.Close()
		}
		// x/crypto's default preference puts ECDSA before ed25519.
		var presented ssh.PublicKey
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		defer cancel()
		var d net.Dialer
		conn, err := d.DialContext(ctx, "tcp", h.Addr.String())
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		_, _, _, err = ssh.NewClientConn(conn, h.Addr.String(), &ssh.ClientConfig{
			User: h.User,
			HostKeyCallback: func(_ string, _ net.Addr, k ssh.PublicKey) error {
				presented = k
				return errHostKeyMismatch
			},
		})
		if !errors.Is(err, errHostKeyMismatch) || presented == nil || keysEqual(presented, h.HostKey) {
			t.Errorf("a client with default algorithms was presented %v (err %v), want a key other than the ed25519 one", presented, err)
		}

		old := slices.Clone(h.HostKeys)
		h.ChangeHostKey(t)
		for i, k := range h.HostKeys {
			if keysEqual(k, old[i]) {
				t.Errorf("ChangeHostKey kept the %s key", k.Type())
			}
		}
		mustRun(t, mustDial(t, h, key), "true")
	})
}

// TestPasswordAttemptsCounted checks the password-only server: Gliderlabs
// lets the right password in; both kinds count every password offered and
// refuse keys.
func TestPasswordAttemptsCounted(t *testing.T) {
	t.Parallel()
	forEachKind(t, func(t *testing.T, kind Kind) {
		key := NewKey(t)
		h := Start(t, 1, Config{Kind: kind, Password: "sshtest-pw"})[0]
		if n := h.PasswordAttempts(); n != 0 {
			t.Fatalf("PasswordAttempts before any login = %d", n)
		}
		if c, err := dial(t.Context(), h, h.User, key, h.HostKey); err == nil {
			c.Close()
			t.Error("a key logged in to a password-only server")
		}
		if n := h.PasswordAttempts(); n != 0 {
			t.Errorf("PasswordAttempts after a key login = %d, want 0", n)
		}
		login := func(pw string) error {
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			var d net.Dialer
			conn, err := d.DialContext(ctx, "tcp", h.Addr.String())
			if err != nil {
				return err
			}
			defer conn.Close()
			c, _, _, err := ssh.NewClientConn(conn, h.Addr.String(), &ssh.ClientConfig{
				User: h.User, Auth: []ssh.AuthMethod{ssh.Password(pw)}, HostKeyCallback: pinnedHostKey(h.HostKey),
				HostKeyAlgorithms: algorithmsOf(h.HostKey),
			})
			if err == nil {
				c.Close()
			}
			return err
		}
		err := login("sshtest-pw")
		if kind == Gliderlabs && err != nil {
			t.Errorf("Gliderlabs refused the right password: %v", err)
		}
		if kind == OpenSSH && err == nil {
			t.Error("OpenSSH accepted a password that is not the system's")
		}
		// The count is read as soon as each login returned: sshd may still
		// be writing its record then, and PasswordAttempts must wait for it.
		if n := h.PasswordAttempts(); n != 1 {
			t.Errorf("PasswordAttempts after one login = %d, want 1", n)
		}
		const burst = 8
		errs := make(chan error, burst)
		for range burst {
			go func() { errs <- login("wrong") }()
		}
		for range burst {
			if err := <-errs; err == nil {
				t.Error("a wrong password logged in")
			}
		}
		if n := h.PasswordAttempts(); n != 1+burst {
			t.Errorf("PasswordAttempts after %d more logins = %d, want %d", burst, n, 1+burst)
		}
		if log, _ := os.ReadFile(h.LogPath()); bytes.Contains(log, []byte("sshtest-pw")) {
			t.Error("the server's log holds the password")
		}
	})
}

// TestProxySilence checks that a silenced proxy keeps connections open and
// passes nothing: a command's output stops reaching the client.
func TestProxySilence(t *testing.T) {
	t.Parallel()
	forEachKind(t, func(t *testing.T, kind Kind) {
		key := NewKey(t)
		h := Start(t, 1, Config{Kind: kind, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})[0]
		p := StartProxy(t, h.Addr.String())
		via := *h
		via.Addr = p.Addr
		c := mustDial(t, &via, key)
		if got := mustRun(t, c, "echo through"); got != "through\n" {
			t.Fatalf("through the proxy: %q", got)
		}
		sess, err := c.NewSession()
		if err != nil {
			t.Fatal(err)
		}
		defer sess.Close()
		stdout, err := sess.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		stdin, err := sess.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := sess.Start("echo first; read x; echo second"); err != nil {
			t.Fatal(err)
		}
		r := bufio.NewReader(stdout)
		if line, err := r.ReadString('\n'); err != nil || line != "first\n" {
			t.Fatalf("first line %q, %v", line, err)
		}
		p.Silence()
		// The line would let the command print "second", if it got through.
		if _, err := stdin.Write([]byte("go\n")); err != nil {
			t.Fatal(err)
		}
		got := make(chan string, 1)
		go func() {
			line, _ := r.ReadString('\n')
			got <- line
		}()
		// Nothing may arrive within a deadline; closing the connection is
		// the only way on.
		ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
		defer cancel()
		select {
		case line := <-got:
			got <- line
			t.Errorf("after Silence the client still read %q", line)
		case <-ctx.Done():
		}
		c.Close()
		if line := <-got; line != "" {
			t.Errorf("after Silence the client read %q", line)
		}
		// New connections are swallowed: the handshake meets silence.
		ctx, cancel = context.WithTimeout(t.Context(), 200*time.Millisecond)
		defer cancel()
		if c, err := dial(ctx, &via, h.User, key, h.HostKey); err == nil {
			c.Close()
			t.Error("a login through the silent proxy succeeded")
		}
	})
}

// TestOnFreePortRetriesTakenPorts checks that a start that finds its chosen
// port taken is tried again on another, a bounded number of times, and that
// a fixed port (a restart) is never swapped for another.
func TestOnFreePortRetriesTakenPorts(t *testing.T) {
	var tried []netip.AddrPort
	taken := func(n int) func(netip.AddrPort) error {
		return func(a netip.AddrPort) error {
			tried = append(tried, a)
			if len(tried) <= n {
				return fmt.Errorf("%w: bind", errAddrInUse)
			}
			return nil
		}
	}
	addr, err := onFreePort(netip.AddrPort{}, taken(2))
	if err != nil || len(tried) != 3 || addr != tried[2] || addr.Port() == 0 {
		t.Errorf("two taken ports: %v after %v (returned %v); want success on the third", err, tried, addr)
	}
	tried = nil
	if _, err := onFreePort(netip.AddrPort{}, taken(portAttempts)); !errors.Is(err, errAddrInUse) || len(tried) != portAttempts {
		t.Errorf("every port taken: %v after %d tries; want errAddrInUse after %d", err, len(tried), portAttempts)
	}
	tried = nil
	fixed := netip.AddrPortFrom(loopback, 2222)
	if _, err := onFreePort(fixed, taken(1)); !errors.Is(err, errAddrInUse) || len(tried) != 1 || tried[0] != fixed {
		t.Errorf("a fixed port taken: %v after %v; want errAddrInUse after one try of %v", err, tried, fixed)
	}
}

// TestRunJustUploadedWhileOthersRun uploads executables over SFTP and runs
// each at once, as the initializer does with the agent, while other sessions
// keep starting commands and the test process itself keeps starting others
// (as other tests of a package do). Under Gliderlabs all happen in the test
// process: a child forked while an upload's file was open for writing holds
// a copy of that descriptor until it execs, and running the upload meanwhile
// fails with "Text file busy" (ETXTBSY), which no real sshd would cause.
func TestRunJustUploadedWhileOthersRun(t *testing.T) {
	// Not parallel: its forks, hundreds a second, would hold every other
	// test's listening sockets for a moment each (a child holds the
	// process's descriptors until its exec), so their ports would seem
	// taken or still open.
	exe, err := os.ReadFile("/bin/true")
	if err != nil {
		t.Fatal(err)
	}
	key := NewKey(t)
	h := Start(t, 1, Config{Kind: Gliderlabs, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})[0]
	c := mustDial(t, h, key)
	sc := newSFTP(t, c)
	ctx, stop := context.WithCancel(t.Context())
	var others sync.WaitGroup
	defer others.Wait()
	defer stop()
	for range 2 {
		others.Go(func() {
			for ctx.Err() == nil {
				sess, err := c.NewSession()
				if err != nil {
					return
				}
				_ = sess.Run("true")
				sess.Close()
			}
		})
		others.Go(func() {
			for ctx.Err() == nil {
				_ = exec.CommandContext(ctx, "/bin/true").Run()
			}
		})
	}
	for i := range 300 {
		path := filepath.Join(h.Dir, fmt.Sprintf("exe-%d", i))
		upload(t, sc, path, exe, 0o755)
		if _, errOut, status := run(t, c, shellquote.Quote(path), ""); status != 0 {
			t.Fatalf("run %d of a just-uploaded executable exited with status %d: %q", i, status, errOut)
		}
	}
}

// TestSessionsHaveTheHostsOwnHome: a test host's sessions get a home of
// their own (Host.Dir/home), so the startup files of the machine running
// the tests (a pyenv in root's ~/.bashrc wrote "cannot rehash" to stderr
// when sessions started at once) neither reach a command's output nor
// slow it. The working directory stays the login user's home under
// OpenSSH, as documented.
func TestSessionsHaveTheHostsOwnHome(t *testing.T) {
	t.Parallel()
	forEachKind(t, func(t *testing.T, kind Kind) {
		if kind != OpenSSH {
			return // Gliderlabs runs /bin/sh with the test's environment
		}
		key := NewKey(t)
		h := Start(t, 1, Config{Kind: kind, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})[0]
		c := mustDial(t, h, key)
		want := filepath.Join(h.Dir, "home")
		if got := strings.TrimSpace(mustRun(t, c, "echo $HOME")); got != want {
			t.Errorf("HOME of a session is %q, want the host's own %q", got, want)
		}
		if _, err := os.Stat(want); err != nil {
			t.Errorf("the host's home: %v", err)
		}
	})
}
