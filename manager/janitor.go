package manager

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb"
)

// Janitor defaults.
const (
	defaultJanitorPeriod    = 30 * time.Second
	defaultSessionRetention = 7 * 24 * time.Hour
	// sweepWindow is how long after a decommission the janitor looks for
	// tags that raced with it (a heartbeat batch authenticated just
	// before). Such a race lasts one statement; an hour covers any stall.
	sweepWindow = time.Hour
)

// JanitorConfig configures the janitor (SPEC §3.6). Zero values mean
// defaults.
type JanitorConfig struct {
	// Period is the time between passes (jittered); default 30s.
	Period time.Duration
	// SessionRetention is how long ended (closed or expired) sessions are
	// kept before they are deleted; default 7 days. History keeps their ids.
	SessionRetention time.Duration
	// FirstHeartbeatTimeout and HeartbeatTimeout decide which machines the
	// gauges count as Silent; zero (the default) reads, every pass, the
	// timeouts the recoverers recorded in the BMDB (bmdb.SilenceTimeouts,
	// the defaults if none did), so that the gauges judge as they do.
	FirstHeartbeatTimeout, HeartbeatTimeout time.Duration
	// Lease is the session lease; default bmdb.DefaultLease.
	Lease time.Duration
}

// Validate reports the first problem with the configuration. It changes nothing.
// (Ifs, not a switch: see LoopConfig.Validate.)
func (c JanitorConfig) Validate() error {
	if c.Period < 0 {
		return fmt.Errorf("janitor: Period must be >= 0 (0 = default %s), got %s", defaultJanitorPeriod, c.Period)
	}
	if c.SessionRetention < 0 {
		return fmt.Errorf("janitor: SessionRetention must be >= 0 (0 = default %s), got %s", defaultSessionRetention, c.SessionRetention)
	}
	if c.FirstHeartbeatTimeout < 0 || c.HeartbeatTimeout < 0 {
		return errors.New("janitor: heartbeat timeouts must be >= 0 (0 = default)")
	}
	if c.Lease < 0 {
		return fmt.Errorf("janitor: Lease must be >= 0 (0 = default), got %s", c.Lease)
	}
	return nil
}

// Janitor keeps the BMDB tidy and exports the fleet gauges (SPEC §3.6).
// Every Period it expires the work of dead sessions (history Expired),
// deletes sessions that ended more than SessionRetention ago, removes tags
// that raced with a decommission, and reads the fleet gauges from the BMDB
// with a few set-based queries.
//
// Any number of janitors may run: every step is idempotent, so they need
// no lease, and each one reads the gauges itself, so every process that
// runs a janitor exports correct gauges. The gauges are the last pass's
// snapshot, reported as a whole: a series whose count went to zero (a
// state no machine is in any more, a location that emptied) is not
// reported at all, rather than kept at its last value.
type Janitor struct {
	cfg     JanitorConfig
	db      *bmdb.DB
	log     *slog.Logger
	metrics *janitorMetrics
	fleet   *fleetCollector
}

type janitorMetrics struct {
	passes          *prometheus.CounterVec
	sessionsDeleted prometheus.Counter
	tagsSwept       prometheus.Counter
	fleetQuery      prometheus.Histogram
}

// NewJanitor validates cfg and returns a janitor. Its metrics, the fleet
// gauges included, are registered on reg (nil keeps them private); log may
// be nil.
func NewJanitor(cfg JanitorConfig, db *bmdb.DB, reg prometheus.Registerer, log *slog.Logger) (*Janitor, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Period = cmp.Or(cfg.Period, defaultJanitorPeriod)
	cfg.SessionRetention = cmp.Or(cfg.SessionRetention, defaultSessionRetention)
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	m := &janitorMetrics{
		passes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_janitor_passes_total",
			Help: "Janitor passes, by result (ok, or error: some step failed and was logged).",
		}, []string{"result"}),
		sessionsDeleted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "shepherd_janitor_sessions_deleted_total",
			Help: "Ended sessions the janitor deleted after the retention period.",
		}),
		tagsSwept: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "shepherd_janitor_tags_swept_total",
			Help: "Tags of decommissioned machines the janitor deleted because they raced with the decommission.",
		}),
		fleetQuery: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "shepherd_janitor_fleet_query_duration_seconds",
			Help:    "Time to read the fleet gauges from the BMDB.",
			Buckets: prometheus.ExponentialBuckets(0.005, 2, 12),
		}),
	}
	fc := &fleetCollector{}
	for _, c := range []prometheus.Collector{m.passes, m.sessionsDeleted, m.tagsSwept, m.fleetQuery, fc} {
		if err := register(reg, c); err != nil {
			return nil, fmt.Errorf("janitor: %w", err)
		}
	}
	for _, r := range []string{"ok", "error"} {
		m.passes.WithLabelValues(r)
	}
	return &Janitor{cfg: cfg, db: db, log: log.With("component", "janitor"), metrics: m, fleet: fc}, nil
}

