// Package manager runs Shepherd's control loops (SPEC §3): the runner that
// claims machines from the BMDB and hands them to a process function, the
// initializer and recoverer built on it, and the provisioner and updater,
// which hold a provider's listing against the BMDB one pass at a time.
package manager

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"runtime/debug"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/internal/ratelog"
)

// Task is one claimed machine handed to a loop's process function.
type Task struct {
	// Machine is the claimed machine's Provided tag.
	Machine bmdb.ProvidedMachine
	// Log carries the machine id and process on every line.
	Log *slog.Logger
	// Session is the session the work was claimed under.
	Session *bmdb.Session
	// Note, if Do sets it and succeeds, is recorded in history with the
	// work's Finished event: what was done (the recovery rungs taken).
	Note string
}

// ErrRetryLater, wrapped by an error a loop's Do returns, means the machine
// could not be processed for a reason that is not the machine's (a circuit
// breaker, a shutdown): the work is canceled, not failed, and no backoff
// applies.
var ErrRetryLater = errors.New("retry later")

// ErrHeld, wrapped by an error a loop's Do returns, means a safety limit
// held the machine back (the recoverer's circuit breaker): the work ends
// with history Held, not Canceled, with the error's text as the cause
// (which limit, and its figures), and no backoff applies.
var ErrHeld = errors.New("held back by a safety limit")

// FinishFunc is the change a successful process makes to the machine's
// tags; it runs in the transaction that ends the work.
type FinishFunc func(ctx context.Context, tx *bmdb.Tx) error

// Loop describes one control loop (SPEC §3.1).
type Loop struct {
	// Process is what the loop does to machines; it names the work.
	Process bmdb.Process
	// Candidates returns the loop's candidate query (called before every
	// claim, so that it may depend on live configuration).
	Candidates func() bmdb.Candidates
	// Backoff applies when processing fails.
	Backoff bmdb.BackoffPolicy
	// Do processes one machine. It returns the tag change that records its
	// success, or an error, which fails the work with the error as cause.
	// ctx ends when the session is lost, the loop stops, or the runner's
	// WorkTimeout passes.
	Do func(ctx context.Context, t *Task) (FinishFunc, error)
	// Admit, if set, is asked before every claim whether the loop may
	// claim now (the recoverer's circuit breaker); a "no" makes the worker
	// wait its idle sleep.
	Admit func(ctx context.Context) bool
}

// LoopConfig configures the runner of a loop. Zero values mean defaults.
type LoopConfig struct {
	// Parallelism is the number of workers sharing the session; default 10.
	Parallelism int
	// QueryLimit bounds how often workers run the candidate query; default
	// 100ms,10.
	QueryLimit Limit
	// IdleSleep is how long a worker waits when there is nothing to do,
	// jittered by ±50 %; default 5s.
	IdleSleep time.Duration
	// Lease is the session lease; default bmdb.DefaultLease.
	Lease time.Duration
	// WorkTimeout bounds one call of the loop's Do, so that a machine is
	// held by a live session for at most WorkTimeout plus the time to end
	// the work (which, if the database is unreachable, the lease bounds);
	// default 30m. Loops bound their own steps more tightly; this is the
	// backstop for a Do that does not.
	WorkTimeout time.Duration
}

// DefaultWorkTimeout is LoopConfig.WorkTimeout when it is zero.
const DefaultWorkTimeout = 30 * time.Minute

// Pauses between attempts to end work (jittered, doubling): short enough to
// release a machine soon after a database restart, long enough not to hammer
// a database that is down.
const (
	endPauseMin = 100 * time.Millisecond
	endPauseMax = 5 * time.Second
)

// Validate reports the first problem with the configuration. It changes nothing.
//
// The checks are if statements, not the cases of a switch: gremlins (the
// mutation tester, see mutate/) cannot see which case expressions the tests
// reach, and would leave their mutants untested.
func (c LoopConfig) Validate(what string) error {
	if c.Parallelism < 0 {
		return fmt.Errorf("%s: Parallelism must be >= 0 (0 = default), got %d", what, c.Parallelism)
	}
	if c.IdleSleep < 0 {
		return fmt.Errorf("%s: IdleSleep must be >= 0 (0 = default), got %s", what, c.IdleSleep)
	}
	if c.Lease < 0 {
		return fmt.Errorf("%s: Lease must be >= 0 (0 = default), got %s", what, c.Lease)
	}
	if c.WorkTimeout < 0 {
		return fmt.Errorf("%s: WorkTimeout must be >= 0 (0 = default %s), got %s", what, DefaultWorkTimeout, c.WorkTimeout)
	}
	return c.QueryLimit.validate(what)
}

