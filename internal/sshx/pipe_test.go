package sshx

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"golang.org/x/crypto/ssh"
	"google.golang.org/grpc/test/bufconn"

	"github.com/shepherd/shepherd/internal/sshtest"
)

// The tests in this file check the deadlines of Dial and Run on the
// synctest bubble's clock: the server is in memory, reached through
// Target.Dial over in-memory connections (grpc's bufconn, or net.Pipe), so
// every wait (the connections' deadlines, the contexts' timers,
// x/crypto/ssh's channels and condition variables) is on the bubble's
// virtual time. A silent peer is then silent for exactly as
// long as the test says, whatever the load on the machine, and the tests
// can require that an operation returns at its deadline, not only "soon
// after".

// pipeServer is an in-memory SSH server that lets any client key in.
type pipeServer struct {
	hostKey ssh.Signer
	// session serves an accepted session channel; nil leaves every
	// request to open a channel unanswered.
	session func(ch ssh.Channel, reqs <-chan *ssh.Request)
}

// newPipeServer returns a server with a fresh host key, for use inside a
// bubble.
func newPipeServer(t *testing.T, session func(ssh.Channel, <-chan *ssh.Request)) *pipeServer {
	return &pipeServer{hostKey: sshtest.NewKey(t), session: session}
}

// target is a Target that reaches s through a new pipe per connection,
// with s's host key in force.
func (s *pipeServer) target(t *testing.T) Target {
	return Target{Addr: "pipe", User: "root", Keys: []ssh.Signer{sshtest.NewKey(t)}, HostKey: s.hostKey.PublicKey(),
		Dial: func(ctx context.Context) (net.Conn, error) {
			// A listener per connection: bufconn's connections are
			// buffered, as TCP's are, so both ends can send their
			// version before they read the other's (a bare net.Pipe
			// would block them on each other).
			l := bufconn.Listen(1 << 16)
			go func() {
				c, err := l.Accept()
				l.Close()
				if err == nil {
					s.serve(c)
				}
			}()
			return l.DialContext(ctx)
		}}
}

// serve runs one connection until the client closes it.
func (s *pipeServer) serve(conn net.Conn) {
	defer conn.Close()
	cfg := &ssh.ServerConfig{PublicKeyCallback: func(ssh.ConnMetadata, ssh.PublicKey) (*ssh.Permissions, error) { return nil, nil }}
	cfg.AddHostKey(s.hostKey)
	sc, chans, reqs, err := ssh.NewServerConn(conn, cfg)
	if err != nil {
		return
	}
	defer sc.Close()
	go ssh.DiscardRequests(reqs)
	for nc := range chans {
		if s.session == nil {
			continue // never answered
		}
		if nc.ChannelType() != "session" {
			_ = nc.Reject(ssh.Prohibited, "only sessions here")
			continue
		}
		ch, creqs, err := nc.Accept()
		if err != nil {
			continue
		}
		go s.session(ch, creqs)
	}
}

// silentAfter serves a session until its exec request, and then says
// nothing more: a machine that stopped answering (it reset) once it saw
// the command, having confirmed that it started it (confirm) or not yet.
func silentAfter(confirm bool) func(ssh.Channel, <-chan *ssh.Request) {
	return func(ch ssh.Channel, reqs <-chan *ssh.Request) {
		for req := range reqs {
			if req.Type != "exec" {
				_ = req.Reply(false, nil)
				continue
			}
			if confirm {
				_ = req.Reply(true, nil)
			}
			break
		}
		// Silent from here on; the client's close ends the connection.
		for range reqs {
		}
	}
}

// silentPeer is a Target whose connection is accepted and then never
// answered: the peer reads and drops what the client sends.
func silentPeer(t *testing.T) Target {
	return Target{Addr: "pipe", User: "root", Keys: []ssh.Signer{sshtest.NewKey(t)}, FirstUse: trustAny,
		Dial: func(context.Context) (net.Conn, error) {
			client, server := net.Pipe()
			go func() { _, _ = io.Copy(io.Discard, server) }()
			return client, nil
		}}
}

// TestDialTimeoutIsDeadlineExceeded dials a server that accepts the
// connection and never says a word: the handshake must end exactly at the
// context's deadline and say so, so callers can tell a hung machine from
// one that refused them.
func TestDialTimeoutIsDeadlineExceeded(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
		defer cancel()
		start := time.Now()
		c, err := Dial(ctx, silentPeer(t))
		if c != nil {
			c.Close()
		}
		if !errors.Is(err, context.DeadlineExceeded) || !strings.HasPrefix(errText(err), "ssh pipe: handshake: context deadline exceeded: ") {
			t.Errorf("Dial to a silent server: %v, want DeadlineExceeded in the handshake", err)
		}
		if took := time.Since(start); took != 200*time.Millisecond {
			t.Errorf("Dial returned after %s, want at its 200ms deadline", took)
		}
	})
}

// TestDialCanceled cancels a Dial to a silent server: it returns at once,
// and says it was canceled together with what the handshake was doing.
func TestDialCanceled(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		time.AfterFunc(time.Second, cancel)
		start := time.Now()
		_, err := Dial(ctx, silentPeer(t))
		if !errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("canceled Dial: %v, want Canceled", err)
		}
		// The handshake's own error follows the context's, so that the
		// message says where the handshake stood.
		if msg := errText(err); !strings.HasPrefix(msg, "ssh pipe: handshake: context canceled: ") || strings.Contains(msg, "%!") {
			t.Errorf("canceled Dial says %q", msg)
		}
		if took := time.Since(start); took != time.Second {
			t.Errorf("Dial returned %s after it began, want when it was canceled after 1s", took)
		}
	})
}

// errText is err's message, or "" for nil.
func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// TestRunReturnsAtDeadline runs commands on servers that go silent
// (machines that reset without closing the connection) at each step of
// starting it: Run must return exactly at its deadline, say so, and say
// that the command never started only if the server did not confirm it.
func TestRunReturnsAtDeadline(t *testing.T) {
	for _, tc := range []struct {
		name       string
		session    func(ssh.Channel, <-chan *ssh.Request) // nil: the session is never opened
		notStarted bool
		want       string // the message begins so
	}{
		{"silent once the command started", silentAfter(true), false, `running "reboot": context deadline exceeded: `},
		{"silent before confirming the command", silentAfter(false), true, `running "reboot": command not started: context deadline exceeded: `},
		{"silent before opening the session", nil, true, `running "reboot": command not started: opening session: context deadline exceeded: `},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				c, err := Dial(t.Context(), newPipeServer(t, tc.session).target(t))
				if err != nil {
					t.Fatal(err)
				}
				defer c.Close()
				ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
				defer cancel()
				start := time.Now()
				_, err = Run(ctx, c, "reboot", nil, 1024)
				if !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, ErrNotStarted) != tc.notStarted ||
					!strings.HasPrefix(errText(err), tc.want) {
					t.Errorf("Run: %v, want DeadlineExceeded, ErrNotStarted %v, and a message beginning %q", err, tc.notStarted, tc.want)
				}
				if took := time.Since(start); took != 2*time.Second {
					t.Errorf("Run returned after %s, want at its 2s deadline", took)
				}
			})
		})
	}
}
