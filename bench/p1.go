package main

import (
	"bufio"
	"context"
	"crypto/ed25519"
	"crypto/sha256"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/shepherd/shepherd/agent"
	"github.com/shepherd/shepherd/api/agent/pulse"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/api/agent/v1/agentv1connect"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/server"
)

// p1Agents are the fleet sizes P1 is measured at.
var p1Agents = []int{1_000, 10_000}

const (
	// p1CeilingShare is the share of the transport-only ceiling (measured
	// in the same run, transportCeiling) the server must reach (SPEC §7).
	p1CeilingShare = 0.8
	p1Warmup       = 3 * time.Second
	p1Measure      = 10 * time.Second
	// p1BaselineMeasure is the baseline's shorter window: a reference
	// rate, steady within a second of the warm-up, whose runs took 26 s
	// of make bench's ten minutes at 10 s.
	p1BaselineMeasure = 5 * time.Second
)

// loadgenMode is the first argument that makes the bench binary a P1 load
// generator instead of the benchmark.
const loadgenMode = "p1-loadgen"

// benchHeartbeats is P1: heartbeats per second accepted by one callback
// server from 1,000 and 10,000 simulated agents, each with its own key,
// behaving as the real agent does: a first heartbeat over TLS (with its
// hardware report) that gets a datagram grant, the TLS connection closed,
// then heartbeats as pulse datagrams from the agent's own UDP socket, back
// to back (each agent waits for the reply to one before sending the
// next); batched, and against a baseline server that writes each heartbeat
// in its own transaction. The agents run in a second process of this
// binary, so that the CPU the server, PostgreSQL and the load generator
// each use can be told apart: all three share this machine's cores.
//
// With BENCH_P1_TLS=1 it also measures agents that do not speak datagrams
// (every heartbeat over a kept TLS connection), against the TLS transport
// ceiling, printed with transport=tls: make bench's ten minutes do not
// leave room for both by default.
func benchHeartbeats(ctx context.Context, e *env) error {
	url, err := e.database(ctx, "p1")
	if err != nil {
		return err
	}
	db, err := bmdb.Open(ctx, bmdb.Config{URL: url, MaxConns: 64})
	if err != nil {
		return err
	}
	defer db.Close()
	if err := raiseFileLimit(slices.Max(p1Agents) + 1000); err != nil {
		return err
	}
	ids, err := newAgents(ctx, db, slices.Max(p1Agents))
	if err != nil {
		return err
	}
	profiles, err := artefactDir("p1")
	if err != nil {
		return err
	}
	transports := []string{transportDatagram}
	if os.Getenv("BENCH_P1_TLS") == "1" {
		transports = append(transports, transportTLS)
	}
	for _, transport := range transports {
		// The ceiling is measured once, with the smallest fleet: it
		// connects in seconds, and a trivial server gets its highest
		// rate from few agents, so the limit it sets for larger fleets
		// is the harder one.
		ceilingAgents := slices.Min(p1Agents)
		ceiling, transportCPU, err := transportCeiling(ctx, ids[:ceilingAgents], transport)
		if err != nil {
			return fmt.Errorf("%d agents, %s transport only: %w", ceilingAgents, transport, err)
		}
		limit := p1CeilingShare * ceiling
		for _, n := range p1Agents {
			profile := filepath.Join(profiles, fmt.Sprintf("cpu-%s-%d.pb.gz", transport, n))
			batched, err := runHeartbeats(ctx, e, db, ids[:n], false, transport, profile, p1Measure)
			if err != nil {
				return fmt.Errorf("%d agents, %s, batched: %w", n, transport, err)
			}
			single, err := runHeartbeats(ctx, e, db, ids[:n], true, transport, "", p1BaselineMeasure)
			if err != nil {
				return fmt.Errorf("%d agents, %s, one transaction each: %w", n, transport, err)
			}
			report("P1", "heartbeats_per_s", batched.perSecond,
				"baseline", single.perSecond, "ratio", batched.perSecond/single.perSecond,
				"limit", limit, "limit_ratio", batched.perSecond/limit, "transport_ceiling", ceiling, "ceiling_agents", ceilingAgents,
				"transport_server_cpu_us", transportCPU,
				"agents", n, "transport", transport, "mean_batch", batched.meanBatch, "p99_ms", batched.p99ms, "rtt_p99_ms", batched.rttP99ms,
				"server_cpu_us", batched.serverCPUus, "postgres_cpu_us", batched.pgCPUus, "loadgen_cpu_us", batched.loadgenCPUus,
				"resends", batched.resends, "no_reply", batched.noReply, "retry_later", batched.retryLater,
				"baseline_server_cpu_us", single.serverCPUus, "baseline_postgres_cpu_us", single.pgCPUus,
				"seconds", p1Measure.Seconds(), "baseline_seconds", p1BaselineMeasure.Seconds(), "profile", profile)
		}
	}
	return nil
}