// Runner runs one loop: Parallelism workers sharing one session, which is
// replaced whenever it is lost.
type Runner struct {
	cfg  LoopConfig
	loop Loop
	db   *bmdb.DB
	log  *slog.Logger
	// failures bounds the lines about failures every worker meets at once
	// (a database outage): one per kind per interval, with a count.
	failures *ratelog.Logger
	metrics  *loopMetrics
	name     string
}

// NewRunner validates cfg and returns a runner for loop. component names the
// session (e.g. "initializer").
func NewRunner(component string, cfg LoopConfig, loop Loop, db *bmdb.DB, reg prometheus.Registerer, log *slog.Logger) (*Runner, error) {
	if err := cfg.Validate(component); err != nil {
		return nil, err
	}
	if err := loop.Process.Validate(); err != nil {
		return nil, err
	}
	if loop.Do == nil || loop.Candidates == nil {
		return nil, fmt.Errorf("%s: a loop needs Do and Candidates", component)
	}
	if err := loop.Backoff.Validate(); err != nil {
		return nil, fmt.Errorf("%s: %w", component, err)
	}
	cfg.Parallelism = cmp.Or(cfg.Parallelism, 10)
	cfg.IdleSleep = cmp.Or(cfg.IdleSleep, 5*time.Second)
	cfg.Lease = cmp.Or(cfg.Lease, bmdb.DefaultLease)
	cfg.WorkTimeout = cmp.Or(cfg.WorkTimeout, DefaultWorkTimeout)
	m, err := newLoopMetrics(reg, string(loop.Process))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", component, err)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("component", component)
	return &Runner{cfg: cfg, loop: loop, db: db, log: log, failures: ratelog.New(log, 0), metrics: m, name: component}, nil
}

// Run runs the workers until ctx ends, then cancels their work, closes the
// session and returns nil.
func (r *Runner) Run(ctx context.Context) error {
	limiter := r.cfg.QueryLimit.limiter(DefaultLimit())
	defer r.failures.Flush()
	return r.db.KeepSession(ctx, bmdb.SessionConfig{Component: r.name, Lease: r.cfg.Lease}, func(ctx context.Context, s *bmdb.Session) error {
		g, gctx := errgroup.WithContext(ctx)
		for i := range r.cfg.Parallelism {
			g.Go(func() error {
				r.worker(gctx, s, i, limiter)
				return nil
			})
		}
		return g.Wait()
	})
}

// worker claims and processes machines until ctx ends. It never dies of an
// error: every error is logged with the machine id, counted, and followed
// by a pause.
func (r *Runner) worker(ctx context.Context, s *bmdb.Session, id int, limiter interface{ Wait(context.Context) error }) {
	log := r.log.With("worker", id)
	for ctx.Err() == nil {
		if r.loop.Admit != nil && !r.loop.Admit(ctx) {
			r.metrics.claims.WithLabelValues("held").Inc()
			sleep(ctx, jitter(r.cfg.IdleSleep))
			continue
		}
		if err := limiter.Wait(ctx); err != nil {
			return
		}
		w, err := r.claim(ctx, s)
		if err == nil && ctx.Err() != nil {
			// Stopping while the claim committed: end what was claimed
			// rather than leave it to the session's close.
			r.end(ctx, s, w, log, ending{kind: endCancel, cause: fmt.Errorf("the %s is stopping (the claim committed as it stopped)", r.name)})
			return
		}
		switch {
		case errors.Is(err, bmdb.ErrNothingToDo):
			r.metrics.claims.WithLabelValues("nothing_to_do").Inc()
			sleep(ctx, jitter(r.cfg.IdleSleep))
			continue
		case errors.Is(err, bmdb.ErrWorkConflict):
			r.metrics.claims.WithLabelValues("conflict").Inc()
			continue
		case errors.Is(err, bmdb.ErrSessionExpired), ctx.Err() != nil:
			return
		case err != nil:
			r.metrics.claims.WithLabelValues("error").Inc()
			r.failures.Error(ctx, "claiming work", "process", r.loop.Process, "worker", id, "err", err)
			sleep(ctx, jitter(r.cfg.IdleSleep))
			continue
		}
		r.metrics.claims.WithLabelValues("claimed").Inc()
		r.process(ctx, s, w, log.With("machine_id", w.MachineID.String(), "process", string(r.loop.Process)))
	}
}

