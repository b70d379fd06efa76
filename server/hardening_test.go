package server_test

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"connectrpc.com/connect"
	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/net/http2"
	"golang.org/x/sync/errgroup"

	"github.com/shepherd/shepherd/agent"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/metricstest"
	"github.com/shepherd/shepherd/internal/tcpproxy"
	"github.com/shepherd/shepherd/server"
	"github.com/shepherd/shepherd/server/servertest"
)

// syncBuffer is a log sink safe for the server's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func errorReport(msg string) *agentv1.OSInstallationReport {
	return &agentv1.OSInstallationReport{Generation: 1,
		Result: &agentv1.OSInstallationReport_Error{Error: &agentv1.InstallationError{Message: msg}}}
}

// A client with any self-signed key and any machine id can send reports
// whose text PostgreSQL cannot store. Such a request may only ever decide
// its own answer: honest agents heartbeating at the same time are never
// refused, and the server's log does not grow with the flood.
func TestPoisonedReportsDoNotFailHonestAgents(t *testing.T) {
	t.Parallel()
	var logs syncBuffer
	e := start(t, server.Config{Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	type agent struct {
		id  uuid.UUID
		key ed25519.PrivateKey
	}
	honest := make([]agent, 10)
	for i := range honest {
		honest[i].id, honest[i].key = e.machine()
	}
	_, hostileKey, _ := ed25519.GenerateKey(rand.Reader)
	poisons := []string{
		"disk\x00gone",
		strings.Repeat("€", 3000), // cut at a byte count, it ends in half a character
	}

	ctx, stop := context.WithCancel(t.Context())
	var hostileSent, hostileUnavailable atomic.Int64
	var hostile sync.WaitGroup
	for w := range 4 {
		hostile.Add(1)
		go func() {
			defer hostile.Done()
			c := e.client(uuid.New(), hostileKey)
			for i := 0; ctx.Err() == nil; i++ {
				rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
				_, err := c.Heartbeat(rctx, connect.NewRequest(&agentv1.HeartbeatRequest{
					MachineId: uuid.NewString(), InstallationReport: errorReport(poisons[(w+i)%len(poisons)])}))
				cancel()
				if ctx.Err() != nil {
					return
				}
				hostileSent.Add(1)
				if connect.CodeOf(err) == connect.CodeUnavailable {
					hostileUnavailable.Add(1)
				}
			}
		}()
	}
	g, gctx := errgroup.WithContext(ctx)
	var honestSent atomic.Int64
	for _, a := range honest {
		g.Go(func() error {
			c := e.client(a.id, a.key)
			for range 30 {
				rctx, cancel := context.WithTimeout(gctx, 10*time.Second)
				// An honest agent's own long non-ASCII error travels too.
				_, err := c.Heartbeat(rctx, connect.NewRequest(&agentv1.HeartbeatRequest{
					MachineId: a.id.String(), InstallationReport: errorReport(strings.Repeat("é€", 1000))}))
				cancel()
				if err != nil {
					return err
				}
				honestSent.Add(1)
			}
			return nil
		})
	}
	err := g.Wait()
	stop()
	hostile.Wait()
	if err != nil {
		t.Fatalf("an honest heartbeat failed during the flood (%d sent before): %v", honestSent.Load(), err)
	}
	if hostileSent.Load() == 0 {
		t.Fatal("the hostile client sent nothing")
	}
	if n := hostileUnavailable.Load(); n > 0 {
		t.Errorf("%d of %d hostile requests got Unavailable: they reached the database as a failure", n, hostileSent.Load())
	}
	for _, a := range honest {
		in, err := e.db.GetInstallation(t.Context(), a.id)
		if err != nil {
			t.Fatal(err)
		}
		msg := in.Report.Error
		if !utf8.ValidString(msg) || len(msg) > 4096 || !strings.HasPrefix(strings.Repeat("é€", 1000), strings.TrimSuffix(msg, "...")) {
			t.Errorf("stored error text of %s is not the agent's text cut on a character boundary: %d bytes, valid UTF-8: %v",
				a.id, len(msg), utf8.ValidString(msg))
		}
	}
	// Each rejection is counted; the log holds a bounded number of lines.
	got := rejected(t, e.reg)
	if got["unauthenticated"] < float64(hostileSent.Load())/2 {
		t.Errorf("rejected = %v after %d hostile requests", got, hostileSent.Load())
	}
	if lines := strings.Count(logs.String(), "\n"); lines > 50 {
		t.Errorf("the server logged %d lines during a %d-request flood, want a bounded number; first lines:\n%s",
			lines, hostileSent.Load(), firstLines(logs.String(), 10))
	}
}

func firstLines(s string, n int) string {
	lines := strings.SplitN(s, "\n", n+1)
	if len(lines) > n {
		lines = lines[:n]
	}
	return strings.Join(lines, "\n")
}

// A server serves exactly as many connections as its limits allow, in
// total and from one address; the next one is closed at once and counted.
// Each connection that closes frees exactly one slot.
func TestConnectionLimits(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		cfg   server.Config
		limit string
		// otherServed: whether another address is served while the
		// first is at the limit.
		otherServed bool
	}{
		{"total", server.Config{MaxConnections: 3}, "total", false},
		{"per IP", server.Config{MaxConnectionsPerIP: 3}, "per_ip", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := start(t, tc.cfg)
			id, key := e.machine()
			tlsCfg, err := agent.ClientTLS(id.String(), e.endpoint, e.srv.CA(), key)
			if err != nil {
				t.Fatal(err)
			}
			var held []net.Conn
			defer func() {
				for _, c := range held {
					c.Close()
				}
			}()
			for range 3 {
				c, err := e.open(tlsCfg, "127.0.0.1")
				if err != nil {
					t.Fatalf("connection %d, within the limit: %v", len(held)+1, err)
				}
				held = append(held, c)
			}
			if c, err := e.open(tlsCfg, "127.0.0.1"); err == nil {
				c.Close()
				t.Fatal("a connection over the limit was served")
			}
			if got := metricstest.Value(t, e.reg, "shepherd_server_connections_refused_total", "limit", tc.limit); got != 1 {
				t.Errorf("connections_refused{limit=%s} = %v, want 1", tc.limit, got)
			}
			c, err := e.open(tlsCfg, "127.0.0.2")
			if (err == nil) != tc.otherServed {
				t.Errorf("a connection from another address at the limit: %v, want served %v", err, tc.otherServed)
			}
			if err == nil {
				c.Close()
			}

			held[0].Close()
			held = held[1:]
			bmdbtest.WaitFor(t, 10*time.Second, "a slot is free again", func(context.Context) (bool, error) {
				c, err := e.open(tlsCfg, "127.0.0.1")
				if err == nil {
					held = append(held, c)
				}
				return err == nil, err
			})
			if c, err := e.open(tlsCfg, "127.0.0.1"); err == nil {
				c.Close()
				t.Fatal("one connection closed, but two more were served")
			}
		})
	}
}

