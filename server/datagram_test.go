package server_test

import (
	"context"
	"crypto/ed25519"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/api/agent/pulse"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/tcpproxy"
	"github.com/shepherd/shepherd/server"
	"github.com/shepherd/shepherd/server/servertest"
)

// grantOf makes a TLS heartbeat for the machine and returns the grant its
// answer carries (nil if none).
func (e *env) grantOf(id uuid.UUID, key ed25519.PrivateKey) *agentv1.DatagramGrant {
	e.t.Helper()
	resp, err := e.heartbeat(e.client(id, key), &agentv1.HeartbeatRequest{MachineId: id.String()})
	if err != nil {
		e.t.Fatalf("TLS heartbeat of %s: %v", id, err)
	}
	return resp.GetDatagramGrant()
}

// udpAgent is one agent's UDP socket, connected to the server's.
type udpAgent struct {
	t    *testing.T
	conn *net.UDPConn
}

func (e *env) udp() *udpAgent {
	e.t.Helper()
	addr := e.srv.DatagramAddr()
	if addr == nil {
		e.t.Fatal("the server has no datagram address")
	}
	conn, err := net.DialUDP("udp", nil, addr.(*net.UDPAddr))
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { conn.Close() })
	return &udpAgent{t: e.t, conn: conn}
}

// keyOf is the key a grant carries.
func keyOf(t *testing.T, g *agentv1.DatagramGrant) *pulse.Key {
	t.Helper()
	var k pulse.Key
	if g == nil || len(g.GetKey()) != len(k) {
		t.Fatalf("grant %v carries no key", g != nil)
	}
	copy(k[:], g.GetKey())
	return &k
}

// request builds the heartbeat datagram of a machine's agent, MACed
// under k.
func request(id uuid.UUID, key ed25519.PrivateKey, counter uint64, known int64, k *pulse.Key) []byte {
	r := pulse.Request{MachineID: id, AgentKey: key.Public().(ed25519.PublicKey), Counter: counter, KnownGeneration: known}
	return r.Seal(nil, k)
}

func (a *udpAgent) send(b []byte) {
	a.t.Helper()
	if _, err := a.conn.Write(b); err != nil {
		a.t.Fatalf("sending a datagram: %v", err)
	}
}

// reply waits (10 s at most) for the next datagram the server sends and
// opens it under k. A reply to a datagram that should have had none shows
// as the wrong counter, or a reply that does not open.
func (a *udpAgent) reply(k *pulse.Key, counter uint64) pulse.Reply {
	a.t.Helper()
	buf := make([]byte, 1500)
	if err := a.conn.SetReadDeadline(time.Now().Add(10 * time.Second)); err != nil {
		a.t.Fatal(err)
	}
	n, err := a.conn.Read(buf)
	if err != nil {
		a.t.Fatalf("waiting for the reply to counter %d: %v", counter, err)
	}
	r, err := pulse.OpenReply(buf[:n], k)
	if err != nil {
		a.t.Fatalf("the reply to counter %d does not open under the grant's key: %v", counter, err)
	}
	if r.Counter != counter {
		a.t.Fatalf("reply to counter %d, want to %d (a datagram that should have had no answer got one?)", r.Counter, counter)
	}
	return r
}

// roundTrip sends a datagram and returns the server's answer.
func (a *udpAgent) roundTrip(id uuid.UUID, key ed25519.PrivateKey, counter uint64, known int64, k *pulse.Key) pulse.Reply {
	a.t.Helper()
	a.send(request(id, key, counter, known, k))
	return a.reply(k, counter)
}

func TestDatagramAccepted(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{HeartbeatInterval: 7 * time.Second})
	id, key := e.machine()
	g := e.grantOf(id, key)
	k := keyOf(t, g)
	if want := uint32(e.srv.DatagramAddr().(*net.UDPAddr).Port); g.GetPort() != want {
		t.Errorf("grant port %d, want the datagram socket's %d", g.GetPort(), want)
	}
	before := e.rows(id)
	a := e.udp()
	counter := g.GetCounterFloor() + 1
	r := a.roundTrip(id, key, counter, 0, k)
	if r.Status != pulse.StatusRecorded || r.NextIn != 7*time.Second {
		t.Errorf("reply %+v, want recorded, next in 7s", r)
	}
	if after := e.rows(id); after == before {
		t.Errorf("the datagram did not move the heartbeat time: %s", after)
	}
	// The next TLS heartbeat's floor is the datagram's counter.
	if g := e.grantOf(id, key); g.GetCounterFloor() != counter {
		t.Errorf("floor after a datagram with counter %d: %d", counter, g.GetCounterFloor())
	}
	waitCounts(t, e.reg, map[string]float64{"accepted": 3})
}

