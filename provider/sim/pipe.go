package sim

import (
	"io"
	"net"
	"os"
	"sync"
	"time"
)

// pipeBuffer is how many bytes one direction of an in-process connection
// holds, like a socket buffer.
const pipeBuffer = 64 << 10

// pipe returns the two ends of an in-process connection. It is net.Pipe
// with a buffer in each direction: SSH needs one, because both ends send
// their version line before reading the other's, and over the unbuffered
// net.Pipe both writes block and the handshake deadlocks. Like a socket
// buffer it is bounded, so an upload costs pipeBuffer bytes per direction,
// not the SSH window's worth.
func pipe(name string) (client, server net.Conn) {
	up, down := newHalfPipe(), newHalfPipe()
	addr := pipeAddr(name)
	return &pipeConn{in: down, out: up, local: pipeAddr("initializer"), remote: addr},
		&pipeConn{in: up, out: down, local: addr, remote: pipeAddr("initializer")}
}

// halfPipe carries bytes in one direction through a ring buffer.
type halfPipe struct {
	mu        sync.Mutex
	buf       []byte // the ring, allocated by the first write
	r, n      int    // read position and bytes buffered
	eof       bool   // the writing end closed: the reader gets io.EOF once buf is drained
	rclosed   bool   // the reading end closed: writes fail
	rdeadline time.Time
	wdeadline time.Time
	// wake is closed (and replaced) on every change the other end may
	// wait for: data, room, a close or a new deadline.
	wake chan struct{}
}

func newHalfPipe() *halfPipe { return &halfPipe{wake: make(chan struct{})} }

func (h *halfPipe) changedLocked() {
	close(h.wake)
	h.wake = make(chan struct{})
}

// waitLocked releases h.mu until something changes or deadline passes;
// it returns os.ErrDeadlineExceeded if the deadline has passed.
func (h *halfPipe) waitLocked(deadline time.Time) error {
	var timeout <-chan time.Time
	if !deadline.IsZero() {
		d := time.Until(deadline)
		if d <= 0 {
			return os.ErrDeadlineExceeded
		}
		t := time.NewTimer(d)
		defer t.Stop()
		timeout = t.C
	}
	wake := h.wake
	h.mu.Unlock()
	select {
	case <-wake:
	case <-timeout:
	}
	h.mu.Lock()
	return nil
}

type pipeConn struct {
	in, out       *halfPipe
	local, remote net.Addr
}

func (c *pipeConn) Read(b []byte) (int, error) {
	h := c.in
	h.mu.Lock()
	defer h.mu.Unlock()
	for {
		switch {
		case h.rclosed:
			return 0, io.ErrClosedPipe
		case len(b) == 0:
			return 0, nil
		case h.n > 0:
			k := copy(b[:min(len(b), h.n)], h.buf[h.r:])
			if k < len(b) && k < h.n { // wrapped around
				k += copy(b[k:min(len(b), h.n)], h.buf)
			}
			h.r, h.n = (h.r+k)%len(h.buf), h.n-k
			h.changedLocked()
			return k, nil
		case h.eof:
			return 0, io.EOF
		}
		if err := h.waitLocked(h.rdeadline); err != nil {
			return 0, err
		}
	}
}

func (c *pipeConn) Write(b []byte) (int, error) {
	h := c.out
	h.mu.Lock()
	defer h.mu.Unlock()
	written := 0
	for {
		switch {
		case h.eof || h.rclosed:
			return written, io.ErrClosedPipe
		case !h.wdeadline.IsZero() && !time.Now().Before(h.wdeadline):
			return written, os.ErrDeadlineExceeded
		case written == len(b):
			return written, nil
		}
		if h.buf == nil {
			h.buf = make([]byte, pipeBuffer)
		}
		if free := len(h.buf) - h.n; free > 0 {
			k := min(free, len(b)-written)
			w := (h.r + h.n) % len(h.buf)
			m := copy(h.buf[w:], b[written:written+k])
			copy(h.buf, b[written+m:written+k]) // the part that wraps around
			h.n += k
			written += k
			h.changedLocked()
			continue
		}
		if err := h.waitLocked(h.wdeadline); err != nil {
			return written, err
		}
	}
}

// Close ends both directions: the peer reads what was written, then EOF.
func (c *pipeConn) Close() error {
	for _, h := range []*halfPipe{c.in, c.out} {
		h.mu.Lock()
		if h == c.in {
			h.rclosed, h.buf, h.n = true, nil, 0
		} else {
			h.eof = true
		}
		h.changedLocked()
		h.mu.Unlock()
	}
	return nil
}

func (c *pipeConn) LocalAddr() net.Addr  { return c.local }
func (c *pipeConn) RemoteAddr() net.Addr { return c.remote }

func (c *pipeConn) SetDeadline(t time.Time) error {
	_ = c.SetReadDeadline(t)
	return c.SetWriteDeadline(t)
}

func (c *pipeConn) SetReadDeadline(t time.Time) error {
	c.in.mu.Lock()
	c.in.rdeadline = t
	c.in.changedLocked()
	c.in.mu.Unlock()
	return nil
}

func (c *pipeConn) SetWriteDeadline(t time.Time) error {
	c.out.mu.Lock()
	c.out.wdeadline = t
	c.out.changedLocked()
	c.out.mu.Unlock()
	return nil
}

// pipeAddr names an end of an in-process connection.
type pipeAddr string

func (a pipeAddr) Network() string { return "sim" }
func (a pipeAddr) String() string  { return string(a) }
