package server

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/net/ipv4"
	"golang.org/x/net/ipv6"

	"github.com/shepherd/shepherd/api/agent/pulse"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb"
)

// datagramReaders is how many goroutines read the UDP socket. The socket's
// reads are serialised by the runtime, so a second reader only lets one
// goroutine check a datagram (three HMACs, a queue hand-off) while the
// other waits for the next; more would add nothing on the two cores the
// server is measured on.
const datagramReaders = 2

// datagramReadBuffer is the UDP socket's receive buffer asked for (the
// kernel caps it at net.core.rmem_max): a burst of datagrams waits there
// while the readers are busy instead of being dropped. 4 MiB holds a few
// thousand datagrams, each charged with the kernel's bookkeeping.
const datagramReadBuffer = 4 << 20

// datagramSecret is the BMDB's secret the datagram keys are derived from.
// Whoever holds it can forge any agent's heartbeats: String and LogValue
// keep it out of logs and errors.
type datagramSecret struct{ b []byte }

func (*datagramSecret) String() string { return "REDACTED" }

// LogValue keeps the secret out of log lines.
func (*datagramSecret) LogValue() slog.Value { return slog.StringValue("REDACTED") }

// loadSecret reads the datagram secret from the BMDB.
func (s *Server) loadSecret(ctx context.Context) error {
	b, err := s.db.DatagramSecret(ctx)
	if err != nil {
		return fmt.Errorf("server: %w", err)
	}
	if len(b) != pulse.SecretSize {
		return fmt.Errorf("server: the heartbeat datagram secret has %d bytes, want %d", len(b), pulse.SecretSize)
	}
	s.secret.Store(&datagramSecret{b: b})
	return nil
}

// retrySecret reads the datagram secret until it has it or ctx ends, a
// second and then up to 30 s apart.
func (s *Server) retrySecret(ctx context.Context) {
	pause := time.Second
	t := time.NewTimer(pause)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		lctx, cancel := context.WithTimeout(ctx, s.cfg.FlushTimeout)
		err := s.loadSecret(lctx)
		cancel()
		if err == nil {
			s.log.InfoContext(ctx, "read the heartbeat datagram secret; granting datagrams")
			return
		}
		if ctx.Err() != nil {
			return
		}
		s.throttle.Log(ctx, slog.LevelWarn, "datagram_secret", "reading the heartbeat datagram secret", "err", err)
		pause = min(2*pause, 30*time.Second)
		t.Reset(pause)
	}
}

// grant is the datagram grant for an agent whose TLS heartbeat the BMDB
// accepted with the stored counter floor, or nil when the server gives
// none (NoDatagrams, or the secret not yet read).
func (s *Server) grant(machine uuid.UUID, key ed25519.PublicKey, floor int64) *agentv1.DatagramGrant {
	if s.datagrams == nil {
		return nil
	}
	sec := s.secret.Load()
	port := s.datagrams.port.Load()
	if sec == nil || port == 0 {
		return nil
	}
	k := pulse.DeriveKey(sec.b, machine, key)
	return &agentv1.DatagramGrant{Key: k[:], Port: port, CounterFloor: uint64(max(floor, 0))}
}

// listenUDP opens the datagram socket on addr. A socket bound to every
// address (0.0.0.0, or :: which takes IPv4 too) is asked for the address
// each datagram was sent to, so that its reply comes from that address:
// the kernel would pick the source by route, which on a host with several
// addresses (a virtual IP, a secondary address) is not always the one the
// agent sent to, and the agent's connected socket drops a reply from any
// other address.
func listenUDP(addr string) (*net.UDPConn, error) {
	ua, err := net.ResolveUDPAddr("udp", addr)
	if err != nil {
		return nil, fmt.Errorf("server: resolving datagram address %s: %w", addr, err)
	}
	conn, err := net.ListenUDP("udp", ua)
	if err != nil {
		return nil, fmt.Errorf("server: listening for datagrams on %s: %w", addr, err)
	}
	// Best effort: a smaller buffer only drops bursts earlier, and agents
	// resend.
	_ = conn.SetReadBuffer(datagramReadBuffer)
	if _, err := askForDestination(conn); err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("server: asking for the destination of datagrams on %s: %w", addr, err)
	}
	return conn, nil
}

