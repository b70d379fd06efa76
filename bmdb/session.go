package bmdb

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"runtime/debug"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/bmdb/model"
)

// DefaultLease is the session lease when SessionConfig.Lease is zero (SPEC §2.3).
const DefaultLease = 10 * time.Second

// minLease keeps renewal (every lease/3) from turning into a busy loop.
const minLease = 300 * time.Millisecond

// ClaimStrategy selects how Work picks among candidates.
type ClaimStrategy int

const (
	// ClaimSkipLocked locks a candidate with FOR UPDATE SKIP LOCKED, so
	// concurrent workers spread over the candidates. The default.
	ClaimSkipLocked ClaimStrategy = iota
	// ClaimPlainLimit takes the first candidate with a plain LIMIT 1 and
	// waits for its lock, so concurrent workers pick the same machine and
	// queue on it (and come back empty-handed when it was taken meanwhile).
	// It is the baseline `make bench` measures ClaimSkipLocked against; it is
	// just as safe, only much slower under contention.
	ClaimPlainLimit
)

// SessionConfig describes a component instance. Zero values mean defaults.
type SessionConfig struct {
	// Component names what runs under the session (initializer, server, ...); required.
	Component string
	// Lease is how long the session stays alive without a renewal; renewals
	// happen every Lease/3. Default DefaultLease; at least 300ms.
	Lease time.Duration
	// Hostname and Version are recorded for operators; defaults are the OS
	// hostname and the binary's module version.
	Hostname string
	Version  string
	// ClaimStrategy selects how Work claims; default ClaimSkipLocked.
	ClaimStrategy ClaimStrategy
	// ScanLimit is how many candidates one claim may look at before giving
	// up on the ones other workers hold; default 64.
	ScanLimit int
}

// Validate reports the first problem with the configuration. It changes nothing.
func (c SessionConfig) Validate() error {
	if c.Component == "" {
		return errors.New("bmdb: SessionConfig.Component is required")
	}
	if c.Lease != 0 && c.Lease < minLease {
		return fmt.Errorf("bmdb: SessionConfig.Lease must be 0 (default %s) or at least %s, got %s", DefaultLease, minLease, c.Lease)
	}
	if c.ClaimStrategy != ClaimSkipLocked && c.ClaimStrategy != ClaimPlainLimit {
		return fmt.Errorf("bmdb: SessionConfig.ClaimStrategy %d is not a known strategy", c.ClaimStrategy)
	}
	if c.ScanLimit < 0 {
		return fmt.Errorf("bmdb: SessionConfig.ScanLimit must be >= 0 (0 = default), got %d", c.ScanLimit)
	}
	return nil
}

// Session is a running component instance's lease on the BMDB. While it is
// alive, the work it claimed is its own; once it is lost (not renewed in
// time) or closed, its context is cancelled and every call on it fails with
// ErrSessionExpired.
type Session struct {
	db  *DB
	id  uuid.UUID
	cfg SessionConfig
	log *slog.Logger

	ctx    context.Context // cancelled when the session is lost or closed
	cancel context.CancelCauseFunc

	stopRenew context.CancelFunc
	renewDone chan struct{}

	// Work the session knows it holds, and the resolution of claims whose
	// outcome is unknown (see reconcileLoop).
	claimMu       sync.RWMutex // held shared by claims, exclusively by reconcile
	heldMu        sync.Mutex
	held          map[workKey]*Work
	unsure        atomic.Bool   // a claim may have committed unheard
	kick          chan struct{} // wakes reconcileLoop; buffered
	reconcileDone chan struct{}

	closeOnce sync.Once
	closeErr  error
	lostOnce  sync.Once
}

