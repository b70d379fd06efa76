package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/metricstest"
)

// promtoolInstall says how to get promtool; scripts/require-promtool runs it.
const promtoolInstall = "scripts/require-promtool (as root on Debian: apt-get install prometheus)"

// TestMetricsPassPromtool runs `shepherd run` with each set of components
// and checks what its /metrics serves with `promtool check metrics`, the
// Prometheus project's own linter (SPEC §9: real peers where we can run
// them). It fails, never skips, when promtool is missing.
func TestMetricsPassPromtool(t *testing.T) {
	t.Parallel()
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatalf("promtool is not installed; install it with %s: %v", promtoolInstall, err)
	}
	for _, tc := range []struct {
		components string
		// families that must be served before the output is judged, so
		// that the check sees every metric of the components.
		want []string
	}{
		{"server", []string{"shepherd_server_heartbeats_accepted_total", "shepherd_server_heartbeat_duration_seconds"}},
		{"provisioner,initializer,recoverer,updater", []string{
			"shepherd_provisioner_passes_total", "shepherd_loop_claims_total", "shepherd_loop_processing_seconds",
			"shepherd_recovery_breaker_paused", "shepherd_updater_passes_total", "shepherd_updater_pass_duration_seconds",
			"shepherd_sim_heartbeats_total",
		}},
		{"janitor", []string{
			"shepherd_janitor_passes_total", "shepherd_janitor_fleet_query_duration_seconds", "shepherd_fleet_machines",
			"shepherd_fleet_live_work", "shepherd_fleet_backoffs", "shepherd_fleet_hardware_machines",
			"shepherd_fleet_memory_bytes", "shepherd_fleet_cpu_threads", "shepherd_fleet_decommissioned_machines",
			"shepherd_fleet_snapshot_timestamp_seconds",
		}},
		{"decommissioner", []string{"shepherd_decommissioner_releases_total", "shepherd_decommissioner_agent_stops_total", "shepherd_loop_claims_total"}},
	} {
		t.Run(tc.components, func(t *testing.T) {
			t.Parallel()
			// Every process serves the BMDB client's metrics too.
			want := append(tc.want, "shepherd_bmdb_transactions_total", "shepherd_bmdb_work_ended_total")
			body := runForMetrics(t, tc.components, want)
			cmd := exec.CommandContext(t.Context(), promtool, "check", "metrics")
			cmd.Stdin = bytes.NewReader(body)
			out, err := cmd.CombinedOutput()
			if err != nil || len(bytes.TrimSpace(out)) > 0 {
				t.Errorf("promtool check metrics on the /metrics of --components=%s: %v\n%s", tc.components, err, out)
			}
		})
	}
}

// runForMetrics runs `shepherd run --components=components` on a fresh
// BMDB with a small simulated fleet (and, for the janitor, machines in
// every table its gauges read), waits until /metrics serves every family
// in want, and returns that output. The command stops when the test ends.
func runForMetrics(t *testing.T, components string, want []string) []byte {
	t.Helper()
	db := bmdbtest.New(t)
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "sim", Healthy: 3, Stale: 1, AwaitingAgent: 1, NeverHeartbeat: 1})
	db.Exec(t, `INSERT INTO machine_hardware_report (machine_id, hardware_report_raw, cpu_threads, memory_bytes)
		SELECT machine_id, '\x00', 16, 64::bigint << 30 FROM machine_agent_heartbeat`)
	db.Exec(t, `INSERT INTO machine_decommission_request (machine_id)
		SELECT machine_id FROM machine_provided WHERE agent_phase = 'AwaitingAgent'`)
	s := bmdbtest.Session(t, db, "setup", time.Minute)
	gone := bmdbtest.AddMachine(t, db, s, "sim")
	err := s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		_, err := tx.Decommission(ctx, gone, true)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	metricsAddr := freeAddr(t)
	dir := t.TempDir()
	simConfig := filepath.Join(dir, "sim.yaml")
	agent := filepath.Join(dir, "shepherd-agent")
	for name, data := range map[string]string{simConfig: "machines: 8\n", agent: "stand-in: simulated machines do not run it"} {
		if err := os.WriteFile(name, []byte(data), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cmd := startCommand(t, "run", "--components="+components, "--database-url", db.URL,
		"--data-dir", dir, "--provider", "sim", "--provider-config", simConfig, "--agent", agent,
		"--server-listen", "127.0.0.1:0", "--agent-endpoint", "127.0.0.1:1",
		"--metrics-listen", metricsAddr, "--log-level", "error",
		"--provisioner-period", "100ms", "--updater-changing-period", "50ms", "--updater-stable-period", "100ms",
		"--janitor-period", "100ms")
	var body []byte
	bmdbtest.WaitFor(t, 30*time.Second, "/metrics of --components="+components+" with "+strings.Join(want, ", "), func(ctx context.Context) (bool, error) {
		cmd.running(t)
		var err error
		if body, err = metricstest.Get(ctx, metricsAddr); err != nil {
			return false, err
		}
		for _, f := range want {
			if !bytes.Contains(body, []byte("\n# TYPE "+f+" ")) {
				return false, nil
			}
		}
		return true, nil
	})
	return body
}
