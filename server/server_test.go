package server_test

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"
	"google.golang.org/protobuf/proto"

	"github.com/shepherd/shepherd/agent"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/api/agent/v1/agentv1connect"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/eventually"
	"github.com/shepherd/shepherd/server"
	"github.com/shepherd/shepherd/server/servertest"
)

func TestMain(m *testing.M) { bmdbtest.Main(m) }

// env is a running callback server on loopback with its own database.
type env struct {
	t        *testing.T
	db       *bmdbtest.DB
	s        *bmdb.Session
	srv      *server.Server
	endpoint string
	reg      *prometheus.Registry
}

func start(t *testing.T, cfg server.Config) *env {
	t.Helper()
	return startOn(t, bmdbtest.New(t), cfg)
}

// startOn is start with a database the test has prepared.
func startOn(t *testing.T, db *bmdbtest.DB, cfg server.Config) *env {
	t.Helper()
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	srv, endpoint := servertest.Start(t, db.DB, cfg)
	return &env{t: t, db: db, s: bmdbtest.Session(t, db, "test", time.Minute), srv: srv, endpoint: endpoint, reg: reg}
}

// machine adds a machine whose agent was started with a fresh key.
func (e *env) machine() (uuid.UUID, ed25519.PrivateKey) {
	e.t.Helper()
	id := bmdbtest.AddMachine(e.t, e.db, e.s, "p")
	return id, e.startAgent(id)
}

// startAgent gives the machine a new agent key, as a takeover does.
func (e *env) startAgent(id uuid.UUID) ed25519.PrivateKey {
	e.t.Helper()
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		e.t.Fatal(err)
	}
	err = e.s.Transact(e.t.Context(), func(ctx context.Context, tx *bmdb.Tx) error { return tx.SetAgentStarted(ctx, id, pub) })
	if err != nil {
		e.t.Fatal(err)
	}
	return priv
}

// startAgentKeyOnly returns a fresh agent key that no machine has.
func (e *env) startAgentKeyOnly() ed25519.PrivateKey {
	e.t.Helper()
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		e.t.Fatal(err)
	}
	return priv
}

// client connects with key (nil: no client certificate).
func (e *env) client(id uuid.UUID, key ed25519.PrivateKey) agentv1connect.AgentCallbackServiceClient {
	e.t.Helper()
	var tlsCfg *tls.Config
	if key != nil {
		var err error
		if tlsCfg, err = agent.ClientTLS(id.String(), e.endpoint, e.srv.CA(), key); err != nil {
			e.t.Fatal(err)
		}
	} else {
		ca, err := x509.ParseCertificate(e.srv.CA())
		if err != nil {
			e.t.Fatal(err)
		}
		tlsCfg = &tls.Config{RootCAs: x509.NewCertPool(), ServerName: "127.0.0.1", NextProtos: []string{"h2"}}
		tlsCfg.RootCAs.AddCert(ca)
	}
	return agent.NewCallbackClient(e.endpoint, tlsCfg)
}

