// Package sshx is the SSH client plumbing Shepherd's loops and providers
// share: dialing with a bounded handshake, host key checks that fail with a
// clear cause, running one command with bounded output, and loading or
// creating the client key.
package sshx

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/crypto/ssh"
)

// ErrHostKeyMismatch means a machine presented a host key other than the
// one pinned or recorded for it.
var ErrHostKeyMismatch = errors.New("SSH host key mismatch")

// ErrNotStarted means Run could not even start the command (no session):
// unlike a connection cut while the command runs, it says for sure that the
// command did nothing.
var ErrNotStarted = errors.New("command not started")

// Target says how to reach one SSH server.
type Target struct {
	// Addr is host:port, used when Dial is nil and in messages.
	Addr string
	// Dial opens the connection; nil means TCP to Addr.
	Dial func(ctx context.Context) (net.Conn, error)
	User string
	Auth []ssh.AuthMethod
	// HostKey verifies the server's key; required (use CheckKey or a TOFU
	// callback, never ssh.InsecureIgnoreHostKey outside tests).
	HostKey ssh.HostKeyCallback
}

// Dial connects and authenticates within ctx. The returned client's
// connection is closed when ctx ends before Dial returns.
func Dial(ctx context.Context, t Target) (*ssh.Client, error) {
	if t.HostKey == nil {
		return nil, fmt.Errorf("ssh %s: no host key check configured", t.Addr)
	}
	var conn net.Conn
	var err error
	if t.Dial != nil {
		conn, err = t.Dial(ctx)
	} else {
		var d net.Dialer
		conn, err = d.DialContext(ctx, "tcp", t.Addr)
	}
	if err != nil {
		return nil, fmt.Errorf("ssh %s: connecting: %w", t.Addr, err)
	}
	// The handshake has no context of its own: bound it by closing the
	// connection when ctx ends first.
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	c, chans, reqs, err := ssh.NewClientConn(conn, t.Addr, &ssh.ClientConfig{
		User:            t.User,
		Auth:            t.Auth,
		HostKeyCallback: t.HostKey,
	})
	if !stop() || err != nil {
		conn.Close()
		// When ctx ended (or its deadline, set on the connection, struck
		// a read first) say so, so that callers can tell a timeout from a
		// refusal with errors.Is.
		cerr := ctx.Err()
		if dl, ok := ctx.Deadline(); ok && cerr == nil && !time.Now().Before(dl) {
			cerr = context.DeadlineExceeded
		}
		switch {
		case err == nil:
			err = cerr
		case cerr != nil:
			err = fmt.Errorf("%w: %w", cerr, err)
		}
		return nil, fmt.Errorf("ssh %s: handshake: %w", t.Addr, err)
	}
	_ = conn.SetDeadline(time.Time{})
	return ssh.NewClient(c, chans, reqs), nil
}

// CheckKey returns a host key callback that accepts exactly want.
func CheckKey(want ssh.PublicKey) ssh.HostKeyCallback {
	return func(_ string, _ net.Addr, got ssh.PublicKey) error {
		if !bytes.Equal(got.Marshal(), want.Marshal()) {
			return fmt.Errorf("%w: expected %s, got %s", ErrHostKeyMismatch, ssh.FingerprintSHA256(want), ssh.FingerprintSHA256(got))
		}
		return nil
	}
}

// Output is what a command printed, bounded.
type Output struct {
	Stdout, Stderr []byte
}

// Run runs cmd in a new session on c with stdin, and returns its output
// (each stream cut at maxOutput bytes). It stops the command when ctx ends.
// A non-zero exit status is an error that includes the end of stderr.
func Run(ctx context.Context, c *ssh.Client, cmd string, stdin []byte, maxOutput int) (Output, error) {
	s, err := c.NewSession()
	if err != nil {
		return Output{}, fmt.Errorf("running %q: %w: opening session: %w", cmd, ErrNotStarted, err)
	}
	defer s.Close()
	var out, errOut limitedBuffer
	out.max, errOut.max = maxOutput, maxOutput
	s.Stdout, s.Stderr = &out, &errOut
	if stdin != nil {
		s.Stdin = bytes.NewReader(stdin)
	}
	done := make(chan error, 1)
	go func() { done <- s.Run(cmd) }()
	select {
	case err = <-done:
	case <-ctx.Done():
		_ = s.Signal(ssh.SIGKILL)
		s.Close()
		<-done
		return Output{Stdout: out.Bytes(), Stderr: errOut.Bytes()}, fmt.Errorf("running %q: %w", cmd, ctx.Err())
	}
	o := Output{Stdout: out.Bytes(), Stderr: errOut.Bytes()}
	if err != nil {
		var exit *ssh.ExitError
		if errors.As(err, &exit) {
			return o, &ExitError{Command: cmd, Status: exit.ExitStatus(), Stderr: tail(o.Stderr, 512), err: exit}
		}
		return o, fmt.Errorf("running %q: %w", cmd, err)
	}
	return o, nil
}

// ExitError is a command's non-zero exit status, with the end of its
// stderr. It unwraps to the *ssh.ExitError.
type ExitError struct {
	Command string
	Status  int
	Stderr  string
	err     *ssh.ExitError
}

func (e *ExitError) Error() string {
	return fmt.Sprintf("running %q: exit status %d: %s", e.Command, e.Status, e.Stderr)
}

// Unwrap returns the SSH library's exit error.
func (e *ExitError) Unwrap() error { return e.err }

// limitedBuffer keeps the first max bytes written and discards the rest,
// so a runaway command cannot exhaust memory.
type limitedBuffer struct {
	bytes.Buffer
	max int
}

func (b *limitedBuffer) Write(p []byte) (int, error) {
	if room := b.max - b.Len(); room > 0 {
		b.Buffer.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}

func tail(b []byte, n int) string {
	b = bytes.TrimSpace(b)
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

// LoadOrCreateKey loads the ed25519 SSH client key from path (PEM, OpenSSH
// or PKCS#8), or creates one there with mode 0600 if the file does not exist.
func LoadOrCreateKey(path string) (ssh.Signer, error) {
	data, err := os.ReadFile(path)
	if err == nil {
		signer, err := ssh.ParsePrivateKey(data)
		if err != nil {
			return nil, fmt.Errorf("parsing SSH key %s: %w", path, err)
		}
		return signer, nil
	}
	if !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("reading SSH key %s: %w", path, err)
	}
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, err
	}
	der, err := x509.MarshalPKCS8PrivateKey(priv)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("creating SSH key %s: %w", path, err)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, fmt.Errorf("creating SSH key %s: %w", path, err)
	}
	if _, err := f.Write(pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})); err != nil {
		f.Close()
		return nil, fmt.Errorf("writing SSH key %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return nil, fmt.Errorf("writing SSH key %s: %w", path, err)
	}
	return ssh.NewSignerFromKey(priv)
}

var _ io.Writer = (*limitedBuffer)(nil)
