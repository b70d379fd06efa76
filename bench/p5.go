package main

import (
	"context"
	"crypto/ed25519"
	"crypto/tls"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/agent"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/internal/metricstest"
)

const (
	// p5Machines are the machines the shepherd process manages: rows in
	// the BMDB and entries of the static inventory, each with its own
	// agent key.
	p5Machines = 100_000
	// p5DefaultAgents are the agents that heartbeat at once, unless
	// BENCH_P5_AGENTS says otherwise. Every agent makes a TLS heartbeat
	// (a handshake, about a millisecond of CPU at each end) before it
	// heartbeats by datagram, and this shared 2-core machine does 15,000
	// of them in two intervals; 100,000 take 420 s at the same pace, six
	// minutes more than make bench's ten minutes leave. Since the server
	// holds nothing per agent between datagrams, the figure at 15,000 is
	// extrapolated per agent to p5Machines (printed as such);
	// BENCH_P5_AGENTS=100000 measures it, on a quiet machine. (On a
	// loaded one, before agents sent unanswered datagrams again after a
	// back-off, a stall of the server longer than an agent's three tries
	// sent every agent heartbeating then to TLS, a handshake each, and at
	// 45,000 agents that load kept the server behind.)
	// The other agents were started less than the first-heartbeat timeout
	// (30 min) ago, so their silence is not yet a reason to recover them.
	p5DefaultAgents = 15_000
	// p5RampRate is how many agents per second start (make their TLS
	// heartbeat) during the ramp: faster makes the server do TLS
	// handshakes faster than this shared machine can, and agents time
	// out.
	p5RampRate = 250
	// p5Interval is SPEC's default heartbeat interval, which the server
	// hands out and the load generator keeps to.
	p5Interval = 30 * time.Second
	// p5Idle is how long RSS is watched once every component runs and
	// before any agent connects: the provisioner's, updater's and
	// janitor's first passes over the fleet fall into it.
	p5Idle = 40 * time.Second
	// p5Measure is how long the started fleet is watched: two intervals,
	// so every agent heartbeats twice.
	p5Measure = 2 * p5Interval
	// p5Sources is how many loopback source addresses (127.0.0.2 and up)
	// the agents' connections and sockets are spread over: each gives its
	// own range of ephemeral ports, and each stays under the server's
	// default limit of 4,096 connections per address.
	p5Sources = 16
	// p5LoadgenMode is the first argument that makes the bench binary P5's
	// load generator.
	p5LoadgenMode = "p5-loadgen"
)

// p5Plan returns how many agents P5 runs (BENCH_P5_AGENTS, default
// p5DefaultAgents, at most p5Machines) and how long they take to start:
// p5RampRate a second, rounded up to whole intervals (at least two), so
// that their heartbeats, at i/N of the ramp and every interval from then
// on, fall evenly over the interval.
func p5Plan() (agents int, ramp time.Duration, err error) {
	agents = p5DefaultAgents
	if v := os.Getenv("BENCH_P5_AGENTS"); v != "" {
		if agents, err = strconv.Atoi(v); err != nil || agents < 1 || agents > p5Machines {
			return 0, 0, fmt.Errorf("BENCH_P5_AGENTS=%q: want 1 to %d agents", v, p5Machines)
		}
	}
	intervals := max(2, (time.Duration(agents)*time.Second/p5RampRate+p5Interval-1)/p5Interval)
	return agents, intervals * p5Interval, nil
}