// agentKey is the key of simulated agent i: derived, so that the load
// generator process can rebuild it from the index alone.
func agentKey(i int) ed25519.PrivateKey {
	seed := sha256.Sum256([]byte("shepherd-bench-agent-" + strconv.Itoa(i)))
	return ed25519.NewKeyFromSeed(seed[:])
}

// newAgents adds n machines whose agents were started with agentKey(i)
// through the BMDB API and returns their ids.
func newAgents(ctx context.Context, db *bmdb.DB, n int) ([]uuid.UUID, error) {
	s, err := db.StartSession(ctx, bmdb.SessionConfig{Component: "bench-setup"})
	if err != nil {
		return nil, err
	}
	defer s.Close(ctx)
	ids := make([]uuid.UUID, 0, n)
	for len(ids) < n {
		chunk := min(1000, n-len(ids))
		var added []uuid.UUID
		err := s.Transact(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
			added = added[:0]
			for i := range chunk {
				k := len(ids) + i
				id, err := tx.AddMachine(ctx, bmdb.Provided{Provider: "sim", ProviderID: fmt.Sprintf("agent-%d", k)})
				if err != nil {
					return err
				}
				if err := tx.SetAgentStarted(ctx, id, agentKey(k).Public().(ed25519.PublicKey)); err != nil {
					return err
				}
				added = append(added, id)
			}
			return nil
		})
		if err != nil {
			return nil, err
		}
		ids = append(ids, added...)
	}
	return ids, nil
}

type heartbeatResult struct {
	perSecond    float64
	meanBatch    float64
	p99ms        float64 // the server's p99 heartbeat latency (its histogram)
	loadgenDone          // what the load generator counted
	serverCPUus  float64 // CPU of the server process per accepted heartbeat
	pgCPUus      float64 // CPU of PostgreSQL per accepted heartbeat
	loadgenCPUus float64 // CPU of the load generator per accepted heartbeat
}