// askForDestination has a socket bound to every address deliver each
// datagram's destination address with it, and says how to read it; a
// socket bound to one address is left as it is (dstBound).
func askForDestination(conn *net.UDPConn) (localDst, error) {
	switch mode := destinationOf(conn); mode {
	case dstIPv4:
		return mode, ipv4.NewPacketConn(conn).SetControlMessage(ipv4.FlagDst, true)
	case dstIPv6:
		return mode, ipv6.NewPacketConn(conn).SetControlMessage(ipv6.FlagDst|ipv6.FlagInterface, true)
	default:
		return mode, nil
	}
}

// destinationOf says how a socket that askForDestination prepared
// delivers each datagram's destination, from the address it is bound to.
func destinationOf(conn *net.UDPConn) localDst {
	ip := conn.LocalAddr().(*net.UDPAddr).IP
	switch {
	case ip != nil && !ip.IsUnspecified():
		return dstBound
	case ip.To4() != nil:
		return dstIPv4
	default:
		return dstIPv6
	}
}

// localDst says how the datagram socket learns which of the host's
// addresses a datagram was sent to.
type localDst int

const (
	dstBound localDst = iota // bound to one address, which every reply comes from
	dstIPv4                  // bound to 0.0.0.0: IP_PKTINFO
	dstIPv6                  // bound to ::: IPV6_PKTINFO, IPv4 as mapped addresses
)

// oobSize is room for the control message of either family.
const oobSize = 64

// parse returns the destination address and interface of a datagram from
// its control message (an invalid address if there is none).
func (m localDst) parse(oob []byte) (netip.Addr, int) {
	switch m {
	case dstIPv4:
		var cm ipv4.ControlMessage
		if cm.Parse(oob) == nil {
			a, _ := netip.AddrFromSlice(cm.Dst.To4())
			return a, cm.IfIndex
		}
	case dstIPv6:
		var cm ipv6.ControlMessage
		if cm.Parse(oob) == nil {
			a, _ := netip.AddrFromSlice(cm.Dst)
			return a, cm.IfIndex
		}
	}
	return netip.Addr{}, 0
}

// source is the control message that sends a reply from local (an address
// a datagram was sent to), or nil to let the kernel choose: for a socket
// bound to one address, or a datagram sent to an address no reply can come
// from (broadcast, multicast). An IPv4 address, mapped or not, goes as
// IP_PKTINFO, which Linux takes on an IPv6 socket too for an IPv4
// destination (and x/net's IPv6 control message leaves mapped addresses
// out).
func (m localDst) source(local netip.Addr, ifIndex int) []byte {
	if m == dstBound || !local.IsValid() {
		return nil
	}
	local = local.Unmap()
	if local.IsMulticast() || local.IsUnspecified() || local == netip.AddrFrom4([4]byte{255, 255, 255, 255}) {
		return nil
	}
	if local.Is4() {
		return (&ipv4.ControlMessage{Src: local.AsSlice()}).Marshal()
	}
	cm := ipv6.ControlMessage{Src: local.AsSlice()}
	if local.IsLinkLocalUnicast() {
		cm.IfIndex = ifIndex // a link-local address is one interface's
	}
	return cm.Marshal()
}

// datagramServer receives heartbeat datagrams (package pulse), submits
// them to the batcher with the TLS heartbeats and answers each once its
// batch is written. Nothing waits per datagram: the flusher that wrote the
// batch sends the replies (datagramBeat.beatDone), so a datagram in flight
// costs a pooled datagramBeat, not a goroutine.
type datagramServer struct {
	s    *Server
	conn *net.UDPConn // set by run, before any datagram is read
	dst  localDst     // set by run, from conn
	// port is the socket's UDP port, for grants; 0 until Listen.
	port atomic.Uint32
	pool sync.Pool
	// rejected are the rejection counters by reason, resolved once rather
	// than per datagram.
	rejected map[string]prometheus.Counter
	// unbatched counts the writes of Config.Unbatched in flight.
	unbatched sync.WaitGroup
}

func newDatagramServer(s *Server) *datagramServer {
	d := &datagramServer{s: s, rejected: map[string]prometheus.Counter{}}
	for _, r := range rejectReasons {
		d.rejected[r] = s.metrics.rejected.WithLabelValues(r)
	}
	d.pool.New = func() any {
		p := &datagramBeat{d: d}
		p.then = p
		return p
	}
	return d
}

// datagramBeat is one verified datagram on its way through the batcher.
type datagramBeat struct {
	pendingBeat
	d        *datagramServer
	key      pulse.Key
	agentKey [ed25519.PublicKeySize]byte // hb.AgentKey points here
	counter  uint64
	known    int64 // the request's KnownGeneration
	from     netip.AddrPort
	local    netip.Addr // the address from was sent to, if the socket is bound to every address
	ifIndex  int        // the interface it came in on, with local
	start    time.Time
	out      [pulse.ReplySize]byte
}