// StartSession opens a session and starts renewing its lease in the
// background until Close. The session's context (Context) derives from ctx.
// When it fails with the start's outcome unknown (the reply lost, or ctx
// ended while the INSERT was in flight), it closes the session it may have
// opened before returning, so that a failed start leaves no open session.
func (db *DB) StartSession(ctx context.Context, cfg SessionConfig) (*Session, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Lease = cmp.Or(cfg.Lease, DefaultLease)
	cfg.ScanLimit = cmp.Or(cfg.ScanLimit, 64)
	if cfg.Hostname == "" {
		cfg.Hostname, _ = os.Hostname()
	}
	if cfg.Version == "" {
		cfg.Version = binaryVersion()
	}
	// The local deadline is measured from before the INSERT is sent, so it
	// never runs later than the deadline the database computes.
	sent := time.Now()
	start := model.SessionStartParams{
		SessionID: uuid.New(),
		Component: cfg.Component,
		Hostname:  cfg.Hostname,
		Pid:       int32(os.Getpid()),
		Version:   cfg.Version,
		LeaseMs:   cfg.Lease.Milliseconds(),
	}
	row, err := db.q.SessionStart(ctx, start)
	if err != nil {
		if outcomeUnknown(err) {
			db.abandonSession(ctx, start)
		}
		return nil, fmt.Errorf("bmdb: starting %s session: %w", cfg.Component, err)
	}
	s := &Session{
		db:        db,
		id:        row.SessionID,
		cfg:       cfg,
		log:       db.log.With("session_id", row.SessionID.String(), "session_component", cfg.Component),
		renewDone: make(chan struct{}),

		held:          map[workKey]*Work{},
		kick:          make(chan struct{}, 1),
		reconcileDone: make(chan struct{}),
	}
	s.ctx, s.cancel = context.WithCancelCause(ctx)
	// Renewal outlives the caller's ctx: the session stays alive until Close,
	// so that Close can still cancel the session's work cleanly.
	rctx, stop := context.WithCancel(context.WithoutCancel(ctx))
	s.stopRenew = stop
	db.metrics.sessionsStarted.WithLabelValues(cfg.Component).Inc()
	db.metrics.sessionsOpen.WithLabelValues(cfg.Component).Inc()
	// At zero from the start, so that the first loss is an increase
	// Prometheus sees (a series born at 1 shows none).
	db.metrics.sessionsLost.WithLabelValues(cfg.Component)
	go s.renew(rctx, sent.Add(cfg.Lease))
	go s.reconcileLoop(rctx)
	s.log.InfoContext(ctx, "session started", "lease", cfg.Lease)
	return s, nil
}

// abandonTimeout bounds abandonSession's attempts, as it bounds Close's.
const abandonTimeout = 10 * time.Second

// abandonSession closes a session whose start failed with its outcome
// unknown: the INSERT may have committed with its reply lost, or the caller's
// context ended while it was in flight (pgx then returns at once, whatever
// the database did). The caller was given no session, so nobody would renew
// or close it, and it would count as a live component until its lease ran
// out. It runs detached from ctx's cancellation, because a canceled ctx is
// one of the reasons it is needed, and retries while the database is
// unreachable, for at most abandonTimeout; after that the lease is what ends
// the session.
func (db *DB) abandonSession(ctx context.Context, start model.SessionStartParams) {
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), abandonTimeout)
	defer cancel()
	pause := 20 * time.Millisecond
	for {
		err := db.q.SessionAbandon(actx, model.SessionAbandonParams(start))
		if err == nil {
			db.log.InfoContext(actx, "closed a session whose start failed unheard", "session_id", start.SessionID.String(), "session_component", start.Component)
			return
		}
		if !Unavailable(err) || !sleep(actx, jitter(pause)) {
			db.log.WarnContext(actx, "cannot close a session whose start failed unheard; it stays open until its lease ends",
				"session_id", start.SessionID.String(), "session_component", start.Component, "lease", time.Duration(start.LeaseMs)*time.Millisecond, "err", err)
			return
		}
		pause = min(2*pause, time.Second)
	}
}

// ID is the session's id, as recorded in history.
func (s *Session) ID() uuid.UUID { return s.id }

// Component is the component name the session was started with.
func (s *Session) Component() string { return s.cfg.Component }

// Context is cancelled when the session is lost or closed (or when the
// context given to StartSession ends). Work done for the session should use
// it, so that it stops once its locks may belong to someone else.
func (s *Session) Context() context.Context { return s.ctx }

// Lost reports whether the session's lease lapsed before Close.
func (s *Session) Lost() bool {
	cause := context.Cause(s.ctx)
	// A closed session's cause wraps ErrSessionExpired (its work is gone
	// all the same), but closing is not losing.
	return errors.Is(cause, ErrSessionExpired) && !errors.Is(cause, errSessionClosed)
}

// renew moves the deadline every lease/3. A failed renewal is retried more
// often until localDeadline, our conservative estimate of the deadline in the
// database: only then, or when the database says the session is gone, is the
// session lost. A third of the lease lets two renewals in a row fail (a
// PostgreSQL restart, a slow checkpoint) before anyone may treat our locks as
// abandoned.
func (s *Session) renew(ctx context.Context, localDeadline time.Time) {
	defer close(s.renewDone)
	period := s.cfg.Lease / 3
	retry := max(period/5, 20*time.Millisecond)
	t := time.NewTimer(period)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		sent := time.Now()
		rctx, cancel := context.WithDeadline(ctx, localDeadline)
		_, err := s.db.q.SessionRenew(rctx, s.id)
		cancel()
		switch {
		case err == nil:
			s.db.metrics.renewals.WithLabelValues("ok").Inc()
			localDeadline = sent.Add(s.cfg.Lease)
			t.Reset(period)
		case errors.Is(err, pgx.ErrNoRows):
			s.db.metrics.renewals.WithLabelValues("expired").Inc()
			s.lose(ctx, "the database says the deadline passed")
			return
		case ctx.Err() != nil:
			return
		default:
			s.db.metrics.renewals.WithLabelValues("error").Inc()
			left := time.Until(localDeadline)
			if left <= 0 {
				s.lose(ctx, "renewals failed until the deadline passed: "+err.Error())
				return
			}
			s.db.failures.Warn(ctx, "session renewal failed, retrying", "session_id", s.id.String(), "session_component", s.cfg.Component,
				"err", err, "left", left.Round(time.Millisecond))
			t.Reset(min(retry, left))
		}
	}
}