// runHeartbeats starts a callback server, has the load generator connect
// every agent and send heartbeats back to back, and measures what the
// server accepted (and the CPU everyone used) in a measuring window of
// length measure. If profile is not empty, a CPU profile of this process
// (the server and its database client) under the same load is written there
// during the warm-up, so that profiling costs the measured window nothing.
func runHeartbeats(ctx context.Context, e *env, db *bmdb.DB, ids []uuid.UUID, unbatched bool, transport, profile string, measure time.Duration) (heartbeatResult, error) {
	reg := prometheus.NewRegistry()
	dir, err := os.MkdirTemp("", "shepherd-bench-p1-")
	if err != nil {
		return heartbeatResult{}, err
	}
	defer os.RemoveAll(dir)
	srv, err := server.New(server.Config{
		Listen: "127.0.0.1:0", DataDir: dir, Registerer: reg, Unbatched: unbatched, HeartbeatInterval: time.Second,
		// Every agent connects from 127.0.0.1, which the default limit
		// per address (4,096) would refuse beyond that.
		MaxConnectionsPerIP: len(ids),
	}, db)
	if err != nil {
		return heartbeatResult{}, err
	}
	addr, err := srv.Listen()
	if err != nil {
		return heartbeatResult{}, err
	}
	srvCtx, stopSrv := context.WithCancel(ctx)
	srvDone := make(chan error, 1)
	go func() { srvDone <- srv.Run(srvCtx) }()
	defer func() {
		stopSrv()
		<-srvDone
	}()

	connecting := time.Now()
	lg, err := startLoadgen(ctx, dir, addr.String(), srv.CA(), ids, transport)
	if err != nil {
		return heartbeatResult{}, err
	}
	fmt.Fprintf(os.Stderr, "bench: P1: %d agents (%s) started in %s\n", len(ids), transport, time.Since(connecting).Round(time.Second/10))
	defer lg.stop()
	if err := lg.start(); err != nil {
		return heartbeatResult{}, err
	}
	if err := sleepProfiled(ctx, p1Warmup, profile); err != nil {
		return heartbeatResult{}, err
	}
	if err := lg.measure(); err != nil {
		return heartbeatResult{}, err
	}
	acc0, batches0, sum0 := serverCounts(reg)
	srv0, pg0, lg0 := processCPU(), postgresCPU(e.srv.DataDir()), pidCPUOrZero(lg.cmd.Process.Pid)
	start := time.Now()
	sleepCtx(ctx, measure)
	acc1, batches1, sum1 := serverCounts(reg)
	srv1, pg1, lg1 := processCPU(), postgresCPU(e.srv.DataDir()), pidCPUOrZero(lg.cmd.Process.Pid)
	elapsed := time.Since(start)
	p99 := latencyQuantile(reg, 0.99)
	done, err := lg.finish()
	if err != nil {
		return heartbeatResult{}, err
	}
	accepted := acc1 - acc0
	if accepted == 0 {
		return heartbeatResult{}, errors.New("no heartbeat accepted in the measuring window")
	}
	perBeat := func(d time.Duration) float64 { return float64(d.Microseconds()) / accepted }
	res := heartbeatResult{
		perSecond:    accepted / elapsed.Seconds(),
		p99ms:        1000 * p99,
		serverCPUus:  perBeat(srv1 - srv0),
		pgCPUus:      perBeat(pg1 - pg0),
		loadgenCPUus: perBeat(lg1 - lg0),
		loadgenDone:  done,
	}
	if batches1 > batches0 {
		res.meanBatch = (sum1 - sum0) / (batches1 - batches0)
	}
	return res, nil
}

// loadgen is a running load generator process (loadgenMain) whose agents
// are connected and wait for GO.
type loadgen struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *bufio.Scanner
}

// startLoadgen starts the load generator against the server at addr, whose
// certificate the DER CA ca signed, for the agents ids (agent i has key
// agentKey(i)), and returns once every agent has connected and sent one
// heartbeat. Its files go to dir.
func startLoadgen(ctx context.Context, dir, addr string, ca []byte, ids []uuid.UUID, transport string) (*loadgen, error) {
	caPath, idsPath := filepath.Join(dir, "ca.der"), filepath.Join(dir, "agents")
	if err := os.WriteFile(caPath, ca, 0o600); err != nil {
		return nil, err
	}
	var lines strings.Builder
	for _, id := range ids {
		lines.WriteString(id.String() + "\n")
	}
	if err := os.WriteFile(idsPath, []byte(lines.String()), 0o600); err != nil {
		return nil, err
	}
	cmd, stdin, stdout, err := startSelf(ctx, loadgenMode, "-endpoint", addr, "-ca", caPath, "-agents", idsPath, "-transport", transport)
	if err != nil {
		return nil, err
	}
	l := &loadgen{cmd: cmd, stdin: stdin, out: bufio.NewScanner(stdout)}
	if _, err := l.expect("READY"); err != nil {
		l.stop()
		return nil, err
	}
	return l, nil
}

// startSelf starts this bench binary as a child in mode (loadgenMode,
// p5LoadgenMode, ...) with args, its stdin and stdout piped to the caller
// and its stderr to ours.
func startSelf(ctx context.Context, mode string, args ...string) (*exec.Cmd, io.WriteCloser, io.ReadCloser, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, nil, nil, err
	}
	cmd := exec.CommandContext(ctx, exe, append([]string{mode}, args...)...)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, nil, nil, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return nil, nil, nil, err
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, nil, nil, err
	}
	return cmd, stdin, stdout, nil
}

// expect reads the load generator's next line, which must start with word.
func (l *loadgen) expect(word string) (string, error) {
	if !l.out.Scan() {
		return "", fmt.Errorf("load generator ended early (waiting for %s)", word)
	}
	line := l.out.Text()
	if !strings.HasPrefix(line, word) {
		return "", fmt.Errorf("load generator: %s", line)
	}
	return line, nil
}

// start lets the agents send heartbeats back to back.
func (l *loadgen) start() error {
	_, err := io.WriteString(l.stdin, "GO\n")
	return err
}

