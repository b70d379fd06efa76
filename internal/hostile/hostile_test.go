package hostile_test

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
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
	"github.com/shepherd/shepherd/internal/hostile"
	"github.com/shepherd/shepherd/internal/tcpproxy"
	"github.com/shepherd/shepherd/server"
	"github.com/shepherd/shepherd/server/servertest"
)

func TestMain(m *testing.M) { bmdbtest.Main(m) }

// env is a real callback server with its own database.
type env struct {
	t        *testing.T
	db       *bmdbtest.DB
	s        *bmdb.Session
	srv      *server.Server
	endpoint string
}

func start(t *testing.T, cfg server.Config) *env {
	t.Helper()
	db := bmdbtest.New(t)
	srv, endpoint := servertest.Start(t, db.DB, cfg)
	return &env{t: t, db: db, s: bmdbtest.Session(t, db, "test", time.Minute), srv: srv, endpoint: endpoint}
}

// caPEM is the server's CA in PEM.
func (e *env) caPEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: e.srv.CA()})
}

// machine adds a machine whose agent was started with a fresh key.
func (e *env) machine() (uuid.UUID, ed25519.PrivateKey) {
	e.t.Helper()
	id := bmdbtest.AddMachine(e.t, e.db, e.s, "p")
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		e.t.Fatal(err)
	}
	err = e.s.Transact(e.t.Context(), func(ctx context.Context, tx *bmdb.Tx) error { return tx.SetAgentStarted(ctx, id, pub) })
	if err != nil {
		e.t.Fatal(err)
	}
	return id, priv
}

// client is an honest agent's client. It connects from 127.0.0.2, so that
// the hostile client's connections from 127.0.0.1 count against another
// address's per-IP limit, as they would on a real network.
func (e *env) client(id uuid.UUID, key ed25519.PrivateKey) agentv1connect.AgentCallbackServiceClient {
	e.t.Helper()
	tlsCfg, err := agent.ClientTLS(id.String(), e.endpoint, e.srv.CA(), key)
	if err != nil {
		e.t.Fatal(err)
	}
	d := &net.Dialer{Timeout: 10 * time.Second, LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}
	tr := &http.Transport{TLSClientConfig: tlsCfg, ForceAttemptHTTP2: true, DialContext: d.DialContext, TLSHandshakeTimeout: 10 * time.Second}
	e.t.Cleanup(tr.CloseIdleConnections)
	return agentv1connect.NewAgentCallbackServiceClient(&http.Client{Transport: tr}, "https://"+e.endpoint, connect.WithGRPC())
}

func heartbeat(ctx context.Context, c agentv1connect.AgentCallbackServiceClient, req *agentv1.HeartbeatRequest) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err := c.Heartbeat(ctx, connect.NewRequest(req))
	return err
}

// rows snapshots every row a heartbeat may write for a machine, and its
// agent.
func (e *env) rows(id uuid.UUID) string {
	e.t.Helper()
	return bmdbtest.Scalar[string](e.t, e.db, `SELECT
		coalesce((SELECT to_jsonb(r)::text FROM machine_agent_started r WHERE machine_id = $1), '-') || '|' ||
		coalesce((SELECT to_jsonb(r)::text FROM machine_agent_heartbeat r WHERE machine_id = $1), '-') || '|' ||
		coalesce((SELECT to_jsonb(r)::text FROM machine_hardware_report r WHERE machine_id = $1), '-') || '|' ||
		coalesce((SELECT to_jsonb(r)::text FROM machine_os_installation_report r WHERE machine_id = $1), '-') || '|' ||
		coalesce((SELECT to_jsonb(r)::text FROM machine_provided r WHERE machine_id = $1), '-')`, id)
}