// claim claims the next candidate. The claim is not cut short when the
// worker stops: a claim abandoned mid-statement may still commit on the
// server after the session's close, and then holds its machine for a
// closed session until a later claim expires it. It runs to its answer,
// for at most one lease (a lost session's claim fails by itself: the claim
// verifies the session; an unreachable database runs into the lease).
func (r *Runner) claim(ctx context.Context, s *bmdb.Session) (*bmdb.Work, error) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.Lease)
	defer cancel()
	return s.Work(cctx, r.loop.Process, r.loop.Candidates())
}

// process runs the loop's Do on one claimed machine, bounded by WorkTimeout,
// and ends the work.
func (r *Runner) process(ctx context.Context, s *bmdb.Session, w *bmdb.Work, log *slog.Logger) {
	start := time.Now()
	defer func() { r.metrics.processing.Observe(time.Since(start).Seconds()) }()
	dctx, cancel := context.WithTimeout(ctx, r.cfg.WorkTimeout)
	t := &Task{Machine: w.Provided, Log: log, Session: s}
	finish, err := r.do(dctx, t)
	timedOut := errors.Is(dctx.Err(), context.DeadlineExceeded) && ctx.Err() == nil
	cancel()
	switch {
	case ctx.Err() != nil:
		// Stopping, or the session is gone: say so, without judging the
		// machine.
		cause := fmt.Errorf("the %s is stopping", r.name)
		if s.Lost() {
			cause = fmt.Errorf("the %s lost its session", r.name)
		}
		if err != nil {
			cause = fmt.Errorf("%w (%w)", cause, err)
		}
		r.end(ctx, s, w, log, ending{kind: endCancel, cause: cause})
	case errors.Is(err, ErrHeld):
		r.end(ctx, s, w, log, ending{kind: endHold, cause: err})
	case errors.Is(err, ErrRetryLater):
		// The loop holds back for a reason that is not the machine's.
		r.end(ctx, s, w, log, ending{kind: endCancel, cause: err})
	case err == nil:
		r.end(ctx, s, w, log, ending{kind: endFinish, finish: finish, note: t.Note})
	case timedOut:
		r.end(ctx, s, w, log, ending{kind: endFail, cause: fmt.Errorf("processing took longer than %s: %w", r.cfg.WorkTimeout, err)})
	default:
		r.end(ctx, s, w, log, ending{kind: endFail, cause: err})
	}
}

// endKind says how a work item is to end.
type endKind int

const (
	endFinish endKind = iota
	endFail
	endCancel
	endHold
)

func (k endKind) String() string {
	return [...]string{"finish", "fail", "cancel", "hold"}[k]
}

// ending is how a work item is to end: with finish's tag change, or failed,
// canceled or held with cause.
type ending struct {
	kind   endKind
	finish FinishFunc
	note   string // recorded with a finish
	cause  error  // why it failed, was canceled or held; nil for a plain cancel

	refusals int // attempts to Fail the database refused
}

// maxFailRefusals is how often the database may refuse to record a failure
// (for reasons other than being unreachable) before the work is canceled
// instead: a refusal that persists must not hold the machine.
const maxFailRefusals = 3

// end ends w as e says, retrying with jittered, doubling pauses (endPauseMin
// to endPauseMax) while the database is unreachable, until the end is
// recorded, the work turns out to be gone, or the session's context is done.
// Giving up earlier would leave the machine held by a live session for the
// life of the process; once the session is lost its work is free for others,
// and once it is closed its work is canceled with it.
//
// A Finish that fails for a reason other than the database being
// unreachable (the FinishFunc refused) becomes a Fail; a Fail the database
// keeps refusing to record becomes a Cancel, so the machine is released
// either way.
// Each attempt runs without the worker's cancellation (a loop that stops
// still records what it did) but within one lease.
func (r *Runner) end(ctx context.Context, s *bmdb.Session, w *bmdb.Work, log *slog.Logger, e ending) {
	r.retryEnd(ctx, s.Context().Done(), log, &e, func(ctx context.Context) error { return r.endOnce(ctx, w, log, &e) })
}

