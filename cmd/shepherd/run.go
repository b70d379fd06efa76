package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"
	"golang.org/x/sync/errgroup"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/server"
)

// component is one long-running part of Shepherd that `shepherd run` can
// start; it runs until ctx ends.
type component func(ctx context.Context, deps *runDeps) error

// runDeps is what every component gets: the BMDB, the metrics registry and
// the logger.
type runDeps struct {
	db  *bmdb.DB
	reg prometheus.Registerer
	log *slog.Logger
}

type runFlags struct {
	db            databaseFlags
	components    []string
	logFormat     string
	logLevel      string
	metricsListen string
	server        server.Config
}

func newRunCommand() *cobra.Command {
	var f runFlags
	components := map[string]component{
		"server": func(ctx context.Context, d *runDeps) error {
			cfg := f.server
			cfg.Registerer, cfg.Logger = d.reg, d.log
			srv, err := server.New(cfg, d.db)
			if err != nil {
				return err
			}
			return srv.Run(ctx)
		},
	}
	names := make([]string, 0, len(components))
	for n := range components {
		names = append(names, n)
	}
	sort.Strings(names)

	cmd := &cobra.Command{
		Use:   "run",
		Short: "Run Shepherd's components against a BMDB until SIGINT or SIGTERM",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var run []string
			for _, c := range f.components {
				for _, n := range strings.Split(c, ",") {
					n = strings.TrimSpace(n)
					if n == "" {
						continue
					}
					if _, ok := components[n]; !ok {
						return fmt.Errorf("--components: unknown component %q (known: %s)", n, strings.Join(names, ", "))
					}
					if !slices.Contains(run, n) {
						run = append(run, n)
					}
				}
			}
			if len(run) == 0 {
				return fmt.Errorf("--components: name at least one of %s", strings.Join(names, ", "))
			}
			log, err := newLogger(f.logFormat, f.logLevel)
			if err != nil {
				return err
			}
			return runComponents(cmd.Context(), &f, run, components, log)
		},
	}
	f.db.bind(cmd)
	fl := cmd.Flags()
	fl.StringSliceVar(&f.components, "components", nil, "components to run, comma-separated: "+strings.Join(names, ", "))
	fl.StringVar(&f.logFormat, "log-format", "text", "log format: text or json")
	fl.StringVar(&f.logLevel, "log-level", "info", "log level: debug, info, warn or error")
	fl.StringVar(&f.metricsListen, "metrics-listen", "", "address to serve Prometheus /metrics on (default: off)")
	fl.StringVar(&f.server.Listen, "server-listen", ":7443", "callback server: TLS address agents send heartbeats to")
	fl.StringVar(&f.server.CertFile, "server-cert", "", "callback server: PEM certificate (chain); empty: a development CA in --data-dir")
	fl.StringVar(&f.server.KeyFile, "server-key", "", "callback server: PEM private key of --server-cert")
	fl.StringVar(&f.server.CAFile, "server-ca", "", "callback server: PEM CA agents verify the server against (default: system roots)")
	fl.StringVar(&f.server.DataDir, "data-dir", "", "directory for state such as the development CA")
	fl.StringSliceVar(&f.server.Hosts, "server-hosts", nil, "callback server: names and addresses in the development certificate (default localhost, 127.0.0.1, ::1, hostname)")
	fl.DurationVar(&f.server.HeartbeatInterval, "heartbeat-interval", 30*time.Second, "callback server: how often agents are told to send heartbeats")
	return cmd
}

func newLogger(format, level string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lv}
	switch format {
	case "text":
		return slog.New(slog.NewTextHandler(os.Stderr, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(os.Stderr, opts)), nil
	}
	return nil, fmt.Errorf("--log-format %q: want text or json", format)
}

// runComponents opens the BMDB and runs the named components until ctx ends
// or one of them fails, then stops them all.
func runComponents(ctx context.Context, f *runFlags, run []string, components map[string]component, log *slog.Logger) error {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	url := f.db.url
	if url == "" {
		url = os.Getenv("SHEPHERD_DATABASE_URL")
	}
	if url == "" {
		return errors.New("no database: pass --database-url or set SHEPHERD_DATABASE_URL")
	}
	db, err := bmdb.Open(ctx, bmdb.Config{URL: url, Registerer: reg, Logger: log})
	if err != nil {
		return err
	}
	defer db.Close()
	log.InfoContext(ctx, "BMDB open", "schema_version", db.SchemaVersion(), "components", strings.Join(run, ","))

	g, gctx := errgroup.WithContext(ctx)
	if f.metricsListen != "" {
		ln, err := net.Listen("tcp", f.metricsListen)
		if err != nil {
			return fmt.Errorf("--metrics-listen: %w", err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
		hs := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		g.Go(func() error {
			<-gctx.Done()
			sctx, cancel := context.WithTimeout(context.WithoutCancel(gctx), 5*time.Second)
			defer cancel()
			return hs.Shutdown(sctx)
		})
		g.Go(func() error {
			if err := hs.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
				return fmt.Errorf("metrics: %w", err)
			}
			return nil
		})
		log.InfoContext(ctx, "serving metrics", "addr", ln.Addr().String())
	}
	deps := &runDeps{db: db, reg: reg, log: log}
	for _, name := range run {
		c := components[name]
		g.Go(func() error {
			if err := c(gctx, deps.with(name)); err != nil {
				return fmt.Errorf("%s: %w", name, err)
			}
			return nil
		})
	}
	err = g.Wait()
	if err != nil && ctx.Err() == nil {
		return err
	}
	log.Info("stopped")
	return nil
}

func (d *runDeps) with(component string) *runDeps {
	c := *d
	c.log = d.log.With("component", component)
	return &c
}
