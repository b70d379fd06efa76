package manager

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/provider"
)

// RecovererConfig configures the recoverer (SPEC §3.4). Zero values mean
// defaults.
type RecovererConfig struct {
	Loop LoopConfig
	// FirstHeartbeatTimeout and HeartbeatTimeout define a silent machine
	// (bmdb.RecoveryCandidates); defaults 30m and 10m.
	FirstHeartbeatTimeout, HeartbeatTimeout time.Duration
	// MaxRebootsPerWindow caps reboots of the provider's fleet per Window;
	// 0 means 5 % of the provider's machines, at least 1. Every admitted
	// reboot counts, however its work ended (finished, failed, canceled,
	// expired with a crashed process), except one whose request certainly
	// never reached the machine (provider.ErrNotReached).
	MaxRebootsPerWindow int
	// Window is the breaker's window; default 10m, at most
	// bmdb.MaxRecoveryWindow.
	Window time.Duration
	// MaxRebootsWithoutHeartbeat quarantines a machine (for Recovery, until
	// an operator resets it) instead of rebooting it again once it was
	// rebooted this many times without a heartbeat in between: its agent
	// starts but never reports (a rack that cannot reach the callback
	// server), and rebooting it every first-heartbeat timeout forever helps
	// nobody. Default 3.
	MaxRebootsWithoutHeartbeat int
	// SilentFraction pauses all reboots while more than this fraction of
	// started machines is silent: so many silent agents at once mean the
	// heartbeat path is broken, not the machines. Default 0.25.
	SilentFraction float64
	// RebootTimeout bounds one reboot request; default 5m.
	RebootTimeout time.Duration
	// Backoff applies to failed reboots; default bmdb.RecoveryBackoff().
	Backoff bmdb.BackoffPolicy
}

// Validate reports the first problem with the configuration. It changes nothing.
// (Ifs, not a switch: see LoopConfig.Validate.)
func (c RecovererConfig) Validate() error {
	if err := c.Loop.Validate("recoverer"); err != nil {
		return err
	}
	if c.FirstHeartbeatTimeout < 0 || c.HeartbeatTimeout < 0 || c.Window < 0 || c.RebootTimeout < 0 {
		return errors.New("recoverer: durations must be >= 0 (0 = default)")
	}
	if c.Window > bmdb.MaxRecoveryWindow {
		return fmt.Errorf("recoverer: Window must be at most %s (reboots are kept that long), got %s", bmdb.MaxRecoveryWindow, c.Window)
	}
	if c.MaxRebootsPerWindow < 0 {
		return fmt.Errorf("recoverer: MaxRebootsPerWindow must be >= 0 (0 = 5%% of the fleet), got %d", c.MaxRebootsPerWindow)
	}
	if c.MaxRebootsWithoutHeartbeat < 0 {
		return fmt.Errorf("recoverer: MaxRebootsWithoutHeartbeat must be >= 0 (0 = default 3), got %d", c.MaxRebootsWithoutHeartbeat)
	}
	if c.SilentFraction < 0 || c.SilentFraction > 1 || math.IsNaN(c.SilentFraction) {
		return fmt.Errorf("recoverer: SilentFraction must be within [0, 1] (0 = default 0.25), got %v", c.SilentFraction)
	}
	if c.Backoff != (bmdb.BackoffPolicy{}) {
		return c.Backoff.Validate()
	}
	return nil
}

// Recoverer reboots machines whose agent fell silent, through the provider,
// and then clears their agent tags so that the initializer takes them over
// again. A fleet-wide circuit breaker caps reboots.
type Recoverer struct {
	cfg     RecovererConfig
	db      *bmdb.DB
	p       provider.Provider
	r       provider.Recoverer
	runner  *Runner
	log     *slog.Logger
	breaker *breaker
}

