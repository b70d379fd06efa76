package bmdb

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/bmdb/model"
	"github.com/shepherd/shepherd/internal/safetext"
)

// claimAttempts bounds how often Work retries after losing a race for a
// candidate before it reports ErrWorkConflict.
const claimAttempts = 3

// Work is one claimed (machine, process) pair. Exactly one of Finish, Fail or
// Cancel ends it; until then no other worker of a conflicting process can
// claim the machine.
type Work struct {
	// MachineID is the claimed machine.
	MachineID uuid.UUID
	// Process is what the machine was claimed for.
	Process Process
	// Provided is the machine's Provided tag as the claim saw it.
	Provided ProvidedMachine

	s     *Session
	mu    sync.Mutex
	ended bool
	// unsure is set once an end attempt failed without learning whether it
	// committed; a later attempt that finds the lock gone then asks history.
	unsure bool
}

// Work claims the free candidate for process that has waited longest, in one
// statement that selects, locks and claims it and writes history Started.
// Work of dead sessions on the chosen machine is expired on the way (history
// Expired). It returns ErrNothingToDo if no candidate is free,
// ErrSessionExpired if the session is dead, and ErrWorkConflict if it kept
// losing races for candidates.
//
// If the claim's reply is lost (the connection broke after the statement
// was sent), Work returns the error, and the claim may have committed all
// the same. The session then releases, in the background and as soon as the
// database answers, every work item it holds that no Work of its own knows
// (history Canceled), so such a machine is not held for the life of the process.
func (s *Session) Work(ctx context.Context, process Process, candidates Candidates) (*Work, error) {
	if err := process.Validate(); err != nil {
		return nil, err
	}
	params := claimParams{process: process, session: s.id, scan: int32(s.cfg.ScanLimit), strategy: s.cfg.ClaimStrategy}
	return s.claim(ctx, process, "claiming "+candidates.String(), ErrNothingToDo, func(ctx context.Context) (claimResult, error) {
		return candidates.claim(ctx, s.db.q, params)
	})
}

// claim runs one claim statement (stmt) for process until it claims a
// machine, finds none, or has lost claimAttempts races. what says what the
// claim does, for errors; none is the error when no machine answers and
// the session is alive. An error of stmt that wraps ErrMachineBusy is
// returned as it is.
func (s *Session) claim(ctx context.Context, process Process, what string, none error,
	stmt func(ctx context.Context) (claimResult, error)) (*Work, error) {
	if s.ctx.Err() != nil {
		return nil, ErrSessionExpired
	}
	// Reconciliation must not run between a claim's commit and the Work's
	// registration as held.
	s.claimMu.RLock()
	defer s.claimMu.RUnlock()
	m := s.db.metrics
	for range claimAttempts {
		var res claimResult
		err := s.db.retry(ctx, func(ctx context.Context) error {
			var err error
			res, err = stmt(ctx)
			return err
		})
		if errors.Is(err, pgx.ErrNoRows) {
			// No machine: either there is none, or our session is dead
			// (the claim only selects machines for a live session).
			alive, err := s.db.q.SessionAlive(ctx, s.id)
			if err != nil {
				return nil, fmt.Errorf("bmdb: checking session %s: %w", s.id, err)
			}
			if !alive {
				return nil, ErrSessionExpired
			}
			return nil, none
		}
		if errors.Is(err, ErrMachineBusy) {
			return nil, err
		}
		if err != nil {
			if outcomeUnknown(err) {
				s.db.failures.Warn(ctx, "claim's outcome unknown, will release what it may have taken",
					"session_id", s.id.String(), "session_component", s.cfg.Component, "process", process, "err", err)
				s.claimUnknown()
			}
			return nil, fmt.Errorf("bmdb: %s for %s: %w", what, process, err)
		}
		if res.ExpiredCount > 0 {
			m.workExpired.WithLabelValues(string(process)).Add(float64(res.ExpiredCount))
			s.log.InfoContext(ctx, "expired work of a dead session", "machine_id", res.CandidateID.String(), "process", process,
				"dead_session_id", res.ExpiredSessions, "expired", res.ExpiredCount)
		}
		if !res.ClaimedID.Valid {
			m.workConflicts.WithLabelValues(string(process)).Inc()
			continue
		}
		m.workStarted.WithLabelValues(string(process)).Inc()
		w := &Work{
			MachineID: res.ClaimedID.UUID,
			Process:   process,
			Provided:  providedMachine(res.ClaimedID.UUID, model.ClaimAgentStartCandidateRow(res)),
			s:         s,
		}
		s.hold(w)
		return w, nil
	}
	return nil, ErrWorkConflict
}