// TestDatagramReplyComesFromTheAddressAsked: a server whose datagram
// socket is bound to every address answers from the address the agent sent
// to, not the one the kernel's route would pick. The agent's socket is
// connected, so it drops a reply from any other address; on loopback a
// datagram sent to 127.0.0.2 would be answered from 127.0.0.1, as on a host
// with a virtual or secondary address.
func TestDatagramReplyComesFromTheAddressAsked(t *testing.T) {
	t.Parallel()
	for _, listen := range []string{"0.0.0.0:0", "[::]:0"} {
		t.Run(listen, func(t *testing.T) {
			t.Parallel()
			e := start(t, server.Config{DatagramListen: listen})
			id, key := e.machine()
			g := e.grantOf(id, key)
			k := keyOf(t, g)
			conn, err := net.DialUDP("udp", nil, &net.UDPAddr{IP: net.ParseIP("127.0.0.2"), Port: int(g.GetPort())})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { conn.Close() })
			a := &udpAgent{t: t, conn: conn}
			for i := range uint64(3) {
				counter := g.GetCounterFloor() + 1 + i
				if r := a.roundTrip(id, key, counter, 0, k); r.Status != pulse.StatusRecorded {
					t.Errorf("reply %+v, want recorded", r)
				}
			}
		})
	}
}

// The grant's key is DeriveKey(secret, machine, agent key) under the
// BMDB's secret, and its floor is the machine's stored counter.
func TestGrantKeyAndFloor(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{})
	id, key := e.machine()
	g := e.grantOf(id, key)
	secret, err := e.db.DatagramSecret(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	want := pulse.DeriveKey(secret, id, key.Public().(ed25519.PublicKey))
	if got := keyOf(t, g); *got != want {
		t.Error("the grant's key is not DeriveKey(secret, machine, agent key)")
	}
	if g.GetCounterFloor() != 0 {
		t.Errorf("floor %d before any datagram, want 0", g.GetCounterFloor())
	}
	e.db.Exec(t, `UPDATE machine_agent_heartbeat SET datagram_counter = 41 WHERE machine_id = $1`, id)
	if g := e.grantOf(id, key); g.GetCounterFloor() != 41 {
		t.Errorf("floor %d with the stored counter at 41", g.GetCounterFloor())
	}
}

