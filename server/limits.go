package server

import (
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
)

// limitListener refuses connections beyond a total and a per-IP limit by
// closing them at once, before TLS: a client that opens connections without
// end (or a misconfigured one) cannot exhaust the process's file
// descriptors, which the honest agents and the database connections need.
type limitListener struct {
	net.Listener
	maxTotal, maxPerIP int
	refused            func(reason string)

	mu    sync.Mutex
	total int
	perIP map[netip.Addr]int
}

func newLimitListener(ln net.Listener, maxTotal, maxPerIP int, refused func(string)) *limitListener {
	return &limitListener{Listener: ln, maxTotal: maxTotal, maxPerIP: maxPerIP, refused: refused, perIP: map[netip.Addr]int{}}
}

// Accept returns the next connection within the limits.
func (l *limitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		ip := remoteIP(c)
		if reason := l.take(ip); reason != "" {
			l.refused(reason)
			c.Close()
			continue
		}
		return &limitedConn{Conn: c, l: l, ip: ip}, nil
	}
}

// take takes a slot for a connection from ip, or returns which limit (total,
// per_ip) leaves none.
func (l *limitListener) take(ip netip.Addr) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.total >= l.maxTotal {
		return "total"
	}
	if l.perIP[ip] >= l.maxPerIP {
		return "per_ip"
	}
	l.total++
	l.perIP[ip]++
	return ""
}

func (l *limitListener) release(ip netip.Addr) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.total--
	if l.perIP[ip]--; l.perIP[ip] <= 0 {
		delete(l.perIP, ip)
	}
}

func remoteIP(c net.Conn) netip.Addr {
	if a, ok := c.RemoteAddr().(*net.TCPAddr); ok {
		return a.AddrPort().Addr().Unmap()
	}
	return netip.Addr{}
}

// limitedConn gives its slot back once, when closed.
type limitedConn struct {
	net.Conn
	l      *limitListener
	ip     netip.Addr
	closed atomic.Bool
}

func (c *limitedConn) Close() error {
	if c.closed.CompareAndSwap(false, true) {
		c.l.release(c.ip)
	}
	return c.Conn.Close()
}

// connState is what the server keeps per client connection: how many
// requests of keys it has not seen accepted are in flight on it. An agent
// sends one request at a time, so a connection with more than a few such
// requests in flight is not an agent, and its extra requests are refused
// without a database round trip.
type connState struct {
	unverified atomic.Int32
}

// maxUnverifiedPerConn is how many requests of unverified keys one
// connection may have in flight.
const maxUnverifiedPerConn = 2

func (c *connState) acquire() bool {
	if c.unverified.Add(1) > maxUnverifiedPerConn {
		c.unverified.Add(-1)
		return false
	}
	return true
}

func (c *connState) release() { c.unverified.Add(-1) }