// begin marks the work as ending, or fails if it already ended.
func (w *Work) begin() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.ended {
		return ErrWorkEnded
	}
	w.ended = true
	return nil
}

// settle records how an end attempt that meant to write event went. A
// database error other than the lock being gone leaves the work held, to be
// ended again. If an earlier attempt failed without learning whether it
// committed, a lock found gone is looked up in history: the earlier attempt
// may have ended the work, in which case this one reports success (resolved
// is then true) or, if it ended otherwise, ErrWorkEnded.
func (w *Work) settle(ctx context.Context, err error, event Event, result string) (resolved bool, _ error) {
	w.mu.Lock()
	unsure := w.unsure
	w.mu.Unlock()
	if errors.Is(err, ErrSessionExpired) && unsure {
		var ended Event
		ended, err = w.endedAs(ctx)
		switch {
		case err != nil:
		case ended == event:
			resolved = true
		case ended == EventFinished || ended == EventFailed || ended == EventCanceled || ended == EventHeld:
			err = fmt.Errorf("%w: an earlier attempt to end %s on machine %s committed as %s", ErrWorkEnded, w.Process, w.MachineID, ended)
			result = map[Event]string{EventFinished: resultFinished, EventFailed: resultFailed, EventCanceled: resultCanceled, EventHeld: resultHeld}[ended]
		default:
			err = ErrSessionExpired
		}
	}
	if err != nil && !errors.Is(err, ErrSessionExpired) && !errors.Is(err, ErrWorkEnded) {
		w.mu.Lock()
		w.ended = false
		w.unsure = w.unsure || Unavailable(err)
		w.mu.Unlock()
		return false, err
	}
	if errors.Is(err, ErrSessionExpired) {
		result = resultLost
	}
	w.s.drop(w)
	w.s.db.metrics.workEnded.WithLabelValues(string(w.Process), result).Inc()
	return resolved, err
}

