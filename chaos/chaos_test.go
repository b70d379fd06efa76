package chaos

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// config is one soak's settings.
type config struct {
	seed       int64
	duration   time.Duration // the fault phase
	machines   int           // simulated machines
	realHosts  int
	processes  int
	startBound time.Duration // fleet Healthy before the faults
	healBound  time.Duration // I5: every machine Healthy this long after the last fault, plus the reboot windows it needs
}

// TestChaos is the soak. Without CHAOS_DURATION it is the short run of
// `make test`: a fixed seed, then a random one (printed). With it (`make
// chaos`), one run of that length with CHAOS_SEED or a random seed.
func TestChaos(t *testing.T) {
	base := config{machines: 500, realHosts: 3, processes: 3, startBound: 5 * time.Minute, healBound: 2 * time.Minute}
	if v := os.Getenv("CHAOS_MACHINES"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 100 {
			t.Fatalf("CHAOS_MACHINES=%q: want a number >= 100", v)
		}
		base.machines = n
	}
	seeds := []int64{1, rand.Int64()}
	base.duration = 45 * time.Second
	if v := os.Getenv("CHAOS_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d < 10*time.Second {
			t.Fatalf("CHAOS_DURATION=%q: want a duration of at least 10s", v)
		}
		base.duration = d
		seeds = []int64{rand.Int64()}
	}
	if v := os.Getenv("CHAOS_SEED"); v != "" {
		seed, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			t.Fatalf("CHAOS_SEED=%q: want an integer", v)
		}
		seeds = []int64{seed}
	}
	bins := buildBinaries(t)
	for _, seed := range seeds {
		cfg := base
		cfg.seed = seed
		t.Run(fmt.Sprintf("seed=%d", seed), func(t *testing.T) { runSoak(t, cfg, bins) })
	}
}

