package manager

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb"
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
}

// Validate reports the first problem with the configuration. It changes nothing.
func (c DecommissionerConfig) Validate() error {
	if err := c.Loop.Validate("decommissioner"); err != nil {
		return err
	}
	if c.ReleaseTimeout < 0 {
		return fmt.Errorf("decommissioner: ReleaseTimeout must be >= 0 (0 = default 5m), got %s", c.ReleaseTimeout)
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
// The agent has no stop RPC. Deleting AgentStarted is what stops it
// counting: the callback server authenticates every heartbeat against
// AgentStarted, so from then on it refuses the agent's heartbeats as
// Unauthenticated, whether or not the provider released the machine. A
// provider that cannot release (a static inventory) only forgets the
// machine, and the provisioner never takes its provider id into the fleet
// again.
type Decommissioner struct {
	cfg      DecommissionerConfig
	p        provider.Provider
	rel      provider.Releaser // nil if p cannot release machines
	runner   *Runner
	releases *prometheus.CounterVec
}

// NewDecommissioner validates cfg and returns the decommissioner of
// provider p's machines.
func NewDecommissioner(cfg DecommissionerConfig, db *bmdb.DB, p provider.Provider, reg prometheus.Registerer, log *slog.Logger) (*Decommissioner, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.ReleaseTimeout = cmp.Or(cfg.ReleaseTimeout, 5*time.Minute)
	if cfg.Backoff == (bmdb.BackoffPolicy{}) {
		cfg.Backoff = bmdb.DecommissionBackoff()
	}
	d := &Decommissioner{
		cfg: cfg,
		p:   p,
		releases: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name:        "shepherd_decommissioner_releases_total",
			Help:        "Machines the decommissioner asked the provider to release, by result (released, gone: the provider no longer had it, error, unsupported: the provider cannot release and only forgets).",
			ConstLabels: prometheus.Labels{"provider": p.Name()},
		}, []string{"result"}),
	}
	d.rel, _ = p.(provider.Releaser)
	if err := register(reg, d.releases); err != nil {
		return nil, fmt.Errorf("decommissioner: %w", err)
	}
	for _, r := range []string{"released", "gone", "error", "unsupported"} {
		d.releases.WithLabelValues(r)
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
