package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb"
)

const (
	p2Workers  = 16
	p2Machines = 5000
	p2Warmup   = 2 * time.Second
	p2Measure  = 10 * time.Second
	// p2BaselineMeasure is the plain-LIMIT baseline's shorter window: a
	// reference rate, which make bench's ten minutes need no more of.
	p2BaselineMeasure = 5 * time.Second
)

// benchClaimFinish is P2: claim + finish cycles per second with 16 workers,
// against a plain-LIMIT-1 baseline and pgbench's simple-update TPS at 16
// clients on the same server.
func benchClaimFinish(ctx context.Context, e *env) error {
	url, err := e.database(ctx, "p2")
	if err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	db, err := bmdb.Open(ctx, bmdb.Config{URL: url, MaxConns: 2 * p2Workers, Registerer: reg})
	if err != nil {
		return err
	}
	defer db.Close()
	if err := addMachines(ctx, db, "bench", p2Machines); err != nil {
		return err
	}

	skip, err := runCycles(ctx, e, db, url, reg, bmdb.ClaimSkipLocked, p2Measure)
	if err != nil {
		return fmt.Errorf("skip-locked cycles: %w", err)
	}
	plain, err := runCycles(ctx, e, db, url, reg, bmdb.ClaimPlainLimit, p2BaselineMeasure)
	if err != nil {
		return fmt.Errorf("plain-limit cycles: %w", err)
	}
	pgb, err := runPgbench(ctx, e)
	if err != nil {
		return fmt.Errorf("pgbench: %w", err)
	}
	report("P2", "claim_finish_per_s", skip.perSecond,
		"baseline", plain.perSecond, "ratio", skip.perSecond/plain.perSecond,
		"limit", pgb.tps, "limit_ratio", skip.perSecond/pgb.tps,
		"workers", p2Workers, "machines", p2Machines,
		"conflict_pct", 100*skip.conflictRate, "retry_pct", 100*skip.retryRate, "wal_bytes_per_cycle", skip.walPerCycle,
		"postgres_cpu_us", skip.postgresCPU.Seconds()*1e6, "process_cpu_us", skip.processCPU.Seconds()*1e6,
		"limit_postgres_cpu_us", pgb.postgresCPU.Seconds()*1e6, "limit_pgbench_cpu_us", pgb.clientCPU.Seconds()*1e6,
		"baseline_conflict_pct", 100*plain.conflictRate, "baseline_empty_claim_pct", 100*plain.emptyRate,
		"seconds", p2Measure.Seconds(), "baseline_seconds", p2BaselineMeasure.Seconds())
	return nil
}

