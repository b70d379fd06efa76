package main

import (
	"context"
	"crypto/ed25519"
	"errors"
	"net"
	"net/netip"
	"sync/atomic"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/agent"
	"github.com/shepherd/shepherd/api/agent/pulse"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
)

// pulseAgent is the datagram side of one simulated agent, as the agent
// daemon has it once a TLS heartbeat granted it a key: the agent's own
// datagram client (its UDP socket, from the load generator's source
// address) and a counter strictly above the grant's floor.
type pulseAgent struct {
	client  *agent.DatagramClient
	counter uint64 // the last counter sent, or the grant's floor
	// resends counts datagrams sent again after no reply.
	resends atomic.Int64
}

// newPulseAgent opens the agent's socket towards port grant.Port of host
// (the host of its server endpoint), from local if it is valid.
func newPulseAgent(machine uuid.UUID, agentKey ed25519.PublicKey, grant *agentv1.DatagramGrant, host string, local netip.Addr) (*pulseAgent, error) {
	if grant == nil {
		return nil, errors.New("the server granted no datagram key")
	}
	d := &net.Dialer{}
	if local.IsValid() {
		d.LocalAddr = net.UDPAddrFromAddrPort(netip.AddrPortFrom(local, 0))
	}
	c, err := agent.NewDatagramClient(context.Background(), func(ctx context.Context, addr string) (net.Conn, error) {
		return d.DialContext(ctx, "udp", addr)
	}, net.JoinHostPort(host, "0"), grant, machine, agentKey)
	if err != nil {
		return nil, err
	}
	return &pulseAgent{client: c, counter: grant.GetCounterFloor()}, nil
}

// close closes the agent's socket.
func (a *pulseAgent) close() { a.client.Close() }

// beat sends one heartbeat and waits for its reply, as the agent does
// (agent.DatagramClient): agent.ErrNoDatagramReply if none came, ctx's error if ctx
// ended. Every try after the first counts as a resend.
func (a *pulseAgent) beat(ctx context.Context) (pulse.Reply, error) {
	before := a.counter
	rep, err := a.client.Beat(ctx, &a.counter, 0)
	if tries := int64(a.counter - before); tries > 1 {
		a.resends.Add(tries - 1)
	}
	return rep, err
}
