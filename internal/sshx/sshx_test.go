package sshx

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/internal/sshtest"
)

// TestDialNeedsHostKeyCheck dials a real server that would let the client
// in, with neither a key in force nor a first-use rule: Dial must refuse
// before it connects, and say why, rather than log in to whatever answers.
func TestDialNeedsHostKeyCheck(t *testing.T) {
	t.Parallel()
	for _, kind := range sshtest.Kinds(t) {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			h, key := hostFor(t, kind)
			// The same Target with a key in force logs in: only the
			// missing check stands between the client and the server.
			if err := dialOnce(t, h, Target{Keys: []ssh.Signer{key}, HostKey: h.HostKey}); err != nil {
				t.Fatalf("with the host key in force: %v", err)
			}
			err := dialRefused(t, h, Target{Keys: []ssh.Signer{key}})
			if err == nil || !strings.Contains(err.Error(), "no host key check configured") || !strings.Contains(err.Error(), h.Addr.String()) {
				t.Errorf("Dial without a host key check: %v, want an error naming %s and the missing check", err, h.Addr)
			}
		})
	}
}

// TestDialRefusesBeforeConnecting dials a real server with Targets that
// Dial cannot use: it must say what is wrong with them without connecting.
func TestDialRefusesBeforeConnecting(t *testing.T) {
	t.Parallel()
	key := sshtest.NewKey(t)
	h := sshtest.Start(t, 1, sshtest.Config{AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})[0]
	for _, tc := range []struct {
		name   string
		tg     Target
		want   string
		wantIs error
	}{
		{"no credentials", Target{HostKey: h.HostKey}, "no credentials to offer", nil},
		{"no credentials on first use", Target{FirstUse: trustAny}, "no credentials to offer", nil},
		{"only the machine's password, withheld", Target{FirstUse: trustAny, SecretAuth: []ssh.AuthMethod{ssh.Password("pw")}},
			"and there is no other credential to offer", ErrSecretsWithheld},
		{"only the machine's key, withheld", Target{FirstUse: trustAny, SecretKeys: []ssh.Signer{key}},
			"and there is no other credential to offer", ErrSecretsWithheld},
		{"a security key in force", Target{HostKey: securityKey(t), Keys: []ssh.Signer{key}},
			"SSH host keys of type sk-ssh-ed25519@openssh.com cannot be verified", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			err := dialRefused(t, h, tc.tg)
			if err == nil || !strings.HasPrefix(err.Error(), "ssh "+h.Addr.String()+": ") || !strings.Contains(err.Error(), tc.want) ||
				(tc.wantIs != nil && !errors.Is(err, tc.wantIs)) {
				t.Errorf("Dial: %v, want an error naming %s and saying %q (%v)", err, h.Addr, tc.want, tc.wantIs)
			}
		})
	}
}

// dialRefused is dialOnce with a Target.Dial that reaches h as Addr would,
// and fails the test if Dial opened a connection.
func dialRefused(t *testing.T, h *sshtest.Host, tg Target) error {
	t.Helper()
	var connected atomic.Bool
	tg.Dial = func(ctx context.Context) (net.Conn, error) {
		connected.Store(true)
		var d net.Dialer
		return d.DialContext(ctx, "tcp", h.Addr.String())
	}
	err := dialOnce(t, h, tg)
	if connected.Load() {
		t.Errorf("Dial connected to %s", h)
	}
	return err
}