// benchMemory is P5: the memory of the shepherd process alone, as an
// operator runs it (`shepherd run --components=all`: callback server,
// provisioner, initializer, recoverer, updater, janitor, decommissioner,
// with the static provider listing p5Machines machines), while agents in
// other processes each with their own key heartbeat as the real agent does:
// a first heartbeat over TLS (agent.HTTPClientDialer, connect-go's gRPC
// client) with the hardware report, which gets a datagram grant; the TLS
// connection closed; then a datagram every 30 s from the agent's own UDP
// socket, back to TLS when the server says so.
//
// It prints the process's RSS with no agent and with the agents
// heartbeating, the memory per agent and its extrapolation to p5Machines
// agents (when fewer were run), the process's descriptors and goroutines,
// the CPU per heartbeat of the server, PostgreSQL and the load generators,
// the heartbeat rate, and the server CPU of an agent's start (the TLS
// handshake, HTTP/2 and gRPC set-up and the first heartbeat with its
// hardware report and grant), derived from the ramp in which the agents
// started. A CPU profile and a heap profile of the loaded process are kept
// in the directory printed as profiles=.
func benchMemory(ctx context.Context, e *env) error {
	p5Agents, ramp, err := p5Plan()
	if err != nil {
		return err
	}
	url, err := e.database(ctx, "p5")
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "shepherd-bench-p5-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	profiles, err := artefactDir("p5")
	if err != nil {
		return err
	}

	bin := filepath.Join(dir, "shepherd")
	build := exec.CommandContext(ctx, "go", "build", "-o", bin, "./cmd/shepherd")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		return fmt.Errorf("building ./cmd/shepherd (run the bench from the module root): %w", err)
	}
	ids, err := p5Fleet(ctx, url, dir)
	if err != nil {
		return fmt.Errorf("recording the fleet: %w", err)
	}
	serverAddr, err := freeAddr()
	if err != nil {
		return err
	}
	metricsAddr, err := freeAddr()
	if err != nil {
		return err
	}
	sh := exec.CommandContext(ctx, bin, "run", "--components=all", "--database-url", url,
		"--data-dir", filepath.Join(dir, "data"), "--provider", "static",
		"--provider-config", filepath.Join(dir, "static.yaml"), "--agent", filepath.Join(dir, "agent-stand-in"),
		"--server-listen", serverAddr, "--metrics-listen", metricsAddr, "--pprof", "--log-level", "warn")
	sh.Stdout, sh.Stderr = os.Stderr, os.Stderr
	sh.Cancel = func() error { return sh.Process.Signal(syscall.SIGTERM) }
	sh.WaitDelay = 30 * time.Second
	if err := sh.Start(); err != nil {
		return err
	}
	shDone := make(chan error, 1)
	go func() { shDone <- sh.Wait() }()
	defer func() {
		_ = sh.Process.Signal(syscall.SIGTERM)
		<-shDone
	}()
	pid := sh.Process.Pid
	if err := waitFor(ctx, time.Minute, "shepherd run serving", func() (bool, error) {
		select {
		case err := <-shDone:
			shDone <- err
			return false, fmt.Errorf("shepherd run exited: %v", err)
		default:
		}
		if _, err := metricstest.Get(ctx, metricsAddr); err != nil {
			return false, err
		}
		c, err := net.Dial("tcp", serverAddr)
		if err != nil {
			return false, err
		}
		c.Close()
		return true, nil
	}); err != nil {
		return err
	}

	// No agent: the process with its fleet of machines and nothing else.
	idle, err := watchRSS(ctx, pid, p5Idle)
	if err != nil {
		return err
	}
	idleFDs, _ := countFDs(pid)
	idleGoroutines, _ := metricstest.Scrape(ctx, metricsAddr, "go_goroutines")
	idleMem, err := goMemory(ctx, metricsAddr)
	if err != nil {
		return err
	}

	lg, err := startP5Loadgens(ctx, dir, serverAddr, ids[:p5Agents], ramp)
	if err != nil {
		return err
	}
	defer lg.stop()
	// The ramp: every agent makes its TLS heartbeat, spread evenly over
	// the ramp, then heartbeats by datagram.
	ramp0 := snapshot(ctx, e, pid, lg.cpu, metricsAddr)
	if err := lg.send("GO"); err != nil {
		return err
	}
	if err := lg.expect(ctx, "CONNECTED", ramp+3*time.Minute); err != nil {
		done, _ := lg.finish(ctx)
		return fmt.Errorf("%w (%+v)", err, done)
	}
	ramp1 := snapshot(ctx, e, pid, lg.cpu, metricsAddr)

	// Steady state: every agent heartbeats by datagram every interval.
	// The CPU profile covers the first half of the window (its sampling
	// costs the server a little CPU, which is counted).
	cpuProfile := make(chan error, 1)
	go func() {
		cpuProfile <- fetch(ctx, metricsAddr, fmt.Sprintf("/debug/pprof/profile?seconds=%d", int(p5Interval.Seconds())), filepath.Join(profiles, "cpu.pb.gz"))
	}()
	loaded, err := watchRSS(ctx, pid, p5Measure)
	if err != nil {
		return err
	}
	steady := snapshot(ctx, e, pid, lg.cpu, metricsAddr)
	fds, _ := countFDs(pid)
	goroutines, _ := metricstest.Scrape(ctx, metricsAddr, "go_goroutines")
	mem, err := goMemory(ctx, metricsAddr)
	if err != nil {
		return err
	}
	if err := fetch(ctx, metricsAddr, "/debug/pprof/heap", filepath.Join(profiles, "heap.pb.gz")); err != nil {
		return err
	}
	if err := fetch(ctx, metricsAddr, "/debug/pprof/goroutine", filepath.Join(profiles, "goroutine.pb.gz")); err != nil {
		return err
	}
	if err := <-cpuProfile; err != nil {
		return err
	}
	done, err := lg.finish(ctx)
	if err != nil {
		return err
	}
	// Every agent started (CONNECTED), so the figure stands; heartbeats
	// that failed on the way (a TLS handshake timing out while this shared
	// machine is overloaded) are printed with it, and the first error
	// here.
	if done.failures > 0 {
		fmt.Fprintf(os.Stderr, "bench: P5: %d heartbeats failed, the first: %s\n", done.failures, done.first)
	}

	handshake, err := handshakeCPU(filepath.Join(dir, "data", "pki"), ids[0], serverAddr, 300, false)
	if err != nil {
		return err
	}
	resumed, err := handshakeCPU(filepath.Join(dir, "data", "pki"), ids[0], serverAddr, 300, true)
	if err != nil {
		return err
	}

	beats := steady.accepted - ramp1.accepted
	if beats <= 0 {
		return errors.New("no heartbeat accepted while connected")
	}
	elapsed := steady.at.Sub(ramp1.at)
	perBeat := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 / beats }
	serverUS := perBeat(steady.server - ramp1.server)
	// The ramp paid for p5Agents starts and the datagrams that followed
	// them; what a datagram costs is known from the steady state.
	rampBeats := ramp1.accepted - ramp0.accepted
	startUS := (float64((ramp1.server-ramp0.server).Nanoseconds())/1e3 - (rampBeats-float64(p5Agents))*serverUS) / float64(p5Agents)
	const mb, limit = 1 << 20, 300 << 20
	perAgent := float64(loaded.max-idle.max) / float64(p5Agents)
	common := []any{"agents", p5Agents, "machines", p5Machines, "interval_s", p5Interval.Seconds(), "ramp_s", ramp.Seconds()}
	report("P5", "rss_mb", float64(loaded.max)/mb, append([]any{
		"baseline", float64(idle.max) / mb, "ratio", float64(loaded.max) / float64(idle.max),
		"limit", float64(limit / mb), "limit_ratio", float64(loaded.max) / limit,
		"peak_mb", float64(loaded.peak) / mb, "fds", fds, "baseline_fds", idleFDs,
		"goroutines", goroutines, "baseline_goroutines", idleGoroutines}, common...)...)
	// Where it goes: the Go heap in use and the goroutine stacks per
	// agent; the rest of RSS is heap the collector has not yet reclaimed
	// or returned. Between its datagrams an agent has no connection, so
	// what remains per agent is what the server caches about it.
	report("P5", "memory_per_agent_kb", perAgent/1024, append([]any{
		"heap_inuse_kb", (mem.heapInuse - idleMem.heapInuse) / float64(p5Agents) / 1024,
		"stack_inuse_kb", (mem.stackInuse - idleMem.stackInuse) / float64(p5Agents) / 1024,
		"goroutines", (goroutines - idleGoroutines) / float64(p5Agents)}, common...)...)
	if p5Agents < p5Machines {
		// The agents not run add what one run agent adds to RSS. The
		// server holds nothing per agent between its datagrams but what
		// it caches, so that can be lost in RSS's noise, down to below
		// zero (the idle process still carried its components' first
		// passes over the fleet): then the Go heap in use per agent,
		// which is what the server keeps for an agent, is the slope.
		slope, from := perAgent, "rss"
		if slope <= 0 {
			slope, from = max((mem.heapInuse-idleMem.heapInuse)/float64(p5Agents), 0), "heap_inuse"
		}
		extrapolated := float64(loaded.max) + slope*float64(p5Machines-p5Agents)
		report("P5", "rss_mb_extrapolated_100000_agents", extrapolated/mb, append([]any{
			"limit", float64(limit / mb), "limit_ratio", extrapolated / limit,
			"from_agents", p5Agents, "baseline_mb", float64(idle.max) / mb, "memory_per_agent_kb", perAgent / 1024,
			"slope_kb", slope / 1024, "slope_from", from}, common...)...)
	}
	report("P5", "heartbeats_per_s", beats/elapsed.Seconds(), append([]any{
		"server_cpu_us", serverUS, "postgres_cpu_us", perBeat(steady.pg - ramp1.pg),
		"loadgen_cpu_us", perBeat(steady.loadgen - ramp1.loadgen),
		"failures", done.failures, "no_reply", done.noReply, "call_tls", done.callTLS, "retry_later", done.retryLater,
		"loadgens", len(lg), "seconds", elapsed.Seconds()}, common...)...)
	// The name stays from when every agent kept its connection: it is the
	// server CPU of an agent's start (its TLS connection and heartbeat).
	report("P5", "new_connection_server_cpu_us", startUS, append([]any{
		"heartbeat_server_cpu_us", serverUS, "profiles", profiles}, common...)...)
	report("P5", "tls_handshake_both_ends_cpu_us", float64(handshake.Nanoseconds())/1e3, "handshakes", 300,
		"resumed_cpu_us", float64(resumed.Nanoseconds())/1e3)
	return nil
}

