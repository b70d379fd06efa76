package sshx

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/internal/sshtest"
)

// TestDialTimeoutIsDeadlineExceeded dials a server that accepts the TCP
// connection and never says a word: the handshake must end at the
// context's deadline and say so, so callers can tell a hung machine from
// one that refused them.
func TestDialTimeoutIsDeadlineExceeded(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	t.Cleanup(func() {
		select {
		case c := <-accepted:
			c.Close()
		default:
		}
	})
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = Dial(ctx, Target{Addr: ln.Addr().String(), User: "root", Keys: []ssh.Signer{sshtest.NewKey(t)}, FirstUse: trustAny})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Dial to a silent server: %v, want DeadlineExceeded", err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("Dial returned after %s, long after its 200ms deadline", took)
	}
}

func TestDialNeedsHostKeyCheck(t *testing.T) {
	t.Parallel()
	_, err := Dial(t.Context(), Target{Addr: "127.0.0.1:1", User: "root", Keys: []ssh.Signer{sshtest.NewKey(t)}})
	if err == nil || !strings.Contains(err.Error(), "no host key check") {
		t.Fatalf("Dial without a host key check: %v", err)
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
			other := sshtest.NewKey(t).PublicKey()
			var mm *HostKeyMismatchError
			if err := dial(Target{HostKey: other}); !errors.As(err, &mm) || !errors.Is(err, ErrHostKeyMismatch) ||
				string(mm.Got.Marshal()) != string(h.HostKey.Marshal()) {
				t.Errorf("with another ed25519 key in force: %v, want a mismatch naming the server's", err)
			}

			// A server reinstalled with only an ed25519 key no longer has
			// the ECDSA key in force.
			h2 := sshtest.Start(t, 1, sshtest.Config{Kind: kind, AuthorizedKeys: auth})[0]
			err := dialOnce(t, h2, Target{Keys: []ssh.Signer{key}, HostKey: h.HostKeys[1]})
			if !errors.As(err, &mm) || mm.Got == nil || string(mm.Got.Marshal()) != string(h2.HostKey.Marshal()) {
				t.Errorf("with a key of a type the server lacks: %v, want a mismatch naming the server's ed25519 key", err)
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

// loginVia logs in to h through addr with key, with x/crypto alone, so
// that the tests of Run do not depend on Dial.
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

// TestRunReturnsAtDeadlineWhenPeerGoesSilent runs a command through a
// proxy that goes silent once the command started (a machine that reset
// without closing the connection): Run must return at its deadline, say
// so, and not claim the command never started.
func TestRunReturnsAtDeadlineWhenPeerGoesSilent(t *testing.T) {
	t.Parallel()
	for _, kind := range sshtest.Kinds(t) {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			key := sshtest.NewKey(t)
			h := sshtest.Start(t, 1, sshtest.Config{Kind: kind, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})[0]
			proxy := sshtest.StartProxy(t, h.Addr.String())
			c := loginVia(t, h, proxy.Addr.String(), key)
			marker := filepath.Join(h.Dir, "started")
			ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
			defer cancel()
			done := make(chan error, 1)
			go func() {
				_, err := Run(ctx, c, sshtest.UntilSilenced(marker), nil, 1024)
				done <- err
			}()
			waitForFile(t, marker)
			proxy.Silence()
			// The deadline is 2s; a Run that waits for the silent peer
			// never returns, and this test fails long before its binary's.
			select {
			case err := <-done:
				if !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, ErrNotStarted) {
					t.Errorf("Run against a silent peer: %v, want DeadlineExceeded (and not ErrNotStarted)", err)
				}
			case <-time.After(time.Minute):
				t.Fatal("Run still waits for a silent peer a minute after its 2s deadline")
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
