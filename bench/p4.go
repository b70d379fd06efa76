package main

import (
	"context"
	"fmt"
	"runtime"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/provider/sim"
)

const (
	p4SSHLatency = 10 * time.Millisecond
	p4Takeover   = 490 * time.Millisecond // with the SSH latency: 500 ms per takeover
)

// p4Run is one P4 line: a fleet size and the initializer's parallelism.
// Both runs have the same ideal, 10 s (machines / parallelism takeovers of
// 500 ms each).
type p4Run struct {
	machines    int
	parallelism int
	// sharedKey makes the simulated agents share one key and a few TLS
	// connections (sim.Config.SharedAgentKey). Its own connection per
	// agent costs two file descriptors in this process (the agent's end
	// and the server's), and 10,000 agents would need more than the
	// 20,000 a process may open here. The takeovers are the same; the
	// first heartbeat skips its TLS handshake.
	sharedKey bool
	// conns is the pool size. Workers hold a connection only for a
	// statement (the claim, the check before the takeover, the finish),
	// never while SSH runs, so the pool need not grow with them.
	conns int
}

// p4SharedConnections is how many TLS connections agents with a shared key
// use (sim.Config.Connections): as many as the fleet's heartbeat workers
// (sim.Config.HeartbeatConcurrency's default), so that agents' first
// heartbeats do not come several at once on one connection, which the
// callback server refuses as no agent's behaviour.
const p4SharedConnections = 64

var p4Runs = []p4Run{
	{machines: 1000, parallelism: 50, conns: 50 + 30},
	{machines: 10000, parallelism: 500, sharedKey: true, conns: 100},
}

// benchTakeover is P4: how long the real initializer needs to take over
// simulated machines that take 500 ms each (SSH and takeover), until every
// machine has sent a heartbeat: 1,000 machines with 50 in parallel, and
// 10,000 with 500; ideally 10 s each.
func benchTakeover(ctx context.Context, e *env) error {
	for _, r := range p4Runs {
		if err := benchTakeoverRun(ctx, e, r); err != nil {
			return fmt.Errorf("%d machines: %w", r.machines, err)
		}
	}
	return nil
}