// open connects from the local address ip and speaks HTTP/2 as a client
// does. It returns the connection once the server has answered with its
// SETTINGS, or the error that shows the server closed it.
func (e *env) open(tlsCfg *tls.Config, ip string) (net.Conn, error) {
	d := &net.Dialer{Timeout: 10 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
	c, err := tls.DialWithDialer(d, "tcp", e.endpoint, tlsCfg)
	if err != nil {
		return nil, err
	}
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	fr := http2.NewFramer(c, c)
	_, err = c.Write([]byte(http2.ClientPreface))
	if err == nil {
		err = fr.WriteSettings()
	}
	if err == nil {
		_, err = fr.ReadFrame()
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	_ = c.SetDeadline(time.Time{})
	return c, nil
}

// The server tells every client how many concurrent streams it may open on
// a connection.
func TestMaxConcurrentStreamsAdvertised(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{MaxStreamsPerConnection: 5})
	id, key := e.machine()
	tlsCfg, err := agent.ClientTLS(id.String(), e.endpoint, e.srv.CA(), key)
	if err != nil {
		t.Fatal(err)
	}
	c, err := tls.Dial("tcp", e.endpoint, tlsCfg)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	fr := http2.NewFramer(c, c)
	if err := fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			t.Fatalf("reading the server's SETTINGS: %v", err)
		}
		sf, ok := f.(*http2.SettingsFrame)
		if !ok || sf.IsAck() {
			continue
		}
		v, ok := sf.Value(http2.SettingMaxConcurrentStreams)
		if !ok || v != 5 {
			t.Errorf("SETTINGS_MAX_CONCURRENT_STREAMS = %d (set: %v), want 5", v, ok)
		}
		return
	}
}

