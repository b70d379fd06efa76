package main

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/ladder"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/power"
	"github.com/shepherd/shepherd/provider/sim"
)

const (
	p8Machines    = 200
	p8Parallelism = 50
	// The BMCs of SPEC §7: a power command shows after 5 s, and each BMC
	// takes a call at most every 5 s.
	p8Transition  = 5 * time.Second
	p8MinInterval = 5 * time.Second
	// What a machine costs once its BMC powered it on: it boots (SSH
	// refused) for p8Boot after the transition, and its takeover takes
	// p8SSHLatency + p8Takeover, as P4's.
	p8Boot        = 2 * time.Second
	p8SSHLatency  = 10 * time.Millisecond
	p8Takeover    = 290 * time.Millisecond
	p8Interval    = time.Second
	p8HBTimeout   = 3 * time.Second
	p8IdleSleep   = 100 * time.Millisecond
	p8InitBackoff = 500 * time.Millisecond
)

// p8Rungs is the ladder P8 climbs: the default one, so that every machine
// pays for the cheap rungs failing before its BMC is asked.
var p8Rungs = ladder.Default

// benchBMCRecovery is P8: 200 simulated machines hang (agent silent, SSH
// dead, in-band reboots refused), and the real recoverer brings them back
// through their BMCs, 50 at a time, until the real initializer took each
// over again and its agent heartbeats.
//
// The clock starts when every machine is a recovery candidate (its last
// heartbeat older than the heartbeat timeout): the machines hang with no
// recoverer running, and the recoverer starts once the BMDB counts all 200
// as candidates, as P4 starts the initializer once everything is
// provisioned. Detection (timeout plus loop period) is P6's figure, not
// this one's. The clock stops when the BMDB counts all 200 Healthy.
//
// The ideal follows from the configuration (p8Ideal): per machine, the
// ladder's cheap rungs fail at once (the agent rung's SSH dial is refused
// after the SSH latency; the in-band reboot is refused without a wait), then
// the BMC's power cycle: State, Off, State until off, On, State until on,
// each call MinInterval after the one before, a transition needing
// max(1, ⌈Transition/MinInterval⌉) polls: MinInterval × (2 + 2 × polls),
// 20 s with 5 s pacing. 200 machines on 50 workers are 4 waves of that.
// The last wave's machines then finish booting (what is left of Transition
// + boot after the cycle saw the power on), are taken over (SSH latency +
// takeover), and send their first heartbeat at once; the earlier waves'
// boots and takeovers overlap the later waves' cycles. In all:
//
//	ideal = waves × (SSHLatency + cycle)
//	      + max(0, Transition + RebootLatency − polls × MinInterval)
//	      + SSHLatency + TakeoverLatency
//
// which is 4 × 20.01 s + 2 s + 0.3 s = 82.34 s here.
//
// The circuit breaker must not hold P8 back: SilentFraction 1 (every
// started machine silent at once is what P8 is) and MaxRebootsPerWindow a
// restart per rung per machine. The initializer's backoff is 500 ms: a
// machine's first takeover attempt comes while it still boots, and the
// default backoff (5 s, doubling) would measure that, not the recovery (the figure
// prints how many attempts found a machine booting).
func benchBMCRecovery(ctx context.Context, e *env) error {
	url, err := e.database(ctx, "p8")
	if err != nil {
		return err
	}
	// A connection for each worker of both loops, and some for the server:
	// fewer would make workers queue for connections.
	db, err := bmdb.Open(ctx, bmdb.Config{URL: url + "&pool_min_conns=" + strconv.Itoa(p8Parallelism+10), MaxConns: 2*p8Parallelism + 30})
	if err != nil {
		return err
	}
	defer db.Close()
	simCfg := sim.Config{
		Machines: p8Machines, SSHLatency: p8SSHLatency, TakeoverLatency: p8Takeover, RebootLatency: p8Boot,
		BMC: &sim.BMCConfig{Fraction: 1, Transition: p8Transition, Power: power.Config{MinInterval: p8MinInterval}},
	}
	st, err := startSimStack(ctx, db, simCfg, p8Interval)
	if err != nil {
		return err
	}
	defer st.stop()
	if err := st.runProvisioner(manager.ProvisionerConfig{Period: 200 * time.Millisecond, ChunkSize: p8Machines, CreateLimit: manager.Limit{Every: time.Millisecond, Burst: p8Machines}}); err != nil {
		return err
	}
	err = st.runInitializer(manager.InitializerConfig{
		Loop:    manager.LoopConfig{Parallelism: p8Parallelism, QueryLimit: manager.Limit{Every: time.Millisecond, Burst: p8Parallelism}, IdleSleep: p8IdleSleep},
		Backoff: bmdb.BackoffPolicy{Initial: p8InitBackoff, Exponent: 1},
	})
	if err != nil {
		return err
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if err := waitFor(ctx, 3*time.Minute, "every machine heartbeating", func() (bool, error) {
		n, err := heartbeating(ctx, conn, st.fleet.Name())
		return n == p8Machines, err
	}); err != nil {
		return err
	}

	listing, err := st.fleet.ListMachines(ctx)
	if err != nil {
		return err
	}
	ids := make([]string, len(listing))
	for i, m := range listing {
		ids[i] = m.ID()
	}
	rcfg := manager.RecovererConfig{
		Loop:             manager.LoopConfig{Parallelism: p8Parallelism, QueryLimit: manager.Limit{Every: time.Millisecond, Burst: p8Parallelism}, IdleSleep: p8IdleSleep},
		HeartbeatTimeout: p8HBTimeout,
		// Every machine silent at once is what P8 is: the breaker must
		// neither pause for it nor run out of restarts.
		SilentFraction:      1,
		MaxRebootsPerWindow: p8Machines * len(p8Rungs),
		Rungs:               p8Rungs,
		// The boot wait dials every 100ms: a simulated dial costs
		// nothing, and the ideal counts the boot exactly.
		BootPoll: 100 * time.Millisecond,
	}
	if rcfg.SSHKey, err = newSigner(); err != nil { // the agent rung applies only with a key
		return err
	}
	candidates := bmdb.RecoveryCandidates(st.fleet.Name(), 0, p8HBTimeout)
	if err := st.fleet.Hang(ids...); err != nil {
		return err
	}
	hung := time.Now()
	if err := waitFor(ctx, time.Minute, "every machine a recovery candidate", func() (bool, error) {
		n, err := db.CountMatching(ctx, candidates)
		return n == p8Machines, err
	}); err != nil {
		return err
	}
	loadStart := load1()
	start := time.Now()
	if err := st.runRecoverer(rcfg); err != nil {
		return err
	}
	ideal, idealCalls, why := p8Ideal(simCfg)
	if err := waitFor(ctx, 10*time.Minute, "every machine Healthy again", func() (bool, error) {
		states, err := db.FleetStates(ctx, st.fleet.Name(), bmdb.DefaultFirstHeartbeatTimeout, p8HBTimeout)
		return states[bmdb.StateHealthy] == p8Machines, err
	}); err != nil {
		return err
	}
	took := time.Since(start)
	loadEnd := load1()
	stats := st.fleet.Stats()
	calls := make([]int, len(ids))
	for i, id := range ids {
		calls[i] = st.fleet.BMCCalls(id)
	}
	if err := st.stop(); err != nil {
		return err
	}
	slices.Sort(calls)
	// A cycle whose poll came a hair before the transition's end (the
	// interval and the transition are both 5 s) polls once more, 5 s later.
	over := len(calls) - sort.SearchInts(calls, idealCalls+1)
	// Where the time went: each machine's recovery work from claim to
	// finish (the ladder), and from the finish to its agent's start (boot
	// and takeover, retries included).
	var work50, work99, takeover50, takeover99 float64
	var booting int64
	err = runQuery(ctx, url, `
		WITH w AS (
			SELECT s.machine_id, s.at AS started, f.at AS finished
			FROM work_history s JOIN work_history f USING (machine_id, process)
			WHERE s.process = 'Recovery' AND s.event = 'Started' AND f.event = 'Finished'
		)
		SELECT
			percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM finished - started)),
			percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM finished - started)),
			percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM a.agent_started_at - finished)),
			percentile_cont(0.99) WITHIN GROUP (ORDER BY extract(epoch FROM a.agent_started_at - finished)),
			(SELECT count(*) FROM work_history WHERE process = 'AgentStart' AND event = 'Failed')
		FROM w JOIN machine_agent_started a USING (machine_id)`, &work50, &work99, &takeover50, &takeover99, &booting)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "bench: P8 ideal %s\n", why)
	report("P8", "bmc_recovery_seconds", took.Seconds(), "ideal", ideal.Seconds(), "ratio", took.Seconds()/ideal.Seconds(),
		"limit", 1.2*ideal.Seconds(), "limit_ratio", took.Seconds()/(1.2*ideal.Seconds()),
		"ideal_formula", "waves*(ssh+cycle+boot_left+ssh)+ssh+takeover",
		"clock", "all_candidates_to_all_healthy", "hang_to_candidates_s", start.Sub(hung).Seconds(),
		"machines", p8Machines, "parallelism", p8Parallelism, "rungs", ladder.Join(p8Rungs),
		"bmc_transition_s", p8Transition.Seconds(), "bmc_min_interval_s", p8MinInterval.Seconds(),
		"boot_s", p8Boot.Seconds(), "heartbeat_timeout_s", p8HBTimeout.Seconds(),
		"breaker_silent_fraction", rcfg.SilentFraction, "breaker_max_reboots", rcfg.MaxRebootsPerWindow,
		"ladder_p50_s", work50, "ladder_p99_s", work99, "finish_to_agent_p50_s", takeover50, "finish_to_agent_p99_s", takeover99,
		"takeover_attempts_while_booting", booting,
		"bmc_calls_ideal", idealCalls, "bmc_calls_p50", calls[len(calls)/2], "bmc_calls_max", calls[len(calls)-1], "bmc_calls_over_ideal", over,
		"inband_reboots_refused", stats.RebootsFailed, "power_ons", stats.PowerOns,
		"load1_start", loadStart, "load1_end", loadEnd)
	return nil
}

