// Package sshx is the SSH client plumbing Shepherd's loops and providers
// share: dialing with a bounded handshake, host key checks that fail with a
// clear cause, the rule of which credentials a server may see, running one
// command with bounded output, and loading or creating the client key.
//
// # Host keys
//
// Which host key a client accepts, and which it asks a server for, is
// decided here and nowhere else. Target.HostKey is the key in force for a
// machine: pinned by its provider, or recorded on first use. A server that
// holds several host keys (a stock sshd has ed25519, ECDSA and RSA ones)
// presents the one the client lists first, and x/crypto/ssh lists ECDSA
// before ed25519, so a client that does not say which key it expects is
// shown another one and reports a mismatch. Dial therefore asks only for the
// algorithms of the key in force (for RSA the SHA-2 signatures, which
// OpenSSH requires since 8.8). With no key in force (first use) it asks for
// FirstUseAlgorithms, ed25519 first, so that the key recorded is the
// strongest one and the same on every machine of a stock fleet.
//
// A server that presents another key, or holds no key of the type in force
// any more (it was reinstalled), fails with a *HostKeyMismatchError that
// names both keys: Dial asks such a server, on a second connection, which
// key it presents now.
//
// # Credentials
//
// Target.Keys (Shepherd's own client key) may go to any server that passed
// the host key check, a first use included: it proves only that we are
// Shepherd. Target.Secrets are the machine's own credentials (an inventory's
// password or key): they go only to a server whose key is in force, unless
// Target.SecretsOnFirstUse says the operator accepted the risk. A login that
// fails while secrets were withheld wraps ErrSecretsWithheld.
//
// # Deadlines
//
// Every operation returns by its context's deadline whatever the server
// does, including a server that accepts the connection and then never
// sends another byte (a machine that reset without closing it): x/crypto/ssh
// waits for ever for such a peer, and only closing the connection unblocks
// it. Dial closes the connection when its context ends first; Run closes the
// client's connection when its context ends before the command did. Callers
// that use a client otherwise (SFTP) bound it the same way with CloseWhenDone.
package sshx

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"time"

	"golang.org/x/crypto/ssh"
)

// ErrHostKeyMismatch means a machine presented a host key other than the
// one pinned or recorded for it. Errors that wrap it are
// *HostKeyMismatchError values, which name both keys.
var ErrHostKeyMismatch = errors.New("SSH host key mismatch")

// ErrNotStarted means the server never confirmed that it started the
// command: no session could be opened, the server refused the command, or
// the connection (or the context) ended before the server answered. After
// the server confirmed, a cut or silent connection says nothing about the
// command, which may well have done its work (a reboot).
var ErrNotStarted = errors.New("command not started")

// ErrSecretsWithheld means the login failed while the machine's own
// credentials (Target.Secrets) were withheld because its host key is not
// verified yet: pin or record the key, or allow secrets on first use.
var ErrSecretsWithheld = errors.New("the machine's own SSH credentials were withheld: its host key is not verified (none is pinned or recorded)")

// FirstUseAlgorithms are the host key algorithms Dial asks a server for
// when no key is in force yet, most preferred first: ed25519, then ECDSA,
// then RSA with SHA-2 signatures. Legacy ssh-rsa (SHA-1) and DSA are not
// offered.
var FirstUseAlgorithms = []string{
	ssh.KeyAlgoED25519,
	ssh.KeyAlgoECDSA256, ssh.KeyAlgoECDSA384, ssh.KeyAlgoECDSA521,
	ssh.KeyAlgoRSASHA512, ssh.KeyAlgoRSASHA256,
}

// HostKeyMismatchError is a server's host key other than the one in force.
type HostKeyMismatchError struct {
	// Want is the key in force (pinned or recorded).
	Want ssh.PublicKey
	// Got is the key the server presents; nil if it could not be learnt.
	Got ssh.PublicKey
}

func (e *HostKeyMismatchError) Error() string {
	if e.Got == nil {
		return fmt.Sprintf("%v: expected %s, and the server presents no key of that type", ErrHostKeyMismatch, Describe(e.Want))
	}
	return fmt.Sprintf("%v: expected %s, got %s", ErrHostKeyMismatch, Describe(e.Want), Describe(e.Got))
}