// A database that stops answering (a black hole, not a refusal) fails each
// batch at the flush timeout: agents hear Unavailable, with a hint to retry
// soon, instead of waiting for TCP to give up, and the server stops
// promptly.
func TestBlackholedDatabase(t *testing.T) {
	t.Parallel()
	e, proxy, stopServer := startBehindProxy(t)
	id, key := e.machine()
	c := e.client(id, key)
	if _, err := e.heartbeat(c, &agentv1.HeartbeatRequest{MachineId: id.String()}); err != nil {
		t.Fatal(err)
	}

	proxy.SetMode(tcpproxy.Blackhole)
	rctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	_, err := c.Heartbeat(rctx, connect.NewRequest(&agentv1.HeartbeatRequest{MachineId: id.String()}))
	cancel()
	var cerr *connect.Error
	if !errors.As(err, &cerr) || cerr.Code() != connect.CodeUnavailable {
		t.Fatalf("heartbeat while the database black-holes: %v, want Unavailable from the server", err)
	}
	if got := cerr.Meta().Get("grpc-retry-pushback-ms"); got != "300" {
		t.Errorf("retry pushback %q, want \"300\"", got)
	}

	if err := stopServer(); err != nil {
		t.Errorf("stopping while the database black-holes: %v", err)
	}
	proxy.SetMode(tcpproxy.Pass)
}

// startBehindProxy runs a callback server (flush timeout 1 s, retry
// pushback 300 ms) whose database is reached through a proxy the test can
// black-hole. stop ends it and returns Run's error, or an error if it has
// not returned within a minute.
func startBehindProxy(t *testing.T) (e *env, proxy *tcpproxy.Proxy, stop func() error) {
	t.Helper()
	db, proxy := bmdbtest.NewBehindProxy(t, bmdb.Config{})
	reg := prometheus.NewRegistry()
	srv, addr, stop := servertest.Run(t, db.DB, server.Config{FlushTimeout: time.Second, RetryPushback: 300 * time.Millisecond, Registerer: reg})
	return &env{t: t, db: db, s: bmdbtest.Session(t, db, "test", time.Minute), srv: srv, endpoint: addr, reg: reg}, proxy, stop
}

// TestDatabaseOutageIsNotSilence: while the server cannot record heartbeats
// (its database black-holes), the agents' silence is the server's doing and
// must not make any machine a recovery candidate, neither during the outage
// nor for a heartbeat timeout after it (issue 10 item 10: a 20 s outage
// with a 15 s timeout rebooted a healthy machine).
func TestDatabaseOutageIsNotSilence(t *testing.T) {
	t.Parallel()
	e, proxy, stopServer := startBehindProxy(t)
	db := e.db
	direct, err := bmdb.Open(t.Context(), bmdb.Config{URL: db.URL})
	if err != nil {
		t.Fatal(err)
	}
	defer direct.Close()
	id, key := e.machine()
	c := e.client(id, key)
	if _, err := e.heartbeat(c, &agentv1.HeartbeatRequest{MachineId: id.String()}); err != nil {
		t.Fatal(err)
	}
	bmdbtest.WaitFor(t, 10*time.Second, "the server registers as a heartbeat recorder", func(ctx context.Context) (bool, error) {
		var n int64
		err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM heartbeat_recorders`).Scan(&n)
		return n == 1, err
	})
	// Make history: the server has recorded fine for a day, and the
	// machine's last heartbeat is an hour old, so it is silent.
	db.Exec(t, `UPDATE heartbeat_recorders SET ok_since = now() - interval '1 day'`)
	db.Exec(t, `UPDATE machine_agent_heartbeat SET agent_heartbeat_at = now() - interval '1 hour'`)
	candidates := func() int64 {
		n, err := direct.CountMatching(t.Context(), bmdb.RecoveryCandidates("p", 0, 0))
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := candidates(); n != 1 {
		t.Fatalf("a machine silent for an hour with the server recording fine: %d candidates, want 1", n)
	}

	proxy.SetMode(tcpproxy.Blackhole)
	rctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	_, err = c.Heartbeat(rctx, connect.NewRequest(&agentv1.HeartbeatRequest{MachineId: id.String()}))
	cancel()
	if connect.CodeOf(err) != connect.CodeUnavailable {
		t.Fatalf("heartbeat while the database black-holes: %v, want Unavailable", err)
	}
	bmdbtest.WaitFor(t, 20*time.Second, "the outage holds recovery back", func(context.Context) (bool, error) {
		return candidates() == 0, nil
	})

	proxy.SetMode(tcpproxy.Pass)
	bmdbtest.WaitFor(t, 20*time.Second, "the server checks in again, restarting its window", func(ctx context.Context) (bool, error) {
		var ok bool
		err := db.Pool.QueryRow(ctx, `SELECT bool_and(checked_at > now() - interval '2 seconds' AND ok_since > now() - interval '1 minute')
			FROM heartbeat_recorders r JOIN sessions s USING (session_id) WHERE s.closed_at IS NULL AND s.deadline > now()`).Scan(&ok)
		return ok, err
	})
	if n := candidates(); n != 0 {
		t.Errorf("right after the outage: %d candidates, want 0 until a heartbeat timeout of good recording has passed", n)
	}

	if err := stopServer(); err != nil {
		t.Error(err)
	}
}