// p5Fleet records p5Machines machines of the static provider in the BMDB
// at url, each started with agent key agentKey(i), writes the static
// inventory listing them and the provider's configuration into dir, and
// returns the machine ids by index. Recording them in bulk is the state a
// fleet is in after its takeovers, which P4 measures.
func p5Fleet(ctx context.Context, url, dir string) ([]string, error) {
	db, err := bmdb.Open(ctx, bmdb.Config{URL: url}) // applies the migrations
	if err != nil {
		return nil, err
	}
	db.Close()
	pids := make([]string, p5Machines)
	keys := make([][]byte, p5Machines)
	addrs := make([]netip.Addr, p5Machines)
	var inv strings.Builder
	inv.WriteString("machines:\n")
	for i := range p5Machines {
		pids[i] = fmt.Sprintf("agent-%d", i)
		keys[i] = agentKey(i).Public().(ed25519.PublicKey)
		// Nothing dials these addresses: every machine's agent is started,
		// so the initializer has nothing to take over, and none is silent
		// for long enough for the recoverer to reach for it.
		addrs[i] = netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)})
		fmt.Fprintf(&inv, "  - id: %s\n    address: %s\n", pids[i], addrs[i])
	}
	for name, data := range map[string]string{
		"inventory.yaml": inv.String(),
		"static.yaml":    "inventory: " + filepath.Join(dir, "inventory.yaml") + "\n",
		"agent-stand-in": "stand-in: every machine's agent is already started",
	} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o600); err != nil {
			return nil, err
		}
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, `
		WITH ids AS (SELECT pid, addr, gen_random_uuid() AS machine_id FROM unnest($1::text[], $2::inet[]) AS u(pid, addr)),
		m AS (INSERT INTO machines (machine_id) SELECT machine_id FROM ids RETURNING machine_id)
		INSERT INTO machine_provided (machine_id, provider, provider_id, provider_ip_address, provider_status, provider_status_at)
		SELECT machine_id, 'static', pid, addr, 'Running', now() FROM ids JOIN m USING (machine_id)`, pids, addrs); err != nil {
		return nil, err
	}
	if _, err := conn.Exec(ctx, `
		INSERT INTO machine_agent_started (machine_id, agent_started_at, agent_public_key)
		SELECT mp.machine_id, now(), u.key FROM unnest($1::text[], $2::bytea[]) AS u(pid, key)
		JOIN machine_provided mp ON mp.provider = 'static' AND mp.provider_id = u.pid`, pids, keys); err != nil {
		return nil, err
	}
	rows, err := conn.Query(ctx, `SELECT provider_id, machine_id::text FROM machine_provided`)
	if err != nil {
		return nil, err
	}
	byPid := map[string]string{}
	for rows.Next() {
		var pid, id string
		if err := rows.Scan(&pid, &id); err != nil {
			return nil, err
		}
		byPid[pid] = id
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	ids := make([]string, p5Machines)
	for i, pid := range pids {
		if ids[i] = byPid[pid]; ids[i] == "" {
			return nil, fmt.Errorf("machine %s was not recorded", pid)
		}
	}
	_, err = conn.Exec(ctx, "VACUUM ANALYZE")
	return ids, err
}

