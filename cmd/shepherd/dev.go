package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/spf13/cobra"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/internal/pgserver"
	"github.com/shepherd/shepherd/internal/shellquote"
	"github.com/shepherd/shepherd/provider"
	"github.com/shepherd/shepherd/provider/equinix"
)

// devDatabase is the database `shepherd dev` keeps the BMDB in.
const devDatabase = "shepherd"

// devSimYAML is the default simulator configuration of `shepherd dev`
// (--sim replaces all of it). Machines answer in tens of milliseconds and
// reboot in 2 s, so the fleet's life shows in seconds. Every machine has a
// BMC, and every 2 minutes one running machine hangs whole (hang_every: its
// agent falls silent and its SSH dies), so that the recovery ladder keeps
// climbing: the agent and the in-band reboot fail, the power cycle brings it
// back. (A machine powered off from its web page with --web-actions is
// silent on purpose: its recovery is held until it is powered on.) The BMCs pace
// calls 5 s apart and take 5 s per transition, as real ones do, and a few
// misbehave as real ones do, so that the ladder's history and the machine
// pages show it: a tenth answer busy for 8 s from their first call (the
// controller's third attempt gets through), a tenth drop their first off
// and their first on (the cycle sends them again once bmc_settle passed
// without the state changing; 20 s rather than the default minute, so a
// cycle with both dropped takes about 70 s, not 150 s). The faults are
// picked by the fleet's seed, so the same machines misbehave every run.
const devSimYAML = "ssh_latency: 20ms\ntakeover_latency: 300ms\nreboot_latency: 2s\nhang_every: 2m\n" +
	"bmc_fraction: 1\nbmc_busy_fraction: 0.1\nbmc_drop_fraction: 0.1\nbmc_settle: 20s\n"

func newDevCommand() *cobra.Command {
	var (
		logs     logFlags
		cfg      stackConfig
		dataDir  string
		machines int
		simYAML  string
		kind     string
	)
	cmd := &cobra.Command{
		Use:   "dev",
		Short: "Run a private PostgreSQL, a simulated fleet and every component, until Ctrl-C",
		Long: "Zero-setup development mode: starts a private PostgreSQL in --data-dir (kept between runs),\n" +
			"migrates it, starts the callback server, a simulated fleet, all control loops and the web UI\n" +
			"(--web-listen; a taken default port falls back to a free one), and prints the fleet's\n" +
			"progress. Ctrl-C stops everything, PostgreSQL included.\n\n" +
			"--provider=equinix runs the real Equinix Metal provider against an in-process fake Metal API\n" +
			"with --machines hardware reservations; simulated machines stand in for the devices.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := logs.logger(cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			raiseFileLimit(cmd.Context(), log)
			if machines < 1 {
				return fmt.Errorf("--machines must be at least 1, got %d", machines)
			}
			if kind != "sim" && kind != equinix.Name {
				return fmt.Errorf("--provider must be sim or equinix, got %q", kind)
			}
			out := cmd.OutOrStdout()
			if err := os.MkdirAll(dataDir, 0o755); err != nil {
				return fmt.Errorf("creating --data-dir: %w", err)
			}
			ctx := cmd.Context()
			fmt.Fprintf(out, "shepherd dev: data in %s\n", dataDir)
			pg, err := pgserver.Start(ctx, pgserver.Config{Dir: filepath.Join(dataDir, "postgres"), Durable: true, Logger: log})
			if err != nil {
				if errors.Is(err, pgserver.ErrNotInstalled) {
					return fmt.Errorf("shepherd dev needs PostgreSQL's server package: %w", err)
				}
				return err
			}
			defer func() {
				if err := pg.Close(); err != nil {
					log.Warn("stopping PostgreSQL", "err", err)
				}
				fmt.Fprintln(out, "shepherd dev: stopped, PostgreSQL included")
			}()
			if err := ensureDatabase(ctx, pg.URL("postgres"), devDatabase); err != nil {
				return err
			}
			url := pg.URL(devDatabase)
			fmt.Fprintf(out, "shepherd dev: PostgreSQL running, BMDB at %s\n", url)
			// The BMDB client's metrics join the stack's (SPEC §6).
			reg := newRegistry()
			db, err := bmdb.Open(ctx, bmdb.Config{URL: url, Logger: log, Registerer: reg})
			if err != nil {
				return err
			}
			defer db.Close()

			agent := filepath.Join(dataDir, "shepherd-agent.sim")
			// Simulated machines do not run what is uploaded to them; a small
			// stand-in keeps thousands of uploads cheap.
			if err := os.WriteFile(agent, []byte("#!/bin/sh\n# stand-in uploaded to simulated machines\nexit 1\n"), 0o755); err != nil {
				return err
			}
			cfg.Components = allComponents
			cfg.Provider = kind
			cfg.ProviderConfig = []byte(fmt.Sprintf("machines: %d\n%s", machines, simYAML))
			var api devEquinixAPI
			if kind == equinix.Name {
				cfg.Providers = provider.NewRegistry()
				cfg.Providers.Add(equinix.Name, devEquinixFactory(machines, simYAML, filepath.Join(dataDir, "equinix"), &api))
			}
			cfg.Server.DataDir = filepath.Join(dataDir, "pki")
			cfg.SSHKeyFile = sshKeyFile(dataDir)
			cfg.Initializer.AgentPath = agent
			// A second dev (or anything else) may hold the default port.
			// (Changed cannot tell: setting the dev defaults below sets it.)
			cfg.Web.FallbackPort = cfg.Web.Listen == cmd.Flags().Lookup("web-listen").DefValue
			s := &stack{cfg: cfg, db: db, reg: reg, log: log}
			return s.run(ctx, func(s *stack) {
				fmt.Fprintf(out, "shepherd dev: callback server on %s, %d simulated machines (provider %s)\n", s.endpoint, machines, kind)
				if s.webAddr != "" {
					fmt.Fprintf(out, "shepherd dev: web UI at %s\n", webURL(s.webAddr, s.cfg.Web.TLSCert != ""))
				}
				if api.URL != "" {
					fmt.Fprintf(out, "shepherd dev: fake Equinix Metal API at %s, token in %s; try the equinix CLI against it:\n    shepherd equinix --config %s --database-url %s devices list\n",
						api.URL, api.TokenFile, shellquote.Readable(api.ConfigFile), shellquote.Readable(url))
				}
				go progress(ctx, out, s, machines)
			})
		},
	}
	fl := cmd.Flags()
	logs.bind(fl)
	_ = fl.Set("log-level", "warn")
	fl.Lookup("log-level").DefValue = "warn"
	fl.StringVar(&dataDir, "data-dir", devDataDir(), "directory kept between runs: PostgreSQL, keys, CA")
	fl.IntVar(&machines, "machines", 50, "size of the simulated fleet")
	fl.StringVar(&kind, "provider", "sim", "sim, or equinix: the Equinix Metal provider against an in-process fake Metal API")
	fl.StringVar(&simYAML, "sim", devSimYAML, "more simulator configuration (YAML)")
	bindStackFlags(fl, &cfg)
	// Development defaults: a local server, and a fleet that shows its life
	// (takeover, silence, recovery) in seconds rather than minutes.
	for name, v := range map[string]string{
		"server-listen":           "127.0.0.1:0",
		"web-listen":              "127.0.0.1:8080",
		"heartbeat-interval":      "5s",
		"heartbeat-timeout":       "30s",
		"first-heartbeat-timeout": "1m",
		"provisioner-period":      "5s",
		"updater-changing-period": "2s",
		"updater-stable-period":   "30s",
		"janitor-period":          "5s",
		"agent-dir":               "/var/lib/shepherd-agent",
	} {
		_ = fl.Set(name, v)
		fl.Lookup(name).DefValue = v
	}
	// run's wording says the web UI is off by default; in dev it is on.
	fl.Lookup("web-listen").Usage = `address to serve the web UI on; "" turns it off (a taken default port falls back to a free one)`
	return cmd
}

