package sshtest

import (
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Proxy forwards TCP connections from its own loopback address to a
// server until Silence makes it a black hole. It stands in for the network
// path to a machine: a machine that resets at once (a reboot command that
// power-cycles it) never closes its TCP connections, it just stops
// answering, and a client that waits for its answer waits for ever.
//
// It works for any TCP server: an SSH Host, or PostgreSQL.
type Proxy struct {
	// Addr is where clients connect instead of the target.
	Addr netip.AddrPort

	network, target string
	ln              net.Listener
	silent          atomic.Bool

	mu     sync.Mutex
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup // the accept loop and every connection's goroutines
}

// UntilSilenced is a shell command for the machine behind a Proxy. It
// reads its stdin to the end, which an x/crypto/ssh client closes only once
// the server confirmed that the command started; then it creates the file
// marker (an absolute path: the test waits for it before it silences the
// proxy, knowing the client saw the command start), and prints a line
// every 200ms until its output goes nowhere: it runs as long as its session
// and ends on its own once the connection is gone.
func UntilSilenced(marker string) string {
	return "cat >/dev/null; touch '" + strings.ReplaceAll(marker, "'", `'\''`) + "'; while :; do echo . || exit; sleep 0.2; done"
}

// proxyDialTimeout bounds the proxy's connection to its target.
const proxyDialTimeout = 10 * time.Second

// StartProxy listens on a free loopback port and forwards every connection
// to target (host:port), until the test ends: then it closes every
// connection and waits for its goroutines.
func StartProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	return StartProxyTo(t, "tcp", target)
}

// StartProxyTo is StartProxy to a target on another network: "unix" and a
// socket's path reach a PostgreSQL that listens only on its socket.
func StartProxyTo(t testing.TB, network, target string) *Proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("sshtest: proxy: listening: %v", err)
	}
	p := &Proxy{
		Addr:    ln.Addr().(*net.TCPAddr).AddrPort(),
		network: network,
		target:  target,
		ln:      ln,
		conns:   map[net.Conn]struct{}{},
	}
	p.wg.Go(p.accept)
	t.Cleanup(p.close)
	return p
}

// Silence makes the proxy a black hole from now on: it keeps every
// connection open but passes no byte in either direction (it reads and
// drops them, as a network that lost the machine does), and it accepts new
// connections without ever answering them.
func (p *Proxy) Silence() { p.silent.Store(true) }

func (p *Proxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return // closed
		}
		if !p.track(c) {
			c.Close()
			return
		}
		p.wg.Go(func() { p.serve(c) })
	}
}

// serve forwards c to the target, or swallows it while the proxy is silent.
func (p *Proxy) serve(c net.Conn) {
	defer p.untrack(c)
	if p.silent.Load() {
		drain(c)
		return
	}
	d := net.Dialer{Timeout: proxyDialTimeout}
	up, err := d.Dial(p.network, p.target)
	if err != nil {
		return
	}
	if !p.track(up) {
		up.Close()
		return
	}
	defer p.untrack(up)
	var both sync.WaitGroup
	both.Go(func() { p.copy(up, c) })
	both.Go(func() { p.copy(c, up) })
	both.Wait()
}

// copy passes what src sends to dst until either ends, dropping it while
// the proxy is silent, then closes both.
func (p *Proxy) copy(dst, src net.Conn) {
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 && !p.silent.Load() {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

// drain reads and drops everything c sends until it is closed.
func drain(c net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		if _, err := c.Read(buf); err != nil {
			return
		}
	}
}

func (p *Proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *Proxy) untrack(c net.Conn) {
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
	c.Close()
}

// close stops the proxy: no new connections, every open one closed.
func (p *Proxy) close() {
	p.mu.Lock()
	p.closed = true
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	_ = p.ln.Close()
	p.wg.Wait()
}
