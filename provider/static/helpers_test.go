package static

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	gliderssh "github.com/gliderlabs/ssh"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/internal/metricstest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// newKey returns a fresh ed25519 SSH key and its private key in OpenSSH
// PEM format (no passphrase).
func newKey(t testing.TB) (ssh.Signer, []byte) {
	t.Helper()
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	signer, err := ssh.NewSignerFromKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	block, err := ssh.MarshalPrivateKey(priv, "")
	if err != nil {
		t.Fatal(err)
	}
	return signer, pem.EncodeToMemory(block)
}

// authorizedKey formats key as the inventory's host_key.
func authorizedKey(key ssh.PublicKey) string {
	return strings.TrimSpace(string(ssh.MarshalAuthorizedKey(key)))
}

// Commands the test SSH server acts on; anything else exits 0.
const (
	cmdDrop = "reboot-drop" // closes the connection without an exit status
	cmdFail = "reboot-fail" // prints to stderr and exits 1
	cmdHang = "reboot-hang" // runs until the client gives up
)

// sshServer is an in-process SSH server that records the commands it runs.
type sshServer struct {
	addr    netip.AddrPort
	hostKey ssh.PublicKey

	mu   sync.Mutex
	runs []run
}

// run is one command the server received.
type run struct{ user, cmd string }

// serverAuth says what the test server accepts: any of keys, or user and
// password; and, once logged in, every session unless refuseSessions.
type serverAuth struct {
	keys           []ssh.PublicKey
	user           string
	password       string
	refuseSessions bool // no command can start
}

func newSSHServer(t *testing.T, auth serverAuth) *sshServer {
	t.Helper()
	hostSigner, _ := newKey(t)
	s := &sshServer{hostKey: hostSigner.PublicKey()}
	srv := &gliderssh.Server{Handler: s.handle}
	if len(auth.keys) > 0 {
		srv.PublicKeyHandler = func(_ gliderssh.Context, key gliderssh.PublicKey) bool {
			for _, k := range auth.keys {
				if gliderssh.KeysEqual(key, k) {
					return true
				}
			}
			return false
		}
	}
	if auth.password != "" {
		srv.PasswordHandler = func(ctx gliderssh.Context, password string) bool {
			return ctx.User() == auth.user && password == auth.password
		}
	}
	if auth.refuseSessions {
		srv.ChannelHandlers = map[string]gliderssh.ChannelHandler{} // none: every channel is rejected
	}
	srv.AddHostKey(hostSigner)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s.addr = ln.Addr().(*net.TCPAddr).AddrPort()
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(ln)
	}()
	t.Cleanup(func() {
		_ = srv.Close()
		// Close alone does not stop a Serve that has not registered ln yet
		// (gliderlabs/ssh forgets a Close that came first), which hung a
		// test that never dialed; closing ln ends Serve either way.
		_ = ln.Close()
		<-served
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx) // waits for the connections' goroutines
	})
	return s
}

func (s *sshServer) handle(sess gliderssh.Session) {
	s.mu.Lock()
	s.runs = append(s.runs, run{user: sess.User(), cmd: sess.RawCommand()})
	s.mu.Unlock()
	switch sess.RawCommand() {
	case cmdDrop:
		_ = sess.Context().Value(gliderssh.ContextKeyConn).(*ssh.ServerConn).Close()
	case cmdFail:
		fmt.Fprintln(sess.Stderr(), "reboot: permission denied")
		_ = sess.Exit(1)
	case cmdHang:
		<-sess.Context().Done()
	default:
		_ = sess.Exit(0)
	}
}

// received returns the commands the server ran, in order.
func (s *sshServer) received() []run {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]run(nil), s.runs...)
}

// writeFile replaces path with content atomically, as operators are told
// to, so that the poller never reads a half-written file.
func writeFile(t testing.TB, path, content string) {
	t.Helper()
	tmp, err := os.CreateTemp(filepath.Dir(path), ".tmp-*")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tmp.WriteString(content); err != nil {
		t.Fatal(err)
	}
	if err := tmp.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		t.Fatal(err)
	}
}

// noEnv is a lookupEnv with no variables.
func noEnv(string) (string, bool) { return "", false }

// envMap is a lookupEnv backed by a map, so tests need not touch the
// process environment and can run in parallel.
func envMap(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) {
		v, ok := m[k]
		return v, ok
	}
}

// syncBuffer is a bytes.Buffer safe for concurrent writes (log handlers).
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// bufferLogger returns a logger that writes every level to buf.
func bufferLogger(buf io.Writer) *slog.Logger {
	return slog.New(slog.NewTextHandler(buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// waitFor polls cond until it reports true, and fails the test at the
// deadline.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("%s: still false after %s", what, timeout)
		case <-tick.C:
		}
	}
}

// metricValue returns the value of the single series named name in reg.
func metricValue(t testing.TB, reg prometheus.Gatherer, name string) float64 {
	t.Helper()
	if n := metricstest.Series(t, reg, name); n != 1 {
		t.Fatalf("metric %s has %d series, want 1", name, n)
	}
	return metricstest.Value(t, reg, name)
}

// runProvider runs p's poller until the test ends.
func runProvider(t testing.TB, p *Provider) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
}

// ids returns the ids of ms.
func ids[M interface{ ID() string }](ms []M) []string {
	out := make([]string, len(ms))
	for i, m := range ms {
		out[i] = m.ID()
	}
	return out
}