// run reads datagrams until ctx ends. It stops its readers with a read
// deadline rather than by closing the socket, so that the heartbeats they
// submitted can still be answered as their batches are written; Run closes
// the socket once the batcher has stopped.
func (d *datagramServer) run(ctx context.Context, conn *net.UDPConn) {
	d.conn, d.dst = conn, destinationOf(conn)
	var wg sync.WaitGroup
	for range datagramReaders {
		wg.Go(func() { d.read(ctx) })
	}
	<-ctx.Done()
	_ = conn.SetReadDeadline(time.Unix(1, 0))
	wg.Wait()
}

// wait waits for the unbatched writes in flight.
func (d *datagramServer) wait() { d.unbatched.Wait() }

// read is one reader's loop. Its buffer is one byte longer than a request,
// so a longer datagram shows as such (the kernel cuts it to the buffer).
func (d *datagramServer) read(ctx context.Context) {
	buf, oob := make([]byte, pulse.RequestSize+1), make([]byte, oobSize)
	for {
		n, oobn, _, from, err := d.conn.ReadMsgUDPAddrPort(buf, oob)
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, net.ErrClosed) {
				return
			}
			// Errors of an unconnected UDP socket are transient (an
			// ICMP error queued by the kernel, memory); pause so that a
			// persistent one cannot spin.
			d.s.throttle.Log(ctx, slog.LevelError, "datagram_read", "reading heartbeat datagrams", "err", err)
			t := time.NewTimer(10 * time.Millisecond)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
			continue
		}
		local, ifIndex := d.dst.parse(oob[:oobn])
		d.handle(ctx, buf[:n], from, local, ifIndex)
	}
}

// handle checks one datagram and submits its heartbeat. A datagram that
// is not an authentic request (wrong size or format, bad MAC) gets no
// answer at all: an answer would tell a prober what it got right, and
// could be sent to a forged source address.
func (d *datagramServer) handle(ctx context.Context, b []byte, from netip.AddrPort, local netip.Addr, ifIndex int) {
	start := time.Now()
	if len(b) != pulse.RequestSize {
		reason := reasonInvalid
		if len(b) > pulse.RequestSize {
			reason = reasonTooLarge
		}
		d.rejected[reason].Inc()
		d.s.throttle.Log(ctx, slog.LevelWarn, "datagram_size", "ignoring a datagram that is not a heartbeat request",
			"peer", from.String(), "bytes", len(b))
		return
	}
	req, err := pulse.ParseRequest(b)
	if err != nil {
		d.rejected[reasonInvalid].Inc()
		d.s.throttle.Log(ctx, slog.LevelWarn, "datagram_malformed", "ignoring a malformed heartbeat datagram",
			"peer", from.String(), "err", err)
		return
	}
	sec := d.s.secret.Load()
	if sec == nil {
		// No grant was given either: the sender holds one of an earlier
		// run, and falls back to TLS when no answer comes.
		d.rejected[reasonUnavailable].Inc()
		d.s.throttle.Log(ctx, slog.LevelWarn, "datagram_no_secret", "ignoring a heartbeat datagram: the datagram secret is not read yet")
		return
	}
	p := d.pool.Get().(*datagramBeat)
	p.key = pulse.DeriveKey(sec.b, req.MachineID, req.AgentKey)
	if err := pulse.VerifyRequest(b, &p.key); err != nil {
		d.release(p)
		d.rejected[reasonBadMAC].Inc()
		d.s.throttle.Log(ctx, slog.LevelWarn, "datagram_bad_mac", "ignoring a heartbeat datagram with a bad MAC",
			"peer", from.String())
		return
	}
	copy(p.agentKey[:], req.AgentKey)
	p.hb = bmdb.Heartbeat{MachineID: req.MachineID, AgentKey: p.agentKey[:], Counter: int64(req.Counter)}
	p.counter, p.known, p.from, p.local, p.ifIndex, p.start = req.Counter, req.KnownGeneration, from, local, ifIndex, start
	if d.s.cfg.Unbatched {
		d.unbatched.Go(func() { d.writeAlone(ctx, p) })
		return
	}
	switch err := d.s.batch.enqueue(ctx, &p.pendingBeat, d.s.verified.has(req.MachineID, p.hb.AgentKey)); {
	case err == nil:
	case errors.Is(err, errBusy):
		d.s.throttle.Log(ctx, slog.LevelWarn, reasonBusy, "too many heartbeats of unverified keys queued; refusing")
		d.reply(p, pulse.StatusRetryLater, d.s.cfg.RetryPushback, reasonBusy)
	default: // stopping
		d.reply(p, pulse.StatusRetryLater, d.s.cfg.RetryPushback, reasonUnavailable)
	}
}