// p8Ideal is P8's ideal time from the configuration, the BMC calls of an
// ideal cycle, and how the time was reckoned (see benchBMCRecovery).
func p8Ideal(c sim.Config) (ideal time.Duration, calls int, why string) {
	pc := c.BMC.Power.WithDefaults()
	interval, transition := pc.MinInterval, cmp.Or(c.BMC.Transition, sim.DefaultBMCTransition)
	polls := max(1, int(math.Ceil(float64(transition)/float64(interval))))
	cycle := interval * time.Duration(2+2*polls)
	// The cheap rungs: the agent rung's dial is refused after the SSH
	// latency; the in-band reboot is refused at once. The cycle sees the
	// power on polls×interval after On; the machine answers SSH
	// transition + boot after it, and the recoverer holds the machine
	// until its SSH login succeeds (the boot wait), so a worker is busy
	// for the boot left too.
	bootLeft := max(0, transition+c.RebootLatency-time.Duration(polls)*interval)
	perMachine := c.SSHLatency + cycle + bootLeft + c.SSHLatency
	waves := (p8Machines + p8Parallelism - 1) / p8Parallelism
	takeover := c.SSHLatency + c.TakeoverLatency
	ideal = time.Duration(waves)*perMachine + takeover
	var b strings.Builder
	fmt.Fprintf(&b, "%.2f s = %d waves (%d machines / %d workers) × (%s agent rung's refused SSH dial + %s power cycle: "+
		"State, Off, %d State, On, %d State, %s apart, for %s transitions + %s boot left once the cycle sees the power on "+
		"+ %s SSH login that ends the boot wait) + %s takeover (SSH %s + %s) + first heartbeat (sent at once); "+
		"the in-band reboot rung is refused at once",
		ideal.Seconds(), waves, p8Machines, p8Parallelism, c.SSHLatency, cycle, polls, polls, interval, transition,
		bootLeft, c.SSHLatency, takeover, c.SSHLatency, c.TakeoverLatency)
	return ideal, 3 + 2*polls, b.String()
}

// load1 is the system's load average over the last minute, from
// /proc/loadavg; 0 if it cannot be read.
func load1() float64 {
	data, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(data))
	if len(f) == 0 {
		return 0
	}
	v, _ := strconv.ParseFloat(f[0], 64)
	return v
}