func (e *env) heartbeat(c agentv1connect.AgentCallbackServiceClient, req *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(e.t.Context(), 10*time.Second)
	defer cancel()
	resp, err := c.Heartbeat(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

// rows snapshots every row the server may write for a machine.
func (e *env) rows(id uuid.UUID) string {
	e.t.Helper()
	return bmdbtest.Scalar[string](e.t, e.db, `SELECT
		coalesce((SELECT agent_heartbeat_at::text FROM machine_agent_heartbeat WHERE machine_id = $1), '-') || '|' ||
		coalesce((SELECT reported_at::text FROM machine_hardware_report WHERE machine_id = $1), '-') || '|' ||
		coalesce((SELECT reported_at::text FROM machine_os_installation_report WHERE machine_id = $1), '-')`, id)
}

func TestHeartbeatAccepted(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{HeartbeatInterval: 7 * time.Second})
	id, key := e.machine()
	report := &agentv1.HardwareReport{
		Cpu:          &agentv1.CPU{Model: "EPYC", Threads: 128},
		MemoryBytes:  1 << 40,
		BlockDevices: []*agentv1.BlockDevice{{Name: "nvme0n1", SizeBytes: 4 << 40}, {Name: "nvme1n1", SizeBytes: 4 << 40}},
	}
	resp, err := e.heartbeat(e.client(id, key), &agentv1.HeartbeatRequest{MachineId: id.String(), HardwareReport: report})
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.GetNextHeartbeatIn().AsDuration(); got != 7*time.Second {
		t.Errorf("next_heartbeat_in = %s, want 7s", got)
	}
	if resp.GetInstallationRequest() != nil {
		t.Errorf("installation request %v, none was made", resp.GetInstallationRequest())
	}
	if _, err := e.db.GetAgentHeartbeat(t.Context(), id); err != nil {
		t.Errorf("no heartbeat row: %v", err)
	}
	hw, err := e.db.GetHardwareReport(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	var stored agentv1.HardwareReport
	if err := proto.Unmarshal(hw.Raw, &stored); err != nil || !proto.Equal(&stored, report) {
		t.Errorf("stored report %v (%v), want %v", &stored, err, report)
	}
	if hw.CPUThreads != 128 || hw.MemoryBytes != 1<<40 || hw.DiskCount != 2 || hw.DiskBytes != 8<<40 {
		t.Errorf("extracted columns %+v", hw)
	}
}

func TestHeartbeatRejected(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{MaxRequestBytes: 16 << 10})
	a, keyA := e.machine()
	b, keyB := e.machine()
	recovered, oldKey := e.machine()
	// Give every machine a heartbeat first, so "no row changed" means the
	// timestamp did not move either.
	for id, key := range map[uuid.UUID]ed25519.PrivateKey{a: keyA, b: keyB, recovered: oldKey} {
		if _, err := e.heartbeat(e.client(id, key), &agentv1.HeartbeatRequest{MachineId: id.String()}); err != nil {
			t.Fatal(err)
		}
	}
	// Recovery replaces AgentStarted: the old key is worthless now.
	e.startAgent(recovered)
	_, stranger := e.machine() // a key that belongs to no machine we use below
	_, strangerKey, _ := ed25519.GenerateKey(rand.Reader)

	huge := &agentv1.HardwareReport{}
	for range 2000 {
		huge.Warnings = append(huge.Warnings, strings.Repeat("x", 100))
	}
	cases := []struct {
		name    string
		machine uuid.UUID // whose rows must not change
		client  agentv1connect.AgentCallbackServiceClient
		req     *agentv1.HeartbeatRequest
		code    connect.Code
	}{
		{"no client certificate", a, e.client(a, nil), &agentv1.HeartbeatRequest{MachineId: a.String()}, connect.CodeUnauthenticated},
		{"key of no machine", a, e.client(a, strangerKey), &agentv1.HeartbeatRequest{MachineId: a.String()}, connect.CodeUnauthenticated},
		{"another machine's key", a, e.client(a, stranger), &agentv1.HeartbeatRequest{MachineId: a.String()}, connect.CodeUnauthenticated},
		{"another machine's id", b, e.client(a, keyA), &agentv1.HeartbeatRequest{MachineId: b.String()}, connect.CodeUnauthenticated},
		{"unknown machine", a, e.client(a, keyA), &agentv1.HeartbeatRequest{MachineId: uuid.NewString()}, connect.CodeUnauthenticated},
		{"key from before a recovery", recovered, e.client(recovered, oldKey), &agentv1.HeartbeatRequest{MachineId: recovered.String()}, connect.CodeUnauthenticated},
		{"oversize request", a, e.client(a, keyA), &agentv1.HeartbeatRequest{MachineId: a.String(), HardwareReport: huge}, connect.CodeResourceExhausted},
		{"machine id not a UUID", a, e.client(a, keyA), &agentv1.HeartbeatRequest{MachineId: "machine-1"}, connect.CodeInvalidArgument},
		{"installation report without generation", a, e.client(a, keyA), &agentv1.HeartbeatRequest{MachineId: a.String(),
			InstallationReport: &agentv1.OSInstallationReport{Result: &agentv1.OSInstallationReport_Success{Success: &agentv1.InstallationSuccess{}}}}, connect.CodeInvalidArgument},
		{"installation report without result", a, e.client(a, keyA), &agentv1.HeartbeatRequest{MachineId: a.String(),
			InstallationReport: &agentv1.OSInstallationReport{Generation: 1}}, connect.CodeInvalidArgument},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before := e.rows(c.machine)
			_, err := e.heartbeat(c.client, c.req)
			if got := connect.CodeOf(err); got != c.code {
				t.Fatalf("error %v (code %v), want code %v", err, got, c.code)
			}
			if after := e.rows(c.machine); after != before {
				t.Errorf("rows of %s changed: %s -> %s", c.machine, before, after)
			}
		})
	}
	// An unknown machine and a wrong key get the same answer.
	_, err1 := e.heartbeat(e.client(a, strangerKey), &agentv1.HeartbeatRequest{MachineId: a.String()})
	_, err2 := e.heartbeat(e.client(a, keyA), &agentv1.HeartbeatRequest{MachineId: uuid.NewString()})
	if err1.Error() != err2.Error() {
		t.Errorf("wrong key says %q, unknown machine says %q", err1, err2)
	}
	// Malformed protobuf.
	raw := agentv1connect.NewAgentCallbackServiceClient(rawHTTPClient(t, e, a, keyA), "https://"+e.endpoint, connect.WithGRPC(), connect.WithCodec(rawCodec{}))
	before := e.rows(a)
	_, err := raw.Heartbeat(t.Context(), connect.NewRequest(&agentv1.HeartbeatRequest{MachineId: "\xff\xff\xff"}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("garbage protobuf: %v, want InvalidArgument", err)
	}
	if after := e.rows(a); after != before {
		t.Errorf("garbage changed rows: %s -> %s", before, after)
	}

	waitCounts(t, e.reg, map[string]float64{
		"no_client_certificate": 1, "unauthenticated": 7, "too_large": 1, "invalid_argument": 4,
	})
}