// The hostile client sends every kind of abuse to a real server; the server
// accepts none of it, leaves the machines it names alone, and keeps serving
// an honest agent.
func TestServerRefusesAllAbuse(t *testing.T) {
	// The per-IP limit is low so that the connection flood exceeds it.
	e := start(t, server.Config{MaxConnectionsPerIP: 32})

	// Targets have agents that heartbeat once, then fall silent.
	var targets []string
	before := map[uuid.UUID]string{}
	for range 3 {
		id, key := e.machine()
		err := heartbeat(t.Context(), e.client(id, key), &agentv1.HeartbeatRequest{MachineId: id.String(),
			AgentVersion: "honest", HardwareReport: &agentv1.HardwareReport{Cpu: &agentv1.CPU{Model: "real", Threads: 8}}})
		if err != nil {
			t.Fatal(err)
		}
		targets = append(targets, id.String())
		before[id] = e.rows(id)
	}
	honestID, honestKey := e.machine()
	honest := e.client(honestID, honestKey)
	if err := heartbeat(t.Context(), honest, &agentv1.HeartbeatRequest{MachineId: honestID.String()}); err != nil {
		t.Fatal(err)
	}

	var mem runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&mem)
	heapBefore := mem.HeapInuse

	// Each kind must be heard and refused for what it is.
	want := map[string]string{
		hostile.KindForeignID:     "unauthenticated",
		hostile.KindUnknownID:     "unauthenticated",
		hostile.KindNoCertificate: "unauthenticated",
		hostile.KindWrongKeyType:  "unauthenticated",
		hostile.KindInvalidID:     "invalid_argument",
		hostile.KindInvalidText:   "invalid_argument",
		hostile.KindMalformed:     "invalid_argument",
		hostile.KindOversized:     "resource_exhausted",
	}
	heard := func(r hostile.Result) bool {
		for k, code := range want {
			if r.Answers[k][code] == 0 {
				return false
			}
		}
		return r.Refused > 0 && answered(r, hostile.KindFlood) > 0
	}

	honestCtx, stopHonest := context.WithCancel(t.Context())
	defer stopHonest()
	var (
		wg                   sync.WaitGroup
		honestSent, refusals int
		firstRefusal         error
	)
	wg.Go(func() {
		for honestCtx.Err() == nil {
			// The request outlives the run's end: an answer cut short by
			// the test's end is not a refusal.
			err := heartbeat(t.Context(), honest, &agentv1.HeartbeatRequest{MachineId: honestID.String(), AgentVersion: "honest"})
			honestSent++
			if err != nil {
				refusals++
				if firstRefusal == nil {
					firstRefusal = err
				}
			}
		}
	})
	// Runs of 2 s, until every kind was heard: on a loaded machine one run
	// may not get through them all.
	res := hostile.Result{Sent: map[string]int64{}, Codes: map[string]int64{}, Answers: map[string]map[string]int64{},
		Variants: map[string]map[string]int64{}, KindErrors: map[string]int64{}}
	giveUp := time.Now().Add(60 * time.Second)
	for round := 1; ; round++ {
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
		r, err := hostile.Run(ctx, hostile.Config{
			Endpoint:        e.endpoint,
			CA:              e.caPEM(),
			Targets:         targets,
			HeldConnections: 48,
			ConnFloodFrom:   "127.0.0.3",
		})
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		merge(&res, r)
		t.Logf("round %d: sent %v; answers %v; errors %v %v; refused connections %d",
			round, r.Sent, r.Answers, r.KindErrors, r.LastErrors, r.Refused)
		if heard(res) || time.Now().After(giveUp) {
			break
		}
	}
	stopHonest()
	wg.Wait()
	for v, codes := range res.Variants {
		t.Logf("%s: %v", v, codes)
	}

	for _, k := range hostile.Kinds() {
		if res.Sent[k] == 0 {
			t.Errorf("sent no %s", k)
		}
	}
	if res.Accepted != 0 {
		t.Errorf("BREACH: the server answered OK to %d hostile requests: %v", res.Accepted, res.Answers)
	}
	for k, code := range want {
		if res.Answers[k][code] == 0 {
			t.Errorf("%s: no %s answer among %v", k, code, res.Answers[k])
		}
	}
	if res.Refused == 0 {
		t.Errorf("no connection over the per-IP limit was refused: the connection flood did not exceed it")
	}
	if answered(res, hostile.KindFlood) == 0 {
		t.Errorf("no flood stream was answered")
	}

	if honestSent == 0 {
		t.Error("the honest agent sent nothing")
	}
	if refusals > 0 {
		t.Errorf("%d of %d honest heartbeats failed during the abuse; first: %v", refusals, honestSent, firstRefusal)
	}
	// The server, in this process, holds no memory for what it refused
	// (an oversized request claims 1 GiB).
	runtime.GC()
	runtime.ReadMemStats(&mem)
	if grown := int64(mem.HeapInuse) - int64(heapBefore); grown > 256<<20 {
		t.Errorf("the heap grew by %d MiB during the abuse", grown>>20)
	}
	for id, rows := range before {
		if got := e.rows(id); got != rows {
			t.Errorf("machine %s changed under forged heartbeats:\nbefore %s\nafter  %s", id, rows, got)
		}
	}
}

// answered is how many answers the server gave to kind.
func answered(r hostile.Result, kind string) int64 {
	var n int64
	for _, v := range r.Answers[kind] {
		n += v
	}
	return n
}

// merge adds the counts of r to into.
func merge(into *hostile.Result, r hostile.Result) {
	add := func(into, m map[string]int64) {
		for k, v := range m {
			into[k] += v
		}
	}
	addNested := func(into, m map[string]map[string]int64) {
		for k, v := range m {
			if into[k] == nil {
				into[k] = map[string]int64{}
			}
			add(into[k], v)
		}
	}
	add(into.Sent, r.Sent)
	add(into.Codes, r.Codes)
	add(into.KindErrors, r.KindErrors)
	addNested(into.Answers, r.Answers)
	addNested(into.Variants, r.Variants)
	into.Accepted += r.Accepted
	into.Errors += r.Errors
	into.Refused += r.Refused
}

