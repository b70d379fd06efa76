package agent

import (
	"context"
	"crypto/ed25519"
	"errors"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"connectrpc.com/connect"
	"github.com/google/uuid"

	"github.com/shepherd/shepherd/api/agent/pulse"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
)

// The tests in this file run the daemon's loop in a synctest bubble, as
// heartbeat_test.go does, with a grant from the scripted callback server
// and a scripted datagram peer. The daemon's datagram socket is an
// in-memory pipe (net.Pipe) in place of a UDP socket, which would keep the
// virtual clock from moving; it keeps datagrams whole, as each read has
// room for a whole one. The real UDP path, and the TLS connection closed
// between heartbeats, are tested in daemon_test.go against real sockets.

// datagramPeer is the server's side of the datagrams: it checks each
// request's MAC under key and answers the n-th (from 0) with the datagrams
// answer returns, in order (none: dropped).
type datagramPeer struct {
	t      *testing.T
	key    pulse.Key
	answer func(n int, req pulse.Request) [][]byte

	mu    sync.Mutex
	got   []datagram
	addrs []string
}

// around is a time that follows one jittered back-off of a second (±20 %).
func around(d time.Duration) window {
	return window{d - 200*time.Millisecond, d + 200*time.Millisecond}
}

// recordedFrom drops the first n datagrams and answers the others
// "recorded", asking for the next heartbeat in idle.
func recordedFrom(n int) func(p *datagramPeer, k int, req pulse.Request) [][]byte {
	return func(p *datagramPeer, k int, req pulse.Request) [][]byte {
		if k < n {
			return nil
		}
		return [][]byte{p.reply(req, pulse.StatusRecorded, idle)}
	}
}

// grantEvery10s answers a TLS heartbeat with a grant (floor 5) and asks
// for the next heartbeat in 10 s.
func grantEvery10s(p *datagramPeer, _ int) *agentv1.HeartbeatResponse {
	r := answer(10 * time.Second)
	r.DatagramGrant = p.grant(9, 5)
	return r
}

// near is the window of d ± tolerance.
func near(d, tolerance time.Duration) window { return window{d - tolerance, d + tolerance} }

// wide is a time that follows two jittered back-offs of a second.
func wide(d time.Duration) window {
	return window{d - 400*time.Millisecond, d + 400*time.Millisecond}
}

// datagram is a request the peer received, and when.
type datagram struct {
	at  time.Time
	req pulse.Request
}

func newDatagramPeer(t *testing.T, answer func(p *datagramPeer, n int, req pulse.Request) [][]byte) *datagramPeer {
	p := &datagramPeer{t: t}
	copy(p.key[:], "the key of this machine's agent.")
	p.answer = func(n int, req pulse.Request) [][]byte { return answer(p, n, req) }
	return p
}

// dial is the daemon's dialDatagram.
func (p *datagramPeer) dial(_ context.Context, addr string) (net.Conn, error) {
	p.mu.Lock()
	p.addrs = append(p.addrs, addr)
	p.mu.Unlock()
	agentEnd, peerEnd := net.Pipe()
	go p.serve(peerEnd)
	return agentEnd, nil
}

func (p *datagramPeer) serve(c net.Conn) {
	defer c.Close()
	buf := make([]byte, 2*pulse.RequestSize)
	for {
		n, err := c.Read(buf)
		if err != nil {
			return // the agent closed its socket
		}
		req, err := pulse.ParseRequest(buf[:n])
		if err == nil {
			err = pulse.VerifyRequest(buf[:n], &p.key)
		}
		if err != nil {
			p.t.Errorf("the agent sent a datagram the server cannot take: %v", err)
			continue
		}
		p.mu.Lock()
		k := len(p.got)
		p.got = append(p.got, datagram{time.Now(), req})
		p.mu.Unlock()
		if replies := p.answer(k, req); len(replies) > 0 {
			// A write waits for the agent to read; the agent reads only
			// while it waits for a reply.
			go func() {
				for _, r := range replies {
					if _, err := c.Write(r); err != nil {
						return
					}
				}
			}()
		}
	}
}

