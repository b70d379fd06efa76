package server_test

import (
	"context"
	"crypto/ed25519"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/google/uuid"

	"github.com/shepherd/shepherd/agent"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/api/agent/v1/agentv1connect"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/server"
)

// blockWrites holds a lock on machine_agent_heartbeat, which every
// heartbeat statement writes, so that heartbeat writes wait in the database
// until release is called (at the latest when the test ends). Reads, and
// the server's recorder check-ins, go on.
func blockWrites(t *testing.T, db *bmdbtest.DB) (release func()) {
	t.Helper()
	tx, err := db.Pool.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(t.Context(), "LOCK TABLE machine_agent_heartbeat IN SHARE MODE"); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	release = func() {
		once.Do(func() {
			if err := tx.Rollback(context.Background()); err != nil {
				t.Errorf("releasing the lock on heartbeat writes: %v", err)
			}
		})
	}
	t.Cleanup(release)
	return release
}

// waitingWrites is how many statements of the test's database wait for the
// lock of blockWrites.
func waitingWrites(ctx context.Context, db *bmdbtest.DB) (int, error) {
	var n int
	err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database
		WHERE d.datname = current_database() AND l.relation = 'machine_agent_heartbeat'::regclass AND NOT l.granted`).Scan(&n)
	return n, err
}

// waitForWrites waits until n heartbeat writes wait for the lock of
// blockWrites. An answer arriving meanwhile fails the test: while writes
// are blocked, none may come.
func waitForWrites(t *testing.T, db *bmdbtest.DB, n int, answers <-chan error) {
	t.Helper()
	bmdbtest.WaitFor(t, 20*time.Second, fmt.Sprintf("%d heartbeat writes wait for the lock", n), func(ctx context.Context) (bool, error) {
		select {
		case err := <-answers:
			t.Fatalf("an answer while heartbeat writes are blocked (%d should wait): %v", n, err)
		default:
		}
		got, err := waitingWrites(ctx, db)
		return got == n, err
	})
}

// conn connects to the server with key and returns a client whose requests
// all share that one HTTP/2 connection, as an agent's do, and the
// connection's local address.
func (e *env) conn(id uuid.UUID, key ed25519.PrivateKey) (agentv1connect.AgentCallbackServiceClient, string) {
	e.t.Helper()
	tlsCfg, err := agent.ClientTLS(id.String(), e.endpoint, e.srv.CA(), key)
	if err != nil {
		e.t.Fatal(err)
	}
	var local string
	tr := &http.Transport{
		TLSClientConfig: tlsCfg,
		Protocols:       new(http.Protocols),
		DialTLSContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := (&tls.Dialer{NetDialer: &net.Dialer{Timeout: 10 * time.Second}, Config: tlsCfg}).DialContext(ctx, network, addr)
			if err == nil {
				local = c.LocalAddr().String()
			}
			return c, err
		},
	}
	tr.Protocols.SetHTTP2(true)
	cc, err := tr.NewClientConn(e.t.Context(), "https", e.endpoint)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { cc.Close() })
	return agentv1connect.NewAgentCallbackServiceClient(oneConn{cc}, "https://"+e.endpoint, connect.WithGRPC()), local
}

// oneConn sends every request on one connection.
type oneConn struct{ cc *http.ClientConn }

func (o oneConn) Do(r *http.Request) (*http.Response, error) { return o.cc.RoundTrip(r) }

// send sends n heartbeats of machine id on c at once; their errors arrive on
// the returned channel as they are answered.
func (e *env) send(c agentv1connect.AgentCallbackServiceClient, id uuid.UUID, n int) <-chan error {
	answers := make(chan error, n)
	for range n {
		go func() {
			_, err := e.heartbeat(c, &agentv1.HeartbeatRequest{MachineId: id.String()})
			answers <- err
		}()
	}
	return answers
}

// setAgentKey gives the machine a new agent key, as a takeover does.
func setAgentKey(t *testing.T, s *bmdb.Session, id uuid.UUID, pub ed25519.PublicKey) {
	t.Helper()
	err := s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error { return tx.SetAgentStarted(ctx, id, pub) })
	if err != nil {
		t.Fatal(err)
	}
}

// An agent sends one request at a time. A connection may have two requests
// of keys the server has not seen accepted in flight; the next is refused
// at once with ResourceExhausted, without waiting for the database, and
// once answered the slots are free again. The keys of the fleet (read at
// start, or seen accepted) are exempt; a key the BMDB refuses loses that,
// and a stranger naming a machine cannot take it from the machine's agent.
func TestRequestsInFlightPerConnection(t *testing.T) {
	t.Parallel()
	// Every heartbeat waits in a batch of its own, so the test sees each
	// one reach the database.
	cfg := server.Config{MaxBatch: 1, Flushers: 4}
	ok := func(e *env, id uuid.UUID, key ed25519.PrivateKey) {
		e.t.Helper()
		if _, err := e.heartbeat(e.client(id, key), &agentv1.HeartbeatRequest{MachineId: id.String()}); err != nil {
			e.t.Fatal(err)
		}
	}
	refused := func(e *env, id uuid.UUID, key ed25519.PrivateKey) {
		e.t.Helper()
		if _, err := e.heartbeat(e.client(id, key), &agentv1.HeartbeatRequest{MachineId: id.String()}); connect.CodeOf(err) != connect.CodeUnauthenticated {
			e.t.Fatalf("heartbeat: %v, want Unauthenticated", err)
		}
	}
	cases := []struct {
		name string
		// agent starts the server and returns whose heartbeats the test
		// sends, and how the server answers them once written.
		agent     func(t *testing.T, db *bmdbtest.DB, cfg server.Config) (*env, uuid.UUID, ed25519.PrivateKey)
		throttled bool
		answer    connect.Code // 0: accepted
	}{
		{"key of no machine", func(t *testing.T, db *bmdbtest.DB, cfg server.Config) (*env, uuid.UUID, ed25519.PrivateKey) {
			e := startOn(t, db, cfg)
			return e, uuid.New(), e.startAgentKeyOnly()
		}, true, connect.CodeUnauthenticated},
		{"agent started before the server", func(t *testing.T, db *bmdbtest.DB, cfg server.Config) (*env, uuid.UUID, ed25519.PrivateKey) {
			s := bmdbtest.Session(t, db, "setup", time.Minute)
			id := bmdbtest.AddMachine(t, db, s, "p")
			pub, key, _ := ed25519.GenerateKey(nil)
			setAgentKey(t, s, id, pub)
			return startOn(t, db, cfg), id, key
		}, false, 0},
		{"agent seen accepted", func(t *testing.T, db *bmdbtest.DB, cfg server.Config) (*env, uuid.UUID, ed25519.PrivateKey) {
			e := startOn(t, db, cfg)
			id, key := e.machine()
			ok(e, id, key)
			return e, id, key
		}, false, 0},
		{"old key of a recovered machine", func(t *testing.T, db *bmdbtest.DB, cfg server.Config) (*env, uuid.UUID, ed25519.PrivateKey) {
			e := startOn(t, db, cfg)
			id, old := e.machine()
			ok(e, id, old)
			e.startAgent(id)
			refused(e, id, old)
			return e, id, old
		}, true, connect.CodeUnauthenticated},
		{"agent of a machine a stranger named", func(t *testing.T, db *bmdbtest.DB, cfg server.Config) (*env, uuid.UUID, ed25519.PrivateKey) {
			e := startOn(t, db, cfg)
			id, key := e.machine()
			ok(e, id, key)
			refused(e, id, e.startAgentKeyOnly())
			return e, id, key
		}, false, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var logs syncBuffer
			cfg := cfg
			cfg.Logger = slog.New(slog.NewTextHandler(&logs, nil))
			db := bmdbtest.New(t)
			e, id, key := tc.agent(t, db, cfg)
			c, local := e.conn(id, key)
			release := blockWrites(t, db)
			const sent = 4
			answers := e.send(c, id, sent)
			inFlight := sent
			if tc.throttled {
				inFlight = 2
				for range sent - inFlight {
					err := <-answers
					var cerr *connect.Error
					if !errors.As(err, &cerr) || cerr.Code() != connect.CodeResourceExhausted || cerr.Message() != "too many requests in flight on this connection" {
						t.Fatalf("a request over the connection's limit: %v, want ResourceExhausted (too many requests in flight)", err)
					}
				}
			}
			waitForWrites(t, db, inFlight, answers)
			release()
			for range inFlight {
				if err := <-answers; code(err) != tc.answer {
					t.Errorf("a request in flight, once written: %v, want code %v", err, tc.answer)
				}
			}
			// Answered requests give their slots back.
			if _, err := e.heartbeat(c, &agentv1.HeartbeatRequest{MachineId: id.String()}); code(err) != tc.answer {
				t.Errorf("the next request on the connection: %v, want code %v", err, tc.answer)
			}

			waitCounts(t, e.reg, map[string]float64{"throttled": float64(sent - inFlight)})
			const msg = `msg="connection sends requests of unverified keys in parallel; refusing"`
			lines := grepLines(logs.String(), msg)
			switch {
			case !tc.throttled && len(lines) > 0:
				t.Errorf("logged %q for a key of the fleet", lines)
			case tc.throttled && (len(lines) != 1 || !strings.Contains(lines[0], "level=WARN") || !strings.Contains(lines[0], " peer="+local)):
				// One line per 10 s, naming the client.
				t.Errorf("log lines about the refusals: %q, want one warning with peer=%s", lines, local)
			}
		})
	}
}

// code is the RPC code of err; 0 for nil.
func code(err error) connect.Code {
	if err == nil {
		return 0
	}
	return connect.CodeOf(err)
}

// grepLines returns the lines of s that contain substr.
func grepLines(s, substr string) []string {
	var out []string
	for l := range strings.Lines(s) {
		if strings.Contains(l, substr) {
			out = append(out, strings.TrimSuffix(l, "\n"))
		}
	}
	return out
}

// Heartbeats of keys the server has not seen accepted wait in a queue of
// MaxBatch; when it is full the next is refused at once with Unavailable and
// a hint to retry soon. The fleet's agents are never refused for it: their
// heartbeats wait in a queue of their own.
func TestUnknownKeysCannotCrowdOutTheFleet(t *testing.T) {
	t.Parallel()
	var logs syncBuffer
	e := start(t, server.Config{MaxBatch: 2, Flushers: 1, RetryPushback: 250 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	id, key := e.machine()
	fleet := e.client(id, key)
	if _, err := e.heartbeat(fleet, &agentv1.HeartbeatRequest{MachineId: id.String()}); err != nil {
		t.Fatal(err)
	}
	release := blockWrites(t, e.db)
	// Each request of an unknown key comes on a connection of its own, as
	// from many clients. The first is written (and waits in the database).
	stranger := func(n int) <-chan error {
		answers := make(chan error, n)
		for range n {
			go func() {
				_, err := e.heartbeat(e.client(uuid.New(), e.startAgentKeyOnly()), &agentv1.HeartbeatRequest{MachineId: uuid.NewString()})
				answers <- err
			}()
		}
		return answers
	}
	first := stranger(1)
	waitForWrites(t, e.db, 1, first)
	// The queue holds two; of four more, two are refused.
	queued := stranger(4)
	for range 2 {
		err := <-queued
		var cerr *connect.Error
		if !errors.As(err, &cerr) || cerr.Code() != connect.CodeUnavailable || cerr.Message() != "busy; try again" {
			t.Fatalf("a request of an unknown key with the queue full: %v, want Unavailable (busy)", err)
		}
		if got := cerr.Meta().Get("grpc-retry-pushback-ms"); got != "250" {
			t.Errorf("retry pushback %q, want \"250\"", got)
		}
	}
	// The agent of the fleet waits for its turn instead.
	fleetAnswer := make(chan error, 1)
	go func() {
		_, err := e.heartbeat(fleet, &agentv1.HeartbeatRequest{MachineId: id.String()})
		fleetAnswer <- err
	}()
	select {
	case err := <-queued:
		t.Fatalf("a third request of an unknown key was answered while the queue could not drain: %v", err)
	default:
	}
	release()
	if err := <-fleetAnswer; err != nil {
		t.Errorf("the fleet's heartbeat while unknown keys filled their queue: %v", err)
	}
	for _, answers := range []<-chan error{first, queued, queued} {
		if err := <-answers; connect.CodeOf(err) != connect.CodeUnauthenticated {
			t.Errorf("a queued request of an unknown key: %v, want Unauthenticated", err)
		}
	}
	waitCounts(t, e.reg, map[string]float64{"busy": 2})
	if lines := grepLines(logs.String(), `msg="too many heartbeats of unverified keys queued; refusing"`); len(lines) != 1 {
		t.Errorf("log lines about the full queue: %q, want one", lines)
	}
}

// Unbatched writes each heartbeat in a statement of its own, however many
// arrive together.
func TestUnbatched(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{Unbatched: true, Flushers: 1})
	const n = 3
	ids := make([]uuid.UUID, n)
	clients := make([]agentv1connect.AgentCallbackServiceClient, n)
	for i := range n {
		var key ed25519.PrivateKey
		ids[i], key = e.machine()
		clients[i] = e.client(ids[i], key)
	}
	release := blockWrites(t, e.db)
	answers := make(chan error, n)
	for i := range n {
		go func() {
			_, err := e.heartbeat(clients[i], &agentv1.HeartbeatRequest{MachineId: ids[i].String()})
			answers <- err
		}()
	}
	waitForWrites(t, e.db, n, answers)
	release()
	for range n {
		if err := <-answers; err != nil {
			t.Error(err)
		}
	}
	waitCounts(t, e.reg, map[string]float64{"accepted": n, "batches": n})
}

// Recovery counts silence only while the server records heartbeats without
// failing: a batch the database fails (here, one that times out on a lock
// while the server's check-ins go through) restarts the server's window; a
// batch that succeeds does not.
func TestFailedBatchesHoldRecoveryBack(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{FlushTimeout: time.Second})
	silent, silentKey := e.machine()
	active, activeKey := e.machine()
	c := e.client(active, activeKey)
	for id, key := range map[uuid.UUID]ed25519.PrivateKey{silent: silentKey, active: activeKey} {
		if _, err := e.heartbeat(e.client(id, key), &agentv1.HeartbeatRequest{MachineId: id.String()}); err != nil {
			t.Fatal(err)
		}
	}
	bmdbtest.WaitFor(t, 10*time.Second, "the server registers as a heartbeat recorder", func(ctx context.Context) (bool, error) {
		var n int64
		err := e.db.Pool.QueryRow(ctx, `SELECT count(*) FROM heartbeat_recorders`).Scan(&n)
		return n == 1, err
	})
	// The server has recorded fine for a day; one machine has been silent
	// for an hour.
	e.db.Exec(t, `UPDATE heartbeat_recorders SET ok_since = now() - interval '1 day'`)
	e.db.Exec(t, `UPDATE machine_agent_heartbeat SET agent_heartbeat_at = now() - interval '1 hour' WHERE machine_id = $1`, silent)
	candidates := func() int64 {
		t.Helper()
		n, err := e.db.CountMatching(t.Context(), bmdb.RecoveryCandidates("p", 0, 0))
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	// checkIn waits for a check-in that began after it was called: the
	// second one to write after that point (the first may have begun just
	// before).
	checkIn := func() {
		t.Helper()
		since := bmdbtest.Scalar[time.Time](t, e.db, `SELECT now()`)
		for range 2 {
			bmdbtest.WaitFor(t, 10*time.Second, "the server checks in", func(ctx context.Context) (bool, error) {
				var at time.Time
				err := e.db.Pool.QueryRow(ctx, `SELECT checked_at FROM heartbeat_recorders`).Scan(&at)
				if at.After(since) {
					since = at
					return true, nil
				}
				return false, err
			})
		}
	}
	if _, err := e.heartbeat(c, &agentv1.HeartbeatRequest{MachineId: active.String()}); err != nil {
		t.Fatal(err)
	}
	checkIn()
	if n := candidates(); n != 1 {
		t.Fatalf("after another agent's heartbeat was recorded: %d recovery candidates, want the silent machine", n)
	}

	release := blockWrites(t, e.db)
	_, err := e.heartbeat(c, &agentv1.HeartbeatRequest{MachineId: active.String()})
	var cerr *connect.Error
	if !errors.As(err, &cerr) || cerr.Code() != connect.CodeUnavailable || cerr.Message() != "recording heartbeat failed; try again" {
		t.Fatalf("heartbeat whose write times out: %v, want Unavailable from the server", err)
	}
	release()
	checkIn()
	if n := candidates(); n != 0 {
		t.Errorf("after a failed batch: %d recovery candidates, want 0 until a heartbeat timeout of good recording has passed", n)
	}
}
