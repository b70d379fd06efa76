package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/localport"
	"github.com/shepherd/shepherd/internal/metricstest"
	"github.com/shepherd/shepherd/manager"
)

func TestParseComponents(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		in      []string
		want    []string
		wantErr string
	}{
		{in: []string{"updater"}, want: []string{compUpdater}},
		{in: []string{"provisioner,updater", "updater"}, want: []string{compProvisioner, compUpdater}},
		{in: []string{"all"}, want: allComponents},
		{in: []string{"updater, bogus"}, wantErr: `unknown component "bogus"`},
		{in: []string{" , "}, wantErr: "name at least one"},
	} {
		got, err := parseComponents(tt.in)
		switch {
		case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
			t.Errorf("parseComponents(%q) error = %v, want one containing %q", tt.in, err, tt.wantErr)
		case tt.wantErr == "" && (err != nil || !slices.Equal(got, tt.want)):
			t.Errorf("parseComponents(%q) = %q, %v; want %q", tt.in, got, err, tt.want)
		}
	}
	if !slices.Contains(allComponents, compUpdater) {
		t.Errorf("all (%q) does not include the updater", allComponents)
	}
}

func TestRunRejectsUnknownComponent(t *testing.T) {
	t.Parallel()
	_, err := run(t, "run", "--components=updater,bogus", "--database-url", "postgres://nobody@127.0.0.1:1/none", "--data-dir", t.TempDir())
	if err == nil || !strings.Contains(err.Error(), `unknown component "bogus"`) {
		t.Fatalf("run with an unknown component: %v", err)
	}
}

