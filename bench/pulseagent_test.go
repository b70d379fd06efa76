package main

import (
	"context"
	"crypto/ed25519"
	"errors"
	"math"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/agent"
	"github.com/shepherd/shepherd/api/agent/pulse"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
)

// startEcho starts a transport-only datagram server for the test.
func startEcho(t *testing.T, secret []byte) *pulseEcho {
	t.Helper()
	echo, err := newPulseEcho("127.0.0.1:0", secret, 7*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		echo.serve()
	}()
	t.Cleanup(func() {
		echo.close()
		<-done
	})
	return echo
}

func testAgent(t *testing.T, machine uuid.UUID, key pulse.Key, port int, floor uint64) *pulseAgent {
	t.Helper()
	a, err := newPulseAgent(machine, agentKey(0).Public().(ed25519.PublicKey),
		&agentv1.DatagramGrant{Key: key[:], Port: uint32(port), CounterFloor: floor}, "127.0.0.1", netip.Addr{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.close() })
	return a
}

// The load generator's agents and the transport-only server speak the same
// protocol: counters start above the grant's floor and rise by one per
// heartbeat, and the server's reply is accepted.
func TestPulseAgentBeatsAgainstEcho(t *testing.T) {
	t.Parallel()
	secret := []byte("0123456789abcdef0123456789abcdef")
	echo := startEcho(t, secret)
	machine := uuid.New()
	key := pulse.DeriveKey(secret, machine, agentKey(0).Public().(ed25519.PublicKey))
	a := testAgent(t, machine, key, echo.port(), 41)
	for want := uint64(42); want <= 44; want++ {
		rep, err := a.beat(t.Context())
		if err != nil {
			t.Fatalf("beat: %v", err)
		}
		if rep.Counter != want || rep.Status != pulse.StatusRecorded || rep.NextIn != 7*time.Second {
			t.Fatalf("reply = %+v, want counter %d, recorded, next in 7s", rep, want)
		}
	}
	if n := echo.answered.Load(); n != 3 {
		t.Fatalf("echo answered %d datagrams, want 3", n)
	}
}

// A datagram under another key gets no answer from the transport-only
// server, as from the callback server: the agent tries agent.DatagramTries times and
// gives up.
func TestPulseAgentWrongKeyGetsNoReply(t *testing.T) {
	t.Parallel()
	secret := []byte("0123456789abcdef0123456789abcdef")
	echo := startEcho(t, secret)
	machine := uuid.New()
	wrong := pulse.DeriveKey([]byte("another secret, another server."), machine, agentKey(0).Public().(ed25519.PublicKey))
	a := testAgent(t, machine, wrong, echo.port(), 0)
	a.client.SetWait(20 * time.Millisecond)
	if _, err := a.beat(t.Context()); !errors.Is(err, agent.ErrNoDatagramReply) {
		t.Fatalf("beat: %v, want agent.ErrNoDatagramReply", err)
	}
	if got := a.resends.Load(); got != agent.DatagramTries-1 {
		t.Fatalf("resends = %d, want %d", got, agent.DatagramTries-1)
	}
	if got := echo.rejected.Load(); got != agent.DatagramTries {
		t.Fatalf("echo rejected %d datagrams, want %d", got, agent.DatagramTries)
	}
	if got := echo.answered.Load(); got != 0 {
		t.Fatalf("echo answered %d datagrams, want 0", got)
	}
}

// The agent takes only a reply to the heartbeat it waits for, under its
// key: a lost datagram is sent again with a new counter, and a forged
// reply, one to an earlier heartbeat and one of the wrong size are
// ignored.
func TestPulseAgentIgnoresStrayReplies(t *testing.T) {
	t.Parallel()
	conn, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	machine := uuid.New()
	var key, forged pulse.Key
	key[0], forged[0] = 1, 2
	a := testAgent(t, machine, key, conn.LocalAddr().(*net.UDPAddr).Port, 10)
	a.client.SetWait(200 * time.Millisecond)

	type result struct {
		rep pulse.Reply
		err error
	}
	res := make(chan result, 1)
	go func() {
		rep, err := a.beat(t.Context())
		res <- result{rep, err}
	}()
	read := func() pulse.Request {
		t.Helper()
		buf := make([]byte, 200)
		_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		n, err := conn.Read(buf)
		if err != nil {
			t.Fatal(err)
		}
		req, err := pulse.ParseRequest(buf[:n])
		if err != nil {
			t.Fatal(err)
		}
		if err := pulse.VerifyRequest(buf[:n], &key); err != nil {
			t.Fatal(err)
		}
		return req
	}
	// The first datagram is "lost": the agent sends the heartbeat again
	// with the next counter.
	if req := read(); req.Counter != 11 || req.MachineID != machine {
		t.Fatalf("first datagram: counter %d machine %s, want 11 and %s", req.Counter, req.MachineID, machine)
	}
	var from *net.UDPAddr
	buf := make([]byte, 200)
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	n, from, err := conn.ReadFromUDP(buf)
	if err != nil {
		t.Fatal(err)
	}
	req, err := pulse.ParseRequest(buf[:n])
	if err != nil || req.Counter != 12 {
		t.Fatalf("second datagram: counter %d (%v), want 12", req.Counter, err)
	}
	send := func(b []byte) {
		t.Helper()
		if _, err := conn.WriteToUDP(b, from); err != nil {
			t.Fatal(err)
		}
	}
	send((&pulse.Reply{Counter: 12, Status: pulse.StatusCallTLS}).Seal(nil, &forged))         // forged
	send((&pulse.Reply{Counter: 10, Status: pulse.StatusCallTLS}).Seal(nil, &key))            // an earlier heartbeat's
	send(append((&pulse.Reply{Counter: 12, Status: pulse.StatusCallTLS}).Seal(nil, &key), 0)) // too long
	send((&pulse.Reply{Counter: 12, Status: pulse.StatusRecorded, NextIn: time.Second}).Seal(nil, &key))
	r := <-res
	if r.err != nil {
		t.Fatalf("beat: %v", r.err)
	}
	if r.rep.Counter != 12 || r.rep.Status != pulse.StatusRecorded {
		t.Fatalf("reply = %+v, want counter 12, recorded", r.rep)
	}
	if got := a.resends.Load(); got != 1 {
		t.Fatalf("resends = %d, want 1", got)
	}
}