func runSoak(t *testing.T, cfg config, bins string) {
	fmt.Printf("chaos: seed=%d duration=%s machines=%d processes=%d (replay: CHAOS_SEED=%d CHAOS_DURATION=%s make chaos)\n",
		cfg.seed, cfg.duration, cfg.machines+cfg.realHosts, cfg.processes, cfg.seed, cfg.duration)
	// Not t.TempDir: the postgres OS user must enter it, and a failed
	// soak's logs are kept for reading.
	dir, err := os.MkdirTemp("", "shepherd-chaos-")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the soak's logs are kept in %s", dir)
			return
		}
		if err := os.RemoveAll(dir); err != nil {
			t.Error(err)
		}
	})
	s := &soak{t: t, cfg: cfg, dir: dir, bins: bins}
	s.rec.applied, s.rec.skipped, s.rec.lostSeen = map[Kind]int{}, map[Kind]int{}, map[string]bool{}
	ctx := t.Context()
	s.start(ctx)
	faults := Schedule(cfg.seed, cfg.duration, Shape{
		Processes: cfg.processes, Servers: 2, SimMachines: cfg.machines, Racks: (cfg.machines + 99) / 100,
		RealHosts: cfg.realHosts, Lease: lease,
	})
	s.logf("schedule of %d faults, seed %d", len(faults), cfg.seed)
	sctx, stopSampling := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		var wg sync.WaitGroup
		wg.Go(func() { s.sampleAcks(sctx) })
		s.sampleWork(sctx)
		wg.Wait()
	}()
	began := time.Now()
	fctx, stopFaults := context.WithTimeout(ctx, cfg.duration+time.Minute)
	s.runFaults(fctx, faults)
	stopFaults()
	s.healAll()
	faultPhase := time.Since(began)
	healed := time.Now()
	s.logf("every fault healed after %s", faultPhase.Round(time.Millisecond))

	var report strings.Builder
	violations := 0
	line := func(name string, n int, detail string, list []string) {
		fmt.Fprintf(&report, "%-4s %-58s %d", name, detail, n)
		report.WriteString("\n")
		for _, l := range list[:min(len(list), 20)] {
			fmt.Fprintf(&report, "       %s\n", l)
		}
		violations += n
	}

	// I5 first: the other checks read a fleet at rest.
	// The bound: time to notice, reboot and take over a machine, and one
	// circuit breaker window (which the fault phase may have used up) per
	// budget of machines that need a reboot now.
	needReboot := cfg.realHosts
	for _, id := range s.simIDs {
		if _, alive := s.fleet.Agent(id); !alive {
			needReboot++
		}
	}
	healBound := cfg.healBound + time.Duration(1+needReboot/rebootBudget)*rebootWindow
	s.logf("%d machines need a reboot: every machine must be Healthy within %s", needReboot, healBound)
	healTime, unhealthy, herr := s.waitAllHealthy(ctx, healBound, healed)
	if herr != nil && len(unhealthy) == 0 {
		unhealthy = []string{herr.Error()} // no machine to name: the fleet is incomplete or unreadable
	}
	stopSampling()
	<-done

	pool, err := s.openPool(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	overlaps, err := bmdbtest.OverlappingClaimsIn(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	line("I1", len(overlaps), "overlapping claims of exclusive processes", overlaps)
	falseReboots, doubleReboots, unadmitted := s.checkReboots(ctx, pool)
	line("I2", len(falseReboots), "false reboots (agent alive, heard and recorded)", falseReboots)
	line("I3", len(doubleReboots), "reboots beyond one per silence episode", doubleReboots)
	overBudget := s.checkBudget(ctx, pool)
	line("I4", len(overBudget)+len(unadmitted), fmt.Sprintf("windows over the budget of %d per %s, unadmitted reboots", rebootBudget, rebootWindow), append(overBudget, unadmitted...))
	line("I5", len(unhealthy), fmt.Sprintf("machines not Healthy %s after the last fault", healBound), unhealthy)
	held := s.checkHeld(ctx, pool)
	line("I6", len(held), fmt.Sprintf("work held by a live session beyond %s", workTimeout+lease), held)
	lost := s.checkLostReports(ctx, pool)
	line("I7", len(lost), "acknowledged heartbeats or hardware reports missing", lost)
	hostileFinds := s.checkHostile()
	line("I8", len(hostileFinds), "hostile client effects, honest heartbeats refused for it", hostileFinds)
	var crashes []string
	for _, p := range s.procs {
		p.mu.Lock()
		crashes = append(crashes, p.crashes...)
		p.mu.Unlock()
	}
	line("--", len(crashes), "processes that exited on their own", crashes)
	line("--", len(s.rec.errors), "harness errors", s.rec.errors)

	applied := 0
	var kinds []string
	for k, n := range s.rec.applied {
		applied += n
		kinds = append(kinds, fmt.Sprintf("%s=%d", k, n))
	}
	slices.Sort(kinds)
	fmt.Fprintf(&report, "faults: %s\n", strings.Join(kinds, " "))
	if len(s.rec.skipped) > 0 {
		var skipped []string
		for k, n := range s.rec.skipped {
			skipped = append(skipped, fmt.Sprintf("%s=%d", k, n))
		}
		slices.Sort(skipped)
		fmt.Fprintf(&report, "skipped (target down or busy): %s\n", strings.Join(skipped, " "))
	}
	fmt.Fprintf(&report, "healthy again %s after the last fault\n", healTime.Round(time.Second))
	acks, refusals, failures, reboots, starts := s.truth.Counts()
	fmt.Fprintf(&report, "ground truth: %d heartbeats acknowledged, %d refused %v, %d unanswered; %d reboots; %d agents started\n",
		acks, refusals, s.truth.RefusalCodes(), failures, reboots, starts)
	fmt.Fprintf(&report, "R chaos faults=%d violations=%d seed=%d duration_s=%d machines=%d processes=%d\n",
		applied, violations, cfg.seed, int(cfg.duration.Seconds()), cfg.machines+cfg.realHosts, cfg.processes)
	fmt.Print(report.String())
	s.logf("report\n%s", report.String())
	if violations > 0 {
		t.Errorf("chaos: %d violations with seed %d (replay: CHAOS_SEED=%d CHAOS_DURATION=%s make chaos)\n%s",
			violations, cfg.seed, cfg.seed, cfg.duration, report.String())
		s.printHistories(ctx, pool, report.String())
		for _, p := range s.procs {
			t.Logf("%s log tail:\n%s", p.name, tail(p.logf.Name(), 40))
		}
		t.Logf("soak log tail:\n%s", tail(s.log.Name(), 80))
	}
}

// waitAllHealthy waits until every machine is Healthy with a heartbeat
// recorded after since (while heartbeats cannot be recorded, no machine is
// called Silent, so the state alone could hide a fleet nobody hears), and
// returns how long that took, or, after bound, an error and the machines
// that are not.
func (s *soak) waitAllHealthy(ctx context.Context, bound time.Duration, since time.Time) (time.Duration, []string, error) {
	start := time.Now()
	want := s.cfg.machines + s.cfg.realHosts
	for {
		total, unhealthy, err := s.unhealthyMachines(ctx, since)
		if err == nil && total == want && len(unhealthy) == 0 {
			return time.Since(start), nil, nil
		}
		if time.Since(start) > bound {
			return time.Since(start), unhealthy, fmt.Errorf("%d of %d machines in the BMDB, %d of them not Healthy and heard from (err %v)",
				total, want, len(unhealthy), err)
		}
		hold(ctx, time.Second)
		if ctx.Err() != nil {
			return time.Since(start), unhealthy, ctx.Err()
		}
	}
}

// unhealthyMachines returns how many machines the BMDB holds, and those of
// them that are not Healthy with a heartbeat recorded after since.
func (s *soak) unhealthyMachines(ctx context.Context, since time.Time) (int, []string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.directURL())
	if err != nil {
		return 0, nil, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	rows, err := conn.Query(ctx, `
		SELECT m.provider_id, m.state, m.agent_phase, h.agent_heartbeat_at
		FROM machine_states($1, $2) m LEFT JOIN machine_agent_heartbeat h USING (machine_id)
		ORDER BY m.provider_id`,
		firstHeartbeatTimeout.Milliseconds(), heartbeatTimeout.Milliseconds())
	if err != nil {
		return 0, nil, err
	}
	defer rows.Close()
	total := 0
	var out []string
	for rows.Next() {
		var id, st, phase string
		var hb *time.Time
		if err := rows.Scan(&id, &st, &phase, &hb); err != nil {
			return total, out, err
		}
		total++
		if st == "Healthy" && hb != nil && hb.After(since) {
			continue
		}
		last := "none"
		if hb != nil {
			last = hb.Format("15:04:05.000")
		}
		out = append(out, fmt.Sprintf("%s: %s (agent phase %s, last heartbeat %s)", id, st, phase, last))
	}
	return total, out, rows.Err()
}