// R6 for datagrams: a datagram MACed with another machine's grant, one
// naming another machine, one with the agent key from before a recovery
// and replays are refused and record nothing. Those that are authentic
// (their MAC is right under the key the server derives) are told to call
// over TLS, which gives the agent the full answer; the others get no
// answer at all.
func TestDatagramR6(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{})
	a, keyA := e.machine()
	b, keyB := e.machine()
	recovered, oldKey := e.machine()
	gA, gB, gOld := e.grantOf(a, keyA), e.grantOf(b, keyB), e.grantOf(recovered, oldKey)
	kA, kB, kOld := keyOf(t, gA), keyOf(t, gB), keyOf(t, gOld)
	// Recovery replaces AgentStarted: the old key and its grant are
	// worthless now.
	e.startAgent(recovered)
	secret, err := e.db.DatagramSecret(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	// forged is what only someone holding the server's secret could MAC:
	// the BMDB must refuse it even so.
	forged := pulse.DeriveKey(secret, a, keyB.Public().(ed25519.PublicKey))
	ag := e.udp()

	// Another machine's grant: b's agent claims to be a, with its own
	// key, MACed with its own grant. The server derives another key.
	before := e.rows(a)
	ag.send(request(a, keyB, 100, 0, kB))
	waitCounts(t, e.reg, map[string]float64{"bad_mac": 1})
	// b's agent MACs a datagram naming a and a's key with b's grant.
	ag.send(request(a, keyA, 101, 0, kB))
	waitCounts(t, e.reg, map[string]float64{"bad_mac": 2})
	// Another machine's id with a right MAC (the secret leaked): the key
	// is not a's.
	if r := ag.roundTrip(a, keyB, 102, 0, &forged); r.Status != pulse.StatusCallTLS {
		t.Errorf("authentic datagram naming another machine: %v, want call-tls", r.Status)
	}
	if after := e.rows(a); after != before {
		t.Errorf("datagrams for a that are not a's changed its rows: %s -> %s", before, after)
	}
	// The key from before a recovery, with its own grant.
	before = e.rows(recovered)
	if r := ag.roundTrip(recovered, oldKey, gOld.GetCounterFloor()+1, 0, kOld); r.Status != pulse.StatusCallTLS {
		t.Errorf("datagram with the key from before a recovery: %v, want call-tls", r.Status)
	}
	if after := e.rows(recovered); after != before {
		t.Errorf("the old key's datagram changed the recovered machine's rows: %s -> %s", before, after)
	}
	waitCounts(t, e.reg, map[string]float64{"unauthenticated": 2, "bad_mac": 2})

	// Replays: the same bytes twice, and a lower counter.
	dg := request(a, keyA, gA.GetCounterFloor()+10, 0, kA)
	ag.send(dg)
	if r := ag.reply(kA, gA.GetCounterFloor()+10); r.Status != pulse.StatusRecorded {
		t.Fatalf("a's own datagram: %v, want recorded", r.Status)
	}
	before = e.rows(a)
	ag.send(dg)
	if r := ag.reply(kA, gA.GetCounterFloor()+10); r.Status != pulse.StatusCallTLS {
		t.Errorf("the same datagram again: %v, want call-tls", r.Status)
	}
	if r := ag.roundTrip(a, keyA, gA.GetCounterFloor()+9, 0, kA); r.Status != pulse.StatusCallTLS {
		t.Errorf("a lower counter: %v, want call-tls", r.Status)
	}
	if after := e.rows(a); after != before {
		t.Errorf("replays changed a's rows: %s -> %s", before, after)
	}
	waitCounts(t, e.reg, map[string]float64{"replayed": 2, "unauthenticated": 2, "bad_mac": 2})
	// The agent carries on above the stored counter.
	if r := ag.roundTrip(a, keyA, gA.GetCounterFloor()+11, 0, kA); r.Status != pulse.StatusRecorded {
		t.Errorf("the next counter after the replays: %v, want recorded", r.Status)
	}
}

// Datagrams that are not authentic requests (wrong size, malformed, bad
// MAC) get no answer, record nothing and are counted. The server answers
// each request it handles before it counts the next, so a good datagram
// sent after a bad one is counted must be the first answered: an answer to
// the bad one would come first.
func TestDatagramGarbageGetsNoAnswer(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{})
	id, key := e.machine()
	g := e.grantOf(id, key)
	k := keyOf(t, g)
	ag := e.udp()
	good := func(counter uint64) []byte { return request(id, key, counter, 0, k) }
	flip := func(b []byte, i int) []byte { b[i] ^= 1; return b }
	var wrongKey pulse.Key
	cases := []struct {
		name   string
		b      []byte
		reason string
	}{
		{"empty", []byte{}, "invalid_argument"},
		{"one byte", []byte{0x53}, "invalid_argument"},
		{"a byte short", good(1000)[:pulse.RequestSize-1], "invalid_argument"},
		{"a byte long", append(good(1001), 0), "too_large"},
		{"a jumbo datagram", make([]byte, 9000), "too_large"},
		{"the largest datagram", make([]byte, 65507), "too_large"},
		{"a reply sent back", (&pulse.Reply{Counter: 1}).Seal(nil, k), "invalid_argument"},
		{"wrong magic", flip(good(1002), 3), "invalid_argument"},
		{"counter 0", request(id, key, 0, 0, k), "invalid_argument"},
		{"counter beyond int64", request(id, key, 1<<63, 0, k), "invalid_argument"},
		{"negative known generation", request(id, key, 1003, -1, k), "invalid_argument"},
		{"MAC bit flipped", flip(good(1004), pulse.RequestSize-1), "bad_mac"},
		{"counter bit flipped", flip(good(1005), 59), "bad_mac"},
		{"machine id bit flipped", flip(good(1006), 4), "bad_mac"},
		{"agent key bit flipped", flip(good(1007), 20), "bad_mac"},
		{"known generation bit flipped", flip(good(1008), 67), "bad_mac"},
		{"wrong key", request(id, key, 1009, 0, &wrongKey), "bad_mac"},
	}
	before := e.rows(id)
	want := map[string]float64{"invalid_argument": 0, "too_large": 0, "bad_mac": 0}
	for _, c := range cases {
		ag.send(c.b)
		want[c.reason]++
		waitCounts(t, e.reg, want)
	}
	if after := e.rows(id); after != before {
		t.Errorf("garbage changed the machine's rows: %s -> %s", before, after)
	}
	if r := ag.roundTrip(id, key, 2000, 0, k); r.Status != pulse.StatusRecorded {
		t.Errorf("a good datagram after the garbage: %v, want recorded", r.Status)
	}
}