func benchTakeoverRun(ctx context.Context, e *env, r p4Run) error {
	url, err := e.database(ctx, "p4")
	if err != nil {
		return err
	}
	// The pool opens most of its connections while the provisioner works,
	// before the clock starts: P4 measures takeovers, not connection
	// set-ups.
	minConns := min(r.conns, r.parallelism+10)
	db, err := bmdb.Open(ctx, bmdb.Config{URL: url + "&pool_min_conns=" + strconv.Itoa(minConns), MaxConns: int32(r.conns)})
	if err != nil {
		return err
	}
	defer db.Close()
	st, err := startSimStack(ctx, db, sim.Config{Machines: r.machines, SSHLatency: p4SSHLatency, TakeoverLatency: p4Takeover, SharedAgentKey: r.sharedKey, Connections: p4SharedConnections}, 30*time.Second)
	if err != nil {
		return err
	}
	defer st.stop()
	// Provision first, then stop the provisioner: P4 measures takeovers,
	// not the provisioner, whose passes every 200 ms (to provision fast)
	// would list the whole fleet five times a second while the clock runs.
	stopProvisioner, err := st.startProvisioner(manager.ProvisionerConfig{Period: 200 * time.Millisecond, ChunkSize: r.machines, CreateLimit: manager.Limit{Every: time.Millisecond, Burst: r.machines}})
	if err != nil {
		return err
	}
	// The polls have a connection of their own and a cheap query, so that
	// watching does not slow down what it watches.
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if err := waitFor(ctx, 2*time.Minute, "provisioning", func() (bool, error) {
		var n int64
		err := conn.QueryRow(ctx, `SELECT count(*) FROM machine_provided`).Scan(&n)
		return n == int64(r.machines), err
	}); err != nil {
		return err
	}
	stopProvisioner()
	ideal := time.Duration(r.machines/r.parallelism) * (p4SSHLatency + p4Takeover)
	cpu0, pgCPU0 := processCPU(), postgresCPU(e.srv.DataDir())
	start := time.Now()
	err = st.runInitializer(manager.InitializerConfig{
		Loop: manager.LoopConfig{Parallelism: r.parallelism, QueryLimit: manager.Limit{Every: time.Millisecond, Burst: r.parallelism}, IdleSleep: 100 * time.Millisecond},
	})
	if err != nil {
		return err
	}
	if err := waitFor(ctx, 5*time.Minute, "every machine heartbeating", func() (bool, error) {
		n, err := heartbeatingAll(ctx, conn)
		return n == int64(r.machines), err
	}); err != nil {
		return err
	}
	took := time.Since(start)
	cpu, pgCPU := processCPU()-cpu0, postgresCPU(e.srv.DataDir())-pgCPU0
	if err := st.stop(); err != nil {
		return err
	}
	// Where the time beyond the simulated latency went: the claim-to-finish
	// span of each takeover, and from finish to the first heartbeat; and
	// the CPU time this process (the initializer, the callback server and
	// the simulated machines' side of SSH and heartbeats) and PostgreSQL
	// spent per machine. cpu_seconds_per_core is the least the run could
	// take if it had every core to itself: a figure above the limit there
	// is CPU-bound on this machine.
	//
	// The first heartbeat's time is when the machine's phase became
	// Heartbeating: machine_agent_heartbeat holds the last one, which for a
	// machine that heartbeat early in a run longer than the 30 s interval
	// is its second, half a minute later.
	var work50, work99, hb50, hb99 float64
	err = runQuery(ctx, url, `
		WITH w AS (
			SELECT s.machine_id, s.at AS started, f.at AS finished
			FROM work_history s JOIN work_history f USING (machine_id, process)
			WHERE s.process = 'AgentStart' AND s.event = 'Started' AND f.event = 'Finished'
		)
		SELECT
			percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM finished - started)) * 1000,
			percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM finished - started)) * 1000,
			percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM p.agent_phase_since - finished)) * 1000,
			percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM p.agent_phase_since - finished)) * 1000
		FROM w JOIN machine_provided p USING (machine_id)
		WHERE p.agent_phase = 'Heartbeating'`, &work50, &work99, &hb50, &hb99)
	if err != nil {
		return err
	}
	keys := "own"
	if r.sharedKey {
		keys = "shared"
	}
	report("P4", "takeover_seconds", took.Seconds(), "ideal", ideal.Seconds(), "ratio", took.Seconds()/ideal.Seconds(),
		"limit", 1.2*ideal.Seconds(), "limit_ratio", took.Seconds()/(1.2*ideal.Seconds()),
		"machines", r.machines, "parallelism", r.parallelism, "per_takeover_ms", (p4SSHLatency + p4Takeover).Milliseconds(),
		"agent_keys", keys, "db_conns", r.conns,
		"claim_to_finish_p50_ms", work50, "claim_to_finish_p99_ms", work99,
		"finish_to_heartbeat_p50_ms", hb50, "finish_to_heartbeat_p99_ms", hb99,
		"process_cpu_ms_per_machine", msPer(cpu, r.machines), "postgres_cpu_ms_per_machine", msPer(pgCPU, r.machines),
		"cpu_seconds_per_core", (cpu+pgCPU).Seconds()/float64(runtime.NumCPU()))
	return nil
}

// heartbeatingAll counts the machines whose agent sent a heartbeat: P4's
// database holds one fleet, and a count of one table costs the database
// less (watching 10,000 machines every 50 ms) than heartbeating's join.
func heartbeatingAll(ctx context.Context, conn *pgx.Conn) (int64, error) {
	var n int64
	err := conn.QueryRow(ctx, `SELECT count(*) FROM machine_agent_heartbeat`).Scan(&n)
	return n, err
}

// heartbeating counts the provider's machines whose agent sent a heartbeat.
func heartbeating(ctx context.Context, conn *pgx.Conn, provider string) (int64, error) {
	var n int64
	err := conn.QueryRow(ctx, `
		SELECT count(*) FROM machine_agent_heartbeat h JOIN machine_provided p USING (machine_id)
		WHERE p.provider = $1`, provider).Scan(&n)
	return n, err
}

// msPer is d in milliseconds per n.
func msPer(d time.Duration, n int) float64 {
	return float64(d) / float64(time.Millisecond) / float64(n)
}
