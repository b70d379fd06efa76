package agent

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"strconv"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/api/agent/pulse"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
)

// Datagram heartbeats (api/agent/pulse): a heartbeat whose datagram is
// unanswered is sent again with a new counter, datagramTries times in all,
// each try waiting datagramWait for the reply, and then over TLS.
//
// A reply normally comes after one batch write of the server, milliseconds
// to tens of milliseconds, so 2 s is one lost datagram's worth of waiting,
// not a slow server's. The worst case, a path that drops every datagram,
// makes each heartbeat 6 s late before the TLS call records it: a fifth of
// the default 30 s interval and 1 % of the default 10-minute
// heartbeat_timeout after which recovery acts, so a black hole never lets
// a live machine look silent. More tries would add load to a server that
// is slow because it is loaded; fewer would send an agent to TLS (a
// handshake, a connection) for one lost packet.
const (
	datagramTries = 3
	datagramWait  = 2 * time.Second
)

// errNoReply means no try of a datagram heartbeat got its reply.
var errNoReply = errors.New("no reply to the heartbeat datagram")

// errCounterExhausted means the counter reached the largest value the
// server accepts; the agent keeps heartbeating over TLS.
var errCounterExhausted = errors.New("heartbeat datagram counter exhausted")

// dialDatagramFunc connects a datagram socket to addr (host:port); net.Conn
// so that tests can put an in-memory packet pipe in its place.
type dialDatagramFunc func(ctx context.Context, addr string) (net.Conn, error)

// dialUDP connects a UDP socket to addr: connected, so the kernel drops
// datagrams from any other source before they reach the agent.
func dialUDP(ctx context.Context, addr string) (net.Conn, error) {
	var d net.Dialer
	return d.DialContext(ctx, "udp", addr)
}

// datagrams sends heartbeats as datagrams under one grant. It is used by
// the daemon's loop only, never concurrently.
type datagrams struct {
	conn     net.Conn
	key      pulse.Key
	machine  uuid.UUID
	agentKey ed25519.PublicKey
	tries    int
	wait     time.Duration
	// msg and buf are the request and reply buffers, kept between beats
	// (a load generator runs thousands of these); buf is one byte longer
	// than a reply: a longer datagram is malformed, not cut short.
	msg, buf []byte
}

// newDatagrams checks grant g and connects a socket to the port it names on
// the host of endpoint. The key is copied out of g; g itself must never be
// logged (its String prints the key).
func newDatagrams(ctx context.Context, dial dialDatagramFunc, endpoint string, g *agentv1.DatagramGrant, machine uuid.UUID, agentKey ed25519.PublicKey) (*datagrams, error) {
	if n := len(g.GetKey()); n != len(pulse.Key{}) {
		return nil, fmt.Errorf("datagram grant: key of %d bytes, want %d", n, len(pulse.Key{}))
	}
	if p := g.GetPort(); p == 0 || p > math.MaxUint16 {
		return nil, fmt.Errorf("datagram grant: port %d out of range", p)
	}
	host, _, err := net.SplitHostPort(endpoint)
	if err != nil {
		return nil, fmt.Errorf("datagram grant: server endpoint %q: %w", endpoint, err)
	}
	addr := net.JoinHostPort(host, strconv.FormatUint(uint64(g.GetPort()), 10))
	conn, err := dial(ctx, addr)
	if err != nil {
		return nil, fmt.Errorf("datagram grant: connecting to %s: %w", addr, err)
	}
	dg := &datagrams{conn: conn, machine: machine, agentKey: agentKey, tries: datagramTries, wait: datagramWait,
		msg: make([]byte, 0, pulse.RequestSize), buf: make([]byte, pulse.ReplySize+1)}
	copy(dg.key[:], g.GetKey())
	return dg, nil
}

// close closes the socket.
func (dg *datagrams) close() { _ = dg.conn.Close() }

