package manager

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/time/rate"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/provider"
)

// ProvisionerConfig configures the provisioner (SPEC §3.2). Zero values mean
// defaults.
type ProvisionerConfig struct {
	// Period is the time between reconcile passes (jittered); default 30s.
	Period time.Duration
	// MaxMachines caps the provider's machines in the BMDB; 0 means no limit.
	MaxMachines int
	// ChunkSize caps the machines created in one pass; default 50.
	ChunkSize int
	// CreateLimit rate-limits creations; default 100ms,10.
	CreateLimit Limit
	// Listing says when a listing lacks too many of the BMDB's machines to
	// be believed; the pass then changes nothing. Defaults: more than 20 %
	// and more than 3 machines.
	Listing ListingGuard
	// Lease is the session lease; default bmdb.DefaultLease.
	Lease time.Duration
}

// Validate reports the first problem with the configuration. It changes nothing.
// (Ifs, not a switch: see LoopConfig.Validate.)
func (c ProvisionerConfig) Validate() error {
	if c.Period < 0 || c.Lease < 0 {
		return errors.New("provisioner: durations must be >= 0 (0 = default)")
	}
	if c.MaxMachines < 0 {
		return fmt.Errorf("provisioner: MaxMachines must be >= 0 (0 = no limit), got %d", c.MaxMachines)
	}
	if c.ChunkSize < 0 {
		return fmt.Errorf("provisioner: ChunkSize must be >= 0 (0 = default), got %d", c.ChunkSize)
	}
	if err := c.Listing.validate("provisioner"); err != nil {
		return err
	}
	return c.CreateLimit.validate("provisioner")
}

// Provisioner keeps the BMDB in step with a provider: capacity becomes
// machines, our orphans are adopted, and machines the provider lost are
// marked Missing. One pass runs at a time per provider, across processes.
type Provisioner struct {
	cfg     ProvisionerConfig
	db      *bmdb.DB
	p       provider.Provider
	log     *slog.Logger
	limiter *rate.Limiter
	metrics *provisionerMetrics
	check   *listingCheck
}

type provisionerMetrics struct {
	passes   *prometheus.CounterVec
	machines *prometheus.CounterVec
	missing  prometheus.Gauge
	foreign  prometheus.Gauge
}

// NewProvisioner validates cfg and returns the provisioner for provider p.
func NewProvisioner(cfg ProvisionerConfig, db *bmdb.DB, p provider.Provider, reg prometheus.Registerer, log *slog.Logger) (*Provisioner, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Period = cmp.Or(cfg.Period, 30*time.Second)
	cfg.ChunkSize = cmp.Or(cfg.ChunkSize, 50)
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	labels := prometheus.Labels{"provider": p.Name()}
	m := &provisionerMetrics{
		passes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_provisioner_passes_total", ConstLabels: labels,
			Help: "Reconcile passes, by result (ok, suspect: the listing lacked too many machines to be believed, see shepherd_provisioner_suspect_listing_missing_machines; busy: another process held the lease; error).",
		}, []string{"result"}),
		machines: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_provisioner_machines_total", ConstLabels: labels,
			Help: "Machines the provisioner created, adopted (ours, missing from the BMDB), marked missing or found again.",
		}, []string{"action"}),
		missing: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "shepherd_provisioner_missing_machines", ConstLabels: labels,
			Help: "BMDB machines the provider's last believed listing did not contain.",
		}),
		foreign: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "shepherd_provisioner_foreign_machines", ConstLabels: labels,
			Help: "Machines at the provider that are not ours, in the last listing.",
		}),
	}
	for _, c := range []prometheus.Collector{m.passes, m.machines, m.missing, m.foreign} {
		if err := register(reg, c); err != nil {
			return nil, fmt.Errorf("provisioner: %w", err)
		}
	}
	for _, r := range []string{"ok", "suspect", "busy", "error"} {
		m.passes.WithLabelValues(r)
	}
	for _, a := range []string{"created", "adopted", "missing", "found"} {
		m.machines.WithLabelValues(a)
	}
	check, err := newListingCheck("provisioner", cfg.Listing, labels, reg)
	if err != nil {
		return nil, err
	}
	return &Provisioner{
		cfg: cfg, db: db, p: p, log: log.With("component", "provisioner", "provider", p.Name()),
		limiter: cfg.CreateLimit.limiter(DefaultLimit()), metrics: m, check: check,
	}, nil
}

// Run makes a pass every Period until ctx ends.
func (pr *Provisioner) Run(ctx context.Context) error {
	return pr.db.KeepSession(ctx, bmdb.SessionConfig{Component: "provisioner", Lease: pr.cfg.Lease}, func(ctx context.Context, s *bmdb.Session) error {
		for ctx.Err() == nil {
			if _, err := pr.Pass(ctx, s); err != nil && ctx.Err() == nil {
				pr.log.ErrorContext(ctx, "reconcile pass failed", "err", err)
			}
			sleep(ctx, jitter(pr.cfg.Period))
		}
		return nil
	})
}