func (p *datagramPeer) received() []datagram {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]datagram(nil), p.got...)
}

func (p *datagramPeer) dialed() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]string(nil), p.addrs...)
}

// reply is the server's reply to req under the peer's key.
func (p *datagramPeer) reply(req pulse.Request, st pulse.Status, next time.Duration) []byte {
	return sealReply(&p.key, req.Counter, st, next)
}

func sealReply(k *pulse.Key, counter uint64, st pulse.Status, next time.Duration) []byte {
	r := pulse.Reply{Counter: counter, Status: st, NextIn: next}
	return r.Seal(nil, k)
}

// grant is a grant of the peer's key at port with floor.
func (p *datagramPeer) grant(port uint32, floor uint64) *agentv1.DatagramGrant {
	return &agentv1.DatagramGrant{Key: append([]byte(nil), p.key[:]...), Port: port, CounterFloor: floor}
}

var testAgentKey = ed25519.NewKeyFromSeed(make([]byte, ed25519.SeedSize)).Public().(ed25519.PublicKey)

// withDatagrams sets the daemon up to send its datagrams to p, counting
// the closes of its idle TLS connection in closes, and, if generation is
// not "", with that content in its generation file.
func withDatagrams(t *testing.T, p *datagramPeer, closes *atomic.Int32, generation string) func(d *daemon) {
	return func(d *daemon) {
		d.machine = uuid.MustParse(d.init.GetMachineId())
		d.agentKey = testAgentKey
		d.dialDatagram = p.dial
		d.closeIdle = func() { closes.Add(1) }
		if generation != "" {
			if err := os.WriteFile(filepath.Join(d.cfg.StateDir, generationFile), []byte(generation), 0o600); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// checkTimes fails the test unless there are as many times as windows,
// each (since start) in its window.
func checkTimes(t *testing.T, what string, start time.Time, at []time.Time, want []window) {
	t.Helper()
	var since []time.Duration
	for _, a := range at {
		since = append(since, a.Sub(start))
	}
	if len(at) != len(want) {
		t.Errorf("%d %s, at %v; want %d", len(at), what, since, len(want))
		return
	}
	for i, w := range want {
		if since[i] < w.lo || since[i] > w.hi {
			t.Errorf("%s %d at %s, want [%s, %s]; all at %v", what, i+1, since[i], w.lo, w.hi, since)
		}
	}
}

// TestDatagramHeartbeats: after a TLS heartbeat that grants datagrams (and
// records the hardware report), heartbeats go as datagrams to the port of
// the grant on the host of the server endpoint, with counters strictly
// increasing above the grant's floor, the generation the agent knows and
// its identity, on the schedule the replies ask for; the TLS connection is
// closed after the granting call, and no TLS heartbeat follows.
func TestDatagramHeartbeats(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const interval = 45 * time.Second
		p := newDatagramPeer(t, func(p *datagramPeer, n int, req pulse.Request) [][]byte {
			next := 30 * time.Second
			if n == 1 {
				next = 0 // the agent's own interval
			}
			return [][]byte{p.reply(req, pulse.StatusRecorded, next)}
		})
		var closes atomic.Int32
		var machine atomic.Pointer[string]
		start := time.Now()
		cb, stop, _ := runDaemonWith(t, daemonConfig{Interval: interval, MaxBackoff: time.Minute},
			func(_ context.Context, n int, req *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error) {
				machine.Store(&req.MachineId)
				r := answer(20 * time.Second)
				r.DatagramGrant = p.grant(9, 5)
				return r, nil
			}, withDatagrams(t, p, &closes, "3\n"))
		time.Sleep(2 * time.Minute)
		if err := stop(); err != nil {
			t.Errorf("the daemon returned %v when stopped, want nil", err)
		}
		checkTimes(t, "TLS heartbeats", start, cb.received(), []window{exactly(0)})
		got := p.received()
		var at []time.Time
		for i, g := range got {
			at = append(at, g.at)
			if want := uint64(6 + i); g.req.Counter != want {
				t.Errorf("datagram %d has counter %d, want %d: the floor 5 of the grant, then one more each", i+1, g.req.Counter, want)
			}
			if g.req.KnownGeneration != 3 {
				t.Errorf("datagram %d says the agent knows generation %d, want 3, the one it handled", i+1, g.req.KnownGeneration)
			}
			if g.req.MachineID.String() != *machine.Load() || !g.req.AgentKey.Equal(testAgentKey) {
				t.Errorf("datagram %d is from machine %s with key %x, want the daemon's", i+1, g.req.MachineID, g.req.AgentKey)
			}
		}
		checkTimes(t, "datagrams", start, at, []window{exactly(20 * time.Second), exactly(50 * time.Second), exactly(95 * time.Second)})
		if a := p.dialed(); len(a) != 1 || a[0] != "callback.test:9" {
			t.Errorf("datagram sockets connected to %v, want one to callback.test:9", a)
		}
		if n := closes.Load(); n != 1 {
			t.Errorf("the idle TLS connection was closed %d times, want once, after the granting heartbeat", n)
		}
	})
}

// TestDatagramFallbacks: what each reply, or none, makes the agent do
// next, on the virtual clock. Every case starts with a TLS heartbeat at 0
// that grants datagrams (floor 5) and asks for the next heartbeat in 10s.
func TestDatagramFallbacks(t *testing.T) {
	t.Parallel()
	other := pulse.Key{1, 2, 3}
	s := time.Second
	for _, c := range []struct {
		name string
		// first answers the first TLS heartbeat, if given; tls the n-th
		// after it (from 1), if given, else answer(idle).
		first    func(p *datagramPeer) *agentv1.HeartbeatResponse
		tls      func(p *datagramPeer, n int) *agentv1.HeartbeatResponse
		tlsErr   func(n int) error // if given and not nil for n, the n-th TLS heartbeat's answer
		answer   func(p *datagramPeer, n int, req pulse.Request) [][]byte
		tlsAt    []window // TLS heartbeats after the first
		dgAt     []window
		counters []uint64 // of the datagrams, if given
		closes   int32
		// generation and report: the state directory holds that
		// generation file and a success report of generation 5 to deliver
		generation string
		report     bool
	}{
		{
			// The server answered within two intervals (the grant, at
			// 0): the datagrams go again after a second's back-off
			// before the agent gives up on them at 23 s.
			name:     "unanswered: three tries 2s apart, again after a back-off, then TLS",
			answer:   func(*datagramPeer, int, pulse.Request) [][]byte { return nil },
			tls:      func(*datagramPeer, int) *agentv1.HeartbeatResponse { return answer(idle) },
			dgAt:     []window{exactly(10 * s), exactly(12 * s), exactly(14 * s), around(17 * s), around(19 * s), around(21 * s)},
			counters: []uint64{6, 7, 8, 9, 10, 11},
			tlsAt:    []window{around(23 * s)},
			closes:   2, // after the first TLS heartbeat, and after the fallback, which still held the grant
		},
		{
			// A server that stalls for less than two intervals costs no
			// TLS connection: the fleet does not all handshake at once.
			name:     "unanswered, then answered: no TLS",
			answer:   recordedFrom(3),
			dgAt:     []window{exactly(10 * s), exactly(12 * s), exactly(14 * s), around(17 * s)},
			counters: []uint64{6, 7, 8, 9},
			closes:   1,
		},
		{
			// An answer ends the back-off: a second outage starts again
			// from a second, not from where the first left off.
			name: "an answer resets the back-off",
			answer: func(p *datagramPeer, n int, req pulse.Request) [][]byte {
				switch {
				case n < 3 || (n >= 4 && n < 7):
					return nil
				case n == 3:
					return [][]byte{p.reply(req, pulse.StatusRecorded, 10*time.Second)}
				}
				return [][]byte{p.reply(req, pulse.StatusRecorded, idle)}
			},
			dgAt: []window{exactly(10 * s), exactly(12 * s), exactly(14 * s), around(17 * s),
				around(27 * s), around(29 * s), around(31 * s), {33600 * time.Millisecond, 34400 * time.Millisecond}},
			closes: 1,
		},
		{
			name:   "unanswered, then granted again: back to datagrams, counters go on",
			answer: recordedFrom(6),
			tls: func(p *datagramPeer, n int) *agentv1.HeartbeatResponse {
				r := answer(10 * time.Second)
				r.DatagramGrant = p.grant(9, 6) // the server's floor is the last counter it took, not the last sent
				return r
			},
			dgAt: []window{exactly(10 * s), exactly(12 * s), exactly(14 * s), around(17 * s), around(19 * s), around(21 * s),
				around(33 * s)},
			counters: []uint64{6, 7, 8, 9, 10, 11, 12},
			tlsAt:    []window{around(23 * s)},
			closes:   2,
		},
		{
			// A firewall that passes TCP but not UDP: the second grant
			// whose datagrams go unanswered while TLS gets through makes
			// the agent ignore grants for half an hour (its TLS
			// connection kept), then try datagrams again.
			name:   "UDP blocked: TLS only after two grants fail, datagrams again later",
			answer: recordedFrom(12),
			tls: func(p *datagramPeer, n int) *agentv1.HeartbeatResponse {
				next := map[int]time.Duration{1: 10 * time.Second, 2: 10 * time.Minute, 3: 25 * time.Minute, 4: time.Minute}[n]
				if next == 0 {
					next = idle
				}
				r := answer(next)
				r.DatagramGrant = p.grant(9, 5)
				return r
			},
			dgAt: []window{exactly(10 * s), exactly(12 * s), exactly(14 * s), around(17 * s), around(19 * s), around(21 * s),
				around(33 * s), around(35 * s), around(37 * s), wide(40 * s), wide(42 * s), wide(44 * s),
				wide(36*time.Minute + 46*s)},
			tlsAt: []window{around(23 * s), wide(46 * s), wide(10*time.Minute + 46*s), wide(35*time.Minute + 46*s)},
			// After the first call, and after each TLS call that held a
			// grant or took one: not while on TLS only.
			closes: 4,
		},
		{
			// Only grants that fail in a row count: an answered datagram
			// between two failed grants says UDP works.
			name: "an answer between two failed grants: datagrams go on",
			answer: func(p *datagramPeer, n int, req pulse.Request) [][]byte {
				switch {
				case n == 6:
					return [][]byte{p.reply(req, pulse.StatusRecorded, 10*time.Second)}
				case n >= 13:
					return [][]byte{p.reply(req, pulse.StatusRecorded, idle)}
				}
				return nil
			},
			tls: grantEvery10s,
			dgAt: []window{exactly(10 * s), exactly(12 * s), exactly(14 * s), around(17 * s), around(19 * s), around(21 * s),
				around(33 * s), around(43 * s), around(45 * s), around(47 * s), wide(50 * s), wide(52 * s), wide(54 * s),
				wide(66 * s)},
			tlsAt:  []window{around(23 * s), wide(56 * s)},
			closes: 3,
		},
		{
			// Datagrams unanswered because the server is down, not
			// blocked: the TLS call after each failed grant fails too
			// before it gets through, and such grants do not count.
			name:   "the server down across two failed grants: datagrams go on",
			answer: recordedFrom(12),
			tlsErr: func(n int) error {
				if n == 1 || n == 3 {
					return connect.NewError(connect.CodeUnavailable, errors.New("connection refused"))
				}
				return nil
			},
			tls: grantEvery10s,
			dgAt: []window{exactly(10 * s), exactly(12 * s), exactly(14 * s), around(17 * s), around(19 * s), around(21 * s),
				near(33250*time.Millisecond, 250*time.Millisecond), near(35250*time.Millisecond, 250*time.Millisecond),
				near(37250*time.Millisecond, 250*time.Millisecond), near(40250*time.Millisecond, 450*time.Millisecond),
				near(42250*time.Millisecond, 450*time.Millisecond), near(44250*time.Millisecond, 450*time.Millisecond),
				near(56500*time.Millisecond, 500*time.Millisecond)},
			tlsAt: []window{around(23 * s), near(23250*time.Millisecond, 250*time.Millisecond),
				near(46250*time.Millisecond, 450*time.Millisecond), near(46500*time.Millisecond, 500*time.Millisecond)},
			closes: 5,
		},
		{
			name: "call TLS: at once",
			answer: func(p *datagramPeer, _ int, req pulse.Request) [][]byte {
				return [][]byte{p.reply(req, pulse.StatusCallTLS, 0)}
			},
			tls:    func(*datagramPeer, int) *agentv1.HeartbeatResponse { return answer(idle) },
			dgAt:   []window{exactly(10 * s)},
			tlsAt:  []window{exactly(10 * s)},
			closes: 2,
		},
		{
			name: "a TLS answer without a grant ends datagrams",
			answer: func(p *datagramPeer, _ int, req pulse.Request) [][]byte {
				return [][]byte{p.reply(req, pulse.StatusCallTLS, 0)}
			},
			tls: func(_ *datagramPeer, n int) *agentv1.HeartbeatResponse {
				if n == 1 {
					return answer(10 * time.Second)
				}
				return answer(idle)
			},
			dgAt:   []window{exactly(10 * s)},
			tlsAt:  []window{exactly(10 * s), exactly(20 * s)},
			closes: 2,
		},
		{
			name: "retry later: the datagram again after the wait asked for, jittered, not TLS",
			answer: func(p *datagramPeer, n int, req pulse.Request) [][]byte {
				if n < 3 {
					return [][]byte{p.reply(req, pulse.StatusRetryLater, 2*time.Second)}
				}
				return [][]byte{p.reply(req, pulse.StatusRecorded, idle)}
			},
			dgAt: []window{exactly(10 * s), {10*s + 2*s*8/10, 10*s + 2*s*12/10},
				{10*s + 2*2*s*8/10, 10*s + 2*2*s*12/10}, {10*s + 3*2*s*8/10, 10*s + 3*2*s*12/10}},
			counters: []uint64{6, 7, 8, 9},
			closes:   1,
		},
		{
			name: "forged, stale, malformed and other counters' replies are ignored",
			answer: func(p *datagramPeer, _ int, req pulse.Request) [][]byte {
				// Each would make the agent call over TLS at once.
				callTLS := p.reply(req, pulse.StatusCallTLS, 0)
				return [][]byte{
					sealReply(&other, req.Counter, pulse.StatusCallTLS, 0),   // another key
					sealReply(&p.key, req.Counter-1, pulse.StatusCallTLS, 0), // an earlier heartbeat's counter
					sealReply(&p.key, req.Counter+1, pulse.StatusCallTLS, 0), // a counter not sent yet
					callTLS[:pulse.ReplySize-1],                              // cut short
					append(append([]byte(nil), callTLS...), 0),               // too long
					p.reply(req, pulse.StatusRecorded, 30*time.Minute),
				}
			},
			dgAt:   []window{exactly(10 * s), exactly(10*s + 30*time.Minute)},
			closes: 1,
		},
		{
			name: "a late reply to an earlier try of the same heartbeat counts",
			answer: func(p *datagramPeer, n int, req pulse.Request) [][]byte {
				if n == 1 {
					return [][]byte{p.reply(pulse.Request{Counter: req.Counter - 1}, pulse.StatusRecorded, idle)}
				}
				return nil
			},
			dgAt:   []window{exactly(10 * s), exactly(12 * s)},
			closes: 1,
		},
		{
			name: "a report to deliver goes over TLS",
			answer: func(p *datagramPeer, _ int, req pulse.Request) [][]byte {
				return [][]byte{p.reply(req, pulse.StatusRecorded, idle)}
			},
			first: func(p *datagramPeer) *agentv1.HeartbeatResponse {
				r := answer(10 * time.Second)
				r.HardwareReportRecorded = false
				r.DatagramGrant = p.grant(9, 5)
				return r
			},
			tls: func(p *datagramPeer, n int) *agentv1.HeartbeatResponse {
				r := answer(10 * time.Second)
				r.HardwareReportRecorded = n >= 2
				r.DatagramGrant = p.grant(9, 5)
				return r
			},
			tlsAt:  []window{exactly(10 * s), exactly(20 * s)},
			dgAt:   []window{exactly(30 * s)},
			closes: 3,
		},
		{
			name:       "an installation report to deliver goes over TLS",
			generation: "5\n",
			report:     true,
			answer: func(p *datagramPeer, _ int, req pulse.Request) [][]byte {
				return [][]byte{p.reply(req, pulse.StatusRecorded, idle)}
			},
			tls: func(p *datagramPeer, n int) *agentv1.HeartbeatResponse {
				r := answer(10 * time.Second)
				if n >= 2 {
					r.InstallationReportRecorded = 5
				}
				r.DatagramGrant = p.grant(9, 5)
				return r
			},
			tlsAt:  []window{exactly(10 * s), exactly(20 * s)},
			dgAt:   []window{exactly(30 * s)},
			closes: 3,
		},
		{
			name: "a grant with a short key is ignored",
			first: func(*datagramPeer) *agentv1.HeartbeatResponse {
				r := answer(10 * time.Second)
				r.DatagramGrant = &agentv1.DatagramGrant{Key: make([]byte, 16), Port: 9}
				return r
			},
			answer: func(p *datagramPeer, _ int, req pulse.Request) [][]byte {
				return [][]byte{p.reply(req, pulse.StatusRecorded, idle)}
			},
			tlsAt: []window{exactly(10 * s)},
		},
		{
			name: "a grant without a port is ignored",
			first: func(p *datagramPeer) *agentv1.HeartbeatResponse {
				r := answer(10 * time.Second)
				r.DatagramGrant = p.grant(0, 0)
				return r
			},
			answer: func(p *datagramPeer, _ int, req pulse.Request) [][]byte {
				return [][]byte{p.reply(req, pulse.StatusRecorded, idle)}
			},
			tlsAt: []window{exactly(10 * s)},
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				p := newDatagramPeer(t, c.answer)
				var closes atomic.Int32
				start := time.Now()
				cb, stop, _ := runDaemonWith(t, daemonConfig{Interval: time.Hour, MaxBackoff: time.Minute},
					func(_ context.Context, n int, _ *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error) {
						switch {
						case n == 0 && c.first != nil:
							return c.first(p), nil
						case n == 0:
							r := answer(10 * time.Second)
							r.DatagramGrant = p.grant(9, 5)
							return r, nil
						case c.tlsErr != nil && c.tlsErr(n) != nil:
							return nil, c.tlsErr(n)
						case c.tls != nil:
							return c.tls(p, n), nil
						}
						return answer(idle), nil
					}, func(d *daemon) {
						withDatagrams(t, p, &closes, c.generation)(d)
						if c.report {
							r := &agentv1.OSInstallationReport{Generation: 5, Result: &agentv1.OSInstallationReport_Success{Success: &agentv1.InstallationSuccess{}}}
							if err := writeReport(d.cfg.StateDir, r, false); err != nil {
								t.Fatal(err)
							}
						}
					})
				time.Sleep(time.Hour)
				if err := stop(); err != nil {
					t.Errorf("the daemon returned %v when stopped, want nil", err)
				}
				checkTimes(t, "TLS heartbeats after the first", start, cb.received()[1:], c.tlsAt)
				var at []time.Time
				var counters []uint64
				for _, g := range p.received() {
					at, counters = append(at, g.at), append(counters, g.req.Counter)
				}
				checkTimes(t, "datagrams", start, at, c.dgAt)
				if c.counters != nil && !slices.Equal(counters, c.counters) {
					t.Errorf("datagram counters %v, want %v", counters, c.counters)
				}
				if n := closes.Load(); n != c.closes {
					t.Errorf("the idle TLS connection was closed %d times, want %d", n, c.closes)
				}
			})
		})
	}
}

