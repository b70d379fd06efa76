package server

import (
	"errors"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// limitListener refuses connections beyond a total and a per-IP limit by
// closing them at once, before TLS: a client that opens connections without
// end (or a misconfigured one) cannot exhaust the process's file
// descriptors, which the honest agents and the database connections need.
//
// When the process runs out of descriptors all the same (the limits are
// set above the open-file limit, or something else holds descriptors), an
// accept fails with EMFILE or ENFILE. The listener then reports the
// failure to outOfFDs and tries again after a pause that grows from
// minAcceptPause to maxAcceptPause, without returning the error: the
// connections already open keep being served by their own goroutines, the
// connections waiting in the kernel's backlog are accepted once
// descriptors are free, and the gRPC server never sees the failure (it
// would retry as well, but uncounted).
type limitListener struct {
	net.Listener
	maxTotal, maxPerIP int
	refused            func(reason string)
	outOfFDs           func(err error)

	mu    sync.Mutex
	total int
	perIP map[netip.Addr]int

	closeOnce sync.Once
	closed    chan struct{} // closed by Close: a pause ends at once
}

// The pause after an accept that failed for lack of descriptors starts at
// minAcceptPause and doubles up to maxAcceptPause; an accepted connection
// resets it. The first retries come soon, since a descriptor is often
// freed within milliseconds; a longer shortage costs one accept a second.
const (
	minAcceptPause = 5 * time.Millisecond
	maxAcceptPause = time.Second
)

func newLimitListener(ln net.Listener, maxTotal, maxPerIP int, refused func(string), outOfFDs func(error)) *limitListener {
	return &limitListener{Listener: ln, maxTotal: maxTotal, maxPerIP: maxPerIP, refused: refused, outOfFDs: outOfFDs,
		perIP: map[netip.Addr]int{}, closed: make(chan struct{})}
}

// Accept returns the next connection within the limits. It waits out a
// shortage of file descriptors (see limitListener) and returns any other
// error of the listener.
func (l *limitListener) Accept() (net.Conn, error) {
	var pause time.Duration
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			if !outOfDescriptors(err) {
				return nil, err
			}
			l.outOfFDs(err)
			pause = min(max(2*pause, minAcceptPause), maxAcceptPause)
			t := time.NewTimer(pause)
			select {
			case <-t.C:
			case <-l.closed:
				// The listener's own Accept now says it is closed.
				t.Stop()
			}
			continue
		}
		pause = 0
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

// Close closes the listener and ends a pause in Accept.
func (l *limitListener) Close() error {
	l.closeOnce.Do(func() { close(l.closed) })
	return l.Listener.Close()
}

// outOfDescriptors reports whether err is an accept's failure for lack of
// file descriptors, of the process (EMFILE) or of the system (ENFILE).
func outOfDescriptors(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE)
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