// waitCounts waits until each of the counts of rejected has its value in
// want. The server counts an RPC once it has answered it, so a count can
// lag the answer a client has just received.
func waitCounts(t *testing.T, reg *prometheus.Registry, want map[string]float64) {
	t.Helper()
	eventually.Holds(t, 10*time.Second, "the server's counts", func(context.Context) (bool, error) {
		got := rejected(t, reg)
		for k, v := range want {
			if got[k] != v {
				return false, fmt.Errorf("%s = %v, want %v (all: %v)", k, got[k], v, got)
			}
		}
		return true, nil
	})
}

// rawCodec sends a request's machine_id bytes as the whole message, to put
// malformed protobuf on the wire.
type rawCodec struct{}

func (rawCodec) Name() string { return "proto" }
func (rawCodec) Marshal(m any) ([]byte, error) {
	return []byte(m.(*agentv1.HeartbeatRequest).GetMachineId()), nil
}
func (rawCodec) Unmarshal(data []byte, m any) error { return proto.Unmarshal(data, m.(proto.Message)) }

func rawHTTPClient(t *testing.T, e *env, id uuid.UUID, key ed25519.PrivateKey) connect.HTTPClient {
	t.Helper()
	tlsCfg, err := agent.ClientTLS(id.String(), e.endpoint, e.srv.CA(), key)
	if err != nil {
		t.Fatal(err)
	}
	return agent.HTTPClient(tlsCfg)
}

func rejected(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		switch mf.GetName() {
		case "shepherd_server_heartbeats_rejected_total":
			for _, m := range mf.GetMetric() {
				out[m.GetLabel()[0].GetValue()] = m.GetCounter().GetValue()
			}
		case "shepherd_server_heartbeats_accepted_total":
			out["accepted"] = mf.GetMetric()[0].GetCounter().GetValue()
		case "shepherd_server_heartbeat_batch_size":
			out["batches"] = float64(mf.GetMetric()[0].GetHistogram().GetSampleCount())
		}
	}
	return out
}