// A beat waiting for its reply ends when its context does.
func TestPulseAgentBeatEndsWithContext(t *testing.T) {
	t.Parallel()
	conn, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	var key pulse.Key
	a := testAgent(t, uuid.New(), key, conn.LocalAddr().(*net.UDPAddr).Port, 0)
	a.client.SetWait(time.Hour)
	ctx, cancel := context.WithCancel(t.Context())
	res := make(chan error, 1)
	go func() {
		_, err := a.beat(ctx)
		res <- err
	}()
	buf := make([]byte, 200)
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := conn.Read(buf); err != nil { // the agent is waiting now
		t.Fatal(err)
	}
	cancel()
	select {
	case err := <-res:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("beat: %v, want context.Canceled", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("beat still waiting 10 s after its context ended")
	}
}

func TestLatenciesQuantile(t *testing.T) {
	t.Parallel()
	var l latencies
	if got := l.quantile(0.99); got != 0 {
		t.Fatalf("empty quantile = %s, want 0", got)
	}
	for range 98 {
		l.add(150 * time.Microsecond)
	}
	l.add(5 * time.Millisecond)
	l.add(time.Hour)
	if got := l.quantile(0.5); got != 200*time.Microsecond {
		t.Fatalf("p50 = %s, want 200µs", got)
	}
	if got := l.quantile(0.99); got != 5100*time.Microsecond {
		t.Fatalf("p99 = %s, want 5.1ms", got)
	}
	if got := l.quantile(1); got != 10*time.Second+latencyBucket {
		t.Fatalf("p100 = %s, want the overflow bucket's bound", got)
	}
	l.reset()
	if got := l.quantile(0.99); got != 0 {
		t.Fatalf("quantile after reset = %s, want 0", got)
	}
}

// A quantile beyond the server histogram's last bound is +Inf, not 0 (which
// read as the best latency of all).
func TestLatencyQuantileBeyondLastBucket(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	h := prometheus.NewHistogram(prometheus.HistogramOpts{
		Name: "shepherd_server_heartbeat_duration_seconds", Help: "test", Buckets: []float64{0.1, 1},
	})
	reg.MustRegister(h)
	if got := latencyQuantile(reg, 0.99); got != 0 {
		t.Fatalf("p99 without samples = %g, want 0", got)
	}
	h.Observe(0.05)
	if got := latencyQuantile(reg, 0.99); got != 0.1 {
		t.Fatalf("p99 = %g, want 0.1", got)
	}
	for range 10 {
		h.Observe(5)
	}
	if got := latencyQuantile(reg, 0.99); !math.IsInf(got, 1) {
		t.Fatalf("p99 beyond the last bucket = %g, want +Inf", got)
	}
}

// A reply to an earlier try of the same heartbeat counts: the server
// recorded that counter, only late.
func TestPulseAgentTakesReplyToEarlierTry(t *testing.T) {
	t.Parallel()
	conn, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	var key pulse.Key
	a := testAgent(t, uuid.New(), key, conn.LocalAddr().(*net.UDPAddr).Port, 0)
	a.client.SetWait(100 * time.Millisecond)
	res := make(chan error, 1)
	var rep pulse.Reply
	go func() {
		var err error
		rep, err = a.beat(t.Context())
		res <- err
	}()
	buf := make([]byte, 200)
	_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	for want := uint64(1); want <= 2; want++ {
		n, from, err := conn.ReadFromUDP(buf)
		if err != nil {
			t.Fatal(err)
		}
		req, err := pulse.ParseRequest(buf[:n])
		if err != nil || req.Counter != want {
			t.Fatalf("datagram %d: counter %d (%v)", want, req.Counter, err)
		}
		if want == 2 { // answer the first try only now
			if _, err := conn.WriteToUDP((&pulse.Reply{Counter: 1, Status: pulse.StatusRecorded}).Seal(nil, &key), from); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := <-res; err != nil {
		t.Fatalf("beat: %v", err)
	}
	if rep.Counter != 1 {
		t.Fatalf("reply counter %d, want 1", rep.Counter)
	}
}