// A pending installation newer than the one the agent knows makes the
// server ask for a TLS heartbeat (which carries the request); one the
// agent knows already does not.
func TestDatagramPendingInstallation(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{})
	id, key := e.machine()
	g := e.grantOf(id, key)
	k := keyOf(t, g)
	var gen int64
	err := e.s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		var err error
		gen, err = tx.RequestInstallation(ctx, id, "test", []byte{})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	ag := e.udp()
	c := g.GetCounterFloor()
	for _, tc := range []struct {
		known int64
		want  pulse.Status
	}{{0, pulse.StatusCallTLS}, {gen - 1, pulse.StatusCallTLS}, {gen, pulse.StatusRecorded}, {gen + 1, pulse.StatusRecorded}} {
		c++
		before := e.rows(id)
		if r := ag.roundTrip(id, key, c, tc.known, k); r.Status != tc.want {
			t.Errorf("pending generation %d, agent knows %d: %v, want %v", gen, tc.known, r.Status, tc.want)
		}
		if after := e.rows(id); after == before {
			t.Errorf("agent knows %d: the heartbeat was not recorded", tc.known)
		}
	}
	waitCounts(t, e.reg, map[string]float64{"accepted": 5})
}

// A database that stops answering: the datagram is answered retry-later,
// with the retry pushback, once the batch times out.
func TestDatagramDatabaseDown(t *testing.T) {
	t.Parallel()
	e, proxy, _ := startBehindProxy(t)
	id, key := e.machine()
	g := e.grantOf(id, key)
	k := keyOf(t, g)
	ag := e.udp()
	if r := ag.roundTrip(id, key, g.GetCounterFloor()+1, 0, k); r.Status != pulse.StatusRecorded {
		t.Fatalf("before the outage: %v", r.Status)
	}
	proxy.SetMode(tcpproxy.Blackhole)
	r := ag.roundTrip(id, key, g.GetCounterFloor()+2, 0, k)
	proxy.SetMode(tcpproxy.Pass)
	if r.Status != pulse.StatusRetryLater || r.NextIn != 300*time.Millisecond {
		t.Errorf("while the database black-holes: %+v, want retry-later in 300ms", r)
	}
	waitCounts(t, e.reg, map[string]float64{"unavailable": 1})
	if r := ag.roundTrip(id, key, g.GetCounterFloor()+3, 0, k); r.Status != pulse.StatusRecorded {
		t.Errorf("after the outage: %v, want recorded", r.Status)
	}
}

