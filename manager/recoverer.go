package manager

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/internal/ratelog"
	"github.com/shepherd/shepherd/internal/sshx"
	"github.com/shepherd/shepherd/ladder"
	"github.com/shepherd/shepherd/power"
	"github.com/shepherd/shepherd/poweraction"
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

	// Rungs is the recovery ladder (SPEC §3.4) of machines whose provider
	// does not choose one (provider.RungChooser); default ladder.Default.
	// A rung a machine cannot take is skipped: Agent without SSHKey, Power
	// without a BMC.
	Rungs []ladder.Rung
	// SSHKey and SSHUser let the Agent rung check that the machine answers
	// SSH before it hands the machine to the initializer (whose takeover
	// replaces the hung agent); without a key the rung does not apply.
	// SSHUser defaults to root, as the initializer's.
	SSHKey  ssh.Signer
	SSHUser string
	// ConnectTimeout bounds the Agent rung's SSH handshake; default 30s.
	ConnectTimeout time.Duration
	// PowerTimeout bounds the Power rung's cycle through the BMC, paced
	// calls and transitions included; default 5m.
	PowerTimeout time.Duration
	// BootTimeout bounds the wait, after a Reboot or Power rung, for the
	// machine to answer SSH again before it is handed to the initializer
	// (whose takeover would otherwise fail against a booting machine and
	// back off for minutes); a machine that does not come back within it
	// makes the ladder climb on. Only with SSHKey; default 10m.
	BootTimeout time.Duration
	// BootPoll is how often the boot wait dials the machine; default 2s.
	BootPoll time.Duration
}

