package manager

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"path"
	"time"

	"github.com/pkg/sftp"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/internal/shellquote"
	"github.com/shepherd/shepherd/internal/sshx"
	"github.com/shepherd/shepherd/provider"
)

// DecommissionerConfig configures the decommissioner (SPEC §3.8). Zero
// values mean defaults.
type DecommissionerConfig struct {
	Loop LoopConfig
	// ReleaseTimeout bounds one release request to the provider; default 5m.
	ReleaseTimeout time.Duration
	// Backoff applies when the provider fails to release a machine;
	// default bmdb.DecommissionBackoff().
	Backoff bmdb.BackoffPolicy
	// AgentStop, if set, is how the agent of a machine the provider cannot
	// release is stopped over SSH; nil leaves it to stop by itself at its
	// next heartbeat (see Decommissioner).
	AgentStop *AgentStopConfig
}

// AgentStopConfig says how the decommissioner reaches a machine's agent over
// SSH to stop it: as the initializer reached it to start it.
type AgentStopConfig struct {
	// SSHKey is Shepherd's SSH client key; required.
	SSHKey ssh.Signer
	// SSHUser logs in unless the provider names another user; default root.
	SSHUser string
	// AgentDir is the remote directory of the agent, as
	// InitializerConfig.AgentDir, with the same default (RootAgentDir for
	// root, else HomeAgentDir under the SSH user's home).
	AgentDir string
	// Timeout bounds dialing and stopping together; default 1m.
	Timeout time.Duration
}

// Validate reports the first problem with the configuration. It changes nothing.
// (Ifs, not a switch: see LoopConfig.Validate.)
func (c AgentStopConfig) Validate() error {
	if c.SSHKey == nil {
		return errors.New("decommissioner: AgentStop.SSHKey is required")
	}
	if c.Timeout < 0 {
		return fmt.Errorf("decommissioner: AgentStop.Timeout must be >= 0 (0 = default 1m), got %s", c.Timeout)
	}
	return nil
}

// Validate reports the first problem with the configuration. It changes nothing.
func (c DecommissionerConfig) Validate() error {
	if err := c.Loop.Validate("decommissioner"); err != nil {
		return err
	}
	if c.ReleaseTimeout < 0 {
		return fmt.Errorf("decommissioner: ReleaseTimeout must be >= 0 (0 = default 5m), got %s", c.ReleaseTimeout)
	}
	if c.AgentStop != nil {
		if err := c.AgentStop.Validate(); err != nil {
			return err
		}
	}
	if c.Backoff != (bmdb.BackoffPolicy{}) {
		return c.Backoff.Validate()
	}
	return nil
}

// Decommissioner takes machines an operator asked to decommission out of
// the fleet (SPEC §3.8). For each one it asks the provider to release the
// machine where the provider can (provider.Releaser: a deleted device, a
// freed simulated slot, whose agent stops with it), then, in the
// transaction that finishes the work, deletes the machine's live tags and
// sets its decommissioned-at time; the machines row and its history stay.
//
// A provider that cannot release (a static inventory) only forgets the
// machine, and the provisioner never takes its provider id into the fleet
// again; its agent would run on. With AgentStop configured, the
// decommissioner first stops that agent over SSH (shepherd-agent stop), as
// the initializer reached it: only to a host whose key is pinned or
// recorded, never on first use. This is best effort: a machine that cannot
// be reached, or whose agent will not stop, is decommissioned all the same.
// Whatever happens over SSH, deleting AgentStarted ends the agent's say:
// the callback server answers the heartbeats of a decommissioned machine's
// last key with PermissionDenied, on which the agent exits for good.
type Decommissioner struct {
	cfg      DecommissionerConfig
	p        provider.Provider
	db       *bmdb.DB
	rel      provider.Releaser // nil if p cannot release machines
	runner   *Runner
	releases *prometheus.CounterVec
	stops    *prometheus.CounterVec
}

// NewDecommissioner validates cfg and returns the decommissioner of
// provider p's machines.
func NewDecommissioner(cfg DecommissionerConfig, db *bmdb.DB, p provider.Provider, reg prometheus.Registerer, log *slog.Logger) (*Decommissioner, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.ReleaseTimeout = cmp.Or(cfg.ReleaseTimeout, 5*time.Minute)
	if cfg.AgentStop != nil {
		as := *cfg.AgentStop // a copy: the caller's value is untouched
		as.SSHUser = cmp.Or(as.SSHUser, "root")
		as.Timeout = cmp.Or(as.Timeout, time.Minute)
		cfg.AgentStop = &as
	}
	if cfg.Backoff == (bmdb.BackoffPolicy{}) {
		cfg.Backoff = bmdb.DecommissionBackoff()
	}
	d := &Decommissioner{
		cfg: cfg,
		p:   p,
		db:  db,
		stops: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name:        "shepherd_decommissioner_agent_stops_total",
			Help:        "Agents of machines the provider cannot release that the decommissioner tried to stop over SSH, by result (stopped, failed, unverified: no pinned or recorded host key, so not tried).",
			ConstLabels: prometheus.Labels{"provider": p.Name()},
		}, []string{"result"}),
		releases: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name:        "shepherd_decommissioner_releases_total",
			Help:        "Machines the decommissioner asked the provider to release, by result (released, gone: the provider no longer had it, error, unsupported: the provider cannot release and only forgets).",
			ConstLabels: prometheus.Labels{"provider": p.Name()},
		}, []string{"result"}),
	}
	d.rel, _ = p.(provider.Releaser)
	for _, c := range []prometheus.Collector{d.releases, d.stops} {
		if err := register(reg, c); err != nil {
			return nil, fmt.Errorf("decommissioner: %w", err)
		}
	}
	for _, r := range []string{"released", "gone", "error", "unsupported"} {
		d.releases.WithLabelValues(r)
	}
	for _, r := range []string{"stopped", "failed", "unverified"} {
		d.stops.WithLabelValues(r)
	}
	var err error
	d.runner, err = NewRunner("decommissioner", cfg.Loop, Loop{
		Process:    bmdb.ProcessDecommission,
		Candidates: func() bmdb.Candidates { return bmdb.DecommissionCandidates(p.Name()) },
		Backoff:    cfg.Backoff,
		Do:         d.decommission,
	}, db, reg, log)
	if err != nil {
		return nil, err
	}
	return d, nil
}