// retryEnd is end's loop: it calls attemptEnd (which may change e) until it
// succeeds, finds the work gone, or lost (the session's context) is done.
func (r *Runner) retryEnd(ctx context.Context, lost <-chan struct{}, log *slog.Logger, e *ending, attemptEnd func(context.Context) error) {
	pause := endPauseMin
	for attempt := 1; ; attempt++ {
		actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), r.cfg.Lease)
		err := attemptEnd(actx)
		cancel()
		switch {
		case err == nil:
			return
		case errors.Is(err, bmdb.ErrSessionExpired):
			r.metrics.claims.WithLabelValues("lost").Inc()
			log.WarnContext(ctx, "work lost with the session before it could be ended", "end", e.kind, "cause", e.cause)
			return
		case errors.Is(err, bmdb.ErrWorkEnded):
			// An earlier attempt committed after all, as something else
			// than this one meant to record.
			r.metrics.claims.WithLabelValues("lost").Inc()
			log.WarnContext(ctx, "work had already ended", "end", e.kind, "err", err)
			return
		}
		r.metrics.endRetries.Inc()
		if attempt == 1 || attempt%10 == 0 {
			log.WarnContext(ctx, "ending work failed, retrying while the session lives", "end", e.kind, "attempt", attempt, "err", err)
		}
		t := time.NewTimer(jitter(pause))
		select {
		case <-lost:
			t.Stop()
			r.metrics.claims.WithLabelValues("lost").Inc()
			log.WarnContext(ctx, "session ended before the work could be ended; it is released with the session",
				"end", e.kind, "err", err, "cause", e.cause)
			return
		case <-t.C:
		}
		// Never pause for long against a lease: the work must end within
		// a lease of the database coming back (SPEC §8 R11).
		pause = min(2*pause, endPauseMax, max(r.cfg.Lease/10, endPauseMin))
	}
}

// endOnce makes one attempt to end w as e says, and records a success in the
// metrics and the log. It turns e into a Fail or a Cancel when the database
// refuses the end e asked for (see end).
func (r *Runner) endOnce(ctx context.Context, w *bmdb.Work, log *slog.Logger, e *ending) error {
	switch e.kind {
	case endFinish:
		var fnErr error
		var fn func(context.Context, *bmdb.Tx) error
		if e.finish != nil {
			fn = func(ctx context.Context, tx *bmdb.Tx) error {
				fnErr = e.finish(ctx, tx)
				return fnErr
			}
		}
		err := w.FinishWithCause(ctx, e.note, fn)
		if err == nil {
			r.metrics.claims.WithLabelValues("finished").Inc()
			log.InfoContext(ctx, "done")
			return nil
		}
		if fnErr == nil || bmdb.Unavailable(err) {
			return err
		}
		// The change Do asked for cannot be recorded: that is the
		// machine's failure, not the database's.
		e.kind, e.cause = endFail, fmt.Errorf("recording the result: %w", err)
		fallthrough
	case endFail:
		b, err := w.Fail(ctx, r.loop.Backoff, e.cause.Error())
		switch {
		case err == nil:
			r.metrics.claims.WithLabelValues("failed").Inc()
			log.WarnContext(ctx, "failed, backing off", "err", e.cause, "retry_in", time.Until(b.Until).Round(time.Second),
				"attempts", b.Attempts, "quarantined", b.Quarantined)
			return nil
		case errors.Is(err, bmdb.ErrSessionExpired), errors.Is(err, bmdb.ErrWorkEnded), bmdb.Unavailable(err):
			return err
		}
		if e.refusals++; e.refusals < maxFailRefusals {
			return err
		}
		log.ErrorContext(ctx, "recording a failure was refused, canceling the work instead", "err", e.cause, "record_err", err)
		e.kind, e.cause = endCancel, fmt.Errorf("recording the failure was refused (%v): %w", err, e.cause)
		fallthrough
	case endCancel:
		// Every cancel says why (stopping, a lost session, retry later, a
		// refused failure): history names it.
		err := w.CancelWithCause(ctx, e.cause.Error())
		if err == nil {
			r.metrics.claims.WithLabelValues("canceled").Inc()
		}
		return err
	default:
		err := w.Hold(ctx, e.cause.Error())
		if err == nil {
			r.metrics.claims.WithLabelValues("held_back").Inc()
			log.InfoContext(ctx, "held back", "cause", e.cause)
		}
		return err
	}
}

// do calls the loop's Do, turning a panic into an error so that one bad
// machine cannot take a worker (or the process) down.
func (r *Runner) do(ctx context.Context, t *Task) (finish FinishFunc, err error) {
	defer func() {
		if p := recover(); p != nil {
			t.Log.ErrorContext(ctx, "panic while processing", "panic", p, "stack", string(debug.Stack()))
			finish, err = nil, fmt.Errorf("internal error: %v", p)
		}
	}()
	return r.loop.Do(ctx, t)
}

// jitter returns a duration in [d/2, 3d/2), so that idle workers of many
// processes do not poll in step.
func jitter(d time.Duration) time.Duration {
	if d <= 1 {
		return d
	}
	return d/2 + time.Duration(rand.Int64N(int64(d)))
}

// sleep waits d or until ctx ends.
func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
