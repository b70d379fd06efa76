package main

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/crypto/ssh"
	"golang.org/x/sync/errgroup"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/internal/sshx"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/provider"
	"github.com/shepherd/shepherd/provider/equinix"
	"github.com/shepherd/shepherd/provider/sim"
	"github.com/shepherd/shepherd/provider/static"
	"github.com/shepherd/shepherd/server"
)

// Component names of `shepherd run --components`.
const (
	compServer         = "server"
	compProvisioner    = "provisioner"
	compInitializer    = "initializer"
	compRecoverer      = "recoverer"
	compUpdater        = "updater"
	compJanitor        = "janitor"
	compDecommissioner = "decommissioner"
)

var allComponents = []string{compServer, compProvisioner, compInitializer, compRecoverer, compUpdater, compJanitor, compDecommissioner}

// providers is the registry of providers this binary knows: adding one is a
// package of its own and one line here.
func providers() *provider.Registry {
	r := provider.NewRegistry()
	r.Add("static", static.Factory)
	r.Add("sim", sim.Factory)
	r.Add(equinix.Name, equinix.Factory)
	return r
}

// stackConfig is everything `shepherd run` (and `shepherd dev`) configures.
type stackConfig struct {
	Components []string

	Provider       string // registry name
	ProviderConfig []byte // the provider's YAML configuration
	// Providers is the registry Provider is looked up in; nil means the
	// registry of every provider (`shepherd dev` swaps in its own).
	Providers *provider.Registry

	Server        server.Config
	MetricsListen string
	Web           webConfig // the web UI (web.go)
	// Pprof serves net/http/pprof's profiles (CPU, heap, goroutines) under
	// /debug/pprof/ on MetricsListen; default off. The profiles name the
	// code and let anyone who reaches them spend the process's CPU on
	// profiling, so they are opt-in and need MetricsListen.
	Pprof bool

	SSHKeyFile string // initializer's SSH client key; created (0600) if missing
	SSHUser    string

	// AgentEndpoint is the callback server's host:port as agents reach it;
	// default: the server's listener when the server runs in this process.
	AgentEndpoint string
	// AgentCAFile is the PEM CA agents verify the server with; default: the
	// server's (development) CA when the server runs in this process.
	AgentCAFile string

	Initializer manager.InitializerConfig
	Recoverer   manager.RecovererConfig
	// Listing judges listings for the provisioner and the updater both
	// (--suspect-fraction, --suspect-min-missing): their Listing fields are
	// set from it.
	Listing     manager.ListingGuard
	Provisioner manager.ProvisionerConfig
	Updater     manager.UpdaterConfig
	// Janitor's heartbeat timeouts are left zero: it reads those the
	// recoverers recorded in the BMDB, so that the gauges call Silent what
	// the recoverer reboots.
	Janitor        manager.JanitorConfig
	Decommissioner manager.DecommissionerConfig
}

// stack is a running set of components sharing one BMDB, registry, logger
// and provider.
type stack struct {
	cfg stackConfig
	db  *bmdb.DB
	reg *prometheus.Registry
	log *slog.Logger

	// set by start, for callers that watch the stack (shepherd dev)
	provider provider.Provider
	endpoint string
	webAddr  string // the web UI's listener, if it runs
}

func newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return reg
}

func parseComponents(list []string) ([]string, error) {
	var run []string
	for _, c := range list {
		for _, n := range strings.Split(c, ",") {
			n = strings.TrimSpace(n)
			if n == "" {
				continue
			}
			if n == "all" {
				for _, a := range allComponents {
					if !slices.Contains(run, a) {
						run = append(run, a)
					}
				}
				continue
			}
			if !slices.Contains(allComponents, n) {
				return nil, fmt.Errorf("--components: unknown component %q (known: %s, or all)", n, strings.Join(allComponents, ", "))
			}
			if !slices.Contains(run, n) {
				run = append(run, n)
			}
		}
	}
	if len(run) == 0 {
		return nil, fmt.Errorf("--components: name at least one of %s (or all)", strings.Join(allComponents, ", "))
	}
	return run, nil
}

// run builds the configured components and runs them until ctx ends or one
// fails; then it stops them all and returns.
//
// Every component is built (configuration checked, provider created,
// listeners opened) before any of them runs: a start-up error, however
// late, returns with nothing started, no session opened in the BMDB and
// every listener closed again. Starting some components and then failing
// would leave them running (or, stopped, would have let a provisioner make
// machines for a process that never came up).
func (s *stack) run(ctx context.Context, ready func(*stack)) error {
	var b parts
	defer b.close()
	if err := s.build(ctx, &b); err != nil {
		b.abandon()
		return err
	}
	g, gctx := errgroup.WithContext(ctx)
	for _, c := range b.components {
		g.Go(func() error { return named(c.name, c.run(gctx)) })
	}
	if ready != nil {
		ready(s)
	}
	err := g.Wait()
	if err != nil && ctx.Err() == nil {
		return err
	}
	return nil
}

