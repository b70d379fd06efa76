package main

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync/atomic"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/api/agent/pulse"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
)

const (
	// pulseTimeout is how long a simulated agent waits for the reply to
	// one datagram before it sends the heartbeat again with a new counter,
	// and pulseTries how many datagrams it sends before it gives up (the
	// real agent then calls over TLS). Two seconds is far above a loaded
	// server's batch latency (P1's p99 is below a second), so a resend
	// means a lost datagram, not a slow server.
	pulseTimeout = 2 * time.Second
	pulseTries   = 3
)

// errNoReply means no valid reply came to any of a heartbeat's datagrams.
var errNoReply = errors.New("no reply to the heartbeat datagrams")

// pulseAgent is the datagram side of one simulated agent, as the agent
// daemon has it once a TLS heartbeat granted it a key: its own UDP socket,
// connected to the server's datagram port, and a counter strictly above
// the grant's floor.
type pulseAgent struct {
	conn    *net.UDPConn
	key     pulse.Key
	req     pulse.Request
	out, in []byte
	// timeout is how long a datagram's reply is waited for: pulseTimeout.
	timeout time.Duration
	// resends counts datagrams sent again after a timeout.
	resends atomic.Int64
}

// newPulseAgent opens the agent's socket towards port grant.Port of host
// (the host of its server endpoint), from local if it is valid.
func newPulseAgent(machine uuid.UUID, agentKey ed25519.PublicKey, grant *agentv1.DatagramGrant, host string, local netip.Addr) (*pulseAgent, error) {
	if grant == nil {
		return nil, errors.New("the server granted no datagram key")
	}
	if len(grant.GetKey()) != len(pulse.Key{}) || grant.GetPort() == 0 || grant.GetPort() > 65535 {
		return nil, fmt.Errorf("unusable datagram grant: %d-byte key, port %d", len(grant.GetKey()), grant.GetPort())
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return nil, fmt.Errorf("server host %q is not an IP address: %w", host, err)
	}
	var laddr *net.UDPAddr
	if local.IsValid() {
		laddr = net.UDPAddrFromAddrPort(netip.AddrPortFrom(local, 0))
	}
	conn, err := net.DialUDP("udp", laddr, net.UDPAddrFromAddrPort(netip.AddrPortFrom(ip, uint16(grant.GetPort()))))
	if err != nil {
		return nil, fmt.Errorf("opening the datagram socket: %w", err)
	}
	a := &pulseAgent{
		conn:    conn,
		req:     pulse.Request{MachineID: machine, AgentKey: agentKey, Counter: grant.GetCounterFloor()},
		out:     make([]byte, 0, pulse.RequestSize),
		in:      make([]byte, pulse.ReplySize+1), // one more: a longer datagram is not a reply
		timeout: pulseTimeout,
	}
	copy(a.key[:], grant.GetKey())
	return a, nil
}

// close closes the agent's socket.
func (a *pulseAgent) close() error { return a.conn.Close() }

// beat sends one heartbeat and waits for its reply: up to pulseTries
// datagrams, each with a new counter, each waited for a.timeout. A reply
// to any of them counts (the server recorded that counter), as for the
// agent; replies to earlier heartbeats and bad MACs are ignored. It returns errNoReply if none came, ctx's error if ctx
// ended.
func (a *pulseAgent) beat(ctx context.Context) (pulse.Reply, error) {
	stop := context.AfterFunc(ctx, func() { _ = a.conn.SetReadDeadline(time.Now()) })
	defer stop()
	first := a.req.Counter + 1
	for try := range pulseTries {
		if try > 0 {
			a.resends.Add(1)
		}
		a.req.Counter++
		a.out = a.req.Seal(a.out[:0], &a.key)
		if err := a.conn.SetReadDeadline(time.Now().Add(a.timeout)); err != nil {
			return pulse.Reply{}, err
		}
		if ctx.Err() != nil { // after the deadline: see AfterFunc above
			return pulse.Reply{}, ctx.Err()
		}
		if _, err := a.conn.Write(a.out); err != nil {
			// ECONNREFUSED from an earlier datagram's ICMP error, or a
			// full socket buffer: like a lost datagram, try again.
			if sleepCtx(ctx, a.timeout); ctx.Err() != nil {
				return pulse.Reply{}, ctx.Err()
			}
			continue
		}
		for {
			n, err := a.conn.Read(a.in)
			if err != nil {
				if ctx.Err() != nil {
					return pulse.Reply{}, ctx.Err()
				}
				var ne net.Error
				if errors.As(err, &ne) && ne.Timeout() {
					break // resend
				}
				continue // e.g. ECONNREFUSED: the port was closed for a moment
			}
			rep, err := pulse.OpenReply(a.in[:n], &a.key)
			if err != nil || rep.Counter < first || rep.Counter > a.req.Counter {
				continue
			}
			return rep, nil
		}
	}
	return pulse.Reply{}, errNoReply
}