// Is makes errors.Is(err, ErrHostKeyMismatch) true.
func (e *HostKeyMismatchError) Is(target error) bool { return target == ErrHostKeyMismatch }

// Describe names a public key for operators: its type and SHA-256
// fingerprint, as ssh-keygen -l shows them.
func Describe(k ssh.PublicKey) string {
	return k.Type() + " " + ssh.FingerprintSHA256(k)
}

// Target says how to reach one SSH server.
type Target struct {
	// Addr is host:port, used when Dial is nil and in messages.
	Addr string
	// Dial opens the connection; nil means TCP to Addr.
	Dial func(ctx context.Context) (net.Conn, error)
	User string
	// Keys are Shepherd's own client keys, offered to every server that
	// passed the host key check.
	Keys []ssh.Signer
	// Secrets are the machine's own credentials: SecretKeys, offered in the
	// same publickey attempt as Keys (a client does not try a method again
	// once the server rejected it), then SecretAuth (a password). Both go
	// only to a server whose key is in force, or with SecretsOnFirstUse.
	SecretKeys []ssh.Signer
	SecretAuth []ssh.AuthMethod
	// SecretsOnFirstUse lets the secrets go to a server whose key is not
	// in force yet: the operator opted the machine into trust on first use.
	SecretsOnFirstUse bool
	// HostKey is the key the server must present: pinned by the provider or
	// recorded on first use. nil means none is known yet, and FirstUse
	// decides.
	HostKey ssh.PublicKey
	// FirstUse decides whether to trust the key a server presents when
	// HostKey is nil; the caller records the key once the work it did
	// through it succeeded. nil refuses every server without HostKey.
	FirstUse func(key ssh.PublicKey) error
}

// SupportedHostKey reports whether Dial can verify a server against key:
// an error names the key types it cannot (DSA, security keys).
func SupportedHostKey(key ssh.PublicKey) error {
	_, err := hostKeyAlgorithms(key)
	return err
}

// hostKeyAlgorithms returns the algorithms to ask a server for when key is
// in force (nil: FirstUseAlgorithms).
func hostKeyAlgorithms(key ssh.PublicKey) ([]string, error) {
	if key == nil {
		return FirstUseAlgorithms, nil
	}
	switch t := key.Type(); t {
	case ssh.KeyAlgoRSA:
		return []string{ssh.KeyAlgoRSASHA512, ssh.KeyAlgoRSASHA256}, nil
	case ssh.CertAlgoRSAv01:
		return []string{ssh.CertAlgoRSASHA512v01, ssh.CertAlgoRSASHA256v01}, nil
	case ssh.KeyAlgoED25519, ssh.KeyAlgoECDSA256, ssh.KeyAlgoECDSA384, ssh.KeyAlgoECDSA521,
		ssh.CertAlgoED25519v01, ssh.CertAlgoECDSA256v01, ssh.CertAlgoECDSA384v01, ssh.CertAlgoECDSA521v01:
		return []string{t}, nil
	default:
		return nil, fmt.Errorf("SSH host keys of type %s cannot be verified (use an ed25519, ECDSA or RSA key)", t)
	}
}

// withheld reports whether t's secrets are kept from the server.
func (t Target) withheld() bool {
	return t.HostKey == nil && !t.SecretsOnFirstUse && (len(t.SecretKeys) > 0 || len(t.SecretAuth) > 0)
}

// auth returns the authentication methods offered to the server.
func (t Target) auth() []ssh.AuthMethod {
	keys, rest := t.Keys, []ssh.AuthMethod(nil)
	if !t.withheld() {
		keys = append(slices.Clip(keys), t.SecretKeys...)
		rest = t.SecretAuth
	}
	var out []ssh.AuthMethod
	if len(keys) > 0 {
		out = append(out, ssh.PublicKeys(keys...))
	}
	return append(out, rest...)
}