// endedAs returns the last history event this work's session wrote for its
// (machine, process): how the work ended, if this session ended it.
func (w *Work) endedAs(ctx context.Context) (Event, error) {
	ev, err := w.s.db.q.WorkLastEvent(ctx, model.WorkLastEventParams{
		MachineID: w.MachineID, Process: string(w.Process), SessionID: uuid.NullUUID{UUID: w.s.id, Valid: true},
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return "", nil
	} else if err != nil {
		return "", fmt.Errorf("bmdb: finding out how %s on machine %s ended: %w", w.Process, w.MachineID, err)
	}
	return Event(ev), nil
}

func (w *Work) logger() *slog.Logger {
	return w.s.log.With("machine_id", w.MachineID.String(), "process", string(w.Process))
}

// Finish ends the work successfully: in one transaction it releases the lock,
// clears the backoff of (machine, process), writes history Finished and
// applies fn's tag changes (fn may be nil). If fn or the database fails, the
// work is still held and the caller must end it again: Finish again if the
// database was unavailable (see Unavailable), else Fail or Cancel. A retry
// after an attempt that committed unheard returns nil. ErrSessionExpired
// means the lock was already gone and nothing was changed.
func (w *Work) Finish(ctx context.Context, fn func(ctx context.Context, tx *Tx) error) error {
	return w.FinishWithCause(ctx, "", fn)
}

// FinishWithCause is Finish with a cause on the Finished history row: what
// the work did, for work an operator asked for ("power off: found on, now
// off"). Like Fail's, the cause is stored as valid UTF-8 without NUL bytes.
func (w *Work) FinishWithCause(ctx context.Context, cause string, fn func(ctx context.Context, tx *Tx) error) error {
	cause = safetext.Clean(cause)
	if err := w.begin(); err != nil {
		return err
	}
	params := model.WorkFinishParams{MachineID: w.MachineID, Process: string(w.Process), SessionID: w.s.id, Cause: cause}
	release := func(ctx context.Context, q *model.Queries) error {
		if _, err := q.WorkFinish(ctx, params); errors.Is(err, pgx.ErrNoRows) {
			return ErrSessionExpired
		} else if err != nil {
			return fmt.Errorf("bmdb: finishing %s on machine %s: %w", w.Process, w.MachineID, err)
		}
		return nil
	}
	var err error
	if fn == nil {
		// One statement is its own transaction: no BEGIN/COMMIT round trips.
		err = w.s.db.retry(ctx, func(ctx context.Context) error { return release(ctx, w.s.db.q) })
	} else {
		err = w.s.db.transact(ctx, func(ctx context.Context, q *model.Queries) error {
			if err := release(ctx, q); err != nil {
				return err
			}
			if err := fn(ctx, &Tx{q: q}); err != nil {
				return fnError{fmt.Errorf("bmdb: finishing %s on machine %s: %w", w.Process, w.MachineID, err)}
			}
			return nil
		})
	}
	_, err = w.settle(ctx, err, EventFinished, resultFinished)
	return err
}

// Fail ends the work as failed: in one transaction it releases the lock,
// writes history Failed with cause, and backs the machine off for this process
// according to policy, quarantining it (history Quarantined) once it has
// failed policy.MaxAttempts times in a row. It returns the new backoff. The
// cause is stored as valid UTF-8 without NUL bytes (which PostgreSQL refuses),
// so no error text can make a failure unrecordable. Like Finish, it may be
// retried after an error.
func (w *Work) Fail(ctx context.Context, policy BackoffPolicy, cause string) (Backoff, error) {
	if err := policy.Validate(); err != nil {
		return Backoff{}, err
	}
	cause = safetext.Clean(cause)
	if err := w.begin(); err != nil {
		return Backoff{}, err
	}
	var b Backoff
	u := rand.Float64()
	err := w.s.db.transact(ctx, func(ctx context.Context, q *model.Queries) error {
		_, err := q.WorkRelease(ctx, model.WorkReleaseParams{
			MachineID: w.MachineID, Process: string(w.Process), SessionID: w.s.id,
			Event: string(EventFailed), Cause: cause,
		})
		if errors.Is(err, pgx.ErrNoRows) {
			return ErrSessionExpired
		} else if err != nil {
			return fmt.Errorf("bmdb: failing %s on machine %s: %w", w.Process, w.MachineID, err)
		}
		b, err = recordFailure(ctx, q, w.MachineID, w.Process, w.s.id, policy, cause, u)
		return err
	})
	resolved, err := w.settle(ctx, err, EventFailed, resultFailed)
	if err != nil {
		return Backoff{}, err
	}
	if resolved {
		// An earlier attempt committed: its backoff is the one recorded.
		// The work has ended either way, so failing to read it is no error.
		if got, err := w.s.db.GetBackoff(ctx, w.MachineID, w.Process); err == nil {
			b = got
		}
	}
	if b.Quarantined {
		w.s.db.metrics.workQuarantined.WithLabelValues(string(w.Process)).Inc()
		w.logger().WarnContext(ctx, "machine quarantined", "attempts", b.Attempts, "cause", cause)
	}
	return b, nil
}

// recordFailure grows the backoff of (machine, process) by one failure.
func recordFailure(ctx context.Context, q *model.Queries, machine uuid.UUID, p Process, session uuid.UUID,
	policy BackoffPolicy, cause string, u float64) (Backoff, error) {
	var last time.Duration
	attempts := 0
	wasQuarantined := false
	prev, err := q.BackoffGetForUpdate(ctx, model.BackoffGetForUpdateParams{MachineID: machine, Process: string(p)})
	switch {
	case err == nil:
		last = time.Duration(prev.LastIntervalMs) * time.Millisecond
		attempts = int(prev.Attempts)
		wasQuarantined = prev.QuarantinedAt != nil
	case !errors.Is(err, pgx.ErrNoRows):
		return Backoff{}, fmt.Errorf("bmdb: reading backoff of machine %s for %s: %w", machine, p, err)
	}
	interval := policy.Next(last)
	attempts++
	quarantine := policy.quarantines(attempts)
	row, err := q.BackoffUpsert(ctx, model.BackoffUpsertParams{
		MachineID:      machine,
		Process:        string(p),
		DelayMs:        policy.jittered(interval, u).Milliseconds(),
		Cause:          cause,
		LastIntervalMs: interval.Milliseconds(),
		Attempts:       int32(min(attempts, 1<<30)),
		Quarantine:     quarantine,
	})
	if err != nil {
		return Backoff{}, fmt.Errorf("bmdb: backing off machine %s for %s: %w", machine, p, err)
	}
	b := Backoff{Interval: interval, Until: row.BackoffUntil, Attempts: attempts, Quarantined: row.QuarantinedAt != nil, Cause: cause}
	if b.Quarantined && !wasQuarantined {
		err := q.HistoryAppend(ctx, model.HistoryAppendParams{
			MachineID: machine,
			Process:   string(p),
			Event:     string(EventQuarantined),
			SessionID: uuid.NullUUID{UUID: session, Valid: true},
			Cause:     fmt.Sprintf("%d failures in a row; last: %s", attempts, cause),
		})
		if err != nil {
			return Backoff{}, fmt.Errorf("bmdb: recording quarantine of machine %s for %s: %w", machine, p, err)
		}
	}
	return b, nil
}

// Cancel ends the work without judging it: it releases the lock and writes
// history Canceled; the backoff is untouched. It works even when ctx is
// already cancelled (typically during shutdown), using a fresh context with a
// timeout instead.
func (w *Work) Cancel(ctx context.Context) error {
	return w.CancelWithCause(ctx, "canceled")
}

// CancelWithCause is Cancel with a cause on the Canceled history row: why
// the work was given back unjudged ("the recoverer is stopping"). Like
// Fail's, the cause is stored as valid UTF-8 without NUL bytes.
func (w *Work) CancelWithCause(ctx context.Context, cause string) error {
	return w.release(ctx, EventCanceled, safetext.Clean(cause), resultCanceled, "canceling")
}

// Hold ends the work as held back by a safety limit, without acting on the
// machine and without judging it: it releases the lock and writes history
// Held with cause (which limit, and its figures: "held by the circuit
// breaker: ..."); the backoff is untouched. Like Cancel, it works even when
// ctx is already cancelled.
func (w *Work) Hold(ctx context.Context, cause string) error {
	return w.release(ctx, EventHeld, safetext.Clean(cause), resultHeld, "holding back")
}

// FailWithoutBackoff ends the work as failed without backing the machine
// off: it releases the lock and writes history Failed with cause. It is for
// work an operator asked for (a power action), which nobody retries by
// itself, so a backoff would only keep the operator out. Like Cancel, it
// works even when ctx is already cancelled (an operator's Ctrl-C), and the
// cause is stored as valid UTF-8 without NUL bytes.
func (w *Work) FailWithoutBackoff(ctx context.Context, cause string) error {
	return w.release(ctx, EventFailed, safetext.Clean(cause), resultFailed, "failing")
}

// release ends the work with one history row, event with cause, leaving the
// backoff as it is. doing names the end for errors.
func (w *Work) release(ctx context.Context, event Event, cause, result, doing string) error {
	if err := w.begin(); err != nil {
		return err
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	err := w.s.db.retry(cctx, func(ctx context.Context) error {
		_, err := w.s.db.q.WorkRelease(ctx, model.WorkReleaseParams{
			MachineID: w.MachineID, Process: string(w.Process), SessionID: w.s.id,
			Event: string(event), Cause: cause,
		})
		if errors.Is(err, pgx.ErrNoRows) {
			return ErrSessionExpired
		} else if err != nil {
			return fmt.Errorf("bmdb: %s %s on machine %s: %w", doing, w.Process, w.MachineID, err)
		}
		return nil
	})
	_, err = w.settle(cctx, err, event, result)
	return err
}

// GetBackoff returns the backoff of (machine, process), or ErrNotFound if the
// process has no failures recorded for the machine.
func (db *DB) GetBackoff(ctx context.Context, machine uuid.UUID, process Process) (Backoff, error) {
	row, err := db.q.BackoffGet(ctx, model.BackoffGetParams{MachineID: machine, Process: string(process)})
	if errors.Is(err, pgx.ErrNoRows) {
		return Backoff{}, ErrNotFound
	} else if err != nil {
		return Backoff{}, fmt.Errorf("bmdb: reading backoff of machine %s for %s: %w", machine, process, err)
	}
	return Backoff{
		Interval:    time.Duration(row.LastIntervalMs) * time.Millisecond,
		Until:       row.BackoffUntil,
		Attempts:    int(row.Attempts),
		Quarantined: row.QuarantinedAt != nil,
		Cause:       row.Cause,
	}, nil
}

// Backoffs returns every backoff and quarantine of process, by machine
// (ended backoffs too, until the next success or reset deletes them).
func (db *DB) Backoffs(ctx context.Context, process Process) (map[uuid.UUID]Backoff, error) {
	if err := process.Validate(); err != nil {
		return nil, err
	}
	rows, err := db.q.BackoffListOfProcess(ctx, string(process))
	if err != nil {
		return nil, fmt.Errorf("bmdb: listing backoffs of %s: %w", process, err)
	}
	out := make(map[uuid.UUID]Backoff, len(rows))
	for _, r := range rows {
		out[r.MachineID] = Backoff{
			Interval:    time.Duration(r.LastIntervalMs) * time.Millisecond,
			Until:       r.BackoffUntil,
			Attempts:    int(r.Attempts),
			Quarantined: r.QuarantinedAt != nil,
			Cause:       r.Cause,
		}
	}
	return out, nil
}

// ResetBackoff clears the backoff and any quarantine of (machine, process)
// and writes history Reset with cause (who asked, and why), so the machine is
// a candidate again. It returns ErrNotFound if there was nothing to reset.
func (db *DB) ResetBackoff(ctx context.Context, machine uuid.UUID, process Process, cause string) error {
	if err := process.Validate(); err != nil {
		return err
	}
	err := db.retry(ctx, func(ctx context.Context) error {
		_, err := db.q.BackoffReset(ctx, model.BackoffResetParams{MachineID: machine, Process: string(process), Cause: cause})
		return err
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return ErrNotFound
	} else if err != nil {
		return fmt.Errorf("bmdb: resetting backoff of machine %s for %s: %w", machine, process, err)
	}
	return nil
}

// ExpireWork removes the work of every dead session and writes history
// Expired naming each one; it returns how many work items it expired. The
// janitor calls it; claims also expire dead work on the machines they take.
func (db *DB) ExpireWork(ctx context.Context) (int, error) {
	var rows []model.WorkExpireRow
	err := db.retry(ctx, func(ctx context.Context) error {
		var err error
		rows, err = db.q.WorkExpire(ctx)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("bmdb: expiring work of dead sessions: %w", err)
	}
	for _, r := range rows {
		db.metrics.workExpired.WithLabelValues(r.Process).Inc()
		db.log.InfoContext(ctx, "expired work of a dead session", "machine_id", r.MachineID.String(),
			"process", r.Process, "dead_session_id", r.SessionID.UUID.String())
	}
	return len(rows), nil
}

// DeleteSessions deletes sessions that ended more than retention ago and
// hold no work, and returns how many it deleted. History keeps their ids.
func (db *DB) DeleteSessions(ctx context.Context, retention time.Duration) (int64, error) {
	if retention < 0 {
		return 0, fmt.Errorf("bmdb: session retention must be >= 0, got %s", retention)
	}
	n, err := db.q.SessionsDelete(ctx, retention.Milliseconds())
	if err != nil {
		return 0, fmt.Errorf("bmdb: deleting old sessions: %w", err)
	}
	return n, nil
}
