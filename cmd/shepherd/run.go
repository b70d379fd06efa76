package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/ladder"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/provider"
)

// logFlags bind the logging flags.
type logFlags struct {
	format, level string
}

func (f *logFlags) bind(fl *pflag.FlagSet) {
	fl.StringVar(&f.format, "log-format", "text", "log format: text or json")
	fl.StringVar(&f.level, "log-level", "info", "log level: debug, info, warn or error")
}

// logger returns the logger the flags ask for, writing to w (the command's
// stderr).
func (f *logFlags) logger(w io.Writer) (*slog.Logger, error) { return newLogger(w, f.format, f.level) }

func newLogger(w io.Writer, format, level string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lv}
	switch format {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, fmt.Errorf("--log-format %q: want text or json", format)
}

// bindStackFlags binds the flags of the components to cfg; `shepherd run`
// and `shepherd dev` share them.
func bindStackFlags(fl *pflag.FlagSet, cfg *stackConfig) {
	fl.StringVar(&cfg.MetricsListen, "metrics-listen", "", "address to serve Prometheus /metrics on (default: off)")
	fl.BoolVar(&cfg.Pprof, "pprof", false, "also serve Go's profiles (/debug/pprof/) on --metrics-listen, for profiling under load; keep that address private")
	cfg.Web.bind(fl)

	fl.StringVar(&cfg.Server.Listen, "server-listen", ":7443", "callback server: TLS address agents send heartbeats to")
	fl.StringVar(&cfg.Server.DatagramListen, "server-datagram-listen", "", "callback server: UDP address agents send heartbeat datagrams to (default: --server-listen's host and port)")
	fl.BoolVar(&cfg.Server.NoDatagrams, "server-no-datagrams", false, "callback server: no UDP socket and no datagram grants, every heartbeat over TLS (for networks that cannot pass UDP)")
	fl.StringVar(&cfg.Server.CertFile, "server-cert", "", "callback server: PEM certificate (chain); empty: a development CA in --data-dir")
	fl.StringVar(&cfg.Server.KeyFile, "server-key", "", "callback server: PEM private key of --server-cert")
	fl.StringVar(&cfg.Server.CAFile, "server-ca", "", "callback server: PEM CA agents verify the server against (default: system roots)")
	fl.StringSliceVar(&cfg.Server.Hosts, "server-hosts", nil, "callback server: names and addresses in the development certificate (default localhost, 127.0.0.1, ::1, hostname)")
	fl.DurationVar(&cfg.Server.HeartbeatInterval, "heartbeat-interval", 30*time.Second, "callback server: how often agents are told to send heartbeats")
	fl.IntVar(&cfg.Server.MaxConnections, "server-max-connections", 0, "callback server: most client connections open at once (0: the open-file limit less 1024)")
	fl.IntVar(&cfg.Server.MaxConnectionsPerIP, "server-max-connections-per-ip", 4096, "callback server: most client connections open at once from one IP address")

	fl.StringVar(&cfg.SSHUser, "ssh-user", "root", "SSH user for agent starts, agent stops and reboots (providers may name another)")
	fl.StringVar(&cfg.AgentEndpoint, "agent-endpoint", "", "callback server host:port as agents reach it (default: this process's server)")
	fl.StringVar(&cfg.AgentCAFile, "agent-ca", "", "PEM CA agents verify the callback server with (default: this process's server CA)")

	in := &cfg.Initializer
	fl.IntVar(&in.Loop.Parallelism, "initializer-parallelism", 10, "initializer: machines taken over at once")
	in.Loop.QueryLimit = manager.DefaultLimit()
	fl.Var(&in.Loop.QueryLimit, "initializer-query-limit", "initializer: candidate query rate as duration,burst")
	fl.DurationVar(&in.Loop.WorkTimeout, "initializer-work-timeout", manager.DefaultWorkTimeout, "initializer: longest one machine is worked on before the attempt is failed (a machine stays claimed at most this plus one lease)")
	in.Backoff = bmdb.AgentStartBackoff()
	fl.Var(&in.Backoff, "initializer-backoff", "initializer: wait after failed agent starts as initial,maximum,exponent,attempts (quarantine after attempts failures in a row; 0: never)")
	fl.DurationVar(&in.ConnectTimeout, "ssh-connect-timeout", 30*time.Second, "initializer: bound on dialing and the SSH handshake")
	fl.DurationVar(&in.ExecTimeout, "ssh-exec-timeout", 2*time.Minute, "initializer: bound on uploading and starting the agent")
	fl.StringVar(&in.AgentDir, "agent-dir", "", "initializer, decommissioner: remote directory of the agent ({provider_id} and {machine_id} are replaced; a relative path is under the SSH user's home; default "+manager.RootAgentDir+" for root, else ~/"+manager.HomeAgentDir+")")

	rc := &cfg.Recoverer
	fl.IntVar(&rc.Loop.Parallelism, "recoverer-parallelism", 4, "recoverer: machines rebooted at once")
	rc.Loop.QueryLimit = manager.DefaultLimit()
	fl.Var(&rc.Loop.QueryLimit, "recoverer-query-limit", "recoverer: candidate query rate as duration,burst")
	fl.DurationVar(&rc.Loop.WorkTimeout, "recoverer-work-timeout", manager.DefaultWorkTimeout, "recoverer: longest one machine is worked on before the attempt is failed (a machine stays claimed at most this plus one lease)")
	rc.Backoff = bmdb.RecoveryBackoff()
	fl.Var(&rc.Backoff, "recoverer-backoff", "recoverer: wait after failed reboots as initial,maximum,exponent,attempts (quarantine after attempts failures in a row; 0: never)")
	fl.DurationVar(&rc.HeartbeatTimeout, "heartbeat-timeout", bmdb.DefaultHeartbeatTimeout, "recoverer: a machine is silent when its last heartbeat is older than this")
	fl.DurationVar(&rc.FirstHeartbeatTimeout, "first-heartbeat-timeout", bmdb.DefaultFirstHeartbeatTimeout, "recoverer: a machine is silent when no heartbeat came this long after its agent started")
	fl.IntVar(&rc.MaxRebootsPerWindow, "max-reboots-per-window", 0, "recoverer: reboot budget per window (0: 5% of the fleet, at least 1)")
	fl.DurationVar(&rc.Window, "reboot-window", 10*time.Minute, "recoverer: the circuit breaker's window (at most 24h)")
	fl.IntVar(&rc.MaxRebootsWithoutHeartbeat, "max-reboots-without-heartbeat", 3, "recoverer: quarantine a machine rebooted this many times without a heartbeat in between")
	fl.Float64Var(&rc.SilentFraction, "silent-fraction", 0.25, "recoverer: no reboots while more than this fraction of started machines is silent")
	rc.Rungs = ladder.Default
	fl.Var((*rungsFlag)(&rc.Rungs), "recovery-rungs", "recoverer: the recovery ladder's rungs for machines whose provider chooses none, from "+ladder.Join(ladder.All)+" (always climbed in that order)")

	pr := &cfg.Provisioner
	fl.DurationVar(&pr.Period, "provisioner-period", 30*time.Second, "provisioner: time between reconcile passes")
	fl.IntVar(&pr.MaxMachines, "max-machines", 0, "provisioner: cap on the provider's machines (0: no limit)")
	fl.IntVar(&pr.ChunkSize, "chunk-size", 50, "provisioner: machines created per pass")
	pr.CreateLimit = manager.DefaultLimit()
	fl.Var(&pr.CreateLimit, "create-limit", "provisioner: creation rate as duration,burst")
	// Pointers, set whether or not the flags are given: their defaults are
	// the manager's, and 0 is a value of its own (ListingGuard).
	cfg.Listing = manager.ListingGuard{Fraction: new(float64), MinMissing: new(int)}
	fl.Float64Var(cfg.Listing.Fraction, "suspect-fraction", manager.DefaultSuspectFraction,
		"provisioner and updater: ignore a listing that lacks more than this fraction of the known machines "+
			"and more than --suspect-min-missing of them (0: any listing lacking more than the minimum; 1: believe every listing)")
	fl.IntVar(cfg.Listing.MinMissing, "suspect-min-missing", manager.DefaultSuspectMinMissing,
		"provisioner and updater: a listing that lacks at most this many known machines is believed whatever the fraction")

	up := &cfg.Updater
	fl.DurationVar(&up.ChangingPeriod, "updater-changing-period", 10*time.Second, "updater: time between passes while a machine is provisioning")
	fl.DurationVar(&up.StablePeriod, "updater-stable-period", 5*time.Minute, "updater: time between passes while no machine is changing")

	jn := &cfg.Janitor
	fl.DurationVar(&jn.Period, "janitor-period", 30*time.Second, "janitor: time between passes (expiring dead work, deleting old sessions, reading the fleet gauges)")
	fl.DurationVar(&jn.SessionRetention, "session-retention", 7*24*time.Hour, "janitor: ended sessions are deleted after this long (history keeps their ids)")

	dc := &cfg.Decommissioner
	fl.IntVar(&dc.Loop.Parallelism, "decommissioner-parallelism", 2, "decommissioner: machines decommissioned at once")
	dc.Loop.QueryLimit = manager.DefaultLimit()
	fl.Var(&dc.Loop.QueryLimit, "decommissioner-query-limit", "decommissioner: candidate query rate as duration,burst")
	fl.DurationVar(&dc.Loop.WorkTimeout, "decommissioner-work-timeout", manager.DefaultWorkTimeout, "decommissioner: longest one machine is worked on before the attempt is failed (a machine stays claimed at most this plus one lease)")
}