// loadgenDone is what the load generator said when it stopped.
type loadgenDone struct {
	// All since MEASURE: the p99 of the heartbeats' round trips, the
	// datagrams sent again after a timeout, the heartbeats none of whose
	// datagrams got a reply and the replies that said retry later.
	rttP99ms                     float64
	resends, noReply, retryLater int64
}

// measure tells the load generator that the measuring window starts.
func (l *loadgen) measure() error {
	_, err := io.WriteString(l.stdin, "MEASURE\n")
	return err
}

// finish stops the heartbeats and fails if any of them failed.
func (l *loadgen) finish() (loadgenDone, error) {
	l.stdin.Close()
	line, err := l.expect("DONE")
	if err != nil {
		return loadgenDone{}, err
	}
	var d loadgenDone
	var failures int64
	var first string
	if _, err := fmt.Sscanf(line, "DONE failures=%d rtt_p99_ms=%g resends=%d no_reply=%d retry_later=%d first=%q",
		&failures, &d.rttP99ms, &d.resends, &d.noReply, &d.retryLater, &first); err != nil {
		return loadgenDone{}, fmt.Errorf("load generator: %q: %w", line, err)
	}
	if failures > 0 {
		return loadgenDone{}, fmt.Errorf("load generator: %s", line)
	}
	return d, nil
}

// stop ends the load generator and waits for it.
func (l *loadgen) stop() {
	l.stdin.Close()
	_ = l.cmd.Wait()
}

func pidCPUOrZero(pid int) time.Duration {
	cpu, _, err := pidCPU(pid)
	if err != nil {
		return 0
	}
	return cpu
}

// readAgents reads a load generator's agents file (one machine id per line)
// and raises the process's file limit for a connection per agent.
func readAgents(path string) ([]string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	ids := strings.Fields(string(data))
	if err := raiseFileLimit(len(ids) + 1000); err != nil {
		return nil, err
	}
	return ids, nil
}

// Transports of P1's load generator (its -transport flag).
const (
	// transportDatagram is the agent of today: a TLS heartbeat with its
	// hardware report gets a datagram grant, the agent closes its TLS
	// connection and sends every later heartbeat as a pulse datagram from
	// its own UDP socket.
	transportDatagram = "datagram"
	// transportTLS is an agent that does not speak datagrams: every
	// heartbeat over its kept TLS connection.
	transportTLS = "tls"
)

// benchHardwareReport is the small hardware report of a simulated agent's
// first heartbeat: the real agent sends one until it is acknowledged.
func benchHardwareReport() *agentv1.HardwareReport {
	return &agentv1.HardwareReport{
		Cpu:         &agentv1.CPU{Model: "bench", Sockets: 1, Cores: 2, Threads: 4},
		MemoryBytes: 8 << 30,
	}
}