// handshakeCPU returns the CPU time of one full TLS handshake between an
// agent and the callback server, both ends in this process, with the
// real certificates: the server's, issued by the development CA `shepherd
// run` made in pkiDir, and an agent's self-signed ed25519 one, with the
// configurations the server (tls.RequestClientCert, TLS 1.3) and the agent
// (agent.ClientTLS: no session resumption) use. With resume, the agent's
// configuration gets a session cache, and the handshakes measured resume
// the session of one before them (TLS 1.3 PSK with a new key exchange, as
// Go does it: no certificates are sent or verified): what an agent that
// reconnects for every heartbeat would cost at best.
func handshakeCPU(pkiDir, machineID, endpoint string, n int, resume bool) (time.Duration, error) {
	cert, err := tls.LoadX509KeyPair(filepath.Join(pkiDir, "server.crt"), filepath.Join(pkiDir, "server.key"))
	if err != nil {
		return 0, err
	}
	ca, err := readCAFile(filepath.Join(pkiDir, "ca.crt"))
	if err != nil {
		return 0, err
	}
	srvCfg := &tls.Config{Certificates: []tls.Certificate{cert}, ClientAuth: tls.RequestClientCert, MinVersion: tls.VersionTLS13, NextProtos: []string{"h2"}}
	cliCfg, err := agent.ClientTLS(machineID, endpoint, ca, agentKey(0))
	if err != nil {
		return 0, err
	}
	if resume {
		cliCfg.ClientSessionCache = tls.NewLRUClientSessionCache(1)
	}
	// Over loopback TCP, not net.Pipe: the server's session ticket, written
	// after the handshake, must not wait for a reader.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	var start time.Duration
	// With resume, one more handshake first, uncounted, gets the ticket.
	first := 0
	if resume {
		first = -1
	}
	for i := first; i < n; i++ {
		if i == 0 {
			start = processCPU()
		}
		done := make(chan error, 1)
		go func() {
			c, err := ln.Accept()
			if err != nil {
				done <- err
				return
			}
			defer c.Close()
			tc := tls.Server(c, srvCfg)
			if err := tc.Handshake(); err != nil {
				done <- err
				return
			}
			// One byte after the ticket, so that the client has read
			// the ticket when it has read the byte.
			_, err = tc.Write([]byte{1})
			done <- err
		}()
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			return 0, err
		}
		tc := tls.Client(c, cliCfg)
		cerr := tc.Handshake()
		if cerr == nil {
			_, cerr = io.ReadFull(tc, make([]byte, 1))
		}
		serr := <-done
		c.Close()
		if err := errors.Join(cerr, serr); err != nil {
			return 0, fmt.Errorf("TLS handshake: %w", err)
		}
		if resume && i >= 0 && !tc.ConnectionState().DidResume {
			return 0, errors.New("a TLS handshake meant to resume a session did not")
		}
	}
	return (processCPU() - start) / time.Duration(n), nil
}

