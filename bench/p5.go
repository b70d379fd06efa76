package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/provider/sim"
)

const (
	p5Machines = 100_000
	// p5Interval is the heartbeat interval the server hands out: SPEC's
	// default, so 100,000 agents send 3,333 heartbeats a second.
	p5Interval = 30 * time.Second
	// p5Measure is how long RSS is watched once every agent heartbeats:
	// a few heartbeat intervals and provisioner passes.
	p5Measure = 2 * p5Interval
	// p5Mode is the first argument that makes the bench binary the
	// all-in-one process P5 measures.
	p5Mode = "p5-allinone"
)

// benchMemory is P5: the resident memory of one all-in-one process (callback
// server, provisioner, initializer, recoverer and a simulated fleet whose
// agents heartbeat to it) managing 100,000 machines. The process is a child
// of its own, so the figure is its memory alone, read from /proc by the
// parent: the peak (VmHWM, including setting up) and the largest RSS seen
// in steady state.
func benchMemory(ctx context.Context, e *env) error {
	url, err := e.database(ctx, "p5")
	if err != nil {
		return err
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, exe, p5Mode, "-url", url, "-machines", strconv.Itoa(p5Machines))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return err
	}
	defer func() {
		stdin.Close()
		_ = cmd.Wait()
	}()
	out := bufio.NewScanner(stdout)
	if !out.Scan() || out.Text() != "READY" {
		return fmt.Errorf("all-in-one process: %s", out.Text())
	}

	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	start := time.Now()
	if err := waitFor(ctx, 3*p5Interval, "every agent heartbeating", func() (bool, error) {
		n, err := heartbeating(ctx, conn, "sim")
		return n == p5Machines, err
	}); err != nil {
		return err
	}
	allBeating := time.Since(start)

	pid := cmd.Process.Pid
	var steady int64
	deadline := time.Now().Add(p5Measure)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		st, err := procStatus(pid)
		if err != nil {
			return err
		}
		steady = max(steady, st["VmRSS"])
		sleepCtx(ctx, time.Second)
	}
	// Every agent still heartbeats: the process was doing its job.
	var fresh int64
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM machine_agent_heartbeat WHERE agent_heartbeat_at > now() - $1::interval`,
		(p5Interval + 10*time.Second).String()).Scan(&fresh); err != nil {
		return err
	}
	st, err := procStatus(pid)
	if err != nil {
		return err
	}
	stdin.Close()
	if out.Scan() && out.Text() != "DONE" {
		return fmt.Errorf("all-in-one process: %s", out.Text())
	}
	const limit = 300 << 20
	report("P5", "rss_mb", float64(steady)/(1<<20), "peak_mb", float64(st["VmHWM"])/(1<<20),
		"limit", float64(limit>>20), "limit_ratio", float64(steady)/limit, "peak_limit_ratio", float64(st["VmHWM"])/limit,
		"machines", p5Machines, "fresh_heartbeats", fresh, "all_heartbeating_s", allBeating.Seconds(),
		"measured_s", p5Measure.Seconds())
	return nil
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

// allInOneMain is the process P5 measures. It records the simulated fleet
// in the BMDB in bulk (taking 100,000 machines over through SSH would
// measure the initializer, which P4 does), adopts every machine with the
// fleet's shared agent key, starts every component, prints READY and runs
// until stdin closes; then it stops cleanly and prints DONE.
func allInOneMain(args []string) int {
	fs := flag.NewFlagSet(p5Mode, flag.ContinueOnError)
	url := fs.String("url", "", "database URL")
	machines := fs.Int("machines", p5Machines, "fleet size")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if err := allInOne(context.Background(), *url, *machines); err != nil {
		fmt.Println("ERROR", err)
		return 1
	}
	fmt.Println("DONE")
	return 0
}

func allInOne(ctx context.Context, url string, machines int) error {
	if err := raiseFileLimit(10_000); err != nil {
		return err
	}
	db, err := bmdb.Open(ctx, bmdb.Config{URL: url})
	if err != nil {
		return err
	}
	defer db.Close()
	st, err := startSimStack(ctx, db, sim.Config{Machines: machines, SharedAgentKey: true}, p5Interval)
	if err != nil {
		return err
	}
	defer st.stop()
	if err := adoptAll(ctx, url, st); err != nil {
		return err
	}
	if err := st.runProvisioner(manager.ProvisionerConfig{}); err != nil {
		return err
	}
	if err := st.runInitializer(manager.InitializerConfig{}); err != nil {
		return err
	}
	if err := st.runRecoverer(manager.RecovererConfig{}); err != nil {
		return err
	}
	fmt.Println("READY")
	stopped := make(chan struct{})
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin)
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-st.ctx.Done():
	}
	return st.stop()
}

// adoptAll records every machine of the fleet as provided and started with
// the fleet's shared agent key, and starts their agents.
func adoptAll(ctx context.Context, url string, st *simStack) error {
	listing, err := st.fleet.ListMachines(ctx)
	if err != nil {
		return err
	}
	ids := make([]string, len(listing))
	for i, m := range listing {
		ids[i] = m.ID()
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	rows, err := conn.Query(ctx, `
		WITH ids AS (SELECT id, gen_random_uuid() AS machine_id FROM unnest($1::text[]) AS id),
		m AS (INSERT INTO machines (machine_id) SELECT machine_id FROM ids RETURNING machine_id)
		INSERT INTO machine_provided (machine_id, provider, provider_id, provider_status, provider_status_at)
		SELECT machine_id, $2, id, 'Running', now() FROM ids JOIN m USING (machine_id)
		RETURNING provider_id, machine_id::text`, ids, st.fleet.Name())
	if err != nil {
		return err
	}
	var adopt []sim.Adoption
	for rows.Next() {
		var a sim.Adoption
		if err := rows.Scan(&a.ProviderID, &a.MachineID); err != nil {
			return err
		}
		adopt = append(adopt, a)
	}
	if err := rows.Err(); err != nil {
		return err
	}
	if len(adopt) != len(ids) {
		return errors.New("not every machine was recorded")
	}
	key, err := st.fleet.Adopt(st.endpoint, st.srv.CA(), adopt)
	if err != nil {
		return err
	}
	if _, err := conn.Exec(ctx, `
		INSERT INTO machine_agent_started (machine_id, agent_started_at, agent_public_key)
		SELECT machine_id, now(), $1 FROM machine_provided`, []byte(key)); err != nil {
		return err
	}
	_, err = conn.Exec(ctx, "VACUUM ANALYZE")
	return err
}