func (s *Session) lose(ctx context.Context, why string) {
	s.lostOnce.Do(func() {
		s.db.metrics.sessionsLost.WithLabelValues(s.cfg.Component).Inc()
		s.db.metrics.sessionsOpen.WithLabelValues(s.cfg.Component).Dec()
		s.log.ErrorContext(ctx, "session lost", "why", why)
		s.cancel(ErrSessionExpired)
	})
}

// Close ends the session: it stops renewal (and reconciliation), then in one transaction cancels
// the session's remaining work (history Canceled) and marks the session
// closed. A claim of the session still in flight is waited for and then
// canceled like the rest; one that starts later finds the session closed. It uses a fresh context derived from ctx without its cancellation,
// because Close typically runs during shutdown when ctx is already done.
// Closing a lost session only marks it closed: its work is left to expire
// (history Expired). Close is idempotent.
func (s *Session) Close(ctx context.Context) error {
	s.closeOnce.Do(func() {
		s.stopRenew()
		<-s.renewDone
		<-s.reconcileDone
		cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		var row model.SessionCloseRow
		err := s.db.transact(cctx, func(ctx context.Context, q *model.Queries) error {
			if err := q.SessionLockForClose(ctx, s.id); err != nil {
				return err
			}
			var err error
			row, err = q.SessionClose(ctx, s.id)
			return err
		})
		wasLost := s.Lost()
		s.cancel(errSessionClosed)
		if err != nil {
			s.closeErr = fmt.Errorf("bmdb: closing session %s: %w", s.id, err)
			return
		}
		if !wasLost {
			s.db.metrics.sessionsOpen.WithLabelValues(s.cfg.Component).Dec()
			s.db.metrics.sessionsClosed.WithLabelValues(s.cfg.Component).Inc()
		}
		s.log.InfoContext(cctx, "session closed", "canceled_work", row.Canceled, "was_alive", row.WasAlive)
	})
	return s.closeErr
}

// errSessionClosed is the cause of a closed session's context.
var errSessionClosed = fmt.Errorf("session closed: %w", ErrSessionExpired)

// KeepSession runs fn with a live session, and whenever that session is lost
// (a database outage longer than the lease, a stalled process) closes it,
// opens a new one and runs fn again. fn must return when its context, the
// session's, is done; it may also return because it found the session
// expired before this process noticed (ErrSessionExpired from a call), which
// KeepSession confirms with the database. KeepSession returns nil once ctx
// is done or fn returns nil with its session alive, and the error of fn if
// fn fails with its session alive. Opening a session is retried with growing
// pauses while the database is unreachable.
func (db *DB) KeepSession(ctx context.Context, cfg SessionConfig, fn func(ctx context.Context, s *Session) error) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	pause := 100 * time.Millisecond
	for {
		s, err := db.StartSession(ctx, cfg)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			// Every attempt at Debug; at Warn one line per interval for
			// all components, with a count.
			db.log.DebugContext(ctx, "cannot start session, retrying", "session_component", cfg.Component, "err", err, "pause", pause)
			db.failures.Warn(ctx, "cannot start a session", "session_component", cfg.Component, "err", err)
			if !sleep(ctx, jitter(pause)) {
				return nil
			}
			pause = min(2*pause, 5*time.Second)
			continue
		}
		pause = 100 * time.Millisecond
		err = fn(s.Context(), s)
		lost := s.Lost()
		if !lost && ctx.Err() == nil {
			// fn may have met the session's expiry before renewal did.
			if alive, aerr := db.q.SessionAlive(ctx, s.id); aerr == nil && !alive {
				lost = true
			}
		}
		if cerr := s.Close(ctx); cerr != nil && !lost {
			db.log.WarnContext(ctx, "closing session", "err", cerr)
		}
		switch {
		case ctx.Err() != nil:
			return nil
		case lost:
			db.log.WarnContext(ctx, "session lost, starting a new one", "session_component", cfg.Component)
		default:
			return err
		}
	}
}

// jitter returns a duration in [d/2, d), so that processes that failed
// together do not retry together.
func jitter(d time.Duration) time.Duration {
	if d <= 1 {
		return d
	}
	return d/2 + time.Duration(rand.Int64N(int64(d/2)))
}

// sleep waits for d or until ctx is done, and reports whether d passed.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

func binaryVersion() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		return bi.Main.Version
	}
	return "unknown"
}