// addMachines adds n machines of provider through the BMDB API.
func addMachines(ctx context.Context, db *bmdb.DB, provider string, n int) error {
	s, err := db.StartSession(ctx, bmdb.SessionConfig{Component: "bench-setup"})
	if err != nil {
		return err
	}
	defer s.Close(ctx)
	for done := 0; done < n; {
		chunk := min(500, n-done)
		err := s.Transact(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
			for i := range chunk {
				_, err := tx.AddMachine(ctx, bmdb.Provided{
					Provider: provider, ProviderID: fmt.Sprintf("%s-%d", provider, done+i), Status: bmdb.ProviderStatusRunning,
				})
				if err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			return err
		}
		done += chunk
	}
	return nil
}

type cycleResult struct {
	perSecond    float64
	conflictRate float64 // claims that lost a race, per cycle
	retryRate    float64 // transactions retried after 40001/40P01, per cycle
	emptyRate    float64 // claims that came back with nothing, per cycle
	// walPerCycle is the WAL the server wrote in the measuring window per
	// cycle. The cycle waits on WAL flushes, and unlike the rate this does
	// not move with the load of other processes on the machine, so it is the
	// number to compare when a change is meant to make the cycle cheaper.
	walPerCycle float64
	// postgresCPU and processCPU are the CPU time PostgreSQL and this
	// process spent per cycle in the measuring window. On two shared cores
	// the rate moves with everything else that runs; these say what a cycle
	// costs, and so where the gap to pgbench's rate is.
	postgresCPU, processCPU time.Duration
}

// runCycles runs p2Workers workers that claim an agent-start candidate and
// finish it straight away (without tag changes, so the machine stays a
// candidate), and counts cycles in a measuring window of length measure
// after a warm-up.
// url is db's database, on which it reads the WAL position.
func runCycles(ctx context.Context, e *env, db *bmdb.DB, url string, reg *prometheus.Registry, strategy bmdb.ClaimStrategy, measure time.Duration) (cycleResult, error) {
	s, err := db.StartSession(ctx, bmdb.SessionConfig{Component: "bench", ClaimStrategy: strategy})
	if err != nil {
		return cycleResult{}, err
	}
	defer s.Close(ctx)
	var (
		measuring atomic.Bool
		cycles    atomic.Int64
		empty     atomic.Int64
		firstErr  error
		errOnce   sync.Once
		wg        sync.WaitGroup
	)
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	cands := bmdb.AgentStartCandidates("bench")
	for range p2Workers {
		wg.Go(func() {
			for runCtx.Err() == nil {
				w, err := s.Work(runCtx, bmdb.ProcessAgentStart, cands)
				// The plain baseline reports nothing to do when the one
				// candidate it looked at was taken under its feet.
				if errors.Is(err, bmdb.ErrWorkConflict) || errors.Is(err, bmdb.ErrNothingToDo) {
					if measuring.Load() {
						empty.Add(1)
					}
					continue
				}
				if err == nil {
					err = w.Finish(runCtx, nil)
				}
				if err != nil {
					if runCtx.Err() == nil {
						errOnce.Do(func() { firstErr = err; cancel() })
					}
					return
				}
				if measuring.Load() {
					cycles.Add(1)
				}
			}
		})
	}
	sleepCtx(runCtx, p2Warmup)
	conflicts0, retries0 := counter(reg, "shepherd_bmdb_work_claim_conflicts_total"), counter(reg, "shepherd_bmdb_transaction_retries_total")
	wal0, walErr0 := walPosition(ctx, url)
	pg0, cpu0 := postgresCPU(e.srv.DataDir()), processCPU()
	measuring.Store(true)
	start := time.Now()
	sleepCtx(runCtx, measure)
	measuring.Store(false)
	elapsed := time.Since(start)
	pg1, cpu1 := postgresCPU(e.srv.DataDir()), processCPU()
	wal1, walErr1 := walPosition(ctx, url)
	conflicts, retries := counter(reg, "shepherd_bmdb_work_claim_conflicts_total")-conflicts0, counter(reg, "shepherd_bmdb_transaction_retries_total")-retries0
	cancel()
	wg.Wait()
	if firstErr != nil {
		return cycleResult{}, firstErr
	}
	if err := errors.Join(walErr0, walErr1); err != nil {
		return cycleResult{}, fmt.Errorf("reading the WAL position: %w", err)
	}
	n := float64(cycles.Load())
	if n == 0 {
		return cycleResult{}, errors.New("no cycle completed")
	}
	return cycleResult{
		perSecond:    n / elapsed.Seconds(),
		conflictRate: conflicts / n,
		retryRate:    retries / n,
		emptyRate:    float64(empty.Load()) / n,
		walPerCycle:  (wal1 - wal0) / n,
		postgresCPU:  (pg1 - pg0) / time.Duration(n),
		processCPU:   (cpu1 - cpu0) / time.Duration(n),
	}, nil
}

// walPosition is the server's current WAL insert position in bytes.
func walPosition(ctx context.Context, url string) (float64, error) {
	var pos float64
	err := runQuery(ctx, url, "SELECT (pg_current_wal_lsn() - '0/0')::float8", &pos)
	return pos, err
}

// counter sums every series of a counter family in reg.
func counter(reg *prometheus.Registry, name string) float64 {
	mfs, err := reg.Gather()
	if err != nil {
		return 0
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

var (
	tpsLine = regexp.MustCompile(`tps = ([0-9.]+) \(without initial connection time\)`)
	txLine  = regexp.MustCompile(`number of transactions actually processed: ([0-9]+)`)
)

// pgbenchResult is what P2 takes from pgbench's run: its rate, and the CPU
// time PostgreSQL and pgbench spent per transaction (connection set-up
// included, which at 16 connections over 10 s is noise).
type pgbenchResult struct {
	tps                    float64
	postgresCPU, clientCPU time.Duration
}

// runPgbench runs pgbench's simple-update script (-N) with 16 clients on the
// same server.
func runPgbench(ctx context.Context, e *env) (pgbenchResult, error) {
	var r pgbenchResult
	bin := filepath.Join(e.srv.BinDir(), "pgbench")
	if _, err := os.Stat(bin); err != nil {
		if bin, err = exec.LookPath("pgbench"); err != nil {
			return r, errors.New("pgbench not found next to postgres or on PATH (Debian: apt-get install postgresql-contrib)")
		}
	}
	if _, err := e.database(ctx, "pgbench"); err != nil {
		return r, err
	}
	dbname := fmt.Sprintf("pgbench_%d", e.seq)
	conn := []string{"-h", e.srv.SocketDir(), "-p", strconv.Itoa(e.srv.Port()), "-U", e.srv.User()}
	initArgs := append(append([]string{"-i", "-q", "-s", "16"}, conn...), dbname)
	if out, err := exec.CommandContext(ctx, bin, initArgs...).CombinedOutput(); err != nil {
		return r, fmt.Errorf("pgbench -i: %w: %s", err, out)
	}
	runArgs := append(append([]string{"-N", "-c", strconv.Itoa(p2Workers), "-j", "2", "-T", strconv.Itoa(int(p2Measure.Seconds()))}, conn...), dbname)
	cmd := exec.CommandContext(ctx, bin, runArgs...)
	pg0 := postgresCPU(e.srv.DataDir())
	out, err := cmd.CombinedOutput()
	if err != nil {
		return r, fmt.Errorf("pgbench -N: %w: %s", err, out)
	}
	pg1 := postgresCPU(e.srv.DataDir())
	m, n := tpsLine.FindSubmatch(out), txLine.FindSubmatch(out)
	if m == nil || n == nil {
		return r, fmt.Errorf("no TPS or transaction count in pgbench output: %s", out)
	}
	if r.tps, err = strconv.ParseFloat(string(m[1]), 64); err != nil {
		return r, fmt.Errorf("pgbench's TPS: %w", err)
	}
	txs, err := strconv.ParseInt(string(n[1]), 10, 64)
	if err != nil || txs == 0 {
		return r, fmt.Errorf("pgbench's transaction count %q: %v", n[1], err)
	}
	r.postgresCPU = (pg1 - pg0) / time.Duration(txs)
	r.clientCPU = cmd.ProcessState.SystemTime() + cmd.ProcessState.UserTime()
	r.clientCPU /= time.Duration(txs)
	return r, nil
}