// NewRecoverer validates cfg and returns the recoverer for provider p,
// which must implement provider.Recoverer.
func NewRecoverer(cfg RecovererConfig, db *bmdb.DB, p provider.Provider, reg prometheus.Registerer, log *slog.Logger) (*Recoverer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	pr, ok := p.(provider.Recoverer)
	if !ok {
		return nil, fmt.Errorf("recoverer: provider %s cannot reboot machines", p.Name())
	}
	cfg = cfg.withBreakerDefaults()
	cfg.RebootTimeout = cmp.Or(cfg.RebootTimeout, 5*time.Minute)
	cfg.MaxRebootsWithoutHeartbeat = cmp.Or(cfg.MaxRebootsWithoutHeartbeat, 3)
	if cfg.Backoff == (bmdb.BackoffPolicy{}) {
		cfg.Backoff = bmdb.RecoveryBackoff()
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	rc := &Recoverer{cfg: cfg, db: db, p: p, r: pr, log: log.With("component", "recoverer", "provider", p.Name())}
	b, err := newBreaker(rc, reg)
	if err != nil {
		return nil, err
	}
	rc.breaker = b
	rc.runner, err = NewRunner("recoverer", cfg.Loop, Loop{
		Process:    bmdb.ProcessRecovery,
		Candidates: rc.candidates,
		Backoff:    cfg.Backoff,
		Do:         rc.recover,
		Admit:      b.allow,
	}, db, reg, log)
	if err != nil {
		return nil, err
	}
	return rc, nil
}

func (rc *Recoverer) candidates() bmdb.Candidates {
	return bmdb.RecoveryCandidates(rc.p.Name(), rc.cfg.FirstHeartbeatTimeout, rc.cfg.HeartbeatTimeout)
}

// Run runs the recoverer until ctx ends.
func (rc *Recoverer) Run(ctx context.Context) error { return rc.runner.Run(ctx) }

// recover reboots one silent machine, if the breaker admits it. The
// admission verifies, in the transaction that records it, that the session
// still holds the work and that the machine is still silent, so a worker
// stalled past its lease (or one that lost a race with a heartbeat) does not
// reboot a machine that another worker rebooted or that recovered.
func (rc *Recoverer) recover(ctx context.Context, t *Task) (FinishFunc, error) {
	max, err := rc.breaker.budget(ctx)
	if err != nil {
		return nil, err
	}
	clearAgent := func(ctx context.Context, tx *bmdb.Tx) error {
		return tx.ClearAgent(ctx, t.Machine.MachineID)
	}
	a, err := t.Session.AdmitReboot(ctx, bmdb.RebootRequest{
		Provider: rc.p.Name(), MachineID: t.Machine.MachineID, Candidates: rc.candidates(),
		Window: rc.cfg.Window, Max: max, StreakLimit: rc.cfg.MaxRebootsWithoutHeartbeat,
	})
	if err != nil {
		return nil, err
	}
	switch a.Decision {
	case bmdb.RebootAdmitted:
	case bmdb.RebootBudgetExhausted:
		// Other workers (or processes) took the last reboots of the window
		// between our check and our claim: give the machine back unjudged.
		rc.breaker.refused(ctx)
		return nil, errBreakerOpen
	case bmdb.RebootNotSilent:
		t.Log.InfoContext(ctx, "not rebooting: the machine is no longer silent")
		return nil, fmt.Errorf("the machine is no longer silent: %w", ErrRetryLater)
	case bmdb.RebootAlreadyIssued:
		// A worker rebooted this agent incarnation and could not record
		// it (it lost its session, or crashed): one reboot per silence.
		t.Log.WarnContext(ctx, "not rebooting: this agent's machine was rebooted already; handing it to the initializer")
		return clearAgent, nil
	case bmdb.RebootStreakQuarantined:
		return nil, errors.New(a.Cause)
	default:
		return nil, fmt.Errorf("admitting the reboot: unknown decision %q", a.Decision)
	}
	rctx, cancel := context.WithTimeout(ctx, rc.cfg.RebootTimeout)
	defer cancel()
	t.Log.InfoContext(ctx, "rebooting silent machine", "provider_id", t.Machine.ProviderID,
		"reboots_in_window", a.InWindow, "reboots_without_heartbeat", a.Streak)
	if err := rc.r.RebootMachine(rctx, t.Machine.ProviderID); err != nil {
		err = fmt.Errorf("rebooting through %s: %w", rc.p.Name(), err)
		if ferr := t.Session.RebootFailed(ctx, a, !errors.Is(err, provider.ErrNotReached), err.Error()); ferr != nil {
			t.Log.WarnContext(ctx, "recording the failed reboot", "err", ferr)
		}
		return nil, err
	}
	return clearAgent, nil
}

var errBreakerOpen = fmt.Errorf("circuit breaker: reboot budget of the window used up: %w", ErrRetryLater)

// breaker is the fleet-wide circuit breaker of SPEC §3.4. Its state comes
// from the BMDB (reboots in the window, silent and started machines), so
// every recoverer process sees the same picture.
type breaker struct {
	rc *Recoverer
	// read computes the breaker from the BMDB: ReadBreaker with rc's
	// provider and configuration.
	read func(context.Context) (BreakerState, error)

	mu        sync.Mutex
	checkedAt time.Time
	paused    string // "" or the reason: silent_fraction, reboot_budget
	max       int64
	loggedAt  time.Time

	pausedGauge *prometheus.GaugeVec
	rebootsG    prometheus.Gauge
	budgetG     prometheus.Gauge
}

// breakerRefresh is how stale the breaker's view of the fleet may be.
const breakerRefresh = 2 * time.Second

func newBreaker(rc *Recoverer, reg prometheus.Registerer) (*breaker, error) {
	labels := prometheus.Labels{"provider": rc.p.Name()}
	b := &breaker{
		rc: rc,
		read: func(ctx context.Context) (BreakerState, error) {
			return ReadBreaker(ctx, rc.db, rc.p.Name(), rc.cfg)
		},
		pausedGauge: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name:        "shepherd_recovery_breaker_paused",
			Help:        "1 while the recoverer's circuit breaker holds reboots back, by reason (silent_fraction, reboot_budget).",
			ConstLabels: labels,
		}, []string{"reason"}),
		rebootsG: prometheus.NewGauge(prometheus.GaugeOpts{
			Name:        "shepherd_recovery_reboots_in_window",
			Help:        "Reboots admitted within the circuit breaker's window (however their work ended), except those that never reached the machine.",
			ConstLabels: labels,
		}),
		budgetG: prometheus.NewGauge(prometheus.GaugeOpts{
			Name:        "shepherd_recovery_reboot_budget",
			Help:        "Reboots the circuit breaker allows per window.",
			ConstLabels: labels,
		}),
	}
	for _, c := range []prometheus.Collector{b.pausedGauge, b.rebootsG, b.budgetG} {
		if err := register(reg, c); err != nil {
			return nil, fmt.Errorf("recoverer: %w", err)
		}
	}
	b.pausedGauge.WithLabelValues("silent_fraction")
	b.pausedGauge.WithLabelValues("reboot_budget")
	return b, nil
}