// readCAFile reads the PEM CA certificate `shepherd run` wrote and returns
// it in DER, as TakeoverInit carries it.
func readCAFile(path string) ([]byte, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	b, _ := pem.Decode(data)
	if b == nil || b.Type != "CERTIFICATE" {
		return nil, fmt.Errorf("%s holds no PEM certificate", path)
	}
	return b.Bytes, nil
}

// freeAddr returns a loopback address with a port nobody listens on now.
func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}

// rssWatch is what watchRSS saw: the largest RSS and the peak (VmHWM).
type rssWatch struct{ max, peak int64 }

// watchRSS reads pid's RSS every second for d.
func watchRSS(ctx context.Context, pid int, d time.Duration) (rssWatch, error) {
	var w rssWatch
	deadline := time.Now().Add(d)
	for {
		st, err := procStatus(pid)
		if err != nil {
			return w, err
		}
		w.max, w.peak = max(w.max, st["VmRSS"]), st["VmHWM"]
		if !time.Now().Before(deadline) || ctx.Err() != nil {
			return w, ctx.Err()
		}
		sleepCtx(ctx, time.Second)
	}
}

// cpuSnapshot is the CPU the three processes had used, and the heartbeats
// the server had accepted, at one moment.
type cpuSnapshot struct {
	at                  time.Time
	server, pg, loadgen time.Duration
	accepted            float64
}