// securityKey is an ed25519 security key (FIDO) as a host key: sshd does
// not use them, and Dial cannot verify them.
func securityKey(t *testing.T) ssh.PublicKey {
	t.Helper()
	ed := sshtest.NewKey(t).PublicKey().Marshal()
	var raw struct {
		Name string
		Key  []byte
	}
	if err := ssh.Unmarshal(ed, &raw); err != nil {
		t.Fatal(err)
	}
	k, err := ssh.ParsePublicKey(ssh.Marshal(struct {
		Name, Key, Application string
	}{ssh.KeyAlgoSKED25519, string(raw.Key), "ssh:"}))
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// TestSupportedHostKey: the key types sshd uses can be verified; others
// are named in the error.
func TestSupportedHostKey(t *testing.T) {
	t.Parallel()
	h := sshtest.Start(t, 1, sshtest.Config{Kind: sshtest.Gliderlabs, AllHostKeyTypes: true})[0]
	for _, k := range h.HostKeys {
		if err := SupportedHostKey(k); err != nil {
			t.Errorf("SupportedHostKey(%s): %v", k.Type(), err)
		}
	}
	if err := SupportedHostKey(securityKey(t)); err == nil || !strings.Contains(err.Error(), ssh.KeyAlgoSKED25519) {
		t.Errorf("SupportedHostKey(a security key): %v, want an error naming its type", err)
	}
}

// dialOnce logs in to h as its user with tg (Addr and User filled in),
// within 30s, and logs out again.
func dialOnce(t *testing.T, h *sshtest.Host, tg Target) error {
	t.Helper()
	tg.Addr, tg.User = h.Addr.String(), h.User
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	c, err := Dial(ctx, tg)
	if err == nil {
		c.Close()
	}
	return err
}

// trustAny is a FirstUse that trusts every key.
func trustAny(ssh.PublicKey) error { return nil }

// TestDialAsksForTheKeyInForce dials servers that hold ed25519, ECDSA and
// RSA host keys, as a stock sshd does: with any of them in force the server
// must present that one; on first use the ed25519 one; a key the server
// does not hold (any more) is a mismatch that names the key it presents.
func TestDialAsksForTheKeyInForce(t *testing.T) {
	t.Parallel()
	for _, kind := range sshtest.Kinds(t) {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			key := sshtest.NewKey(t)
			auth := []ssh.PublicKey{key.PublicKey()}
			h := sshtest.Start(t, 1, sshtest.Config{Kind: kind, AllHostKeyTypes: true, AuthorizedKeys: auth})[0]
			dial := func(tg Target) error {
				tg.Keys = []ssh.Signer{key}
				return dialOnce(t, h, tg)
			}
			for _, k := range h.HostKeys {
				if err := dial(Target{HostKey: k}); err != nil {
					t.Errorf("with the %s key in force: %v", k.Type(), err)
				}
			}
			var first ssh.PublicKey
			if err := dial(Target{FirstUse: func(k ssh.PublicKey) error { first = k; return nil }}); err != nil {
				t.Errorf("first use: %v", err)
			} else if string(first.Marshal()) != string(h.HostKey.Marshal()) {
				t.Errorf("first use was presented %s, want the ed25519 key %s", Describe(first), Describe(h.HostKey))
			}
			errRefused := errors.New("the operator refused the key")
			if err := dial(Target{FirstUse: func(ssh.PublicKey) error { return errRefused }}); !errors.Is(err, errRefused) {
				t.Errorf("first use refused: %v, want the refusal", err)
			}
			other := sshtest.NewKey(t).PublicKey()
			var mm *HostKeyMismatchError
			err := dial(Target{HostKey: other})
			if !errors.As(err, &mm) || !errors.Is(err, ErrHostKeyMismatch) || string(mm.Got.Marshal()) != string(h.HostKey.Marshal()) {
				t.Errorf("with another ed25519 key in force: %v, want a mismatch naming the server's", err)
			}
			// The operator is shown both keys.
			if want := fmt.Sprintf("ssh %s: handshake: ssh: handshake failed: SSH host key mismatch: expected %s, got %s",
				h.Addr, Describe(other), Describe(h.HostKey)); fmt.Sprint(err) != want {
				t.Errorf("with another ed25519 key in force, the error says\n\t%v\nwant\n\t%s", err, want)
			}

			// A server reinstalled with only an ed25519 key no longer has
			// the ECDSA key in force.
			h2 := sshtest.Start(t, 1, sshtest.Config{Kind: kind, AuthorizedKeys: auth})[0]
			ecdsa := h.HostKeys[1]
			err = dialOnce(t, h2, Target{Keys: []ssh.Signer{key}, HostKey: ecdsa})
			if !errors.As(err, &mm) || mm.Got == nil || string(mm.Got.Marshal()) != string(h2.HostKey.Marshal()) ||
				!strings.Contains(err.Error(), fmt.Sprintf("SSH host key mismatch: expected %s, got %s", Describe(ecdsa), Describe(h2.HostKey))) {
				t.Errorf("with a key of a type the server lacks: %v, want a mismatch naming the server's ed25519 key", err)
			}
			// If the server cannot be asked again which key it presents
			// now (it went away), the mismatch says so.
			dials := 0
			var d net.Dialer
			err = dialOnce(t, h2, Target{Keys: []ssh.Signer{key}, HostKey: ecdsa, Dial: func(ctx context.Context) (net.Conn, error) {
				if dials++; dials > 1 {
					return nil, errors.New("connection refused")
				}
				return d.DialContext(ctx, "tcp", h2.Addr.String())
			}})
			if !errors.As(err, &mm) || mm.Got != nil ||
				!strings.Contains(err.Error(), fmt.Sprintf("SSH host key mismatch: expected %s, and the server presents no key of that type", Describe(ecdsa))) {
				t.Errorf("with a key of a type the server lacks, asked once: %v, want a mismatch saying the server has no such key", err)
			}
		})
	}
}