// TestDatagramRetired: a decommissioned machine's datagram is answered
// "call TLS", and the TLS call's PermissionDenied stops the daemon at once
// with ErrRetired, as it does without datagrams.
func TestDatagramRetired(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		p := newDatagramPeer(t, func(p *datagramPeer, _ int, req pulse.Request) [][]byte {
			return [][]byte{p.reply(req, pulse.StatusCallTLS, 0)}
		})
		var closes atomic.Int32
		start := time.Now()
		cb, _, exited := runDaemonWith(t, daemonConfig{Interval: time.Hour, MaxBackoff: time.Minute},
			func(_ context.Context, n int, _ *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error) {
				if n == 0 {
					r := answer(10 * time.Second)
					r.DatagramGrant = p.grant(9, 5)
					return r, nil
				}
				return nil, connect.NewError(connect.CodePermissionDenied, errors.New("machine decommissioned"))
			}, withDatagrams(t, p, &closes, ""))
		var err error
		select {
		case err = <-exited:
		case <-time.After(time.Hour):
			t.Fatal("the daemon still runs an hour after the server said the machine was decommissioned")
		}
		if !errors.Is(err, ErrRetired) {
			t.Errorf("the daemon returned %v, want ErrRetired", err)
		}
		if took := time.Since(start); took != 10*time.Second {
			t.Errorf("the daemon returned %s after the start, want 10s: at the first datagram's TLS call", took)
		}
		if n, m := len(cb.received()), len(p.received()); n != 2 || m != 1 {
			t.Errorf("%d TLS heartbeats and %d datagrams, want 2 and 1", n, m)
		}
	})
}

