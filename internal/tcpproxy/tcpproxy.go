// Package tcpproxy is a TCP proxy for tests that need a peer to misbehave
// the way networks do: pass traffic, black-hole it (accept and then never
// answer, which is what a dead host behind a firewall or a partition looks
// like, and which a refused connection does not test), reset every
// connection, or deliver requests but lose the replies (a write that
// commits while its client never hears so). Tests put it between a client and a real server (PostgreSQL,
// the callback server) and switch its mode while they run.
package tcpproxy

import (
	"context"
	"fmt"
	"net"
	"sync"
	"time"
)

// Mode is what the proxy does with traffic.
type Mode int

const (
	// Pass forwards bytes both ways.
	Pass Mode = iota
	// Blackhole accepts connections and reads what arrives, but forwards
	// nothing and answers nothing, on new and existing connections alike.
	Blackhole
	// Reset closes every connection, new and existing, with a TCP reset.
	Reset
	// DropReplies forwards what clients send but swallows what the server
	// answers, so requests take effect unheard. A connection that lost a
	// reply is broken for good: it is reset once the mode changes.
	DropReplies
)

func (m Mode) String() string {
	switch m {
	case Pass:
		return "pass"
	case Blackhole:
		return "blackhole"
	case Reset:
		return "reset"
	case DropReplies:
		return "drop-replies"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// Proxy forwards connections from its listener to a target address.
type Proxy struct {
	target string
	ln     net.Listener

	mu     sync.Mutex
	mode   Mode
	delay  time.Duration
	conns  map[*link]struct{}
	closed bool
	// dropped counts the reply chunks DropReplies swallowed.
	dropped int
	change  chan struct{} // closed and replaced whenever mode changes
	wg      sync.WaitGroup
}

// link is one proxied connection.
type link struct {
	client, server net.Conn
	lost           bool // a reply was dropped; guarded by Proxy.mu
}

// Start listens on 127.0.0.1 with a free port and forwards to target.
func Start(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("tcpproxy: listening: %w", err)
	}
	p := &Proxy{target: target, ln: ln, conns: map[*link]struct{}{}, change: make(chan struct{})}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the proxy's host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// SetMode switches the proxy's behaviour for new and existing connections.
func (p *Proxy) SetMode(m Mode) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.mode = m
	close(p.change)
	p.change = make(chan struct{})
	for l := range p.conns {
		// A stream that lost bytes cannot carry on.
		if m == Reset || (l.lost && m != DropReplies) {
			resetConn(l.client)
			l.server.Close()
		}
	}
}

// DroppedReplies counts the chunks of server replies DropReplies swallowed
// so far. A reply the server sent is swallowed only once the proxy has read
// it, which on a busy machine can be well after the server acted on the
// request: a test that means to lose a reply waits for this count to grow,
// not only for the request's effect, before it passes traffic again, or the
// reply still in the socket is delivered after all.
func (p *Proxy) DroppedReplies() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.dropped
}

// SetDelay delays every chunk forwarded in Pass mode by d (0: none).
func (p *Proxy) SetDelay(d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.delay = d
}

// SetTarget makes new connections go to target; existing ones keep their
// server. A test moves a proxy to a new server the way a virtual IP or a DNS
// name moves after a failover.
func (p *Proxy) SetTarget(target string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.target = target
}

// Mode returns the current mode.
func (p *Proxy) Mode() Mode {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.mode
}

// Close stops listening, closes every connection and waits for the
// proxy's goroutines.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	for l := range p.conns {
		l.client.Close()
		l.server.Close()
	}
	close(p.change)
	p.change = make(chan struct{})
	p.mu.Unlock()
	err := p.ln.Close()
	p.wg.Wait()
	return err
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		mode, closed := p.mode, p.closed
		p.mu.Unlock()
		switch {
		case closed:
			c.Close()
			continue
		case mode == Reset:
			resetConn(c)
			continue
		}
		p.wg.Add(1)
		go p.serve(c)
	}
}

func (p *Proxy) serve(client net.Conn) {
	defer p.wg.Done()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	p.mu.Lock()
	target := p.target
	p.mu.Unlock()
	var d net.Dialer
	server, err := d.DialContext(ctx, "tcp", target)
	cancel()
	if err != nil {
		client.Close()
		return
	}
	l := &link{client: client, server: server}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		client.Close()
		server.Close()
		return
	}
	p.conns[l] = struct{}{}
	p.mu.Unlock()
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); p.pipe(l, server, client, false) }()
	go func() { defer wg.Done(); p.pipe(l, client, server, true) }()
	wg.Wait()
	p.mu.Lock()
	delete(p.conns, l)
	p.mu.Unlock()
}

// pipe copies from src to dst chunk by chunk, holding chunks back while the
// proxy black-holes, until either side closes. reply says that src is the
// server.
func (p *Proxy) pipe(l *link, dst, src net.Conn, reply bool) {
	defer dst.Close()
	defer src.Close()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if !p.deliver(l, dst, buf[:n], reply) {
				return
			}
		}
		if err != nil {
			return // EOF or a broken connection: close both sides
		}
	}
}

// deliver writes b to dst once the proxy passes traffic; it drops b and
// reports false when the connection is to be closed. reply says that b
// comes from the server.
func (p *Proxy) deliver(l *link, dst net.Conn, b []byte, reply bool) bool {
	for {
		p.mu.Lock()
		mode, delay, closed, change, lost := p.mode, p.delay, p.closed, p.change, l.lost
		if mode == DropReplies && reply {
			l.lost = true
			p.dropped++
		}
		p.mu.Unlock()
		switch {
		case closed || mode == Reset:
			return false
		case lost && mode != DropReplies:
			return false
		case mode == DropReplies && reply:
			return true // swallowed; keep reading so the server is not held up
		case mode == Blackhole:
			// Swallow the bytes: a black hole never answers, and the
			// sender sees its data acknowledged by TCP. Wait for a mode
			// change only to learn whether to close.
			<-change
			p.mu.Lock()
			m, c := p.mode, p.closed
			p.mu.Unlock()
			if c || m == Reset {
				return false
			}
			// Bytes sent into the black hole stay lost, as on a real
			// network after a partition: the connection is broken.
			if m == Pass {
				return false
			}
			continue
		}
		if delay > 0 {
			t := time.NewTimer(delay)
			select {
			case <-t.C:
			case <-change:
				t.Stop()
				continue
			}
		}
		_, err := dst.Write(b)
		return err == nil
	}
}

// resetConn closes c with a TCP RST rather than a FIN.
func resetConn(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	c.Close()
}
