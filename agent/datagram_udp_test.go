package agent

import (
	"context"
	"errors"
	"net"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/api/agent/pulse"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
)

// udpResponder is a server's datagram port on a real UDP socket: it
// answers each authentic request with what answer returns, in order, and
// passes each on requests.
type udpResponder struct {
	conn     *net.UDPConn
	key      pulse.Key
	requests chan pulse.Request
}

func newUDPResponder(t *testing.T, answer func(k *pulse.Key, req pulse.Request) [][]byte) *udpResponder {
	t.Helper()
	conn, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	r := &udpResponder{conn: conn, requests: make(chan pulse.Request, 100)}
	copy(r.key[:], "the key of this machine's agent.")
	go func() {
		buf := make([]byte, 1500)
		for {
			n, from, err := conn.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			req, err := pulse.ParseRequest(buf[:n])
			if err != nil || pulse.VerifyRequest(buf[:n], &r.key) != nil {
				continue
			}
			r.requests <- req
			for _, b := range answer(&r.key, req) {
				_, _ = conn.WriteToUDPAddrPort(b, from)
			}
		}
	}()
	return r
}

// grant is a grant of the responder's key and port with floor.
func (r *udpResponder) grant(floor uint64) *agentv1.DatagramGrant {
	return &agentv1.DatagramGrant{Key: append([]byte(nil), r.key[:]...), Port: uint32(r.conn.LocalAddr().(*net.UDPAddr).Port), CounterFloor: floor}
}

// TestBeatOverUDP: the datagram client on real UDP sockets, which keep
// datagram boundaries (a reply one byte too long is not cut to size) and
// report a closed port.
func TestBeatOverUDP(t *testing.T) {
	t.Parallel()
	machine := uuid.New()
	connect := func(t *testing.T, g *agentv1.DatagramGrant) *datagrams {
		t.Helper()
		dg, err := newDatagrams(t.Context(), dialUDP, "127.0.0.1:7443", g, machine, testAgentKey)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(dg.close)
		return dg
	}

	t.Run("hostile replies are ignored", func(t *testing.T) {
		t.Parallel()
		other := pulse.Key{9}
		r := newUDPResponder(t, func(k *pulse.Key, req pulse.Request) [][]byte {
			callTLS := sealReply(k, req.Counter, pulse.StatusCallTLS, 0)
			return [][]byte{
				sealReply(&other, req.Counter, pulse.StatusCallTLS, 0),
				sealReply(k, req.Counter+1, pulse.StatusCallTLS, 0),
				sealReply(k, req.Counter-1, pulse.StatusCallTLS, 0),
				append(callTLS, 0),
				callTLS[:pulse.ReplySize-1],
				sealReply(k, req.Counter, pulse.StatusRecorded, 5*time.Second),
			}
		})
		dg := connect(t, r.grant(41))
		counter := uint64(41)
		reply, err := dg.beat(t.Context(), &counter, 2)
		if err != nil {
			t.Fatal(err)
		}
		if reply != (pulse.Reply{Counter: 42, Status: pulse.StatusRecorded, NextIn: 5 * time.Second}) || counter != 42 {
			t.Errorf("reply %+v, counter %d; want the authentic reply to counter 42", reply, counter)
		}
		req := <-r.requests
		if req.MachineID != machine || !req.AgentKey.Equal(testAgentKey) || req.Counter != 42 || req.KnownGeneration != 2 {
			t.Errorf("request %+v, want machine %s, the agent's key, counter 42, known generation 2", req, machine)
		}
	})

	t.Run("a closed port fails at once", func(t *testing.T) {
		t.Parallel()
		r := newUDPResponder(t, func(*pulse.Key, pulse.Request) [][]byte { return nil })
		g := r.grant(0)
		r.conn.Close()
		dg := connect(t, g)
		dg.wait = time.Hour // only the port's refusal can end the wait
		var counter uint64
		done := make(chan error, 1)
		go func() { _, err := dg.beat(t.Context(), &counter, 0); done <- err }()
		select {
		case err := <-done:
			if !errors.Is(err, syscall.ECONNREFUSED) {
				t.Errorf("beat returned %v, want connection refused", err)
			}
		case <-time.After(time.Minute):
			t.Fatal("beat still waits a minute after sending to a closed port")
		}
	})

	t.Run("cancelling ends the wait", func(t *testing.T) {
		t.Parallel()
		r := newUDPResponder(t, func(*pulse.Key, pulse.Request) [][]byte { return nil })
		dg := connect(t, r.grant(0))
		dg.wait = time.Hour
		ctx, cancel := context.WithCancel(t.Context())
		var counter uint64
		done := make(chan error, 1)
		go func() { _, err := dg.beat(ctx, &counter, 0); done <- err }()
		<-r.requests
		cancel()
		select {
		case err := <-done:
			if !errors.Is(err, context.Canceled) {
				t.Errorf("beat returned %v, want context.Canceled", err)
			}
		case <-time.After(time.Minute):
			t.Fatal("beat still waits for a reply a minute after its context ended")
		}
	})
}
