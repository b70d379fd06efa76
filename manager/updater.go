package manager

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/provider"
)

// Updater defaults.
const (
	defaultChangingPeriod = 10 * time.Second
	defaultStablePeriod   = 5 * time.Minute
)

// releaseTimeout bounds giving up a lease after a pass. The release runs
// with the pass's context without its cancellation (a pass ends at shutdown
// too), so it needs a bound of its own; a release that does not happen is
// harmless, as the lease ends with the session.
const releaseTimeout = 10 * time.Second

// UpdaterConfig configures the updater (SPEC §3.5). Zero values mean
// defaults.
type UpdaterConfig struct {
	// ChangingPeriod is the time between passes (jittered) while some
	// machine of the provider is changing: Provisioning, or Unknown to a
	// provider that describes its machines. Default 10s.
	ChangingPeriod time.Duration
	// StablePeriod is the time between passes (jittered) otherwise; default
	// 5m. It must not be shorter than ChangingPeriod. Meanwhile the BMDB is
	// looked at every ChangingPeriod, and a machine that starts changing
	// (one the provisioner just recorded) ends the wait.
	StablePeriod time.Duration
	// Listing says when a listing lacks too many of the BMDB's machines to
	// be believed; the pass then changes nothing. Defaults: more than 20 %
	// and more than 3 machines.
	Listing ListingGuard
	// Lease is the session lease; default bmdb.DefaultLease.
	Lease time.Duration
}

// Validate reports the first problem with the configuration. It changes nothing.
// (Ifs, not a switch: see LoopConfig.Validate.)
func (c UpdaterConfig) Validate() error {
	if c.ChangingPeriod < 0 {
		return fmt.Errorf("updater: ChangingPeriod must be >= 0 (0 = default %s), got %s", defaultChangingPeriod, c.ChangingPeriod)
	}
	if c.StablePeriod < 0 {
		return fmt.Errorf("updater: StablePeriod must be >= 0 (0 = default %s), got %s", defaultStablePeriod, c.StablePeriod)
	}
	if c.Lease < 0 {
		return fmt.Errorf("updater: Lease must be >= 0 (0 = default), got %s", c.Lease)
	}
	if err := c.Listing.validate("updater"); err != nil {
		return err
	}
	changing, stable := cmp.Or(c.ChangingPeriod, defaultChangingPeriod), cmp.Or(c.StablePeriod, defaultStablePeriod)
	if changing > stable {
		return fmt.Errorf("updater: ChangingPeriod (%s) must not be longer than StablePeriod (%s)", changing, stable)
	}
	return nil
}

// Updater keeps what the BMDB holds of a provider's machines (provider
// status, IP address, location, reservation id) in step with the provider,
// and marks machines the provider no longer lists Missing (SPEC §3.5). A
// pass costs one listing of the provider, however large the fleet, and
// writes only what changed. One pass runs at a time per provider, across
// processes, independently of the provisioner.
type Updater struct {
	cfg     UpdaterConfig
	db      *bmdb.DB
	p       provider.Provider
	log     *slog.Logger
	metrics *updaterMetrics
	check   *listingCheck

	// describes is false once a listing had machines and none of them
	// described itself: such a provider never tells a status, so its
	// machines stay Unknown and polling them faster would learn nothing.
	describes atomic.Bool
	// waiting, if set, is told the (unjittered) period Run waits after
	// each pass. Tests set it before Run.
	waiting func(time.Duration)
	// isChanging is changing; tests replace it.
	isChanging func(context.Context) (bool, error)
}

type updaterMetrics struct {
	passes   *prometheus.CounterVec
	machines *prometheus.CounterVec
	duration prometheus.Histogram
}