// Dial connects and authenticates within ctx (see the package doc for the
// host key and credential rules). The connection is closed when ctx ends
// before Dial returns.
func Dial(ctx context.Context, t Target) (*ssh.Client, error) {
	algos, err := hostKeyAlgorithms(t.HostKey)
	if err != nil {
		return nil, fmt.Errorf("ssh %s: %w", t.Addr, err)
	}
	if t.HostKey == nil && t.FirstUse == nil {
		return nil, fmt.Errorf("ssh %s: no host key check configured: no key is pinned or recorded, and first use is not allowed", t.Addr)
	}
	auth := t.auth()
	switch {
	case len(auth) == 0 && t.withheld():
		return nil, fmt.Errorf("ssh %s: %w, and there is no other credential to offer", t.Addr, ErrSecretsWithheld)
	case len(auth) == 0:
		return nil, fmt.Errorf("ssh %s: no credentials to offer", t.Addr)
	}
	verified := false
	check := func(_ string, _ net.Addr, got ssh.PublicKey) error {
		if t.HostKey == nil {
			if err := t.FirstUse(got); err != nil {
				return err
			}
		} else if !bytes.Equal(got.Marshal(), t.HostKey.Marshal()) {
			return &HostKeyMismatchError{Want: t.HostKey, Got: got}
		}
		verified = true
		return nil
	}
	c, err := handshake(ctx, t, &ssh.ClientConfig{User: t.User, Auth: auth, HostKeyCallback: check, HostKeyAlgorithms: algos})
	if err == nil {
		return c, nil
	}
	var neg *ssh.AlgorithmNegotiationError
	switch {
	case t.HostKey != nil && errors.As(err, &neg) && neg.What == "host key":
		// No key of the type in force: the machine's keys changed. Learn
		// the key it presents now, so that an operator can accept it.
		mismatch := &HostKeyMismatchError{Want: t.HostKey, Got: presentedKey(ctx, t)}
		return nil, fmt.Errorf("ssh %s: handshake: %w (the server offers only %v)", t.Addr, mismatch, neg.RequestedAlgorithms)
	case verified && t.withheld():
		return nil, fmt.Errorf("ssh %s: %w: %w", t.Addr, ErrSecretsWithheld, err)
	}
	return nil, fmt.Errorf("ssh %s: %w", t.Addr, err)
}

// errPresented ends the handshake of presentedKey once the key is known.
var errPresented = errors.New("host key learnt")

// presentedKey returns the host key t's server presents to a client that
// asks for FirstUseAlgorithms, or nil if it cannot be learnt.
func presentedKey(ctx context.Context, t Target) ssh.PublicKey {
	var got ssh.PublicKey
	_, _ = handshake(ctx, t, &ssh.ClientConfig{
		User:              t.User,
		HostKeyAlgorithms: FirstUseAlgorithms,
		HostKeyCallback: func(_ string, _ net.Addr, k ssh.PublicKey) error {
			got = k
			return errPresented
		},
	})
	return got
}

// handshake connects to t and runs the SSH handshake with cfg, bounded by
// ctx.
func handshake(ctx context.Context, t Target, cfg *ssh.ClientConfig) (*ssh.Client, error) {
	var conn net.Conn
	var err error
	if t.Dial != nil {
		conn, err = t.Dial(ctx)
	} else {
		var d net.Dialer
		conn, err = d.DialContext(ctx, "tcp", t.Addr)
	}
	if err != nil {
		return nil, fmt.Errorf("connecting: %w", err)
	}
	// The handshake has no context of its own: bound it by closing the
	// connection when ctx ends first.
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	if dl, ok := ctx.Deadline(); ok {
		_ = conn.SetDeadline(dl)
	}
	c, chans, reqs, err := ssh.NewClientConn(conn, t.Addr, cfg)
	if !stop() || err != nil {
		conn.Close()
		// When ctx ended (or its deadline, set on the connection, struck
		// a read first) say so, so that callers can tell a timeout from a
		// refusal with errors.Is.
		if cerr := ctxErr(ctx); cerr != nil {
			if err == nil {
				err = cerr
			} else {
				err = fmt.Errorf("%w: %w", cerr, err)
			}
		}
		return nil, fmt.Errorf("handshake: %w", err)
	}
	_ = conn.SetDeadline(time.Time{})
	return ssh.NewClient(c, chans, reqs), nil
}