// writeAlone records p's heartbeat in a transaction of its own
// (Config.Unbatched, the benchmark's baseline).
func (d *datagramServer) writeAlone(ctx context.Context, p *datagramBeat) {
	d.s.metrics.batchSize.Observe(1)
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), d.s.cfg.FlushTimeout)
	defer cancel()
	res, err := d.s.db.RecordHeartbeats(wctx, []bmdb.Heartbeat{p.hb})
	if err != nil {
		p.beatDone(beatResult{err: err})
		return
	}
	p.beatDone(beatResult{res: res[0]})
}

// beatDone answers the datagram once its batch is written. It runs on the
// flusher's goroutine and does not block (a UDP send waits for nothing but
// the socket buffer).
func (p *datagramBeat) beatDone(r beatResult) {
	d, s := p.d, p.d.s
	ctx := context.Background()
	res := r.res
	switch {
	case r.err != nil:
		if !errors.Is(r.err, errStopped) {
			s.throttle.Log(ctx, slog.LevelError, reasonUnavailable, "recording heartbeats failed",
				"machine_id", p.hb.MachineID.String(), "err", r.err)
		}
		d.reply(p, pulse.StatusRetryLater, s.cfg.RetryPushback, reasonUnavailable)
	case res.Err != nil:
		s.throttle.Log(ctx, slog.LevelWarn, reasonInvalid, "the database refused a heartbeat",
			"machine_id", p.hb.MachineID.String(), "err", res.Err)
		d.reply(p, pulse.StatusCallTLS, 0, reasonInvalid)
	case res.Retired:
		s.verified.learn(p.hb.MachineID, p.hb.AgentKey, false)
		s.throttle.Log(ctx, slog.LevelInfo, reasonRetired, "telling the agent of a decommissioned machine to stop",
			"machine_id", p.hb.MachineID.String())
		d.reply(p, pulse.StatusCallTLS, 0, reasonRetired)
	case res.Replayed:
		// The key is still the machine's: it stays verified. A replay is
		// not the agent's doing (it never reuses a counter), so it is
		// counted, and logged at the bounded rate, as a possible attack.
		s.throttle.Log(ctx, slog.LevelWarn, reasonReplayed, "refusing a replayed heartbeat datagram",
			"machine_id", p.hb.MachineID.String(), "peer", p.from.String())
		d.reply(p, pulse.StatusCallTLS, 0, reasonReplayed)
	case !res.Accepted:
		s.verified.learn(p.hb.MachineID, p.hb.AgentKey, false)
		d.reply(p, pulse.StatusCallTLS, 0, reasonUnauthenticated)
	default:
		s.verified.learn(p.hb.MachineID, p.hb.AgentKey, true)
		if res.Pending != nil && res.Pending.Generation > p.known {
			d.reply(p, pulse.StatusCallTLS, 0, "")
		} else {
			d.reply(p, pulse.StatusRecorded, s.cfg.HeartbeatInterval, "")
		}
	}
}

// reply sends p's answer, counts the heartbeat (reason "": accepted) and
// returns p to the pool.
func (d *datagramServer) reply(p *datagramBeat, st pulse.Status, next time.Duration, reason string) {
	r := pulse.Reply{Counter: p.counter, Status: st, NextIn: next}
	msg := r.Seal(p.out[:0], &p.key)
	var err error
	if oob := d.dst.source(p.local, p.ifIndex); oob != nil {
		_, _, err = d.conn.WriteMsgUDPAddrPort(msg, oob, p.from)
	} else {
		_, err = d.conn.WriteToUDPAddrPort(msg, p.from)
	}
	if err != nil {
		d.s.throttle.Log(context.Background(), slog.LevelWarn, "datagram_write", "answering a heartbeat datagram",
			"peer", p.from.String(), "err", err)
	}
	if reason == "" {
		d.s.metrics.accepted.Inc()
	} else {
		d.rejected[reason].Inc()
	}
	d.s.metrics.latency.Observe(time.Since(p.start).Seconds())
	d.release(p)
}

// release clears p (the key is a secret) and returns it to the pool.
func (d *datagramServer) release(p *datagramBeat) {
	p.hb = bmdb.Heartbeat{}
	p.key = pulse.Key{}
	d.pool.Put(p)
}
