package bmdb

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/bmdb/model"
)

// MaxRecoveryWindow is the longest circuit breaker window (SPEC §3.4) a
// recoverer may use: admitted reboots are kept this long (the janitor
// deletes older ones), so a longer window would undercount.
const MaxRecoveryWindow = 24 * time.Hour

// CheckWork verifies, right before a side effect on the machine, that the
// session is alive, still holds process on the machine and that the
// machine still matches c, the candidate query it was claimed from (a
// claim is not ended by a change of the machine's tags). A worker stalled
// past its lease (a GC pause, SIGSTOP, a paused VM) finds out here instead
// of acting on a machine another worker took over. It returns
// ErrSessionExpired when the work is not held any more, ErrNotCandidate
// when the machine changed, and nil when the side effect may go ahead.
func (s *Session) CheckWork(ctx context.Context, process Process, machine uuid.UUID, c Candidates) error {
	err := s.db.transact(ctx, func(ctx context.Context, q *model.Queries) error {
		return s.checkWork(ctx, q, process, machine, c)
	})
	switch {
	case errors.Is(err, ErrSessionExpired), errors.Is(err, ErrNotCandidate):
		return err
	case err != nil:
		return fmt.Errorf("bmdb: checking %s work on machine %s: %w", process, machine, err)
	}
	return nil
}

// checkWork is CheckWork within the caller's transaction.
func (s *Session) checkWork(ctx context.Context, q *model.Queries, process Process, machine uuid.UUID, c Candidates) error {
	held, err := q.WorkHeld(ctx, model.WorkHeldParams{MachineID: machine, Process: string(process), SessionID: s.id})
	if err != nil {
		return fmt.Errorf("checking the work: %w", err)
	}
	if !held {
		return ErrSessionExpired
	}
	ok, err := c.matches(ctx, q, machine)
	if err != nil {
		return fmt.Errorf("checking the machine is still a candidate: %w", err)
	}
	if !ok {
		return ErrNotCandidate
	}
	return nil
}

// RebootRequest asks AdmitReboot to admit the reboot of one machine the
// session holds for Recovery.
type RebootRequest struct {
	// Provider is the machine's provider, whose reboots the budget caps.
	Provider string
	// MachineID is the machine to reboot.
	MachineID uuid.UUID
	// Candidates is the recovery candidate query the machine was claimed
	// from (RecoveryCandidates): it must still select the machine.
	Candidates Candidates
	// Window and Max are the circuit breaker's: at most Max reboots of the
	// provider's machines are admitted within Window (at most
	// MaxRecoveryWindow).
	Window time.Duration
	Max    int64
	// StreakLimit quarantines the machine instead of rebooting it once it
	// has been rebooted this many times without a heartbeat in between;
	// 0 never does.
	StreakLimit int
}

// RebootDecision is what AdmitReboot decided.
type RebootDecision string

// Reboot decisions.
const (
	// RebootAdmitted: reboot the machine now, then end the work; call
	// RebootFailed if the reboot fails.
	RebootAdmitted RebootDecision = "admitted"
	// RebootBudgetExhausted: the window's reboots are used up; give the
	// work back unjudged.
	RebootBudgetExhausted RebootDecision = "budget_exhausted"
	// RebootNotSilent: the machine is no longer silent (its agent
	// heartbeat since the claim, or the provider lost or stopped it); give
	// the work back without rebooting.
	RebootNotSilent RebootDecision = "not_silent"
	// RebootAlreadyIssued: a reboot of this agent incarnation was admitted
	// already (by a worker that could not record its result): do not
	// reboot again, finish the recovery as if this worker had rebooted.
	RebootAlreadyIssued RebootDecision = "already_issued"
	// RebootStreakQuarantined: the machine was rebooted StreakLimit times
	// without a heartbeat in between; it is now quarantined for Recovery
	// (history Quarantined with Cause). Fail the work with Cause.
	RebootStreakQuarantined RebootDecision = "streak_quarantined"
)

// RebootAdmission is AdmitReboot's decision and what it was based on.
type RebootAdmission struct {
	Decision RebootDecision
	// InWindow counts the provider's reboots in the window, this one
	// included if admitted.
	InWindow int64
	// Streak counts the machine's reboots since its agent's last
	// heartbeat, this one included if admitted; StreakSince is when the
	// first of them was admitted.
	Streak      int
	StreakSince time.Time
	// Cause says why the machine was quarantined (RebootStreakQuarantined).
	Cause string

	admission int64
}