// budget is the number of reboots allowed per window.
func (b *breaker) budget(ctx context.Context) (int64, error) {
	if err := b.refresh(ctx, false); err != nil {
		return 0, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.max, nil
}

// allow reports whether the recoverer may claim now.
func (b *breaker) allow(ctx context.Context) bool {
	if err := b.refresh(ctx, false); err != nil {
		b.rc.log.WarnContext(ctx, "checking the circuit breaker", "err", err)
		return false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.paused == ""
}

// refused records that an admission found the budget used up, so that
// the other workers stop claiming at once.
func (b *breaker) refused(ctx context.Context) {
	if err := b.refresh(ctx, true); err != nil {
		b.rc.log.WarnContext(ctx, "checking the circuit breaker", "err", err)
	}
}

func (b *breaker) refresh(ctx context.Context, force bool) error {
	b.mu.Lock()
	fresh := !force && time.Since(b.checkedAt) < breakerRefresh
	b.mu.Unlock()
	if fresh {
		return nil
	}
	rc := b.rc
	st, err := b.read(ctx)
	if err != nil {
		return err
	}
	silent, started, reboots, max, paused := st.Silent, st.Started, st.RebootsInWindow, st.Budget, st.Paused
	b.mu.Lock()
	defer b.mu.Unlock()
	b.checkedAt, b.max = time.Now(), max
	b.rebootsG.Set(float64(reboots))
	b.budgetG.Set(float64(max))
	for _, r := range []string{"silent_fraction", "reboot_budget"} {
		v := 0.0
		if r == paused {
			v = 1
		}
		b.pausedGauge.WithLabelValues(r).Set(v)
	}
	if paused != "" && (b.paused != paused || time.Since(b.loggedAt) >= time.Minute) {
		b.loggedAt = time.Now()
		rc.log.WarnContext(ctx, "circuit breaker holds reboots back", "reason", paused,
			"silent", silent, "started", started, "reboots_in_window", reboots, "budget", max, "window", rc.cfg.Window)
	} else if paused == "" && b.paused != "" {
		rc.log.InfoContext(ctx, "circuit breaker allows reboots again")
	}
	b.paused = paused
	return nil
}

// withBreakerDefaults fills in the defaults of the fields that define the
// breaker and a silent machine.
func (c RecovererConfig) withBreakerDefaults() RecovererConfig {
	c.FirstHeartbeatTimeout = cmp.Or(c.FirstHeartbeatTimeout, bmdb.DefaultFirstHeartbeatTimeout)
	c.HeartbeatTimeout = cmp.Or(c.HeartbeatTimeout, bmdb.DefaultHeartbeatTimeout)
	c.Window = cmp.Or(c.Window, 10*time.Minute)
	c.SilentFraction = cmp.Or(c.SilentFraction, 0.25)
	return c
}

// BreakerState is the circuit breaker of one provider's fleet (SPEC §3.4).
type BreakerState struct {
	// Provided counts the provider's machines; Started those whose agent
	// was started (and not installed); Silent the recovery candidates.
	Provided, Started, Silent int64
	// SilentFraction is the threshold: above it no machine is rebooted.
	SilentFraction float64
	// RebootsInWindow were admitted within Window, however their work
	// ended, except those that never reached the machine; Budget is the
	// most the window allows.
	RebootsInWindow, Budget int64
	Window                  time.Duration
	// Paused is "" while reboots are allowed, else the reason they are held
	// back: "silent_fraction" or "reboot_budget".
	Paused string
}

// ReadBreaker computes the breaker of provider's fleet from the BMDB with
// cfg's thresholds (zero fields: the defaults), exactly as every recoverer
// does before a reboot; it changes nothing. The web UI shows it, also in
// processes that run no recoverer.
func ReadBreaker(ctx context.Context, db *bmdb.DB, provider string, cfg RecovererConfig) (BreakerState, error) {
	cfg = cfg.withBreakerDefaults()
	st := BreakerState{SilentFraction: cfg.SilentFraction, Window: cfg.Window}
	var err error
	if st.Provided, st.Started, err = db.ProviderAgentCounts(ctx, provider); err != nil {
		return st, err
	}
	if st.Silent, err = db.CountMatching(ctx, bmdb.RecoveryCandidates(provider, cfg.FirstHeartbeatTimeout, cfg.HeartbeatTimeout)); err != nil {
		return st, err
	}
	if st.RebootsInWindow, err = db.RecoveryReboots(ctx, provider, cfg.Window); err != nil {
		return st, err
	}
	st.Budget = int64(cfg.MaxRebootsPerWindow)
	if st.Budget == 0 {
		st.Budget = int64(math.Max(1, math.Floor(0.05*float64(st.Provided))))
	}
	// Ifs, not a switch, so that gremlins tests these boundaries (see
	// LoopConfig.Validate).
	if st.Started > 0 && float64(st.Silent) > cfg.SilentFraction*float64(st.Started) {
		st.Paused = "silent_fraction"
	} else if st.RebootsInWindow >= st.Budget {
		st.Paused = "reboot_budget"
	}
	return st, nil
}