func newRunCommand() *cobra.Command {
	var (
		db         databaseFlags
		logs       logFlags
		cfg        stackConfig
		components []string
		dataDir    string
		provConfig string
		agentPath  string
	)
	cmd := &cobra.Command{
		Use:   "run",
		Short: "Run Shepherd's components against a BMDB until SIGINT or SIGTERM",
		Long: "Runs the named components (" + strings.Join(allComponents, ", ") + ", or all) in one process.\n" +
			"Any number of processes may run any components against the same BMDB.\n" +
			"SIGINT or SIGTERM shuts down cleanly; a second one exits at once. SIGHUP makes the provider\n" +
			"re-read its files (a static inventory and the secret files it names).",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			// Catch SIGHUP before anything else, so that it never kills
			// the process (its default action); it reloads once the
			// provider runs.
			hup := make(chan os.Signal, 1)
			signal.Notify(hup, syscall.SIGHUP)
			defer signal.Stop(hup)
			var err error
			if cfg.Components, err = parseComponents(components); err != nil {
				return err
			}
			log, err := logs.logger(cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			raiseFileLimit(cmd.Context(), log)
			if provConfig != "" {
				if cfg.ProviderConfig, err = os.ReadFile(provConfig); err != nil {
					return fmt.Errorf("--provider-config: %w", err)
				}
			}
			if dataDir == "" {
				return fmt.Errorf("--data-dir is required (it keeps the SSH key and the development CA)")
			}
			cfg.Server.DataDir = filepath.Join(dataDir, "pki")
			cfg.SSHKeyFile = sshKeyFile(dataDir)
			cfg.Initializer.AgentPath = agentPath
			if agentPath == "" {
				cfg.Initializer.AgentPath = defaultAgentPath()
			}
			reg := newRegistry()
			d, err := db.openObserved(cmd.Context(), reg, log)
			if err != nil {
				return err
			}
			defer d.Close()
			s := &stack{cfg: cfg, db: d, reg: reg, log: log}
			log.InfoContext(cmd.Context(), "starting", "components", strings.Join(cfg.Components, ","), "schema_version", d.SchemaVersion())
			var reloader sync.WaitGroup
			defer reloader.Wait()
			rctx, stopReloader := context.WithCancel(cmd.Context())
			defer stopReloader() // before reloader.Wait: deferred calls run last first
			err = s.run(cmd.Context(), func(s *stack) {
				reloader.Go(func() { reloadOnHangup(rctx, hup, s.provider, log) })
			})
			log.Info("stopped")
			return err
		},
	}
	db.bind(cmd)
	fl := cmd.Flags()
	logs.bind(fl)
	fl.StringSliceVar(&components, "components", nil, "components to run, comma-separated: "+strings.Join(allComponents, ", ")+", or all")
	fl.StringVar(&dataDir, "data-dir", "", "directory for the SSH key and the development CA (required)")
	fl.StringVar(&cfg.Provider, "provider", "", "provider of the machines: "+strings.Join(providers().Names(), ", "))
	fl.StringVar(&provConfig, "provider-config", "", "YAML configuration file of the provider")
	fl.StringVar(&agentPath, "agent", "", "local agent binary to upload (default: shepherd-agent next to this binary)")
	bindStackFlags(fl, &cfg)
	return cmd
}