// ensureDatabase creates database on the server at adminURL unless it exists.
func ensureDatabase(ctx context.Context, adminURL, database string) error {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return fmt.Errorf("connecting to PostgreSQL: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var exists bool
	if err := conn.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", database).Scan(&exists); err != nil {
		return fmt.Errorf("looking for database %s: %w", database, err)
	}
	if exists {
		return nil
	}
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{database}.Sanitize()); err != nil {
		return fmt.Errorf("creating database %s: %w", database, err)
	}
	return nil
}

// progress prints the fleet's states whenever they change (and at least
// every 30 s), and once when every machine is Healthy.
func progress(ctx context.Context, out io.Writer, s *stack, machines int) {
	start := time.Now()
	var last string
	var lastAt time.Time
	allHealthy := false
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		states, err := s.db.FleetStates(ctx, s.provider.Name(), s.cfg.Recoverer.FirstHeartbeatTimeout, s.cfg.Recoverer.HeartbeatTimeout)
		if err != nil {
			continue
		}
		var total int64
		var parts []string
		for st, n := range states {
			total += n
			parts = append(parts, fmt.Sprintf("%s %d", st, n))
		}
		sort.Strings(parts)
		line := fmt.Sprintf("fleet: %d of %d machines provided: %s", total, machines, strings.Join(parts, ", "))
		if total == 0 {
			line = fmt.Sprintf("fleet: 0 of %d machines provided yet", machines)
		}
		if line != last || time.Since(lastAt) >= 30*time.Second {
			fmt.Fprintf(out, "%s  [%s]\n", line, time.Since(start).Round(time.Second))
			last, lastAt = line, time.Now()
		}
		if !allHealthy && states[bmdb.StateHealthy] == int64(machines) {
			allHealthy = true
			fmt.Fprintf(out, "shepherd dev: all %d machines are Healthy after %s (Ctrl-C to stop)\n", machines, time.Since(start).Round(100*time.Millisecond))
		}
	}
}