// Told to stop with datagrams in flight (their batch waits for a lock,
// more are queued behind it), the server answers each (retry-later: the
// batch times out, or the server stops before writing it) and Run
// returns.
func TestDatagramStop(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	reg := prometheus.NewRegistry()
	srv, addr, stop := servertest.Run(t, db.DB, server.Config{FlushTimeout: time.Second, RetryPushback: 300 * time.Millisecond, Flushers: 1, Registerer: reg})
	e := &env{t: t, db: db, s: bmdbtest.Session(t, db, "test", time.Minute), srv: srv, endpoint: addr, reg: reg}
	id, key := e.machine()
	g := e.grantOf(id, key)
	k := keyOf(t, g)
	ag := e.udp()
	before := e.rows(id)
	blockWrites(t, db)
	const n = 20
	ag.send(request(id, key, g.GetCounterFloor()+1, 0, k))
	waitForWrites(t, db, 1, nil)
	for i := range uint64(n - 1) {
		ag.send(request(id, key, g.GetCounterFloor()+2+i, 0, k))
	}
	// A datagram still in the socket's buffer when the readers stop is
	// never read (nor answered: the agent resends); these have all been
	// read once the buffer is empty.
	port := srv.DatagramAddr().(*net.UDPAddr).Port
	bmdbtest.WaitFor(t, 10*time.Second, "the server reads the datagrams", func(context.Context) (bool, error) {
		q, err := udpReceiveQueue(port)
		return q == 0, err
	})
	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	answered := map[uint64]bool{}
	buf := make([]byte, 1500)
	for len(answered) < n {
		if err := ag.conn.SetReadDeadline(time.Now().Add(30 * time.Second)); err != nil {
			t.Fatal(err)
		}
		m, err := ag.conn.Read(buf)
		if err != nil {
			t.Fatalf("%d of %d datagrams in flight answered: %v", len(answered), n, err)
		}
		r, err := pulse.OpenReply(buf[:m], k)
		if err != nil {
			t.Fatal(err)
		}
		if r.Status != pulse.StatusRetryLater {
			t.Errorf("counter %d: %v, want retry-later", r.Counter, r.Status)
		}
		answered[r.Counter] = true
	}
	if err := <-stopped; err != nil {
		t.Errorf("stopping with datagrams in flight: %v", err)
	}
	if after := e.rows(id); after != before {
		t.Errorf("rows changed: %s -> %s", before, after)
	}
}

// NoDatagrams: no UDP socket, no grant; TLS heartbeats work as before.
func TestNoDatagrams(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{NoDatagrams: true})
	if a := e.srv.DatagramAddr(); a != nil {
		t.Errorf("a datagram socket on %s with NoDatagrams", a)
	}
	id, key := e.machine()
	if g := e.grantOf(id, key); g != nil {
		t.Error("a grant with NoDatagrams")
	}
}

// udpReceiveQueue is the bytes waiting in the receive buffer of the UDP
// socket bound to port on 127.0.0.1 (from /proc/net/udp).
func udpReceiveQueue(port int) (int64, error) {
	data, err := os.ReadFile("/proc/net/udp")
	if err != nil {
		return 0, err
	}
	local := fmt.Sprintf("0100007F:%04X", port)
	for l := range strings.Lines(string(data)) {
		f := strings.Fields(l)
		if len(f) > 4 && f[1] == local {
			_, rx, ok := strings.Cut(f[4], ":")
			if !ok {
				return 0, fmt.Errorf("queue field %q", f[4])
			}
			return strconv.ParseInt(rx, 16, 64)
		}
	}
	return 0, fmt.Errorf("no UDP socket on %s in /proc/net/udp", local)
}

// By default the datagram socket takes the TLS listener's host and port.
func TestDatagramListenDefault(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	// A port free for TCP and for UDP, as far as can be known.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	srv, err := server.New(server.Config{Listen: fmt.Sprintf("127.0.0.1:%d", port), DataDir: t.TempDir()}, db.DB)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := srv.Listen(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := srv.Run(ctx); err != nil { // closes what Listen opened
		t.Fatal(err)
	}
	if got := srv.DatagramAddr().String(); got != fmt.Sprintf("127.0.0.1:%d", port) {
		t.Errorf("datagram address %s, want the TLS address 127.0.0.1:%d over UDP", got, port)
	}
}