// reloadOnHangup makes p re-read its files on every signal from hup, until
// ctx ends. A provider without files (p is not a provider.Reloader, or no
// provider runs) has nothing to re-read, which is logged.
func reloadOnHangup(ctx context.Context, hup <-chan os.Signal, p provider.Provider, log *slog.Logger) {
	r, ok := p.(provider.Reloader)
	for {
		select {
		case <-ctx.Done():
			return
		case <-hup:
		}
		if !ok {
			log.WarnContext(ctx, "SIGHUP: the provider has no files to reload")
			continue
		}
		// Reload logs what it loaded, or what is wrong (FILE:LINE) while
		// the last good configuration stays in force.
		if err := r.Reload(); err != nil {
			log.ErrorContext(ctx, "SIGHUP: reload failed, keeping the configuration in force", "provider", p.Name())
			continue
		}
		log.InfoContext(ctx, "SIGHUP: provider reloaded", "provider", p.Name())
	}
}

// openObserved is open (with migrations) for the long-running commands:
// the BMDB client's metrics (sessions, transactions, work; SPEC §6) are
// registered on reg, which they serve on /metrics, and its events (lost
// sessions, retried transactions) are logged to log.
//
// A database that cannot be reached now (down, starting, read-only while a
// failover is under way, a network fault) is waited for, with pauses
// growing from openRetryFirst to openRetryMax, until ctx ends: a process
// started, or restarted by its supervisor, during a database outage comes
// up when the database does, as the running ones carry on. Configuration
// errors (bmdb.RetryOpen) end it at once.
func (f *databaseFlags) openObserved(ctx context.Context, reg prometheus.Registerer, log *slog.Logger) (*bmdb.DB, error) {
	pause := openRetryFirst
	for {
		d, err := f.openConfig(ctx, bmdb.Config{Schema: bmdb.SchemaMigrate, Registerer: reg, Logger: log})
		if err == nil || !bmdb.RetryOpen(err) || ctx.Err() != nil {
			return d, err
		}
		log.WarnContext(ctx, "the database cannot be reached; waiting for it", "retry_in", pause, "err", err)
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("waiting for the database: %w (last error: %w)", ctx.Err(), err)
		case <-time.After(pause):
		}
		pause = min(2*pause, openRetryMax)
	}
}

// The pauses between attempts to open an unreachable database.
const (
	openRetryFirst = time.Second
	openRetryMax   = 30 * time.Second
)

// defaultAgentPath is shepherd-agent next to the running binary.
func defaultAgentPath() string {
	exe, err := os.Executable()
	if err != nil {
		return "shepherd-agent"
	}
	return filepath.Join(filepath.Dir(exe), "shepherd-agent")
}

// rungsFlag binds --recovery-rungs to a ladder.
type rungsFlag []ladder.Rung

func (f *rungsFlag) String() string { return ladder.Join(*f) }
func (f *rungsFlag) Type() string   { return "rungs" }
func (f *rungsFlag) Set(s string) error {
	r, err := ladder.ParseList(s)
	if err != nil {
		return err
	}
	*f = r
	return nil
}