// Validate reports the first problem with the configuration. It changes nothing.
// (Ifs, not a switch: see LoopConfig.Validate.)
func (c RecovererConfig) Validate() error {
	if err := c.Loop.Validate("recoverer"); err != nil {
		return err
	}
	if c.FirstHeartbeatTimeout < 0 || c.HeartbeatTimeout < 0 || c.Window < 0 || c.RebootTimeout < 0 || c.ConnectTimeout < 0 ||
		c.PowerTimeout < 0 || c.BootTimeout < 0 || c.BootPoll < 0 {
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
	if c.Rungs != nil {
		if _, err := ladder.Order(c.Rungs); err != nil {
			return fmt.Errorf("recoverer: Rungs: %w", err)
		}
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
	// rungs counts the rungs taken, by rung and result (done, failed).
	rungs *prometheus.CounterVec
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
	cfg.ConnectTimeout = cmp.Or(cfg.ConnectTimeout, 30*time.Second)
	cfg.PowerTimeout = cmp.Or(cfg.PowerTimeout, 5*time.Minute)
	cfg.BootTimeout = cmp.Or(cfg.BootTimeout, 10*time.Minute)
	cfg.BootPoll = cmp.Or(cfg.BootPoll, 2*time.Second)
	cfg.SSHUser = cmp.Or(cfg.SSHUser, "root")
	if cfg.Rungs == nil {
		cfg.Rungs = ladder.Default
	} else {
		cfg.Rungs, _ = ladder.Order(cfg.Rungs) // validated above: only the order changes
	}
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
	rc.rungs = prometheus.NewCounterVec(prometheus.CounterOpts{
		Name:        "shepherd_recovery_rungs_total",
		Help:        "Rungs of the recovery ladder taken for silent machines, by rung (agent, reboot, power, reinstall) and result (done, failed).",
		ConstLabels: prometheus.Labels{"provider": p.Name()},
	}, []string{"rung", "result"})
	if err := register(reg, rc.rungs); err != nil {
		return nil, fmt.Errorf("recoverer: %w", err)
	}
	for _, r := range ladder.All {
		rc.rungs.WithLabelValues(string(r), "done")
		rc.rungs.WithLabelValues(string(r), "failed")
	}
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

// Run runs the recoverer until ctx ends. It first records its heartbeat
// timeouts in the BMDB (bmdb.RecordSilenceTimeouts), retrying meanwhile
// until that succeeds, so that every surface judges Silent as it does.
func (rc *Recoverer) Run(ctx context.Context) error {
	// The recording stops with the runner, which may return before ctx
	// ends (an error of its own): Run must not then wait on a retry loop
	// that only ctx would end.
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Go(func() { rc.recordTimeouts(ctx) })
	// The breaker's lines held back are logged when the recoverer stops,
	// as the runner's are.
	defer rc.breaker.failures.Flush()
	return rc.runner.Run(ctx)
}

// recordTimeoutsRetry is the pause between attempts to record the
// timeouts while the BMDB is unreachable.
const recordTimeoutsRetry = 5 * time.Second

// recordTimeouts records the recoverer's heartbeat timeouts, retrying
// until it succeeds or ctx ends.
func (rc *Recoverer) recordTimeouts(ctx context.Context) {
	host, _ := os.Hostname()
	by := fmt.Sprintf("recoverer on %s (pid %d)", cmp.Or(host, "unknown host"), os.Getpid())
	for {
		err := rc.db.RecordSilenceTimeouts(ctx, rc.p.Name(), by, rc.cfg.FirstHeartbeatTimeout, rc.cfg.HeartbeatTimeout)
		if err == nil {
			rc.log.InfoContext(ctx, "recorded the heartbeat timeouts in the BMDB",
				"first_heartbeat_timeout", rc.cfg.FirstHeartbeatTimeout, "heartbeat_timeout", rc.cfg.HeartbeatTimeout)
			return
		}
		if ctx.Err() != nil {
			return
		}
		rc.log.WarnContext(ctx, "recording the heartbeat timeouts in the BMDB; retrying", "err", err)
		sleep(ctx, recordTimeoutsRetry)
	}
}

// recover climbs the recovery ladder (SPEC §3.4) for one silent machine:
// it takes the rung above the last one carried out since the agent's last
// heartbeat (the bottom rung first), and climbs on at once past a rung that
// fails, so that a machine whose SSH is dead reaches its BMC within one work
// item. A rung carried out ends the work: the machine's agent tags are
// cleared, the initializer takes it over again, and the next silence climbs
// one rung higher. When the top rung fails too, a ladder of two or more
// rungs quarantines the machine with a cause listing every rung and what it
// returned; a ladder of one rung fails the work with backoff, as a plain
// reboot always did.
//
// Every admission verifies, in the transaction that records it, that the
// session still holds the work and that the machine is still silent, so a
// worker stalled past its lease (or one that lost a race with a heartbeat)
// does not act on a machine that another worker took over or that
// recovered. Every rung but Agent is a restart, counted by the breaker.
func (rc *Recoverer) recover(ctx context.Context, t *Task) (FinishFunc, error) {
	budget, err := rc.breaker.budget(ctx)
	if err != nil {
		return nil, err
	}
	rungs, err := rc.ladderOf(ctx, t.Machine.ProviderID)
	if err != nil {
		return nil, err
	}
	if len(rungs) == 0 {
		cause := "no recovery rung applies to the machine (is the rung it was configured with, such as power without a BMC, possible?); " +
			"fix the configuration and reset the machine's Recovery"
		if err := t.Session.QuarantineRecovery(ctx, t.Machine.MachineID, cause); err != nil {
			return nil, err
		}
		return nil, errors.New(cause)
	}
	clearAgent := func(ctx context.Context, tx *bmdb.Tx) error {
		return tx.ClearAgent(ctx, t.Machine.MachineID)
	}
	req := bmdb.RebootRequest{
		Provider: rc.p.Name(), MachineID: t.Machine.MachineID, Candidates: rc.candidates(),
		Window: rc.cfg.Window, Max: budget, StreakLimit: max(rc.cfg.MaxRebootsWithoutHeartbeat, len(rungs)),
		Ladder: rungs,
	}
	var climbed []bmdb.RungAttempt
	for {
		a, err := t.Session.AdmitReboot(ctx, req)
		if err != nil {
			return nil, err
		}
		switch a.Decision {
		case bmdb.RebootAdmitted:
		case bmdb.RebootBudgetExhausted:
			// Other workers (or processes) took the last restarts of the
			// window between our check and our claim: give the machine
			// back unjudged, held by the breaker.
			rc.breaker.refused(ctx)
			return nil, fmt.Errorf("held by the circuit breaker: %d restarts of %s's machines admitted in the last %s, "+
				"the budget of the window is %d; the %s rung waits for the window to move on: %w",
				a.InWindow, rc.p.Name(), rc.cfg.Window, budget, a.Rung, ErrHeld)
		case bmdb.RebootNotSilent:
			t.Log.InfoContext(ctx, "not recovering: the machine is no longer silent")
			return nil, fmt.Errorf("not recovering: the machine is no longer silent (its agent heartbeat since the claim, "+
				"or the provider reports it missing or stopped): %w", ErrRetryLater)
		case bmdb.RebootAlreadyIssued:
			// A worker took a rung for this agent incarnation and could
			// not record it (it lost its session, or crashed): one rung
			// per silence.
			t.Log.WarnContext(ctx, "not recovering: a rung was taken for this agent already; handing it to the initializer")
			t.Note = "no rung taken: one was taken for this agent already by a worker that could not record its end; " +
				"handed to the initializer"
			return clearAgent, nil
		case bmdb.RebootStreakQuarantined:
			return nil, errors.New(a.Cause)
		default:
			return nil, fmt.Errorf("admitting a recovery rung: unknown decision %q", a.Decision)
		}
		t.Log.InfoContext(ctx, "recovering silent machine", "rung", a.Rung, "provider_id", t.Machine.ProviderID,
			"restarts_in_window", a.InWindow, "rungs_without_heartbeat", a.Streak)
		err = rc.take(ctx, t, a.Rung)
		if err == nil {
			err = rc.waitBooted(ctx, t, a.Rung)
		}
		result := "done"
		if err != nil {
			result = "failed"
		}
		rc.rungs.WithLabelValues(string(a.Rung), result).Inc()
		if err == nil {
			t.Note = fmt.Sprintf("recovery rung %s (%s) done; waiting for a heartbeat", a.Rung, a.Rung.Describe())
			if len(climbed) > 0 {
				t.Note += "; below it: " + bmdb.DescribeRungs(climbed)
			}
			return clearAgent, nil
		}
		if ctx.Err() != nil {
			// Stopping (or out of time): what the rung did is unknown.
			rc.rungFailed(ctx, t, a, true, err)
			return nil, err
		}
		reached := !errors.Is(err, provider.ErrNotReached)
		rc.rungFailed(ctx, t, a, reached, err)
		climbed = append(climbed, bmdb.RungAttempt{Rung: a.Rung, Failed: true, Reached: reached, Result: err.Error()})
		if a.Rung != rungs[len(rungs)-1] {
			t.Log.WarnContext(ctx, "recovery rung failed, climbing", "rung", a.Rung, "err", err)
			req.After = a.Rung
			continue
		}
		if len(rungs) == 1 {
			return nil, err
		}
		cause := "every recovery rung failed: " + bmdb.DescribeRungs(climbed) +
			"; the machine needs an operator (reset its Recovery to climb again)"
		if qerr := t.Session.QuarantineRecovery(ctx, t.Machine.MachineID, cause); qerr != nil {
			return nil, fmt.Errorf("%s (quarantining: %w)", cause, qerr)
		}
		return nil, errors.New(cause)
	}
}

// rungFailed records that rung a failed with err.
func (rc *Recoverer) rungFailed(ctx context.Context, t *Task, a bmdb.RebootAdmission, reached bool, err error) {
	if ferr := t.Session.RebootFailed(ctx, a, reached, err.Error()); ferr != nil {
		t.Log.WarnContext(ctx, "recording the failed recovery rung", "rung", a.Rung, "err", ferr)
	}
}

// ladderOf returns the rungs machine pid may take: the provider's choice
// for it (provider.RungChooser) or the configured ladder, without the rungs
// the machine cannot take.
func (rc *Recoverer) ladderOf(ctx context.Context, pid string) ([]ladder.Rung, error) {
	rungs := rc.cfg.Rungs
	if ch, ok := rc.p.(provider.RungChooser); ok {
		r, err := ch.RecoveryRungs(ctx, pid)
		if err != nil {
			return nil, fmt.Errorf("asking %s for the recovery rungs of %s: %w", rc.p.Name(), pid, err)
		}
		if r != nil {
			rungs = r
		}
	}
	out := make([]ladder.Rung, 0, len(rungs))
	for _, r := range rungs {
		switch r {
		case ladder.Agent:
			if rc.cfg.SSHKey == nil {
				continue
			}
		case ladder.Power:
			pc, ok := rc.p.(provider.PowerController)
			if !ok {
				continue
			}
			if _, err := pc.BMC(ctx, pid); errors.Is(err, provider.ErrNoBMC) {
				continue
			}
		}
		out = append(out, r)
	}
	return out, nil
}

// take carries out one rung. An error wrapping provider.ErrNotReached says
// the rung certainly did nothing to the machine.
func (rc *Recoverer) take(ctx context.Context, t *Task, r ladder.Rung) error {
	pid := t.Machine.ProviderID
	switch r {
	case ladder.Agent:
		return rc.checkSSH(ctx, t)
	case ladder.Reboot:
		rctx, cancel := context.WithTimeout(ctx, rc.cfg.RebootTimeout)
		defer cancel()
		if err := rc.r.RebootMachine(rctx, pid); err != nil {
			return fmt.Errorf("rebooting through %s: %w", rc.p.Name(), err)
		}
		return nil
	case ladder.Power:
		return rc.powerCycle(ctx, t)
	case ladder.Reinstall:
		rctx, cancel := context.WithTimeout(ctx, rc.cfg.RebootTimeout)
		defer cancel()
		err := rc.r.ReinstallMachine(rctx, pid)
		if errors.Is(err, provider.ErrUnsupported) {
			return fmt.Errorf("reinstalling through %s: %w: %w", rc.p.Name(), err, provider.ErrNotReached)
		} else if err != nil {
			return fmt.Errorf("reinstalling through %s: %w", rc.p.Name(), err)
		}
		return nil
	}
	return fmt.Errorf("unknown recovery rung %q: %w", r, provider.ErrNotReached)
}

// checkSSH is the Agent rung: the machine's SSH server must complete a
// handshake and accept Shepherd's login, with the host key the initializer
// would accept, before the machine is handed to the initializer. A host
// that does not answer needs a restart, and handing it over would only
// stall it in the initializer's backoff.
func (rc *Recoverer) checkSSH(ctx context.Context, t *Task) error {
	if err := rc.dialSSH(ctx, t); err != nil {
		return fmt.Errorf("the machine does not answer SSH: %w: %w", err, provider.ErrNotReached)
	}
	return nil
}

// dialSSH logs in to the machine as the initializer would, within
// ConnectTimeout, and logs out.
func (rc *Recoverer) dialSSH(ctx context.Context, t *Task) error {
	target, trust, err := machineTarget(ctx, rc.db, rc.p, t.Machine.MachineID, t.Machine.ProviderID, rc.cfg.SSHUser, rc.cfg.SSHKey)
	if err != nil {
		return err
	}
	trust.apply(&target)
	dctx, cancel := context.WithTimeout(ctx, rc.cfg.ConnectTimeout)
	defer cancel()
	client, err := sshx.Dial(dctx, target)
	if err != nil {
		return trust.explain(ctx, rc.db, err)
	}
	client.Close()
	return nil
}

// waitBooted waits, after a rung that restarted the machine in place
// (Reboot, Power), until the machine answers SSH again, polling every
// BootPoll for at most BootTimeout, so that the initializer's takeover
// meets a booted machine. An answer with another host key counts (the
// initializer reports it). A machine that does not come back is an error
// that reached it: the ladder climbs on. Without an SSH key, or after
// other rungs (a reinstall changes the host key), it does not wait.
func (rc *Recoverer) waitBooted(ctx context.Context, t *Task, r ladder.Rung) error {
	if rc.cfg.SSHKey == nil || (r != ladder.Reboot && r != ladder.Power) {
		return nil
	}
	wctx, cancel := context.WithTimeout(ctx, rc.cfg.BootTimeout)
	defer cancel()
	tick := time.NewTicker(rc.cfg.BootPoll)
	defer tick.Stop()
	var last error
	for {
		err := rc.dialSSH(wctx, t)
		if err == nil || errors.Is(err, sshx.ErrHostKeyMismatch) {
			return nil
		}
		last = err
		select {
		case <-wctx.Done():
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return fmt.Errorf("%s carried out, but the machine did not answer SSH within %s: %w", r.Describe(), rc.cfg.BootTimeout, last)
		case <-tick.C:
		}
	}
}

// powerCycle is the Power rung: a cycle through the machine's BMC, whose
// result is recorded as the machine's last known power state.
func (rc *Recoverer) powerCycle(ctx context.Context, t *Task) error {
	pc, ok := rc.p.(provider.PowerController)
	if !ok {
		return fmt.Errorf("%s has no BMCs: %w", rc.p.Name(), provider.ErrNotReached)
	}
	bmc, err := pc.BMC(ctx, t.Machine.ProviderID)
	if err != nil {
		return fmt.Errorf("finding the BMC: %w: %w", err, provider.ErrNotReached)
	}
	pctx, cancel := context.WithTimeout(ctx, rc.cfg.PowerTimeout)
	defer cancel()
	found, err := bmc.Cycle(pctx) // on success the BMC reports on
	if rerr := rc.db.RecordPowerState(context.WithoutCancel(ctx), t.Machine.MachineID, poweraction.Reading(bmc.Name, power.On, err)); rerr != nil {
		t.Log.WarnContext(ctx, "recording the power state", "err", rerr)
	}
	if err != nil {
		err = fmt.Errorf("power cycle through %s: %w", bmc.Name, err)
		// Nothing was done to the machine when the BMC refused us or the
		// action: the breaker does not count it.
		if errors.Is(err, power.ErrAuth) || errors.Is(err, power.ErrCertificate) || errors.Is(err, power.ErrUnsupported) {
			err = fmt.Errorf("%w: %w", err, provider.ErrNotReached)
		}
		return err
	}
	t.Log.InfoContext(ctx, "power cycled", "bmc", bmc.Name, "found", found)
	return nil
}

// breaker is the fleet-wide circuit breaker of SPEC §3.4. Its state comes
// from the BMDB (reboots in the window, silent and started machines), so
// every recoverer process sees the same picture.
type breaker struct {
	rc *Recoverer
	// read computes the breaker from the BMDB: ReadBreaker with rc's
	// provider and configuration.
	read func(context.Context) (BreakerState, error)
	// failures bounds the lines of failed reads (every worker reads
	// before every claim): one per interval, with a count.
	failures *ratelog.Logger

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
		failures: ratelog.New(rc.log, 0),
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
		b.failures.Warn(ctx, "checking the circuit breaker", "err", err)
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
		b.failures.Warn(ctx, "checking the circuit breaker", "err", err)
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