// loadgenMain is the load generator process: it connects every agent named
// in the agents file (with -transport datagram, each makes its first
// heartbeat over TLS, takes its datagram grant and closes the connection),
// prints READY, sends heartbeats back to back from the GO line on stdin
// (each agent one at a time, waiting for the answer), restarts its latency
// count on a MEASURE line, and when stdin closes prints DONE with the
// failures and, since MEASURE, the p99 of the heartbeats' round trips, the
// datagrams sent again after a timeout, the heartbeats none of whose
// datagrams got a reply (the real agent would call over TLS) and the
// replies that said retry later.
func loadgenMain(args []string) int {
	fs := flag.NewFlagSet(loadgenMode, flag.ContinueOnError)
	endpoint := fs.String("endpoint", "", "callback server host:port")
	caPath := fs.String("ca", "", "DER CA certificate of the server")
	agentsPath := fs.String("agents", "", "file with one machine id per line; line i uses agentKey(i)")
	transport := fs.String("transport", transportDatagram, "datagram or tls")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	fail := func(err error) int {
		fmt.Println("ERROR", err)
		return 1
	}
	if *transport != transportDatagram && *transport != transportTLS {
		return fail(fmt.Errorf("unknown -transport %q", *transport))
	}
	host, _, err := net.SplitHostPort(*endpoint)
	if err != nil {
		return fail(fmt.Errorf("endpoint %q: %w", *endpoint, err))
	}
	ca, err := os.ReadFile(*caPath)
	if err != nil {
		return fail(err)
	}
	ids, err := readAgents(*agentsPath)
	if err != nil {
		return fail(err)
	}
	ctx := context.Background()
	conns := make([]*grpc.ClientConn, len(ids))
	pulses := make([]*pulseAgent, len(ids))
	defer func() {
		for i := range ids {
			if conns[i] != nil {
				conns[i].Close()
			}
			if pulses[i] != nil {
				pulses[i].close()
			}
		}
	}()
	// Every agent has its own key and TLS connection, as on real machines.
	// The load generator speaks gRPC with grpc-go, the cheapest client at
	// hand; agents themselves use connect-go's gRPC client.
	var g errgroup.Group
	g.SetLimit(64)
	for i, id := range ids {
		g.Go(func() error {
			tlsCfg, err := agent.ClientTLS(id, *endpoint, ca, agentKey(i))
			if err != nil {
				return err
			}
			if conns[i], err = grpc.NewClient(*endpoint, grpc.WithTransportCredentials(credentials.NewTLS(tlsCfg))); err != nil {
				return err
			}
			resp, err := heartbeat(ctx, conns[i], &agentv1.HeartbeatRequest{MachineId: id, AgentVersion: "bench", HardwareReport: benchHardwareReport()})
			if err != nil || *transport == transportTLS {
				return err
			}
			// As the agent does while it holds a grant: nothing stays
			// open on the server between heartbeats.
			err = conns[i].Close()
			conns[i] = nil
			if err != nil {
				return err
			}
			machine, err := uuid.Parse(id)
			if err != nil {
				return err
			}
			pulses[i], err = newPulseAgent(machine, agentKey(i).Public().(ed25519.PublicKey), resp.GetDatagramGrant(), host, netip.Addr{})
			return err
		})
	}
	if err := g.Wait(); err != nil {
		return fail(fmt.Errorf("connecting agents: %w", err))
	}
	fmt.Println("READY")
	in := bufio.NewScanner(os.Stdin)
	if !in.Scan() || in.Text() != "GO" {
		return fail(errors.New("no GO on stdin"))
	}
	var rtt latencies
	var failures, noReply, retryLater, resends0 atomic.Int64
	var firstErr atomic.Value
	resends := func() (n int64) {
		for _, p := range pulses {
			if p != nil {
				n += p.resends.Load()
			}
		}
		return n
	}
	runCtx, cancel := context.WithCancel(ctx)
	go func() {
		for in.Scan() { // until stdin closes
			if in.Text() == "MEASURE" {
				rtt.reset()
				noReply.Store(0)
				retryLater.Store(0)
				resends0.Store(resends())
			}
		}
		cancel()
	}()
	failed := func(err error) {
		failures.Add(1)
		firstErr.CompareAndSwap(nil, err.Error())
	}
	var wg sync.WaitGroup
	for i, id := range ids {
		req := &agentv1.HeartbeatRequest{MachineId: id, AgentVersion: "bench"}
		wg.Go(func() {
			for runCtx.Err() == nil {
				start := time.Now()
				if pulses[i] == nil {
					if _, err := heartbeat(runCtx, conns[i], req); err != nil {
						if runCtx.Err() == nil {
							failed(err)
						}
						continue
					}
					rtt.add(time.Since(start))
					continue
				}
				rep, err := pulses[i].beat(runCtx)
				switch {
				case runCtx.Err() != nil:
				case errors.Is(err, agent.ErrNoDatagramReply):
					// The real agent would now call over TLS; here it
					// is counted, and the agent goes on.
					noReply.Add(1)
				case err != nil:
					failed(err)
				case rep.Status == pulse.StatusRetryLater:
					// The server could not record it (busy): as the
					// agent does, send it again when the server says.
					retryLater.Add(1)
					sleepCtx(runCtx, rep.NextIn)
				case rep.Status != pulse.StatusRecorded:
					// No installation is pending and every key is
					// right: being sent to TLS is a fault here.
					failed(fmt.Errorf("heartbeat datagram of %s: %s", id, rep.Status))
				default:
					rtt.add(time.Since(start))
				}
			}
		})
	}
	wg.Wait()
	first, _ := firstErr.Load().(string)
	fmt.Printf("DONE failures=%d rtt_p99_ms=%s resends=%d no_reply=%d retry_later=%d first=%q\n", failures.Load(),
		num(rtt.quantile(0.99).Seconds()*1000), resends()-resends0.Load(), noReply.Load(), retryLater.Load(), first)
	return 0
}

