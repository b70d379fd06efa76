package agent_test

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/google/uuid"
	"google.golang.org/protobuf/proto"

	"github.com/shepherd/shepherd/agent"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/server"
	"github.com/shepherd/shepherd/server/servertest"
)

// The tests in this file run the agent binary against the real callback
// server, with heartbeat datagrams, and PostgreSQL. The agent reaches the
// server's TLS port through a tlsCounter, which counts its connections:
// that is how they see which way heartbeats travel.

// tlsCounter forwards the TCP connections it accepts to the callback
// server, counting them.
type tlsCounter struct {
	ln          net.Listener
	target      string
	total, open atomic.Int64
}

// newTLSCounter listens on host with a free port and forwards to target.
func newTLSCounter(t *testing.T, host, target string) *tlsCounter {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		t.Fatal(err)
	}
	c := &tlsCounter{ln: ln, target: target}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			c.total.Add(1)
			c.open.Add(1)
			go c.forward(conn.(*net.TCPConn))
		}
	}()
	return c
}

func (c *tlsCounter) forward(in *net.TCPConn) {
	defer c.open.Add(-1)
	defer in.Close()
	out, err := net.Dial("tcp", c.target)
	if err != nil {
		return
	}
	defer out.Close()
	done := make(chan struct{}, 2)
	pipe := func(dst, src *net.TCPConn) {
		_, _ = io.Copy(dst, src)
		_ = dst.CloseWrite()
		done <- struct{}{}
	}
	go pipe(out.(*net.TCPConn), in)
	go pipe(in, out.(*net.TCPConn))
	<-done
	<-done
}

// addr is the endpoint agents are given.
func (c *tlsCounter) addr() string { return c.ln.Addr().String() }

// datagramFleet is a fleet whose agents reach the server through a
// tlsCounter on host.
func datagramFleet(t *testing.T, cfg server.Config, host string) (*fleet, *tlsCounter) {
	t.Helper()
	db := bmdbtest.New(t)
	cfg.HeartbeatInterval = 200 * time.Millisecond
	cfg.Hosts = []string{"127.0.0.1", host}
	srv, endpoint := servertest.Start(t, db.DB, cfg)
	c := newTLSCounter(t, host, endpoint)
	return &fleet{t: t, db: db, s: bmdbtest.Session(t, db, "test", time.Minute), srv: srv, endpoint: c.addr()}, c
}

// startAgent takes the machine over with the agent binary, records its
// key as the initializer does, and waits until its hardware report is
// stored: from then on it has no report to deliver.
func startAgent(t *testing.T, f *fleet, id uuid.UUID, args ...string) (stateDir string) {
	t.Helper()
	stateDir = t.TempDir()
	resp, _ := takeover(t, stateDir, f.init(id), args...)
	ok := successOf(t, resp)
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error { return tx.SetAgentStarted(ctx, id, ok.GetPublicKey()) })
	bmdbtest.WaitFor(t, 30*time.Second, "hardware report", func(ctx context.Context) (bool, error) {
		_, err := f.db.GetHardwareReport(ctx, id)
		return err == nil, nil
	})
	return stateDir
}

// waitNoConnection waits until the agent holds no connection to the server.
func waitNoConnection(t *testing.T, c *tlsCounter) {
	t.Helper()
	bmdbtest.WaitFor(t, 30*time.Second, "the agent's TLS connection closed", func(context.Context) (bool, error) {
		return c.open.Load() == 0, nil
	})
}