// PassResult says what one pass did.
type PassResult struct {
	Busy    bool // another session held the lease: nothing done
	Suspect bool // the listing was not believed: nothing changed
	// Accepted: the listing lacked too many machines to be believed, but an
	// operator had accepted it (bmdb.DB.AcceptListing).
	Accepted               bool
	Created, Adopted       int
	MarkedMissing, Found   int
	Foreign, FailedCreates int
	// Decommissioned counts listed machines left alone because a
	// decommissioned machine had their provider id.
	Decommissioned int
}

// Pass makes one reconcile pass under s, holding the provider's
// provisioning lease for its duration.
func (pr *Provisioner) Pass(ctx context.Context, s *bmdb.Session) (PassResult, error) {
	held, err := s.AcquireProviderLease(ctx, pr.p.Name())
	if err != nil {
		pr.metrics.passes.WithLabelValues("error").Inc()
		return PassResult{}, err
	}
	if !held {
		pr.metrics.passes.WithLabelValues("busy").Inc()
		return PassResult{Busy: true}, nil
	}
	defer func() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
		defer cancel()
		if err := s.ReleaseProviderLease(rctx, pr.p.Name()); err != nil {
			pr.log.WarnContext(ctx, "releasing the provisioning lease", "err", err)
		}
	}()
	res, err := pr.pass(ctx, s)
	switch {
	case err != nil:
		pr.metrics.passes.WithLabelValues("error").Inc()
	case res.Suspect:
		pr.metrics.passes.WithLabelValues("suspect").Inc()
	default:
		pr.metrics.passes.WithLabelValues("ok").Inc()
	}
	return res, err
}

func (pr *Provisioner) pass(ctx context.Context, s *bmdb.Session) (PassResult, error) {
	var res PassResult
	l, err := listProvider(ctx, pr.db, pr.p, pr.log)
	if err != nil {
		return res, err
	}
	known, inBMDB := l.known, l.inBMDB
	// Provider ids of decommissioned machines never come back into the
	// fleet (SPEC §3.8), whatever the listing says of them. Read after the
	// BMDB's machines, so that a machine decommissioned meanwhile is among
	// the one or the other.
	retired, err := pr.db.DecommissionedProviderIDs(ctx, pr.p.Name())
	if err != nil {
		return res, err
	}

	// Machines the BMDB has and the listing lacks become Missing, unless so
	// many do that the listing is not believed.
	presence, err := l.reconcilePresence(ctx, s, pr.check, pr.log)
	if err != nil {
		return res, err
	}
	if presence.suspect {
		return PassResult{Suspect: true}, nil
	}
	res.MarkedMissing, res.Found, res.Accepted = len(presence.missing), len(presence.found), presence.accepted
	pr.metrics.machines.WithLabelValues("missing").Add(float64(res.MarkedMissing))
	pr.metrics.machines.WithLabelValues("found").Add(float64(res.Found))
	pr.metrics.missing.Set(float64(res.MarkedMissing + (len(known) - presence.present - res.Found)))

	// Ours but unknown to the BMDB (a crash between creating and recording):
	// adopt. Capacity: create, within the limits.
	var adopt, capacity []provider.Machine
	for _, m := range l.machines {
		if _, ok := inBMDB[m.ID()]; ok {
			continue
		}
		if _, ok := retired[m.ID()]; ok {
			res.Decommissioned++
			continue
		}
		switch m.Availability() {
		case provider.KnownUsed:
			adopt = append(adopt, m)
		case provider.KnownUnused, provider.PossiblyUsed:
			if !m.Failed() {
				capacity = append(capacity, m)
			}
		case provider.Foreign:
			res.Foreign++
		}
	}
	pr.metrics.foreign.Set(float64(res.Foreign))
	for _, m := range adopt {
		if err := pr.record(ctx, s, m); err != nil {
			return res, err
		}
		res.Adopted++
		pr.metrics.machines.WithLabelValues("adopted").Inc()
		pr.log.InfoContext(ctx, "adopted a machine of ours the BMDB did not know", "provider_id", m.ID())
	}
	budget := pr.cfg.ChunkSize
	if pr.cfg.MaxMachines > 0 {
		budget = min(budget, pr.cfg.MaxMachines-len(known)-res.Adopted)
	}
	for _, c := range capacity {
		if budget <= 0 {
			break
		}
		if err := pr.limiter.Wait(ctx); err != nil {
			return res, err
		}
		m, err := pr.p.CreateMachine(ctx, provider.CreateRequest{From: c, Session: s.ID()})
		if err != nil {
			// One bad capacity entry does not stop the pass.
			res.FailedCreates++
			pr.log.WarnContext(ctx, "creating a machine failed", "from", c.ID(), "err", err)
			continue
		}
		// Recorded right after the provider confirmed: a crash in between
		// leaves an orphan that the next pass adopts.
		if err := pr.record(ctx, s, m); err != nil {
			return res, err
		}
		res.Created++
		budget--
		pr.metrics.machines.WithLabelValues("created").Inc()
		pr.log.InfoContext(ctx, "created a machine", "provider_id", m.ID())
	}
	return res, nil
}

// record adds a machine of the provider with its Provided tag, in one
// transaction.
func (pr *Provisioner) record(ctx context.Context, s *bmdb.Session, m provider.Machine) error {
	return s.Transact(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
		_, err := tx.AddMachine(ctx, providedOf(pr.p.Name(), m))
		return err
	})
}