// latencies is a histogram of round trips in 100 µs buckets up to 10 s,
// safe for concurrent use.
type latencies struct {
	buckets [100_001]atomic.Int64
}

const latencyBucket = 100 * time.Microsecond

func (l *latencies) add(d time.Duration) {
	l.buckets[min(int(d/latencyBucket), len(l.buckets)-1)].Add(1)
}

func (l *latencies) reset() {
	for i := range l.buckets {
		l.buckets[i].Store(0)
	}
}

// quantile returns the upper bound of the bucket quantile q falls in (0
// without samples).
func (l *latencies) quantile(q float64) time.Duration {
	var total int64
	for i := range l.buckets {
		total += l.buckets[i].Load()
	}
	want, seen := int64(math.Ceil(q*float64(total))), int64(0)
	for i := range l.buckets {
		if seen += l.buckets[i].Load(); seen >= want && seen > 0 {
			return time.Duration(i+1) * latencyBucket
		}
	}
	return 0
}

// raiseFileLimit makes sure this process may open n files: every simulated
// agent holds a connection, on each side. It raises the soft limit, and the
// hard limit when running as root.
func raiseFileLimit(n int) error {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return err
	}
	if lim.Cur >= uint64(n) {
		return nil
	}
	want := syscall.Rlimit{Cur: uint64(n), Max: max(lim.Max, uint64(n))}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &want); err != nil {
		return fmt.Errorf("P1 needs %d open files but the limit is %d (hard %d): raise it, e.g. `ulimit -n %d`: %w", n, lim.Cur, lim.Max, n, err)
	}
	return nil
}

// heartbeat makes one heartbeat RPC on conn.
func heartbeat(ctx context.Context, conn *grpc.ClientConn, req *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error) {
	resp := &agentv1.HeartbeatResponse{}
	if err := conn.Invoke(ctx, agentv1connect.AgentCallbackServiceHeartbeatProcedure, req, resp); err != nil {
		return nil, err
	}
	return resp, nil
}

// serverCounts reads accepted heartbeats and the batch-size histogram's
// count and sum from the server's registry.
func serverCounts(reg *prometheus.Registry) (accepted, batches, batched float64) {
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		switch mf.GetName() {
		case "shepherd_server_heartbeats_accepted_total":
			accepted = mf.GetMetric()[0].GetCounter().GetValue()
		case "shepherd_server_heartbeat_batch_size":
			h := mf.GetMetric()[0].GetHistogram()
			batches, batched = float64(h.GetSampleCount()), h.GetSampleSum()
		}
	}
	return accepted, batches, batched
}

// latencyQuantile estimates a quantile of the server's request latency
// from its histogram buckets (the upper bound of the bucket it falls in;
// +Inf beyond the last bound; 0 without samples).
func latencyQuantile(reg *prometheus.Registry, q float64) float64 {
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() != "shepherd_server_heartbeat_duration_seconds" {
			continue
		}
		h := mf.GetMetric()[0].GetHistogram()
		if h.GetSampleCount() == 0 {
			return 0
		}
		want := q * float64(h.GetSampleCount())
		for _, b := range h.GetBucket() {
			if float64(b.GetCumulativeCount()) >= want {
				return b.GetUpperBound()
			}
		}
		return math.Inf(1)
	}
	return 0
}

// sleepProfiled waits d (or until ctx ends), writing a CPU profile of this
// process for that time to path if path is not empty. When a profile of the
// whole run is already being taken (BENCH_CPUPROFILE), it only waits: Go
// profiles one thing at a time.
func sleepProfiled(ctx context.Context, d time.Duration, path string) error {
	if path == "" || os.Getenv("BENCH_CPUPROFILE") != "" {
		sleepCtx(ctx, d)
		return nil
	}
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("creating the CPU profile: %w", err)
	}
	defer f.Close()
	if err := pprof.StartCPUProfile(f); err != nil {
		return fmt.Errorf("starting the CPU profile: %w", err)
	}
	sleepCtx(ctx, d)
	pprof.StopCPUProfile()
	return f.Close()
}