// A server that cannot read the datagram secret as it starts (the
// database is down) serves TLS heartbeats without grants, and ignores
// datagrams, until it reads the secret in the background; then it grants.
func TestDatagramSecretReadLate(t *testing.T) {
	t.Parallel()
	db, proxy := bmdbtest.NewBehindProxy(t, bmdb.Config{})
	e := &env{t: t, db: db, s: bmdbtest.Session(t, db, "test", time.Minute)}
	id, key := e.machine()
	proxy.SetMode(tcpproxy.Blackhole)
	e.reg = prometheus.NewRegistry()
	e.srv, e.endpoint = servertest.Start(t, db.DB, server.Config{FlushTimeout: time.Second, Registerer: e.reg})
	// A datagram with the right MAC, while the server has no secret:
	// ignored, and counted.
	direct, err := bmdb.Open(t.Context(), bmdb.Config{URL: db.URL})
	if err != nil {
		t.Fatal(err)
	}
	defer direct.Close()
	secret, err := direct.DatagramSecret(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	k := pulse.DeriveKey(secret, id, key.Public().(ed25519.PublicKey))
	ag := e.udp()
	ag.send(request(id, key, 1, 0, &k))
	waitCounts(t, e.reg, map[string]float64{"unavailable": 1, "accepted": 0})
	proxy.SetMode(tcpproxy.Pass)
	bmdbtest.WaitFor(t, 30*time.Second, "a TLS heartbeat carries a grant", func(context.Context) (bool, error) {
		resp, err := e.heartbeat(e.client(id, key), &agentv1.HeartbeatRequest{MachineId: id.String()})
		return resp.GetDatagramGrant() != nil, err
	})
	if r := ag.roundTrip(id, key, 2, 0, &k); r.Status != pulse.StatusRecorded {
		t.Errorf("a datagram once the secret is read: %v, want recorded", r.Status)
	}
}

// A datagram of a key the server has not seen accepted waits in the
// bounded queue; when that is full, it is answered retry-later at once.
func TestDatagramBusy(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{MaxBatch: 1, Flushers: 1, RetryPushback: 300 * time.Millisecond})
	secret, err := e.db.DatagramSecret(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	// Machines started after the server read the fleet's keys, and never
	// heartbeating over TLS: their keys are not verified. Run reads the keys
	// before it serves, while servertest.Start returns at once: a machine
	// added before the read is verified, and its datagram queues where a
	// full queue waits instead of refusing (seen once in CI, under load).
	// Another machine's TLS heartbeat, answered, shows the read is done.
	e.grantOf(e.machine())
	type agent struct {
		id  uuid.UUID
		key ed25519.PrivateKey
		k   pulse.Key
	}
	var agents []agent
	for range 3 {
		id, key := e.machine()
		agents = append(agents, agent{id, key, pulse.DeriveKey(secret, id, key.Public().(ed25519.PublicKey))})
	}
	ag := e.udp()
	blockWrites(t, e.db)
	// The first is written (and waits for the lock); of the other two
	// (read by two readers, in either order) one fills the queue and the
	// other finds it full, and is the one answered.
	ag.send(request(agents[0].id, agents[0].key, 1, 0, &agents[0].k))
	waitForWrites(t, e.db, 1, nil)
	ag.send(request(agents[1].id, agents[1].key, 1, 0, &agents[1].k))
	ag.send(request(agents[2].id, agents[2].key, 2, 0, &agents[2].k))
	buf := make([]byte, 1500)
	if err := ag.conn.SetReadDeadline(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	n, err := ag.conn.Read(buf)
	if err != nil {
		t.Fatalf("no answer to either datagram: %v", err)
	}
	r, err := pulse.OpenReply(buf[:n], &agents[1].k)
	if err != nil {
		r, err = pulse.OpenReply(buf[:n], &agents[2].k)
	}
	if err != nil {
		t.Fatalf("the answer opens under neither key: %v", err)
	}
	if r.Status != pulse.StatusRetryLater || r.NextIn != 300*time.Millisecond {
		t.Errorf("a datagram finding the queue full: %+v, want retry-later in 300ms", r)
	}
	waitCounts(t, e.reg, map[string]float64{"busy": 1})
}

// Unbatched (the benchmark's baseline) writes each datagram's heartbeat
// in a transaction of its own, and answers it.
func TestDatagramUnbatched(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{Unbatched: true})
	id, key := e.machine()
	g := e.grantOf(id, key)
	k := keyOf(t, g)
	ag := e.udp()
	before := e.rows(id)
	for i := range uint64(3) {
		if r := ag.roundTrip(id, key, g.GetCounterFloor()+1+i, 0, k); r.Status != pulse.StatusRecorded {
			t.Errorf("datagram %d: %v, want recorded", i, r.Status)
		}
	}
	if after := e.rows(id); after == before {
		t.Error("the datagrams did not move the heartbeat time")
	}
	waitCounts(t, e.reg, map[string]float64{"accepted": 4, "batches": 4})
}