// beat sends one heartbeat, counters above *counter (which it advances to
// the last one sent), and returns the first reply to any of its tries. A
// reply that is malformed, has a bad MAC, or answers a counter this beat
// did not send (an earlier heartbeat's, a forgery's) is ignored. A reply to
// an earlier try of this beat counts: the server recorded that counter.
// known is the highest installation generation the agent has received.
func (dg *datagrams) beat(ctx context.Context, counter *uint64, known int64) (pulse.Reply, error) {
	// A cancelled ctx ends the wait for a reply at once.
	stop := context.AfterFunc(ctx, func() { _ = dg.conn.SetReadDeadline(time.Unix(1, 0)) })
	defer stop()
	first := *counter + 1
	msg, buf := dg.msg[:0], dg.buf
	for range dg.tries {
		if *counter >= math.MaxInt64 {
			return pulse.Reply{}, errCounterExhausted
		}
		*counter++
		req := pulse.Request{MachineID: dg.machine, AgentKey: dg.agentKey, Counter: *counter, KnownGeneration: known}
		if err := dg.conn.SetReadDeadline(time.Now().Add(dg.wait)); err != nil {
			return pulse.Reply{}, fmt.Errorf("setting the reply deadline: %w", err)
		}
		if ctx.Err() != nil {
			return pulse.Reply{}, ctx.Err()
		}
		if _, err := dg.conn.Write(req.Seal(msg[:0], &dg.key)); err != nil {
			return pulse.Reply{}, fmt.Errorf("sending heartbeat datagram: %w", err)
		}
		for {
			n, err := dg.conn.Read(buf)
			if ctx.Err() != nil {
				return pulse.Reply{}, ctx.Err()
			}
			if errors.Is(err, os.ErrDeadlineExceeded) {
				break // the next try
			}
			if err != nil {
				// ECONNREFUSED (nothing listens at the port) among others:
				// TLS is the way left.
				return pulse.Reply{}, fmt.Errorf("receiving heartbeat reply: %w", err)
			}
			r, err := pulse.OpenReply(buf[:n], &dg.key)
			if err != nil || r.Counter < first || r.Counter > *counter {
				continue
			}
			return r, nil
		}
	}
	return pulse.Reply{}, errNoReply
}

// DatagramClient sends heartbeats as datagrams under one grant exactly as
// the agent daemon does (the same tries, waits and reply checks). It is
// exported for the benchmark's load generators, whose simulated agents
// must behave as the real one; the daemon uses it through its loop.
type DatagramClient struct{ dg *datagrams }

// ErrNoDatagramReply is what Beat returns when no try got its reply.
var ErrNoDatagramReply = errNoReply

// DatagramTries is how many datagrams Beat sends for one heartbeat before
// it gives up (and the daemon calls over TLS).
const DatagramTries = datagramTries

// NewDatagramClient checks grant g and connects, with dial (nil: a UDP
// socket), to the port it names on the host of endpoint.
func NewDatagramClient(ctx context.Context, dial func(ctx context.Context, addr string) (net.Conn, error), endpoint string,
	g *agentv1.DatagramGrant, machine uuid.UUID, agentKey ed25519.PublicKey) (*DatagramClient, error) {
	if dial == nil {
		dial = dialUDP
	}
	dg, err := newDatagrams(ctx, dial, endpoint, g, machine, agentKey)
	if err != nil {
		return nil, err
	}
	return &DatagramClient{dg: dg}, nil
}

// Beat sends one heartbeat with counters above *counter, which it advances
// to the last one sent; known is the newest installation generation the
// agent has received.
func (c *DatagramClient) Beat(ctx context.Context, counter *uint64, known int64) (pulse.Reply, error) {
	return c.dg.beat(ctx, counter, known)
}

// SetWait changes how long each try waits for its reply (datagramWait by
// default); for tests.
func (c *DatagramClient) SetWait(d time.Duration) { c.dg.wait = d }

// Close closes the socket.
func (c *DatagramClient) Close() { c.dg.close() }