// Run makes a pass at once and then every Period (jittered) until ctx
// ends, and returns nil. It holds a session, so that operators see the
// janitor among the running components.
func (j *Janitor) Run(ctx context.Context) error {
	return j.db.KeepSession(ctx, bmdb.SessionConfig{Component: "janitor", Lease: j.cfg.Lease}, func(ctx context.Context, _ *bmdb.Session) error {
		for ctx.Err() == nil {
			if _, err := j.Pass(ctx); err != nil && ctx.Err() == nil {
				j.log.ErrorContext(ctx, "janitor pass failed", "err", err)
			}
			sleep(ctx, jitter(j.cfg.Period))
		}
		return nil
	})
}

// JanitorResult says what one pass did.
type JanitorResult struct {
	// Expired is the number of work items of dead sessions expired.
	Expired int
	// SessionsDeleted is the number of old sessions deleted.
	SessionsDeleted int64
	// TagsSwept is the number of stray tags of decommissioned machines deleted.
	TagsSwept int64
	// HoldsReleased is the number of ended Recovery backoffs of machines
	// that heartbeat again, deleted.
	HoldsReleased int64
	// AdmissionsDeleted is the number of records of reboots admitted longer
	// ago than any circuit breaker window (bmdb.MaxRecoveryWindow) deleted.
	AdmissionsDeleted int64
	// Fleet is what the gauges show now; zero if reading them failed.
	Fleet bmdb.FleetSnapshot
}

// Pass makes one pass. Each step runs even if an earlier one failed; the
// error joins the failures. The gauges keep the last snapshot that was
// read successfully.
func (j *Janitor) Pass(ctx context.Context) (JanitorResult, error) {
	var res JanitorResult
	var errs []error
	var err error
	if res.Expired, err = j.db.ExpireWork(ctx); err != nil {
		errs = append(errs, err)
	}
	if res.SessionsDeleted, err = j.db.DeleteSessions(ctx, j.cfg.SessionRetention); err != nil {
		errs = append(errs, err)
	}
	j.metrics.sessionsDeleted.Add(float64(res.SessionsDeleted))
	if res.TagsSwept, err = j.db.SweepDecommissioned(ctx, sweepWindow); err != nil {
		errs = append(errs, err)
	}
	j.metrics.tagsSwept.Add(float64(res.TagsSwept))
	if res.HoldsReleased, err = j.db.ReleaseRecoveredHolds(ctx); err != nil {
		errs = append(errs, err)
	}
	if res.AdmissionsDeleted, err = j.db.DeleteRecoveryAdmissions(ctx); err != nil {
		errs = append(errs, err)
	}
	start := time.Now()
	snap, err := j.fleetSnapshot(ctx)
	took := time.Since(start)
	if err != nil {
		errs = append(errs, err)
	} else {
		j.metrics.fleetQuery.Observe(took.Seconds())
		j.fleet.set(snap, time.Now())
		res.Fleet = snap
	}
	if res.Expired > 0 || res.SessionsDeleted > 0 || res.TagsSwept > 0 || res.HoldsReleased > 0 || res.AdmissionsDeleted > 0 {
		j.log.InfoContext(ctx, "janitor pass", "expired_work", res.Expired, "sessions_deleted", res.SessionsDeleted,
			"tags_swept", res.TagsSwept, "recovery_holds_released", res.HoldsReleased,
			"admissions_deleted", res.AdmissionsDeleted, "fleet_query", took.Round(time.Millisecond))
	} else {
		j.log.DebugContext(ctx, "janitor pass", "fleet_query", took.Round(time.Millisecond))
	}
	if err := errors.Join(errs...); err != nil {
		j.metrics.passes.WithLabelValues("error").Inc()
		return res, fmt.Errorf("janitor: %w", err)
	}
	j.metrics.passes.WithLabelValues("ok").Inc()
	return res, nil
}