// parts are the stack's components, built and not yet running.
type parts struct {
	components []component
	// abandonFns release what built components hold (their listeners) when
	// they will never run; a running component releases it itself.
	abandonFns []func()
	// closeFns run once the stack is done, whether it ran or not.
	closeFns []func()
}

// component is one long-running part of the stack: run blocks until ctx
// ends, cleans up and returns nil, or returns the error that stopped it.
type component struct {
	name string
	run  func(ctx context.Context) error
}

func (b *parts) add(name string, run func(ctx context.Context) error) {
	b.components = append(b.components, component{name, run})
}

// onAbandon registers fn to release a resource if the stack never runs.
func (b *parts) onAbandon(fn func()) { b.abandonFns = append(b.abandonFns, fn) }

// onClose registers fn to run when the stack is done.
func (b *parts) onClose(fn func()) { b.closeFns = append(b.closeFns, fn) }

func (b *parts) abandon() {
	for i := len(b.abandonFns) - 1; i >= 0; i-- {
		b.abandonFns[i]()
	}
}

func (b *parts) close() {
	for i := len(b.closeFns) - 1; i >= 0; i-- {
		b.closeFns[i]()
	}
}

// build builds the configured components into b, in the order they
// depend on each other, and starts none of them.
func (s *stack) build(ctx context.Context, b *parts) error {
	cfg := s.cfg
	has := func(c string) bool { return slices.Contains(cfg.Components, c) }

	if cfg.Pprof && cfg.MetricsListen == "" {
		return errors.New("--pprof serves on --metrics-listen, which is not set")
	}
	if cfg.MetricsListen != "" {
		if err := s.buildMetrics(b); err != nil {
			return err
		}
	}
	if err := cfg.Web.validate(); err != nil {
		return err
	}
	if cfg.Web.Listen != "" {
		if err := s.buildWeb(b); err != nil {
			return err
		}
	}

	var srv *server.Server
	if has(compServer) {
		c := cfg.Server
		// The server names itself (component=server) on its lines.
		c.Registerer, c.Logger = s.reg, s.log
		var err error
		if srv, err = server.New(c, s.db); err != nil {
			return err
		}
		addr, err := srv.Listen()
		if err != nil {
			return err
		}
		// The server has no Close: Run with a done context is how it
		// closes the listener Listen opened.
		b.onAbandon(func() {
			done, cancel := context.WithCancel(context.WithoutCancel(ctx))
			cancel()
			_ = srv.Run(done)
		})
		s.endpoint = addr.String()
		b.add(compServer, srv.Run)
	}

	if has(compJanitor) {
		j, err := manager.NewJanitor(cfg.Janitor, s.db, s.reg, s.log)
		if err != nil {
			return err
		}
		b.add(compJanitor, j.Run)
	}

	needProvider := has(compProvisioner) || has(compInitializer) || has(compRecoverer) || has(compUpdater) || has(compDecommissioner)
	if !needProvider {
		return nil
	}
	if cfg.Provider == "" {
		return errors.New("--provider is required for the provisioner, initializer, recoverer, updater and decommissioner")
	}
	signer, err := sshx.LoadOrCreateKey(cfg.SSHKeyFile)
	if err != nil {
		return err
	}
	// Operators put this line into the machines' authorized_keys.
	s.log.Info("SSH client key", "file", cfg.SSHKeyFile,
		"authorized_key", strings.TrimSpace(string(ssh.MarshalAuthorizedKey(signer.PublicKey()))))
	// The host key checker needs the provider's name, which is known only
	// once the provider exists; it is not used before.
	hostKeys := &manager.HostKeys{DB: s.db}
	env := provider.Env{
		// Every provider names itself (provider=NAME) on its lines.
		Logger:     s.log,
		Registerer: s.reg,
		HostKeys:   hostKeys,
		SSHSigner:  signer,
		SSHUser:    cfg.SSHUser,
		// Every process of the fleet shares an API account's budget
		// through the BMDB (SPEC §5.3).
		RequestBudget: manager.RequestBudgets(s.db),
	}
	registry := cfg.Providers
	if registry == nil {
		registry = providers()
	}
	p, err := registry.New(ctx, cfg.Provider, env, cfg.ProviderConfig)
	if err != nil {
		return err
	}
	if c, ok := p.(io.Closer); ok {
		b.onClose(func() {
			if err := c.Close(); err != nil {
				s.log.Warn("closing the provider", "provider", p.Name(), "err", err)
			}
		})
	}
	hostKeys.Provider = p.Name()
	s.provider = p
	if r, ok := p.(provider.Runner); ok {
		b.add("provider "+p.Name(), r.Run)
	}

	if has(compProvisioner) {
		pc := cfg.Provisioner
		pc.Listing = cfg.Listing
		pr, err := manager.NewProvisioner(pc, s.db, p, s.reg, s.log)
		if err != nil {
			return err
		}
		b.add(compProvisioner, pr.Run)
	}
	if has(compInitializer) {
		ic := cfg.Initializer
		ic.SSHKey = signer
		ic.SSHUser = cfg.SSHUser
		ic.ServerEndpoint = cfg.AgentEndpoint
		if ic.ServerEndpoint == "" {
			if srv == nil {
				return errors.New("--agent-endpoint is required when the server does not run in this process")
			}
			ic.ServerEndpoint = agentEndpoint(s.endpoint)
		}
		switch {
		case cfg.AgentCAFile != "":
			if ic.ServerCA, err = readCA(cfg.AgentCAFile); err != nil {
				return err
			}
		case srv != nil:
			ic.ServerCA = srv.CA()
		}
		in, err := manager.NewInitializer(ic, s.db, p, s.reg, s.log)
		if err != nil {
			return err
		}
		b.add(compInitializer, in.Run)
	}
	if has(compRecoverer) {
		rcfg := cfg.Recoverer
		rcfg.SSHKey, rcfg.SSHUser, rcfg.ConnectTimeout = signer, cfg.SSHUser, cfg.Initializer.ConnectTimeout
		rc, err := manager.NewRecoverer(rcfg, s.db, p, s.reg, s.log)
		if err != nil {
			return err
		}
		b.add(compRecoverer, rc.Run)
	}
	if has(compUpdater) {
		uc := cfg.Updater
		uc.Listing = cfg.Listing
		up, err := manager.NewUpdater(uc, s.db, p, s.reg, s.log)
		if err != nil {
			return err
		}
		b.add(compUpdater, up.Run)
	}
	if has(compDecommissioner) {
		dcfg := cfg.Decommissioner
		// The agent of a machine the provider cannot release is stopped
		// over SSH, reached as the initializer reached it.
		dcfg.AgentStop = &manager.AgentStopConfig{SSHKey: signer, SSHUser: cfg.SSHUser, AgentDir: cfg.Initializer.AgentDir}
		dc, err := manager.NewDecommissioner(dcfg, s.db, p, s.reg, s.log)
		if err != nil {
			return err
		}
		b.add(compDecommissioner, dc.Run)
	}
	return nil
}