// TestSecretsGoOnlyToVerifiedServers dials password-only servers: the
// password is offered to a server whose key is in force, or on first use
// when allowed, and withheld otherwise, with an error that says so.
func TestSecretsGoOnlyToVerifiedServers(t *testing.T) {
	t.Parallel()
	for _, kind := range sshtest.Kinds(t) {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			const pw = "sshx-S3CR3T"
			hosts := sshtest.Start(t, 3, sshtest.Config{Kind: kind, Password: pw})
			dial := func(h *sshtest.Host, tg Target) error {
				tg.Keys, tg.SecretAuth = []ssh.Signer{sshtest.NewKey(t)}, []ssh.AuthMethod{ssh.Password(pw)}
				return dialOnce(t, h, tg)
			}
			err := dial(hosts[0], Target{FirstUse: trustAny})
			if !errors.Is(err, ErrSecretsWithheld) || hosts[0].PasswordAttempts() != 0 {
				t.Errorf("first use: %v with %d passwords offered; want ErrSecretsWithheld and none", err, hosts[0].PasswordAttempts())
			}
			if strings.Contains(fmt.Sprint(err), pw) {
				t.Errorf("the error holds the password: %v", err)
			}
			for i, tg := range []Target{{HostKey: hosts[1].HostKey}, {FirstUse: trustAny, SecretsOnFirstUse: true}} {
				h := hosts[i+1]
				err := dial(h, tg)
				if h.PasswordAttempts() != 1 || errors.Is(err, ErrSecretsWithheld) || (kind == sshtest.Gliderlabs && err != nil) {
					t.Errorf("case %d: %v with %d passwords offered; want it offered once", i, err, h.PasswordAttempts())
				}
			}
		})
	}
}

// TestSecretKeysGoOnlyToVerifiedServers dials servers that let in only
// the machine's own key (Target.SecretKeys), not Shepherd's: the key is
// offered to a server whose key is in force, or on first use when
// allowed, and withheld otherwise, with an error that says so. A login
// that fails with no secret withheld does not blame withholding.
func TestSecretKeysGoOnlyToVerifiedServers(t *testing.T) {
	t.Parallel()
	for _, kind := range sshtest.Kinds(t) {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			own, machine := sshtest.NewKey(t), sshtest.NewKey(t)
			h := sshtest.Start(t, 1, sshtest.Config{Kind: kind, AuthorizedKeys: []ssh.PublicKey{machine.PublicKey()}})[0]
			dial := func(tg Target) error {
				tg.Keys, tg.SecretKeys = []ssh.Signer{own}, []ssh.Signer{machine}
				return dialOnce(t, h, tg)
			}
			if err := dial(Target{FirstUse: trustAny}); !errors.Is(err, ErrSecretsWithheld) || !strings.Contains(err.Error(), "unable to authenticate") {
				t.Errorf("first use: %v, want the login refused with ErrSecretsWithheld", err)
			}
			if err := dial(Target{HostKey: h.HostKey}); err != nil {
				t.Errorf("with the host key in force: %v", err)
			}
			if err := dial(Target{FirstUse: trustAny, SecretsOnFirstUse: true}); err != nil {
				t.Errorf("first use with SecretsOnFirstUse: %v", err)
			}
			err := dialOnce(t, h, Target{FirstUse: trustAny, Keys: []ssh.Signer{own}})
			if err == nil || errors.Is(err, ErrSecretsWithheld) || strings.Contains(err.Error(), "withheld") {
				t.Errorf("first use without secrets: %v, want a refused login that does not blame withheld secrets", err)
			}
		})
	}
}

// loginVia logs in to h through addr with key, with x/crypto alone, so
// that the tests of Run do not depend on Dial.
// hostFor starts a real server of kind that lets key, a fresh key, in.
func hostFor(t *testing.T, kind sshtest.Kind) (h *sshtest.Host, key ssh.Signer) {
	t.Helper()
	key = sshtest.NewKey(t)
	return sshtest.Start(t, 1, sshtest.Config{Kind: kind, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})[0], key
}

func loginVia(t *testing.T, h *sshtest.Host, addr string, key ssh.Signer) *ssh.Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	dl, _ := ctx.Deadline()
	_ = conn.SetDeadline(dl)
	c, chans, reqs, err := ssh.NewClientConn(conn, addr, &ssh.ClientConfig{
		User: h.User, Auth: []ssh.AuthMethod{ssh.PublicKeys(key)},
		HostKeyCallback: ssh.FixedHostKey(h.HostKey), HostKeyAlgorithms: []string{h.HostKey.Type()},
	})
	if err != nil {
		conn.Close()
		t.Fatalf("logging in to %s: %v", h, err)
	}
	_ = conn.SetDeadline(time.Time{})
	client := ssh.NewClient(c, chans, reqs)
	t.Cleanup(func() { client.Close() })
	return client
}