// NewUpdater validates cfg and returns the updater for provider p. Metrics
// are registered on reg (nil keeps them private); log may be nil.
func NewUpdater(cfg UpdaterConfig, db *bmdb.DB, p provider.Provider, reg prometheus.Registerer, log *slog.Logger) (*Updater, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.ChangingPeriod = cmp.Or(cfg.ChangingPeriod, defaultChangingPeriod)
	cfg.StablePeriod = cmp.Or(cfg.StablePeriod, defaultStablePeriod)
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	labels := prometheus.Labels{"provider": p.Name()}
	m := &updaterMetrics{
		passes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_updater_passes_total", ConstLabels: labels,
			Help: "Updater passes, by result (ok, suspect: the listing lacked too many machines to be believed, see shepherd_updater_suspect_listing_missing_machines; busy: another process held the lease; error).",
		}, []string{"result"}),
		machines: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_updater_machines_total", ConstLabels: labels,
			Help: "Machines the updater changed: details updated, marked missing, or found again.",
		}, []string{"action"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "shepherd_updater_pass_duration_seconds", ConstLabels: labels,
			Help:    "Duration of updater passes that held the lease, listing included.",
			Buckets: prometheus.ExponentialBuckets(0.01, 2, 16),
		}),
	}
	for _, c := range []prometheus.Collector{m.passes, m.machines, m.duration} {
		if err := register(reg, c); err != nil {
			return nil, fmt.Errorf("updater: %w", err)
		}
	}
	for _, r := range []string{"ok", "suspect", "busy", "error"} {
		m.passes.WithLabelValues(r)
	}
	for _, a := range []string{"updated", "missing", "found"} {
		m.machines.WithLabelValues(a)
	}
	check, err := newListingCheck("updater", cfg.Listing, labels, reg)
	if err != nil {
		return nil, err
	}
	u := &Updater{cfg: cfg, db: db, p: p, log: log.With("component", "updater", "provider", p.Name()), metrics: m, check: check}
	u.describes.Store(true)
	u.isChanging = u.changing
	return u, nil
}

// Run makes passes until ctx ends, ChangingPeriod apart while a machine of
// the provider is changing and StablePeriod apart otherwise (a stable wait
// ends early when a machine starts changing), and returns nil.
func (u *Updater) Run(ctx context.Context) error {
	return u.db.KeepSession(ctx, bmdb.SessionConfig{Component: "updater", Lease: u.cfg.Lease}, func(ctx context.Context, s *bmdb.Session) error {
		for ctx.Err() == nil {
			res, err := u.Pass(ctx, s)
			if errors.Is(err, bmdb.ErrSessionExpired) {
				return err // KeepSession confirms and starts a new session
			}
			if err != nil && ctx.Err() == nil {
				u.log.ErrorContext(ctx, "update pass failed", "err", err)
			}
			period := u.cfg.StablePeriod
			if res.Changing {
				period = u.cfg.ChangingPeriod
			}
			if u.waiting != nil {
				u.waiting(period)
			}
			u.wait(ctx, period)
		}
		return nil
	})
}

// wait sleeps period, jittered. A stable wait is cut short once some
// machine of the provider starts changing: the provisioner records new
// machines Provisioning while the updater sleeps, and they should not wait
// minutes for their first refresh. Noticing that costs a look at the BMDB
// (an index probe) every ChangingPeriod, never a listing.
func (u *Updater) wait(ctx context.Context, period time.Duration) {
	deadline := time.Now().Add(jitter(period))
	for {
		left := time.Until(deadline)
		if left <= 0 || ctx.Err() != nil {
			return
		}
		if period <= u.cfg.ChangingPeriod {
			sleep(ctx, left)
			return
		}
		sleep(ctx, min(left, jitter(u.cfg.ChangingPeriod)))
		if ctx.Err() != nil {
			return
		}
		if changing, err := u.isChanging(ctx); err == nil && changing {
			u.log.DebugContext(ctx, "a machine is changing; ending the stable wait early")
			return
		}
	}
}

// UpdateResult says what one updater pass did.
type UpdateResult struct {
	Busy    bool // another session held the update lease: nothing done
	Suspect bool // the listing was not believed: nothing changed
	// Accepted: the listing lacked too many machines to be believed, but an
	// operator had accepted it (bmdb.DB.AcceptListing).
	Accepted bool
	// Listed is the number of machines in the listing, Known the number of
	// the provider's machines in the BMDB.
	Listed, Known int
	// Updated counts machines whose details changed (found machines are
	// counted as Found only).
	Updated              int
	MarkedMissing, Found int
	// Changing reports that, after the pass, some machine of the provider
	// is still changing in the BMDB, so the next pass comes after
	// ChangingPeriod. It is also true when that could not be read.
	Changing bool
}

// Pass makes one updater pass under s, holding the provider's update lease
// for its duration, and then reads whether the fleet is still changing
// (also when another session held the lease).
func (u *Updater) Pass(ctx context.Context, s *bmdb.Session) (UpdateResult, error) {
	name := u.p.Name()
	held, err := s.AcquireUpdateLease(ctx, name)
	if err != nil {
		u.metrics.passes.WithLabelValues("error").Inc()
		return UpdateResult{Changing: true}, err
	}
	var res UpdateResult
	if held {
		start := time.Now()
		res, err = u.pass(ctx, s)
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
		if rerr := s.ReleaseUpdateLease(rctx, name); rerr != nil {
			u.log.WarnContext(ctx, "releasing the update lease", "err", rerr)
		}
		cancel()
		u.metrics.duration.Observe(time.Since(start).Seconds())
		switch {
		case err != nil:
			u.metrics.passes.WithLabelValues("error").Inc()
		case res.Suspect:
			u.metrics.passes.WithLabelValues("suspect").Inc()
		default:
			u.metrics.passes.WithLabelValues("ok").Inc()
		}
	} else {
		u.metrics.passes.WithLabelValues("busy").Inc()
		res.Busy = true
	}
	changing, cerr := u.isChanging(ctx)
	res.Changing = changing || cerr != nil
	if err == nil && cerr != nil {
		err = cerr
	}
	return res, err
}