// AdmitReboot decides, in one transaction and one decision at a time per
// provider (across all processes), whether the session may reboot a machine
// it holds for Recovery (SPEC §3.4). It verifies that the session is alive
// and holds the work (ErrSessionExpired if not: do nothing), that the
// machine is still silent, that no reboot of the same agent incarnation
// was admitted already, that the machine's reboot streak is below the
// limit (else it quarantines the machine), and that the provider's reboots
// in the window leave room. An admitted reboot is recorded, and counts
// against the window whatever becomes of the work, unless RebootFailed
// says it never reached the machine.
func (s *Session) AdmitReboot(ctx context.Context, r RebootRequest) (RebootAdmission, error) {
	if r.Candidates == nil {
		return RebootAdmission{}, errors.New("bmdb: admitting a reboot: no candidate query")
	}
	var a RebootAdmission
	err := s.db.transact(ctx, func(ctx context.Context, q *model.Queries) error {
		a = RebootAdmission{}
		// Serialises admissions of the provider's reboots, so that the
		// count below cannot admit two reboots for one free slot.
		if err := q.ProviderStateLock(ctx, r.Provider); err != nil {
			return fmt.Errorf("locking provider: %w", err)
		}
		err := s.checkWork(ctx, q, ProcessRecovery, r.MachineID, r.Candidates)
		if errors.Is(err, ErrNotCandidate) {
			a.Decision = RebootNotSilent
			return nil
		} else if err != nil {
			return err
		}
		st, err := q.RecoveryAdmissionState(ctx, r.MachineID)
		if errors.Is(err, pgx.ErrNoRows) {
			a.Decision = RebootNotSilent
			return nil
		} else if err != nil {
			return fmt.Errorf("reading earlier reboots: %w", err)
		}
		a.Streak, a.StreakSince = int(st.Streak), st.StreakSince
		if st.AlreadyAdmitted {
			a.Decision = RebootAlreadyIssued
			return nil
		}
		if r.StreakLimit > 0 && a.Streak >= r.StreakLimit {
			a.Decision = RebootStreakQuarantined
			a.Cause = fmt.Sprintf("rebooted %d times since %s without a heartbeat in between: the agent starts but never reports "+
				"(can the machine reach the callback server?); reset the machine's Recovery to try again",
				a.Streak, a.StreakSince.UTC().Format(time.RFC3339))
			return q.RecoveryQuarantine(ctx, model.RecoveryQuarantineParams{SessionID: s.id, Cause: a.Cause, MachineID: r.MachineID})
		}
		if a.InWindow, err = q.RecoveryRebootsInWindow(ctx, model.RecoveryRebootsInWindowParams{
			Provider: r.Provider, WindowMs: r.Window.Milliseconds()}); err != nil {
			return fmt.Errorf("counting reboots in the window: %w", err)
		}
		if a.InWindow >= r.Max {
			a.Decision = RebootBudgetExhausted
			return nil
		}
		row, err := q.RecoveryAdmit(ctx, model.RecoveryAdmitParams{
			MachineID: r.MachineID, Provider: r.Provider, SessionID: s.id, AgentStartedAt: st.AgentStartedAt,
			Heartbeated: st.Heartbeated})
		if errors.Is(err, pgx.ErrNoRows) {
			// Cannot happen while the work is held (the claim is
			// exclusive), but the index has the last word.
			a.Decision = RebootAlreadyIssued
			return nil
		} else if err != nil {
			return fmt.Errorf("recording the admission: %w", err)
		}
		a.Decision, a.admission = RebootAdmitted, row.AdmissionID
		if a.Streak == 0 {
			a.StreakSince = row.AdmittedAt
		}
		a.Streak++
		a.InWindow++
		return nil
	})
	switch {
	case errors.Is(err, ErrSessionExpired):
		return RebootAdmission{}, err
	case err != nil:
		return RebootAdmission{}, fmt.Errorf("bmdb: admitting a reboot of machine %s on %s: %w", r.MachineID, r.Provider, err)
	}
	return a, nil
}

// RebootFailed records that the reboot a admitted failed, and whether its
// request reached the machine (or its provider's API) at all: a reboot that
// certainly did not is not counted by the circuit breaker. A failed reboot
// leaves the machine's reboot streak, and a later claim may reboot the same
// agent incarnation again. It works whether or not the session still holds
// the work (the failure happened either way), even when ctx is cancelled.
func (s *Session) RebootFailed(ctx context.Context, a RebootAdmission, reached bool) error {
	if a.Decision != RebootAdmitted {
		return fmt.Errorf("bmdb: recording a failed reboot: the reboot was not admitted (%s)", a.Decision)
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	err := s.db.retry(cctx, func(ctx context.Context) error {
		_, err := s.db.q.RecoveryAdmissionFailed(ctx, model.RecoveryAdmissionFailedParams{
			Reached: reached, AdmissionID: a.admission, SessionID: s.id})
		return err
	})
	if err != nil {
		return fmt.Errorf("bmdb: recording failed reboot %d: %w", a.admission, err)
	}
	return nil
}

// RecoveryReboots counts the reboots admitted for provider's machines
// within window (at most MaxRecoveryWindow), as the circuit breaker counts
// them: however their work ended, except those that never reached the
// machine.
func (db *DB) RecoveryReboots(ctx context.Context, provider string, window time.Duration) (int64, error) {
	n, err := db.q.RecoveryRebootsInWindow(ctx, model.RecoveryRebootsInWindowParams{Provider: provider, WindowMs: window.Milliseconds()})
	if err != nil {
		return 0, fmt.Errorf("bmdb: counting recent reboots of %s: %w", provider, err)
	}
	return n, nil
}

// DeleteRecoveryAdmissions deletes the records of reboots admitted more
// than MaxRecoveryWindow ago, which no circuit breaker counts any more, and
// returns how many it deleted.
func (db *DB) DeleteRecoveryAdmissions(ctx context.Context) (int64, error) {
	var n int64
	err := db.retry(ctx, func(ctx context.Context) error {
		var err error
		n, err = db.q.RecoveryAdmissionsDelete(ctx, MaxRecoveryWindow.Milliseconds())
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("bmdb: deleting old reboot admissions: %w", err)
	}
	return n, nil
}
