package main

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

const (
	p3Machines = 100_000
	// p3Iterations is how often each statement is timed (its p99 is the
	// 10th slowest run); 23 statements, each followed by its floor, must
	// leave room in make bench's 10 minutes for the other figures.
	p3Iterations = 1000
	p3LimitMs    = 5.0
)

// benchCandidateLatency is P3: the latency of every candidate query (list
// and count) and every claim of every process that claims machines (agent
// start, recovery, decommission, and an operator's hold of a named machine),
// on a fleet of 100,000 machines of which only a few are candidates; on a
// provider where nearly every candidate waits in backoff; and, for the
// takeover, on a provider where 20,000 are candidates (a new fleet being
// taken over). It prints one line per statement, then the worst p99 of them
// all, claims included.
func benchCandidateLatency(ctx context.Context, e *env) error {
	url, err := e.database(ctx, "p3")
	if err != nil {
		return err
	}
	db, err := bmdb.Open(ctx, bmdb.Config{URL: url})
	if err != nil {
		return err
	}
	defer db.Close()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	fleet := bmdbtest.Fleet{Provider: "p", Healthy: p3Machines - 105, Stale: 10, Installed: 50, AwaitingAgent: 40, NeverHeartbeat: 5,
		Decommissioning: 20}
	if err := bmdbtest.BuildFleet(ctx, pool, fleet); err != nil {
		return err
	}
	if err := bmdbtest.BuildFleet(ctx, pool, bmdbtest.Fleet{Provider: "new", AwaitingAgent: 20_000}); err != nil {
		return err
	}
	// A provider with half as many machines as p, nearly all waiting in
	// backoff: 50,000 awaiting their agent of which all but 10 failed agent
	// start, 2,000 silent of which all but 10 failed recovery (issue 10
	// item 20), and 2,000 being decommissioned of which all but 10, the
	// oldest requests, failed decommission. Held machines must not be read
	// by any statement.
	held := bmdbtest.Fleet{Provider: "held", AwaitingAgent: 50_000, AgentStartHeld: 50_000 - 10, Stale: 2000, RecoveryHeld: 2000 - 10,
		Healthy: 2000, Decommissioning: 2000, DecommissionHeld: 2000 - 10}
	if err := bmdbtest.BuildFleet(ctx, pool, held); err != nil {
		return err
	}
	// The machine an operator's power action holds: a healthy one of p.
	var target uuid.UUID
	err = pool.QueryRow(ctx, `
		SELECT h.machine_id FROM machine_agent_heartbeat h JOIN machine_provided p USING (machine_id)
		WHERE p.provider = 'p' AND h.agent_heartbeat_at > now() - interval '1 hour'
		  AND NOT EXISTS (SELECT 1 FROM machine_decommission_request d WHERE d.machine_id = h.machine_id)
		LIMIT 1`).Scan(&target)
	if err != nil {
		return fmt.Errorf("finding a machine to hold: %w", err)
	}

	s, err := db.StartSession(ctx, bmdb.SessionConfig{Component: "bench"})
	if err != nil {
		return err
	}
	defer s.Close(ctx)

	// The floors: what the same round trip costs with (nearly) no query
	// in it, timed right after each run of a statement so that both see
	// the same machine. A read is `SELECT 1`; a claim writes and commits,
	// durably, so its floor is a one-row UPDATE committed on its own.
	// They are the baselines of the lines: what no query or index can
	// win back on this machine at this moment.
	for _, sql := range []string{
		"CREATE TABLE bench_commit_floor (id integer PRIMARY KEY, n bigint NOT NULL)",
		"INSERT INTO bench_commit_floor VALUES (1, 0)",
	} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			return fmt.Errorf("creating the commit floor table: %w", err)
		}
	}
	readFloor := func() error {
		_, err := pool.Exec(ctx, "SELECT 1")
		return err
	}
	commitFloor := func() error {
		_, err := pool.Exec(ctx, "UPDATE bench_commit_floor SET n = n + 1 WHERE id = 1")
		return err
	}

	type probe struct {
		name string
		run  func() error
		// after, if set, runs after each timed run, untimed: it undoes what
		// run did (a claim's cancel) so the next run finds the same fleet.
		after func() error
		// floor is the baseline statement: readFloor, or commitFloor for
		// a claim.
		floor func() error
	}
	var probes []probe
	// Each claim is timed on its own; its cancel, untimed, leaves the
	// machine a candidate for the next round.
	var claimed *bmdb.Work
	cancelClaim := func() error { return claimed.Cancel(ctx) }
	addQueries := func(prefix string, process bmdb.Process, c bmdb.Candidates) {
		probes = append(probes,
			probe{name: prefix + "_list", run: func() error {
				_, err := db.ListCandidates(ctx, process, c, 16)
				return err
			}, floor: readFloor},
			probe{name: prefix + "_count", run: func() error {
				_, err := db.CountCandidates(ctx, process, c)
				return err
			}, floor: readFloor},
			probe{name: prefix + "_claim", run: func() error {
				var err error
				claimed, err = s.Work(ctx, process, c)
				return err
			}, after: cancelClaim, floor: commitFloor})
	}
	addQueries("agent_start", bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"))
	addQueries("recovery", bmdb.ProcessRecovery, bmdb.RecoveryCandidates("p", 0, 0))
	addQueries("decommission", bmdb.ProcessDecommission, bmdb.DecommissionCandidates("p"))
	addQueries("backed_off_agent_start", bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("held"))
	addQueries("backed_off_recovery", bmdb.ProcessRecovery, bmdb.RecoveryCandidates("held", 0, 0))
	addQueries("backed_off_decommission", bmdb.ProcessDecommission, bmdb.DecommissionCandidates("held"))
	// The recoverer's circuit breaker counts the silent machines each pass.
	probes = append(probes,
		probe{name: "recovery_matching_count", run: func() error {
			_, err := db.CountMatching(ctx, bmdb.RecoveryCandidates("p", 0, 0))
			return err
		}, floor: readFloor},
		probe{name: "backed_off_recovery_matching_count", run: func() error {
			_, err := db.CountMatching(ctx, bmdb.RecoveryCandidates("held", 0, 0))
			return err
		}, floor: readFloor},
		// A claim among the 20,000 candidates of a fleet being taken over.
		probe{name: "takeover_list", run: func() error {
			_, err := db.ListCandidates(ctx, bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("new"), 16)
			return err
		}, floor: readFloor},
		probe{name: "takeover_claim", run: func() error {
			var err error
			claimed, err = s.Work(ctx, bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("new"))
			return err
		}, after: cancelClaim, floor: commitFloor},
		// An operator's power action holds one named machine.
		probe{name: "power_hold_claim", run: func() error {
			var err error
			claimed, err = s.Hold(ctx, bmdb.ProcessPower, target, "bench")
			return err
		}, after: cancelClaim, floor: commitFloor},
	)

	var worst, worstP50 float64
	worstName := ""
	for _, p := range probes {
		lat := make([]time.Duration, 0, p3Iterations)
		floor := make([]time.Duration, 0, p3Iterations)
		for i := range p3Iterations + 100 {
			start := time.Now()
			if err := p.run(); err != nil {
				return fmt.Errorf("%s: %w", p.name, err)
			}
			took := time.Since(start)
			if p.after != nil {
				if err := p.after(); err != nil {
					return fmt.Errorf("%s: %w", p.name, err)
				}
			}
			start = time.Now()
			if err := p.floor(); err != nil {
				return fmt.Errorf("%s floor: %w", p.name, err)
			}
			if i >= 100 { // the first runs warm caches and prepared statements
				lat = append(lat, took)
				floor = append(floor, time.Since(start))
			}
		}
		p50, p99 := quantiles(lat)
		_, floor99 := quantiles(floor)
		report("P3", p.name+"_p99_ms", p99, "baseline", floor99, "ratio", p99/floor99,
			"limit", p3LimitMs, "limit_ratio", p99/p3LimitMs, "p50_ms", p50)
		if p99 > worst {
			worst, worstP50, worstName = p99, p50, p.name
		}
	}
	report("P3", "candidate_query_p99_ms", worst, "limit", p3LimitMs, "limit_ratio", worst/p3LimitMs, "p50_ms", worstP50,
		"worst", worstName, "statements", len(probes), "machines", p3Machines,
		"backed_off_machines", held.AgentStartHeld+held.RecoveryHeld+held.DecommissionHeld)
	return nil
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// quantiles sorts lat and returns its median and p99 (the samples at 50%
// and 99% of the sorted order; of fewer than 100 samples, p99 is the
// slowest) in milliseconds.
func quantiles(lat []time.Duration) (p50, p99 float64) {
	slices.Sort(lat)
	return ms(lat[len(lat)/2]), ms(lat[len(lat)*99/100])
}