func named(name string, err error) error {
	if err != nil {
		return fmt.Errorf("%s: %w", name, err)
	}
	return nil
}

// agentEndpoint turns the server's listening address into one agents can
// reach: a wildcard host becomes this machine's hostname.
func agentEndpoint(listen string) string {
	host, port, err := net.SplitHostPort(listen)
	if err != nil {
		return listen
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		if h, err := os.Hostname(); err == nil {
			host = h
		}
	}
	return net.JoinHostPort(host, port)
}

func readCA(path string) ([]byte, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("reading agent CA %s: %w", path, err)
	}
	b, _ := pem.Decode(data)
	if b == nil || b.Type != "CERTIFICATE" {
		return nil, fmt.Errorf("agent CA %s holds no PEM certificate", path)
	}
	if _, err := x509.ParseCertificate(b.Bytes); err != nil {
		return nil, fmt.Errorf("parsing agent CA %s: %w", path, err)
	}
	return b.Bytes, nil
}

// buildMetrics opens the metrics listener, so that a taken address fails
// the start, and adds the component that serves /metrics on it.
func (s *stack) buildMetrics(b *parts) error {
	ln, err := net.Listen("tcp", s.cfg.MetricsListen)
	if err != nil {
		return fmt.Errorf("--metrics-listen: %w", err)
	}
	b.onAbandon(func() { ln.Close() })
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(s.reg, promhttp.HandlerOpts{Registry: s.reg}))
	if s.cfg.Pprof {
		// On this mux only: importing net/http/pprof also registers on
		// http.DefaultServeMux, which nothing here serves.
		mux.HandleFunc("/debug/pprof/", pprof.Index)
		mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	hs := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	b.add("metrics", func(ctx context.Context) error {
		served := make(chan error, 1)
		go func() { served <- hs.Serve(ln) }()
		s.log.InfoContext(ctx, "serving metrics", "addr", ln.Addr().String())
		select {
		case err := <-served:
			return err // Serve never returns nil
		case <-ctx.Done():
		}
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		err := hs.Shutdown(sctx)
		if serr := <-served; !errors.Is(serr, http.ErrServerClosed) {
			err = errors.Join(err, serr)
		}
		return err
	})
	return nil
}