// TestHeartbeatDatagrams: once the first accepted heartbeat (over TLS)
// granted datagrams and stored the hardware report, the agent's heartbeats
// move the heartbeat time without a TLS connection, open or new; a
// pending installation makes it call over TLS, install, and deliver the
// report; then heartbeats are datagrams again.
func TestHeartbeatDatagrams(t *testing.T) {
	t.Parallel()
	f, c := datagramFleet(t, server.Config{}, "127.0.0.1")
	id := bmdbtest.AddMachine(t, f.db, f.s, "p")
	targets := t.TempDir()
	target := filepath.Join(targets, "disk.img")
	startAgent(t, f, id, "--work-dir", t.TempDir(), "--allow-file-target-dir", targets)

	waitNoConnection(t, c)
	conns := c.total.Load()
	waitHeartbeats(t, f, id, 5)
	if n, open := c.total.Load(), c.open.Load(); n != conns || open != 0 {
		t.Errorf("%d TLS connections made during 5 heartbeats, %d open; want none", n-conns, open)
	}

	images := newImageServer(t, 64<<10)
	raw, err := proto.Marshal(&agentv1.OSInstallationRequest{ImageUrl: images.URL + "/os.img", ImageSha256: images.sha256(), TargetDevice: target})
	if err != nil {
		t.Fatal(err)
	}
	var gen int64
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error {
		gen, err = tx.RequestInstallation(ctx, id, "test", raw)
		return err
	})
	bmdbtest.WaitFor(t, 30*time.Second, "installation report", func(ctx context.Context) (bool, error) {
		in, err := f.db.GetInstallation(ctx, id)
		return err == nil && in.Report != nil && in.Report.Generation == gen, err
	})
	if in, err := f.db.GetInstallation(t.Context(), id); err != nil || !in.Installed() {
		t.Fatalf("installation %+v (%v), want installed", in, err)
	}
	if n := c.total.Load(); n < conns+2 {
		t.Errorf("%d TLS connections for the installation, want at least 2: its request and its report", n-conns)
	}

	waitNoConnection(t, c)
	conns = c.total.Load()
	waitHeartbeats(t, f, id, 5)
	if n, open := c.total.Load(), c.open.Load(); n != conns || open != 0 {
		t.Errorf("%d TLS connections made during 5 heartbeats after the installation, %d open; want none", n-conns, open)
	}
	if n := images.downloads.Load(); n != 1 {
		t.Errorf("%d downloads, want 1", n)
	}
}

// TestDatagramsBlackHoled: datagrams to the server's port are dropped on
// the way (here: they reach a socket that never answers), as behind a
// firewall that passes only TCP. The agent falls back to TLS after each
// grant's tries; after the second such grant it takes UDP for blocked and
// heartbeats over one kept TLS connection, sending no more datagrams; the
// machine keeps heartbeating throughout.
func TestDatagramsBlackHoled(t *testing.T) {
	t.Parallel()
	// The agent's server endpoint is on 127.0.0.3, where the server's
	// datagram port leads to a sink instead of the server (on 127.0.0.1).
	const host = "127.0.0.3"
	f, c := datagramFleet(t, server.Config{}, host)
	sink, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.ParseIP(host), Port: f.srv.DatagramAddr().(*net.UDPAddr).Port})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sink.Close() })
	var dropped atomic.Int64
	go func() {
		buf := make([]byte, 1500)
		for {
			if _, err := sink.Read(buf); err != nil {
				return
			}
			dropped.Add(1)
		}
	}()
	id := bmdbtest.AddMachine(t, f.db, f.s, "p")
	startAgent(t, f, id)
	// Each failed grant costs three tries of 2 s before its TLS call.
	bmdbtest.WaitFor(t, 2*time.Minute, "two grants' datagrams black-holed", func(context.Context) (bool, error) {
		return dropped.Load() >= 2*3, nil // three tries a grant
	})
	waitHeartbeats(t, f, id, 2) // the fallback of the second grant, and one on TLS only
	sent, conns := dropped.Load(), c.total.Load()
	waitHeartbeats(t, f, id, 5)
	if n := dropped.Load(); n != sent {
		t.Errorf("%d datagrams sent after UDP was taken for blocked, want none", n-sent)
	}
	if n := c.total.Load(); n != conns {
		t.Errorf("%d TLS connections for 5 heartbeats on TLS only, want 0: the connection is kept", n-conns)
	}
}

