package main

import (
	"github.com/jackc/pgx/v5"
	"strconv"

	"context"
	"time"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/provider/sim"
)

const (
	p4Machines    = 1000
	p4Parallelism = 50
	p4SSHLatency  = 10 * time.Millisecond
	p4Takeover    = 490 * time.Millisecond // with the SSH latency: 500 ms per takeover
)

// benchTakeover is P4: how long the real initializer needs to take over
// 1,000 simulated machines that take 500 ms each (SSH and takeover), with
// 50 in parallel, until every machine has sent a heartbeat; ideally 10 s.
func benchTakeover(ctx context.Context, e *env) error {
	url, err := e.database(ctx, "p4")
	if err != nil {
		return err
	}
	// A connection for every worker, and some for the server and the
	// provisioner: fewer would make workers queue for connections. The pool
	// opens them while the provisioner works, before the clock starts: P4
	// measures takeovers, not 50 connection set-ups at once.
	db, err := bmdb.Open(ctx, bmdb.Config{URL: url + "&pool_min_conns=" + strconv.Itoa(p4Parallelism+10), MaxConns: p4Parallelism + 30})
	if err != nil {
		return err
	}
	defer db.Close()
	st, err := startSimStack(ctx, db, sim.Config{Machines: p4Machines, SSHLatency: p4SSHLatency, TakeoverLatency: p4Takeover}, 30*time.Second)
	if err != nil {
		return err
	}
	defer st.stop()
	// Provision first: P4 measures takeovers, not the provisioner.
	if err := st.runProvisioner(manager.ProvisionerConfig{Period: 200 * time.Millisecond, ChunkSize: p4Machines, CreateLimit: manager.Limit{Every: time.Millisecond, Burst: p4Machines}}); err != nil {
		return err
	}
	if err := waitFor(ctx, 2*time.Minute, "provisioning", func() (bool, error) {
		refs, err := db.ListProvided(ctx, st.fleet.Name())
		return len(refs) == p4Machines, err
	}); err != nil {
		return err
	}

	// The poll for the end has a connection of its own and a cheap query,
	// so that watching does not slow down what it watches.
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	ideal := time.Duration(p4Machines/p4Parallelism) * (p4SSHLatency + p4Takeover)
	start := time.Now()
	err = st.runInitializer(manager.InitializerConfig{
		Loop: manager.LoopConfig{Parallelism: p4Parallelism, QueryLimit: manager.Limit{Every: time.Millisecond, Burst: p4Parallelism}, IdleSleep: 100 * time.Millisecond},
	})
	if err != nil {
		return err
	}
	if err := waitFor(ctx, 5*time.Minute, "every machine heartbeating", func() (bool, error) {
		n, err := heartbeating(ctx, conn, st.fleet.Name())
		return n == p4Machines, err
	}); err != nil {
		return err
	}
	took := time.Since(start)
	if err := st.stop(); err != nil {
		return err
	}
	// Where the time beyond the simulated latency went: the claim-to-finish
	// span of each takeover, and from finish to the first heartbeat.
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
			percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM h.agent_heartbeat_at - finished)) * 1000,
			percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM h.agent_heartbeat_at - finished)) * 1000
		FROM w JOIN machine_agent_heartbeat h USING (machine_id)`, &work50, &work99, &hb50, &hb99)
	if err != nil {
		return err
	}
	report("P4", "takeover_seconds", took.Seconds(), "ideal", ideal.Seconds(), "ratio", took.Seconds()/ideal.Seconds(),
		"limit", 1.2*ideal.Seconds(), "limit_ratio", took.Seconds()/(1.2*ideal.Seconds()),
		"machines", p4Machines, "parallelism", p4Parallelism, "per_takeover_ms", (p4SSHLatency + p4Takeover).Milliseconds(),
		"claim_to_finish_p50_ms", work50, "claim_to_finish_p99_ms", work99,
		"finish_to_heartbeat_p50_ms", hb50, "finish_to_heartbeat_p99_ms", hb99)
	return nil
}

// heartbeating counts the provider's machines whose agent sent a heartbeat.
func heartbeating(ctx context.Context, conn *pgx.Conn, provider string) (int64, error) {
	var n int64
	err := conn.QueryRow(ctx, `
		SELECT count(*) FROM machine_agent_heartbeat h JOIN machine_provided p USING (machine_id)
		WHERE p.provider = $1`, provider).Scan(&n)
	return n, err
}