// changing reports whether some machine of the provider is in a status
// that a pass soon may change.
func (u *Updater) changing(ctx context.Context) (bool, error) {
	statuses := []bmdb.ProviderStatus{bmdb.ProviderStatusProvisioning}
	if u.describes.Load() {
		statuses = append(statuses, bmdb.ProviderStatusUnknown)
	}
	return u.db.ProviderHasStatus(ctx, u.p.Name(), statuses...)
}

func (u *Updater) pass(ctx context.Context, s *bmdb.Session) (UpdateResult, error) {
	name := u.p.Name()
	l, err := listProvider(ctx, u.db, u.p, u.log)
	if err != nil {
		return UpdateResult{}, err
	}
	res := UpdateResult{Listed: len(l.machines), Known: len(l.known)}
	if len(l.machines) > 0 {
		describes := false
		for _, m := range l.machines {
			if _, ok := m.(provider.Described); ok {
				describes = true
				break
			}
		}
		u.describes.Store(describes)
	}

	presence, err := l.reconcilePresence(ctx, s, u.check, u.log)
	if err != nil {
		return res, err
	}
	if presence.suspect {
		res.Suspect = true
		return res, nil
	}
	res.MarkedMissing, res.Found, res.Accepted = len(presence.missing), len(presence.found), presence.accepted
	u.metrics.machines.WithLabelValues("missing").Add(float64(res.MarkedMissing))
	u.metrics.machines.WithLabelValues("found").Add(float64(res.Found))

	// Listed machines whose details differ from the BMDB's. Missing ones
	// were either found above or are not listed.
	var updates []bmdb.ProvidedUpdate
	var was []bmdb.ProvidedRef
	for _, k := range l.known {
		m, ok := l.listed[k.ProviderID]
		if !ok || k.Status == bmdb.ProviderStatusMissing {
			continue
		}
		if up := providedUpdateOf(name, m); up != providedUpdateIn(k) {
			updates = append(updates, up)
			was = append(was, k)
		}
	}
	// Set-based writes in chunks, a transaction each: a fleet that changed
	// entirely is a hundred short transactions, not a hundred thousand,
	// and no transaction holds many row locks for long.
	for lo := 0; lo < len(updates); lo += bmdb.MaxProvidedUpdates {
		hi := min(lo+bmdb.MaxProvidedUpdates, len(updates))
		var n int64
		err := s.Transact(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
			var err error
			n, err = tx.UpdateProvided(ctx, name, updates[lo:hi])
			return err
		})
		if err != nil {
			return res, err
		}
		res.Updated += int(n)
		u.metrics.machines.WithLabelValues("updated").Add(float64(n))
		for i := lo; i < hi; i++ {
			u.logUpdate(ctx, was[i], updates[i])
		}
	}
	if err := s.Transact(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
		return tx.ConfirmUpdate(ctx, name)
	}); err != nil {
		return res, err
	}
	level := slog.LevelDebug
	if res.Updated > 0 || res.MarkedMissing > 0 || res.Found > 0 {
		level = slog.LevelInfo
	}
	u.log.Log(ctx, level, "update pass done", "listed", res.Listed, "known", res.Known,
		"updated", res.Updated, "marked_missing", res.MarkedMissing, "found", res.Found)
	return res, nil
}

// logUpdate logs a machine's change of details: a change of status at Info,
// anything else at Debug.
func (u *Updater) logUpdate(ctx context.Context, was bmdb.ProvidedRef, now bmdb.ProvidedUpdate) {
	level := slog.LevelDebug
	if was.Status != now.Status {
		level = slog.LevelInfo
	}
	if !u.log.Enabled(ctx, level) {
		return // a fleet-wide change is many lines; skip building them
	}
	u.log.Log(ctx, level, "machine details changed at the provider",
		"machine_id", was.MachineID.String(), "provider_id", was.ProviderID,
		"provider_status", string(now.Status), "was_provider_status", string(was.Status),
		"address", addrString(now.Address), "location", now.Location, "reservation_id", now.ReservationID)
}

// addrString is a's text, or "" for the zero Addr (which prints "invalid IP").
func addrString(a netip.Addr) string {
	if !a.IsValid() {
		return ""
	}
	return a.String()
}