// The fleet gauges (SPEC §3.6, §6).
var (
	fleetMachinesDesc = prometheus.NewDesc("shepherd_fleet_machines",
		"Provided machines per provider, location and derived state (Provided, AgentStarting, Healthy, Silent, ...; SPEC 3.7), as of the janitor's last pass. Decommissioned machines are not counted.",
		[]string{"provider", "location", "state"}, nil)
	fleetLiveWorkDesc = prometheus.NewDesc("shepherd_fleet_live_work",
		"Work items held by live sessions, per process, as of the janitor's last pass.",
		[]string{"process"}, nil)
	fleetBackoffsDesc = prometheus.NewDesc("shepherd_fleet_backoffs",
		"Machines a process leaves alone, per process: in an active backoff (quarantined=\"false\") or quarantined until an operator resets them (quarantined=\"true\").",
		[]string{"process", "quarantined"}, nil)
	fleetHardwareMachinesDesc = prometheus.NewDesc("shepherd_fleet_hardware_machines",
		"Provided machines with a hardware report, per provider and location.",
		[]string{"provider", "location"}, nil)
	fleetMemoryDesc = prometheus.NewDesc("shepherd_fleet_memory_bytes",
		"Memory of the provided machines per provider and location, from their hardware reports.",
		[]string{"provider", "location"}, nil)
	fleetThreadsDesc = prometheus.NewDesc("shepherd_fleet_cpu_threads",
		"CPU threads of the provided machines per provider and location, from their hardware reports.",
		[]string{"provider", "location"}, nil)
	fleetDecommissionedDesc = prometheus.NewDesc("shepherd_fleet_decommissioned_machines",
		"Machines decommissioned so far, per provider: they keep their history but left the fleet.",
		[]string{"provider"}, nil)
	fleetSnapshotDesc = prometheus.NewDesc("shepherd_fleet_snapshot_timestamp_seconds",
		"When the janitor last read the fleet gauges from the BMDB (Unix time); the other shepherd_fleet_ gauges are as of then.",
		nil, nil)
)

// fleetCollector reports the fleet gauges of the last snapshot, all of
// them from the same snapshot. Nothing is reported before the first one.
type fleetCollector struct {
	mu   sync.Mutex
	snap *bmdb.FleetSnapshot
	at   time.Time
}

func (c *fleetCollector) set(s bmdb.FleetSnapshot, at time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.snap, c.at = &s, at
}

// Describe implements prometheus.Collector.
func (c *fleetCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{fleetMachinesDesc, fleetLiveWorkDesc, fleetBackoffsDesc, fleetHardwareMachinesDesc,
		fleetMemoryDesc, fleetThreadsDesc, fleetDecommissionedDesc, fleetSnapshotDesc} {
		ch <- d
	}
}

// Collect implements prometheus.Collector. Machine counts by state and
// location, hardware and decommissions are reported where they are not
// zero: providers and locations are open sets, and a series for every
// state in every location would mostly say zero. Live work and backoffs
// are reported for every process (a closed set), zeros included.
func (c *fleetCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	s, at := c.snap, c.at
	c.mu.Unlock()
	if s == nil {
		return
	}
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	gauge(fleetSnapshotDesc, float64(at.UnixNano())/1e9)
	for _, st := range s.States {
		gauge(fleetMachinesDesc, float64(st.Machines), st.Provider, st.Location, string(st.State))
	}
	backoffs := map[bmdb.BackoffCount]int64{}
	for _, b := range s.Backoffs {
		backoffs[bmdb.BackoffCount{Process: b.Process, Quarantined: b.Quarantined}] = b.Machines
	}
	for _, p := range bmdb.Processes() {
		gauge(fleetLiveWorkDesc, float64(s.LiveWork[p]), string(p))
		for _, q := range []bool{false, true} {
			gauge(fleetBackoffsDesc, float64(backoffs[bmdb.BackoffCount{Process: p, Quarantined: q}]), string(p), strconv.FormatBool(q))
		}
	}
	for _, h := range s.Hardware {
		gauge(fleetHardwareMachinesDesc, float64(h.Machines), h.Provider, h.Location)
		gauge(fleetMemoryDesc, h.MemoryBytes, h.Provider, h.Location)
		gauge(fleetThreadsDesc, h.CPUThreads, h.Provider, h.Location)
	}
	for p, n := range s.Decommissioned {
		gauge(fleetDecommissionedDesc, float64(n), p)
	}
}

// fleetSnapshot reads the fleet gauges, judging silence by the configured
// heartbeat timeouts or, where they are zero, by those the recoverers
// recorded in the BMDB.
func (j *Janitor) fleetSnapshot(ctx context.Context) (bmdb.FleetSnapshot, error) {
	first, hb := j.cfg.FirstHeartbeatTimeout, j.cfg.HeartbeatTimeout
	if first == 0 || hb == 0 {
		t, err := j.db.SilenceTimeouts(ctx)
		if err != nil {
			return bmdb.FleetSnapshot{}, fmt.Errorf("bmdb: reading the fleet gauges: %w", err)
		}
		first, hb = cmp.Or(first, t.FirstHeartbeat), cmp.Or(hb, t.Heartbeat)
	}
	return j.db.FleetSnapshot(ctx, first, hb)
}