// TestRunUpdater runs `shepherd run --components=provisioner,updater` on a
// simulated fleet with short updater periods, and waits for updater passes
// in its metrics.
func TestRunUpdater(t *testing.T) {
	db := bmdbtest.New(t)
	metricsAddr := freeAddr(t)
	dataDir := t.TempDir()
	simConfig := filepath.Join(dataDir, "sim.yaml")
	if err := os.WriteFile(simConfig, []byte("machines: 5\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := startCommand(t, "run", "--components=provisioner,updater", "--database-url", db.URL,
		"--data-dir", dataDir, "--provider", "sim", "--provider-config", simConfig,
		"--metrics-listen", metricsAddr, "--log-level", "warn", "--provisioner-period", "100ms",
		"--updater-changing-period", "50ms", "--updater-stable-period", "100ms")
	bmdbtest.WaitFor(t, 30*time.Second, "updater passes over the simulated fleet", func(ctx context.Context) (bool, error) {
		cmd.running(t)
		refs, err := db.ListProvided(ctx, "sim")
		if err != nil || len(refs) != 5 {
			return false, err
		}
		// Passes after the fleet was recorded, at the short periods.
		n, err := metricstest.Scrape(ctx, metricsAddr, `shepherd_updater_passes_total{provider="sim",result="ok"}`)
		return n >= 5, err
	})
	cmd.stop(t)
}

// freeAddr returns a loopback address with a port that was free a moment
// ago, for a listener the command under test opens itself (below the
// ephemeral range, see package localport).
func freeAddr(t *testing.T) string {
	t.Helper()
	port, err := localport.Free(localport.Low, localport.High)
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("127.0.0.1:%d", port)
}

// TestRunSuspectFractionZero runs the provisioner with --suspect-fraction 0
// over a static inventory that lacks 4 of the BMDB's 20 machines. 0 is a
// fraction of its own, not "the default": every listing that lacks more
// machines than the minimum (3) is suspect, so nothing is marked Missing.
// At the default 0.2 the same listing would be believed.
func TestRunSuspectFractionZero(t *testing.T) {
	db := bmdbtest.New(t)
	dir := t.TempDir()
	s := bmdbtest.Session(t, db, "setup", time.Minute)
	inventory := "machines:\n"
	err := s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		for i := range 20 {
			id := fmt.Sprintf("m%02d", i)
			if _, err := tx.AddMachine(ctx, bmdb.Provided{Provider: "lab", ProviderID: id, Status: bmdb.ProviderStatusRunning}); err != nil {
				return err
			}
			if i >= 4 {
				inventory += fmt.Sprintf("  - id: %s\n    address: 192.0.2.%d\n", id, i+1)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	invPath, cfgPath := filepath.Join(dir, "inventory.yaml"), filepath.Join(dir, "static.yaml")
	for name, data := range map[string]string{invPath: inventory, cfgPath: "name: lab\ninventory: " + invPath + "\n"} {
		if err := os.WriteFile(name, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	metricsAddr := freeAddr(t)
	cmd := startCommand(t, "run", "--components=provisioner", "--database-url", db.URL,
		"--data-dir", dir, "--provider", "static", "--provider-config", cfgPath,
		"--metrics-listen", metricsAddr, "--log-level", "error", "--provisioner-period", "50ms",
		"--suspect-fraction", "0")
	const passes = `shepherd_provisioner_passes_total{provider="lab",result="%s"}`
	var suspect float64
	bmdbtest.WaitFor(t, 30*time.Second, "a provisioner pass", func(ctx context.Context) (bool, error) {
		cmd.running(t)
		ok, err := metricstest.Scrape(ctx, metricsAddr, fmt.Sprintf(passes, "ok"))
		if err != nil {
			return false, err
		}
		suspect, err = metricstest.Scrape(ctx, metricsAddr, fmt.Sprintf(passes, "suspect"))
		return ok+suspect > 0, err
	})
	cmd.stop(t)
	if suspect == 0 {
		t.Error("no provisioner pass found the listing suspect with --suspect-fraction 0")
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM machine_provided WHERE provider_status = 'Missing'"); n != 0 {
		t.Errorf("%d machines marked Missing from a listing --suspect-fraction 0 should not believe", n)
	}
}

// TestWorkTimeoutFlags: each loop's work deadline (issue 10 item 6: a
// machine stays claimed at most this plus one lease) can be set.
func TestWorkTimeoutFlags(t *testing.T) {
	var cfg stackConfig
	fl := pflag.NewFlagSet("run", pflag.ContinueOnError)
	bindStackFlags(fl, &cfg)
	if cfg.Recoverer.Loop.WorkTimeout != manager.DefaultWorkTimeout {
		t.Errorf("default recoverer work timeout %s, want %s", cfg.Recoverer.Loop.WorkTimeout, manager.DefaultWorkTimeout)
	}
	err := fl.Parse([]string{"--initializer-work-timeout=7m", "--recoverer-work-timeout=8m", "--decommissioner-work-timeout=9m"})
	if err != nil {
		t.Fatal(err)
	}
	got := []time.Duration{cfg.Initializer.Loop.WorkTimeout, cfg.Recoverer.Loop.WorkTimeout, cfg.Decommissioner.Loop.WorkTimeout}
	want := []time.Duration{7 * time.Minute, 8 * time.Minute, 9 * time.Minute}
	if !slices.Equal(got, want) {
		t.Errorf("work timeouts %v, want %v", got, want)
	}
}

func TestBackoffFlags(t *testing.T) {
	var cfg stackConfig
	fl := pflag.NewFlagSet("run", pflag.ContinueOnError)
	fl.SetOutput(io.Discard)
	bindStackFlags(fl, &cfg)
	if cfg.Initializer.Backoff != bmdb.AgentStartBackoff() || cfg.Recoverer.Backoff != bmdb.RecoveryBackoff() {
		t.Errorf("default backoffs %v and %v, want the SPEC's %v and %v",
			cfg.Initializer.Backoff, cfg.Recoverer.Backoff, bmdb.AgentStartBackoff(), bmdb.RecoveryBackoff())
	}
	if err := fl.Parse([]string{"--initializer-backoff=10s,2m,1.5,30", "--recoverer-backoff=20s,0s,1,0"}); err != nil {
		t.Fatal(err)
	}
	want := bmdb.BackoffPolicy{Initial: 10 * time.Second, Maximum: 2 * time.Minute, Exponent: 1.5, MaxAttempts: 30}
	if cfg.Initializer.Backoff != want {
		t.Errorf("initializer backoff %v, want %v", cfg.Initializer.Backoff, want)
	}
	if want := (bmdb.BackoffPolicy{Initial: 20 * time.Second, Exponent: 1}); cfg.Recoverer.Backoff != want {
		t.Errorf("recoverer backoff %v, want %v", cfg.Recoverer.Backoff, want)
	}
	err := fl.Parse([]string{"--recoverer-backoff=1m,10s,2,5"})
	if err == nil || !strings.Contains(err.Error(), "below Initial") {
		t.Errorf("a maximum below the initial wait: err %v, want it named", err)
	}
}
