package main

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/provider/sim"
	"github.com/shepherd/shepherd/server"
)

// simStack is an all-in-one Shepherd on one process: the callback server, a
// simulated fleet and the control loops, as `shepherd dev` runs them.
type simStack struct {
	db       *bmdb.DB
	fleet    *sim.Fleet
	srv      *server.Server
	endpoint string
	reg      *prometheus.Registry
	dir      string

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	errs   []error
}

// startSimStack starts the callback server (handing agents interval) and
// the simulated fleet; loops start with the run* methods.
func startSimStack(ctx context.Context, db *bmdb.DB, simCfg sim.Config, interval time.Duration) (*simStack, error) {
	dir, err := os.MkdirTemp("", "shepherd-bench-")
	if err != nil {
		return nil, err
	}
	s := &simStack{db: db, reg: prometheus.NewRegistry(), dir: dir}
	if s.srv, err = server.New(server.Config{Listen: "127.0.0.1:0", DataDir: filepath.Join(dir, "pki"), HeartbeatInterval: interval, Registerer: s.reg}, db); err != nil {
		return nil, err
	}
	addr, err := s.srv.Listen()
	if err != nil {
		return nil, err
	}
	s.endpoint = addr.String()
	simCfg.Registerer = s.reg
	if s.fleet, err = sim.New(simCfg); err != nil {
		return nil, err
	}
	rctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s.ctx, s.cancel = rctx, cancel
	s.goRun(func() error { return s.srv.Run(rctx) })
	s.goRun(func() error { return s.fleet.Run(rctx) })
	return s, nil
}

// runProvisioner starts the provisioner.
func (s *simStack) runProvisioner(cfg manager.ProvisionerConfig) error {
	pr, err := manager.NewProvisioner(cfg, s.db, s.fleet, s.reg, nil)
	if err != nil {
		return err
	}
	s.goRun(func() error { return pr.Run(s.ctx) })
	return nil
}

// startProvisioner starts the provisioner and returns a function that stops
// it and waits until it has.
func (s *simStack) startProvisioner(cfg manager.ProvisionerConfig) (stop func(), err error) {
	pr, err := manager.NewProvisioner(cfg, s.db, s.fleet, s.reg, nil)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(s.ctx)
	done := make(chan struct{})
	s.goRun(func() error {
		defer close(done)
		return pr.Run(ctx)
	})
	return func() { cancel(); <-done }, nil
}

// runInitializer starts the initializer, uploading a small stand-in agent:
// simulated machines do not run what is uploaded, and a real binary would
// make the figure measure SSH encryption rather than takeovers.
func (s *simStack) runInitializer(cfg manager.InitializerConfig) error {
	var err error
	if cfg.SSHKey, err = newSigner(); err != nil {
		return err
	}
	cfg.AgentPath = filepath.Join(s.dir, "agent-stand-in")
	if err := os.WriteFile(cfg.AgentPath, []byte("stand-in"), 0o755); err != nil {
		return err
	}
	cfg.ServerEndpoint, cfg.ServerCA = s.endpoint, s.srv.CA()
	in, err := manager.NewInitializer(cfg, s.db, s.fleet, s.reg, nil)
	if err != nil {
		return err
	}
	s.goRun(func() error { return in.Run(s.ctx) })
	return nil
}

// runRecoverer starts the recoverer.
func (s *simStack) runRecoverer(cfg manager.RecovererConfig) error {
	rc, err := manager.NewRecoverer(cfg, s.db, s.fleet, s.reg, nil)
	if err != nil {
		return err
	}
	s.goRun(func() error { return rc.Run(s.ctx) })
	return nil
}

func (s *simStack) goRun(f func() error) {
	s.wg.Go(func() {
		if err := f(); err != nil {
			s.mu.Lock()
			s.errs = append(s.errs, err)
			s.mu.Unlock()
		}
	})
}

// stop stops everything and reports the first error a component returned.
// It may be called more than once.
func (s *simStack) stop() error {
	s.cancel()
	s.wg.Wait()
	os.RemoveAll(s.dir)
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.errs) > 0 {
		return s.errs[0]
	}
	return nil
}

func newSigner() (ssh.Signer, error) {
	_, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, err
	}
	return ssh.NewSignerFromKey(key)
}

// waitFor polls cond every 50 ms until it holds or timeout passes.
func waitFor(ctx context.Context, timeout time.Duration, what string, cond func() (bool, error)) error {
	deadline := time.Now().Add(timeout)
	var last error
	for time.Now().Before(deadline) {
		ok, err := cond()
		if ok {
			return nil
		}
		last = err
		if ctx.Err() != nil {
			return ctx.Err()
		}
		sleepCtx(ctx, 50*time.Millisecond)
	}
	return fmt.Errorf("%s: not done after %s (last error: %v)", what, timeout, last)
}