func TestInstallationRequests(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{})
	id, key := e.machine()
	c := e.client(id, key)
	req := &agentv1.OSInstallationRequest{ImageUrl: "https://images.example/os.img", ImageSha256: strings.Repeat("ab", 32), TargetDevice: "/dev/sda", RebootAfter: true}
	raw, err := proto.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	var gen int64
	err = e.s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		gen, err = tx.RequestInstallation(ctx, id, "test", raw)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	resp, err := e.heartbeat(c, &agentv1.HeartbeatRequest{MachineId: id.String()})
	if err != nil {
		t.Fatal(err)
	}
	want := proto.Clone(req).(*agentv1.OSInstallationRequest)
	want.Generation = gen
	if !proto.Equal(resp.GetInstallationRequest(), want) {
		t.Fatalf("installation request %v, want %v", resp.GetInstallationRequest(), want)
	}
	// Reporting on the generation ends the request.
	report := &agentv1.OSInstallationReport{Generation: gen, Result: &agentv1.OSInstallationReport_Error{Error: &agentv1.InstallationError{Message: "checksum mismatch"}}}
	resp, err = e.heartbeat(c, &agentv1.HeartbeatRequest{MachineId: id.String(), InstallationReport: report})
	if err != nil {
		t.Fatal(err)
	}
	if resp.GetInstallationRequest() != nil {
		t.Errorf("request still pending after the report: %v", resp.GetInstallationRequest())
	}
	in, err := e.db.GetInstallation(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	if in.Report == nil || in.Report.Generation != gen || in.Report.Success || in.Report.Error != "checksum mismatch" || in.Installed() {
		t.Errorf("stored installation %+v", in)
	}
}

// TestHeartbeatsShareTransactions sends many heartbeats at once and checks
// that they were written in fewer transactions than requests.
func TestHeartbeatsShareTransactions(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{Flushers: 1})
	const n = 100
	var clients []agentv1connect.AgentCallbackServiceClient
	var ids []uuid.UUID
	for range n {
		id, key := e.machine()
		ids = append(ids, id)
		clients = append(clients, e.client(id, key))
	}
	var g errgroup.Group
	var startLine sync.WaitGroup
	startLine.Add(1)
	for i := range n {
		g.Go(func() error {
			startLine.Wait()
			_, err := e.heartbeat(clients[i], &agentv1.HeartbeatRequest{MachineId: ids[i].String()})
			return err
		})
	}
	startLine.Done()
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	waitCounts(t, e.reg, map[string]float64{"accepted": n})
	m := rejected(t, e.reg)
	if m["batches"] >= n {
		t.Errorf("%v transactions for %d concurrent heartbeats: no batching", m["batches"], n)
	}
	t.Logf("%d heartbeats in %v transactions", n, m["batches"])
}

func TestDevelopmentCAIsReused(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	dir := t.TempDir()
	first, err := server.New(server.Config{DataDir: dir}, db.DB)
	if err != nil {
		t.Fatal(err)
	}
	second, err := server.New(server.Config{DataDir: dir}, db.DB)
	if err != nil {
		t.Fatal(err)
	}
	if string(first.CA()) != string(second.CA()) || len(first.CA()) == 0 {
		t.Error("a restarted server made a new CA: agents taken over before would stop trusting it")
	}
	for name, cfg := range map[string]server.Config{
		"no data dir":       {},
		"cert without key":  {CertFile: "/nonexistent.crt", DataDir: dir},
		"missing cert file": {CertFile: "/nonexistent.crt", KeyFile: "/nonexistent.key"},
		"negative batch":    {DataDir: dir, MaxBatch: -1},
	} {
		if _, err := server.New(cfg, db.DB); err == nil {
			t.Errorf("%s: New succeeded", name)
		}
	}
}