// TestNoDatagramsKeepsTheConnection: a server that grants no datagrams (as
// an older one) gets every heartbeat over one kept TLS connection.
func TestNoDatagramsKeepsTheConnection(t *testing.T) {
	t.Parallel()
	f, c := datagramFleet(t, server.Config{NoDatagrams: true}, "127.0.0.1")
	id := bmdbtest.AddMachine(t, f.db, f.s, "p")
	startAgent(t, f, id)
	waitHeartbeats(t, f, id, 5)
	if n, open := c.total.Load(), c.open.Load(); n != 1 || open != 1 {
		t.Errorf("%d TLS connections made, %d open; want one, kept", n, open)
	}
}

// TestOldAgentIgnoresGrant: a client that knows nothing of datagrams (an
// agent from before them, the simulated fleet) keeps heartbeating over TLS
// against a server that grants them.
func TestOldAgentIgnoresGrant(t *testing.T) {
	t.Parallel()
	f, _ := datagramFleet(t, server.Config{}, "127.0.0.1")
	id := bmdbtest.AddMachine(t, f.db, f.s, "p")
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error { return tx.SetAgentStarted(ctx, id, pub) })
	tlsCfg, err := agent.ClientTLS(id.String(), f.endpoint, f.srv.CA(), priv)
	if err != nil {
		t.Fatal(err)
	}
	client := agent.NewCallbackClient(f.endpoint, tlsCfg)
	var last time.Time
	for i := range 3 {
		resp, err := client.Heartbeat(t.Context(), connect.NewRequest(&agentv1.HeartbeatRequest{MachineId: id.String()}))
		if err != nil {
			t.Fatalf("heartbeat %d: %v", i+1, err)
		}
		if resp.Msg.GetDatagramGrant() == nil {
			t.Errorf("heartbeat %d got no grant: the server does not grant datagrams, and this test tests nothing", i+1)
		}
		at, err := f.db.GetAgentHeartbeat(t.Context(), id)
		if err != nil || !at.After(last) {
			t.Errorf("heartbeat %d did not move the heartbeat time (%s, then %s; %v)", i+1, last, at, err)
		}
		last = at
	}
}

// TestRecoveredAgentIsRefused: once a recovery replaced the agent key, the
// old agent's datagrams are refused, and so, as before datagrams, is its
// TLS call: its heartbeats are unauthenticated and record nothing (R6).
func TestRecoveredAgentIsRefused(t *testing.T) {
	t.Parallel()
	f, c := datagramFleet(t, server.Config{}, "127.0.0.1")
	id := bmdbtest.AddMachine(t, f.db, f.s, "p")
	stateDir := startAgent(t, f, id)
	waitNoConnection(t, c)
	waitHeartbeats(t, f, id, 2)
	conns := c.total.Load()

	pub, _, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error { return tx.SetAgentStarted(ctx, id, pub) })
	log := filepath.Join(stateDir, "agent.log")
	refusals := func() int {
		data, err := os.ReadFile(log)
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for l := range strings.Lines(string(data)) {
			if strings.Contains(l, "heartbeat failed, retrying") && strings.Contains(l, "unauthenticated") {
				n++
			}
		}
		return n
	}
	bmdbtest.WaitFor(t, 30*time.Second, "the agent's TLS heartbeats refused as unauthenticated", func(context.Context) (bool, error) {
		return refusals() >= 1, nil
	})
	heartbeat := func() time.Time {
		at, err := f.db.GetAgentHeartbeat(t.Context(), id)
		if err != nil && !errors.Is(err, bmdb.ErrNotFound) {
			t.Fatal(err)
		}
		return at
	}
	at, seen := heartbeat(), refusals()
	bmdbtest.WaitFor(t, 30*time.Second, "another refusal", func(context.Context) (bool, error) {
		return refusals() > seen, nil
	})
	if now := heartbeat(); !now.Equal(at) {
		t.Errorf("the heartbeat time moved from %s to %s after the recovery", at, now)
	}
	if n := c.total.Load(); n <= conns {
		t.Error("no TLS call after the recovery: the refused datagram did not send the agent to TLS")
	}
}