// TestRunReturnsWhenPeerGoesSilent runs a command on real servers through
// a proxy that goes silent once the command started (a machine that reset
// without closing the connection), and then ends Run's context: Run must
// return, say why, and not claim the command never started. The exact
// timing is TestRunReturnsAtDeadline's (on a virtual clock); here the
// context ends only after the peer went silent, whatever the load.
func TestRunReturnsWhenPeerGoesSilent(t *testing.T) {
	t.Parallel()
	for _, kind := range sshtest.Kinds(t) {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			h, key := hostFor(t, kind)
			proxy := sshtest.StartProxy(t, h.Addr.String())
			c := loginVia(t, h, proxy.Addr.String(), key)
			marker := filepath.Join(h.Dir, "started")
			ctx, cancel := context.WithCancel(t.Context())
			defer cancel()
			done := make(chan error, 1)
			go func() {
				_, err := Run(ctx, c, sshtest.UntilSilenced(marker), nil, 1024)
				done <- err
			}()
			waitForFile(t, marker)
			proxy.Silence()
			select {
			case err := <-done:
				t.Fatalf("Run returned while its context was alive and the command ran: %v", err)
			default:
			}
			cancel()
			select {
			case err := <-done:
				if !errors.Is(err, context.Canceled) || errors.Is(err, ErrNotStarted) {
					t.Errorf("Run against a silent peer: %v, want Canceled (and not ErrNotStarted)", err)
				}
			case <-time.After(time.Minute):
				t.Fatal("Run still waits for a silent peer a minute after its context ended")
			}
		})
	}
}

// lines returns n bytes of numbered lines, so that any cut of them shows
// where it was made.
func lines(n int) []byte {
	var b []byte
	for i := 0; len(b) < n; i++ {
		b = fmt.Appendf(b, "line %05d\n", i)
	}
	return b[:n]
}

// TestRunOutput runs commands on real servers: the command reads Run's
// stdin; each stream is kept up to maxOutput bytes; a non-zero exit status
// is an *ExitError with the status and the end of stderr, which is what
// operators see in a failed takeover.
func TestRunOutput(t *testing.T) {
	t.Parallel()
	for _, kind := range sshtest.Kinds(t) {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			h, key := hostFor(t, kind)
			c := loginVia(t, h, h.Addr.String(), key)
			ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
			defer cancel()

			// One command, because every command costs OpenSSH a login
			// shell: it copies its stdin to stdout and stderr and fails.
			// 100 kB arrive in several SSH packets (32 kB at most), so the
			// limit must hold across writes.
			const cmd, limit = "tee /dev/stderr; exit 3", 50_001
			in := lines(100_000)
			out, err := Run(ctx, c, cmd, in, limit)
			if string(out.Stdout) != string(in[:limit]) || string(out.Stderr) != string(in[:limit]) {
				t.Errorf("%s of %d bytes with maxOutput %d: stdout %d bytes, stderr %d bytes; want the first %d bytes of each",
					cmd, len(in), limit, len(out.Stdout), len(out.Stderr), limit)
			}
			var exit *ExitError
			var sshExit *ssh.ExitError
			if !errors.As(err, &exit) || !errors.As(err, &sshExit) || exit.Status != 3 || sshExit.ExitStatus() != 3 {
				t.Fatalf("%s: %v, want exit status 3", cmd, err)
			}
			tail := string(in[limit-512 : limit]) // from "line" to a digit: nothing to trim
			if exit.Command != cmd || exit.Stderr != tail {
				t.Errorf("ExitError{Command: %q, Stderr: %d bytes %q...%q}, want the command and the last 512 bytes of stderr kept, %q...%q",
					exit.Command, len(exit.Stderr), exit.Stderr[:min(12, len(exit.Stderr))], exit.Stderr[max(0, len(exit.Stderr)-12):], tail[:12], tail[len(tail)-12:])
			}
			if want := fmt.Sprintf("running %q: exit status 3: %s", cmd, tail); err.Error() != want {
				t.Errorf("the error says\n\t%v\nwant\n\t%s", err, want)
			}

			// A client whose connection is gone cannot start anything.
			c.Close()
			_, err = Run(ctx, c, "true", nil, 1024)
			if !errors.Is(err, ErrNotStarted) || !strings.HasPrefix(fmt.Sprint(err), `running "true": command not started: opening session: `) ||
				strings.Contains(err.Error(), "%!") || errors.Is(err, context.Canceled) {
				t.Errorf("Run on a closed client: %v, want ErrNotStarted, and nothing about a context", err)
			}
		})
	}
}

// waitForFile polls until path exists.
func waitForFile(t *testing.T, path string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for {
		if _, err := os.Stat(path); err == nil {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s did not appear within 30s", path)
		case <-tick.C:
		}
	}
}