// ctxErr is ctx.Err(), or DeadlineExceeded once ctx's deadline has passed
// though ctx has not noticed yet.
func ctxErr(ctx context.Context) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if dl, ok := ctx.Deadline(); ok && !time.Now().Before(dl) {
		return context.DeadlineExceeded
	}
	return nil
}

// CloseWhenDone closes c's connection when ctx ends, which is what ends
// every operation on c that waits for the server (SFTP, sessions). Call
// stop to keep c open once the operations are done; it reports whether it
// stopped the close in time.
func CloseWhenDone(ctx context.Context, c *ssh.Client) (stop func() bool) {
	return context.AfterFunc(ctx, func() { c.Close() })
}

// Output is what a command printed, bounded.
type Output struct {
	Stdout, Stderr []byte
}

// Run runs cmd in a new session on c with stdin, and returns its output
// (each stream cut at maxOutput bytes). A non-zero exit status is an
// *ExitError that includes the end of stderr.
//
// Run returns by the time ctx ends, whatever the server does: if ctx ends
// before the command does, Run closes c's connection (a server that went
// silent would hold the session, and x/crypto/ssh, for ever; closing is the
// only thing that frees them) and returns an error wrapping ctx.Err(); c
// is unusable then. An error wrapping ErrNotStarted means the server never
// confirmed it started the command.
func Run(ctx context.Context, c *ssh.Client, cmd string, stdin []byte, maxOutput int) (Output, error) {
	stop := CloseWhenDone(ctx, c)
	defer stop()
	s, err := c.NewSession()
	if err != nil {
		return Output{}, fmt.Errorf("running %q: %w: opening session: %w", cmd, ErrNotStarted, withCtx(ctx, err))
	}
	defer s.Close()
	var out, errOut limitedBuffer
	out.max, errOut.max = maxOutput, maxOutput
	s.Stdout, s.Stderr = &out, &errOut
	if stdin != nil {
		s.Stdin = bytes.NewReader(stdin)
	}
	if err := s.Start(cmd); err != nil {
		return Output{}, fmt.Errorf("running %q: %w: %w", cmd, ErrNotStarted, withCtx(ctx, err))
	}
	err = s.Wait()
	o := Output{Stdout: out.Bytes(), Stderr: errOut.Bytes()}
	var exit *ssh.ExitError
	switch {
	case err == nil:
		return o, nil
	case errors.As(err, &exit):
		return o, &ExitError{Command: cmd, Status: exit.ExitStatus(), Stderr: tail(o.Stderr, 512), err: exit}
	}
	return o, fmt.Errorf("running %q: %w", cmd, withCtx(ctx, err))
}

// withCtx adds ctx's error to err, the error of an operation that ctx's end
// may have cut short (by closing the connection), so that callers can tell
// a timeout with errors.Is.
func withCtx(ctx context.Context, err error) error {
	if cerr := ctx.Err(); cerr != nil && !errors.Is(err, cerr) {
		return fmt.Errorf("%w: %w", cerr, err)
	}
	return err
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
// so a runaway command cannot exhaust memory. Its only way in is Write:
// an embedded bytes.Buffer would lend it ReadFrom, which io.Copy (and so
// the SSH session copying a command's output) prefers to Write, and which
// knows no limit.
type limitedBuffer struct {
	buf bytes.Buffer
	max int
}

func (b *limitedBuffer) Write(p []byte) (int, error) {
	if room := b.max - b.buf.Len(); room > 0 {
		b.buf.Write(p[:min(len(p), room)])
	}
	return len(p), nil
}

// Bytes returns what was kept.
func (b *limitedBuffer) Bytes() []byte { return b.buf.Bytes() }

func tail(b []byte, n int) string {
	b = bytes.TrimSpace(b)
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}

var _ io.Writer = (*limitedBuffer)(nil)