// Run runs the decommissioner until ctx ends.
func (d *Decommissioner) Run(ctx context.Context) error { return d.runner.Run(ctx) }

// decommission releases one machine where the provider can, and returns
// the tag change that takes it out of the fleet.
func (d *Decommissioner) decommission(ctx context.Context, t *Task) (FinishFunc, error) {
	released := false
	if d.rel == nil {
		d.releases.WithLabelValues("unsupported").Inc()
		if d.cfg.AgentStop != nil {
			d.stopAgent(ctx, t)
		}
		t.Log.InfoContext(ctx, "provider cannot release machines; forgetting the machine", "provider_id", t.Machine.ProviderID)
	} else {
		rctx, cancel := context.WithTimeout(ctx, d.cfg.ReleaseTimeout)
		err := d.rel.ReleaseMachine(rctx, t.Machine.ProviderID)
		cancel()
		switch {
		case err == nil:
			released = true
			d.releases.WithLabelValues("released").Inc()
			t.Log.InfoContext(ctx, "machine released through the provider", "provider_id", t.Machine.ProviderID)
		case errors.Is(err, provider.ErrNotFound):
			// Released by an earlier attempt whose result was lost, or
			// by someone else: either way the provider has it no more.
			released = true
			d.releases.WithLabelValues("gone").Inc()
			t.Log.InfoContext(ctx, "machine already gone at the provider", "provider_id", t.Machine.ProviderID)
		default:
			d.releases.WithLabelValues("error").Inc()
			return nil, fmt.Errorf("releasing %s through %s: %w", t.Machine.ProviderID, d.p.Name(), err)
		}
	}
	id := t.Machine.MachineID
	return func(ctx context.Context, tx *bmdb.Tx) error {
		_, err := tx.Decommission(ctx, id, released)
		return err
	}, nil
}

// stopAgent stops the machine's agent over SSH, as far as it can: what
// fails is logged, and the decommission goes on.
func (d *Decommissioner) stopAgent(ctx context.Context, t *Task) {
	cfg := d.cfg.AgentStop
	target, trust, err := machineTarget(ctx, d.db, d.p, t.Machine.MachineID, t.Machine.ProviderID, cfg.SSHUser, cfg.SSHKey)
	if err != nil {
		d.stops.WithLabelValues("failed").Inc()
		t.Log.WarnContext(ctx, "cannot stop the agent over SSH; it stops at its next heartbeat", "err", err)
		return
	}
	if trust.inForce == nil {
		// Trusting a key on first use is for a takeover, which records
		// it; a machine never taken over has no agent to stop.
		d.stops.WithLabelValues("unverified").Inc()
		t.Log.InfoContext(ctx, "no pinned or recorded host key; not stopping the agent over SSH")
		return
	}
	target.HostKey = trust.inForce
	sctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	if err := stopOverSSH(sctx, target, agentDir(cfg.AgentDir, target.User, t.Machine)); err != nil {
		d.stops.WithLabelValues("failed").Inc()
		t.Log.WarnContext(ctx, "stopping the agent over SSH failed; it stops at its next heartbeat", "err", err)
		return
	}
	d.stops.WithLabelValues("stopped").Inc()
	t.Log.InfoContext(ctx, "agent stopped over SSH")
}

// stopOverSSH runs shepherd-agent stop in the agent directory dir on
// target, resolving a relative dir as the initializer did; ctx bounds
// everything, even a machine that goes silent.
func stopOverSSH(ctx context.Context, target sshx.Target, dir string) error {
	client, err := sshx.Dial(ctx, target)
	if err != nil {
		return fmt.Errorf("connecting to %s: %w", target.Addr, err)
	}
	defer client.Close()
	stop := sshx.CloseWhenDone(ctx, client)
	defer stop()
	if !path.IsAbs(dir) {
		sc, err := sftp.NewClient(client)
		if err != nil {
			return fmt.Errorf("starting SFTP: %w", err)
		}
		dir, err = resolveAgentDir(sc, dir)
		sc.Close()
		if err != nil {
			return err
		}
	}
	cmd := shellquote.Join(path.Join(dir, "shepherd-agent"), "stop", "--state-dir", path.Join(dir, "state"))
	_, err = sshx.Run(ctx, client, cmd, nil, 64<<10)
	return err
}