func snapshot(ctx context.Context, e *env, pid int, loadgenCPU func() time.Duration, metricsAddr string) cpuSnapshot {
	s := cpuSnapshot{at: time.Now(), pg: postgresCPU(e.srv.DataDir()), loadgen: loadgenCPU(), server: pidCPUOrZero(pid)}
	s.accepted, _ = metricstest.Scrape(ctx, metricsAddr, "shepherd_server_heartbeats_accepted_total")
	return s
}

// goMemStats are the Go runtime's memory figures a process serves on
// /metrics.
type goMemStats struct{ heapInuse, stackInuse float64 }

func goMemory(ctx context.Context, metricsAddr string) (goMemStats, error) {
	var m goMemStats
	var err error
	if m.heapInuse, err = metricstest.Scrape(ctx, metricsAddr, "go_memstats_heap_inuse_bytes"); err != nil {
		return m, err
	}
	m.stackInuse, err = metricstest.Scrape(ctx, metricsAddr, "go_memstats_stack_inuse_bytes")
	return m, err
}

func countFDs(pid int) (int, error) {
	entries, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	return len(entries), err
}

// fetch saves what GET http://addr+path answers into file.
func fetch(ctx context.Context, addr, path, file string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+path, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("GET %s: %w", path, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", path, resp.Status)
	}
	f, err := os.Create(file)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return fmt.Errorf("GET %s: %w", path, err)
	}
	return f.Close()
}

// procStatus reads the kB fields of /proc/pid/status, in bytes.
func procStatus(pid int) (map[string]int64, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return nil, err
	}
	out := map[string]int64{}
	for _, line := range strings.Split(string(data), "\n") {
		name, rest, ok := strings.Cut(line, ":")
		f := strings.Fields(rest)
		if !ok || len(f) != 2 || f[1] != "kB" {
			continue
		}
		if v, err := strconv.ParseInt(f[0], 10, 64); err == nil {
			out[name] = v << 10
		}
	}
	return out, nil
}