// hostileGoroutines lists the goroutines running this package's code.
func hostileGoroutines() []string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var found []string
	for g := range strings.SplitSeq(string(buf), "\n\n") {
		if strings.Contains(g, "shepherd/internal/hostile.") && !strings.Contains(g, "hostile_test.") {
			found = append(found, g)
		}
	}
	return found
}

// Run returns promptly after its context ends, even while the server
// answers nothing (connections accepted, bytes swallowed), and leaves no
// goroutine of its own behind.
func TestRunStopsWhileServerBlackholes(t *testing.T) {
	e := start(t, server.Config{})
	proxy, err := tcpproxy.Start(e.endpoint)
	if err != nil {
		t.Fatal(err)
	}
	defer proxy.Close()
	proxy.SetMode(tcpproxy.Blackhole)

	const timeout = time.Second
	ctx, cancel := context.WithTimeout(t.Context(), 2500*time.Millisecond)
	defer cancel()
	res, err := hostile.Run(ctx, hostile.Config{
		Endpoint:       proxy.Addr(),
		ServerName:     "127.0.0.1",
		CA:             e.caPEM(),
		Targets:        []string{uuid.NewString()},
		RequestTimeout: timeout,
	})
	late := time.Since(deadline(t, ctx))
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("returned %s after ctx ended; sent %v; answers %v; errors %d", late, res.Sent, res.Answers, res.Errors)
	// Everything in flight is bound to ctx; the request timeout bounds
	// what is not. Slack for -race on a loaded machine.
	if bound := 2*timeout + time.Second; late > bound {
		t.Errorf("Run returned %s after its context ended, want within %s", late, bound)
	}
	if res.Accepted != 0 || len(res.Codes) != 0 {
		t.Errorf("answers from a black hole: accepted %d, codes %v", res.Accepted, res.Codes)
	}
	if res.Sent[hostile.KindUnknownID] == 0 {
		t.Error("no request was sent: nothing was in flight when the context ended")
	}
	// Connections it dialed are closed; their readers end shortly after.
	bmdbtest.WaitFor(t, 10*time.Second, "the hostile client's goroutines end", func(context.Context) (bool, error) {
		return len(hostileGoroutines()) == 0, nil
	})
}

func deadline(t *testing.T, ctx context.Context) time.Time {
	t.Helper()
	d, ok := ctx.Deadline()
	if !ok {
		t.Fatal("no deadline")
	}
	return d
}

// A server that answers OK to everything is caught: every kind counts OK
// answers as accepted. (Without this, Accepted == 0 could mean that the
// client never recognises an OK.)
func TestAcceptingServerIsBreach(t *testing.T) {
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/grpc")
		_, _ = w.Write([]byte{0, 0, 0, 0, 0}) // an empty HeartbeatResponse
		w.Header().Set(http.TrailerPrefix+"Grpc-Status", "0")
	}))
	srv.EnableHTTP2 = true
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the connection flood's closes
	srv.StartTLS()
	defer srv.Close()

	okEverywhere := func(r hostile.Result) bool {
		for _, k := range hostile.Kinds() {
			if k != hostile.KindConnFlood && r.Answers[k]["ok"] == 0 {
				return false
			}
		}
		return true
	}
	res := hostile.Result{Sent: map[string]int64{}, Codes: map[string]int64{}, Answers: map[string]map[string]int64{},
		Variants: map[string]map[string]int64{}, KindErrors: map[string]int64{}}
	// Rounds of 1 s, until every kind was answered: on a loaded machine
	// one may not get through them all.
	giveUp := time.Now().Add(30 * time.Second)
	for !okEverywhere(res) && time.Now().Before(giveUp) {
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		r, err := hostile.Run(ctx, hostile.Config{
			Endpoint:         srv.Listener.Addr().String(),
			CA:               pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}),
			Targets:          []string{uuid.NewString()},
			Connections:      2,
			FloodConnections: 1,
			HeldConnections:  2,
			OversizeBytes:    1 << 20,
		})
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		merge(&res, r)
	}
	t.Logf("answers %v; errors %d", res.Answers, res.Errors)
	var sum int64
	for _, k := range hostile.Kinds() {
		if k != hostile.KindConnFlood && res.Answers[k]["ok"] == 0 {
			t.Errorf("%s: OK answers not counted: %v", k, res.Answers[k])
		}
		sum += res.Answers[k]["ok"]
	}
	if res.Accepted == 0 || res.Accepted != sum || res.Codes["ok"] != sum {
		t.Errorf("accepted %d, codes %v, OK answers by kind sum to %d", res.Accepted, res.Codes, sum)
	}
}

// A bad configuration is an error, not a run.
func TestRunRejectsBadConfig(t *testing.T) {
	for _, cfg := range []hostile.Config{
		{},
		{Endpoint: "no-port"},
		{Endpoint: "127.0.0.1:1", CA: []byte("not a certificate")},
		{Endpoint: "127.0.0.1:1", Rate: -1},
	} {
		if _, err := hostile.Run(t.Context(), cfg); err == nil {
			t.Errorf("Run(%+v) = nil error", cfg)
		}
	}
}
