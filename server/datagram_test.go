package server_test

import (
	"crypto/ed25519"
	"net"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/api/agent/pulse"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/server"
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