// TestTLSOnlyPeriodDoubles: each time UDP is taken for blocked again, the
// agent stays on TLS twice as long as the time before, from tlsOnlyMin up to
// tlsOnlyMax; an answered datagram starts it over, and a grant taken while
// the period runs is ignored.
func TestTLSOnlyPeriodDoubles(t *testing.T) {
	t.Parallel()
	p := newDatagramPeer(t, func(*datagramPeer, int, pulse.Request) [][]byte { return nil })
	d := &daemon{init: &agentv1.TakeoverInit{MachineId: uuid.NewString(), ServerEndpoint: "callback.test:7443"},
		log: slog.New(slog.DiscardHandler)}
	var closes atomic.Int32
	withDatagrams(t, p, &closes, "")(d)
	g := p.grant(9, 5)
	blocked := func() time.Duration {
		t.Helper()
		d.failedGrants, d.tlsOnlyUntil = udpBlockedAfter, time.Time{}
		d.takeGrant(t.Context(), g, false)
		if d.dg != nil {
			t.Fatalf("a grant was taken when UDP was found blocked")
		}
		return d.tlsOnlyFor
	}
	var got []time.Duration
	for range 6 {
		got = append(got, blocked())
	}
	h := time.Hour
	if want := []time.Duration{h / 2, h, 2 * h, 4 * h, 8 * h, 8 * h}; !slices.Equal(got, want) {
		t.Errorf("TLS-only periods %v, want %v", got, want)
	}
	d.takeGrant(t.Context(), g, false) // within the period
	if d.dg != nil {
		t.Error("a grant was taken while the TLS-only period runs")
	}
	d.datagramAnswered()
	if got := blocked(); got != tlsOnlyMin {
		t.Errorf("TLS-only period after an answered datagram %v, want %v", got, tlsOnlyMin)
	}
	d.tlsOnlyUntil = time.Time{}
	d.takeGrant(t.Context(), g, false)
	if d.dg == nil {
		t.Error("no grant taken once the TLS-only period is over")
	}
	d.dropGrant()
}
