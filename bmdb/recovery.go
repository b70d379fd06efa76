package bmdb

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/bmdb/model"
	"github.com/shepherd/shepherd/internal/safetext"
	"github.com/shepherd/shepherd/ladder"
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

// RebootRequest asks AdmitReboot to admit the next rung of the recovery
// ladder (SPEC §3.4) for one machine the session holds for Recovery.
type RebootRequest struct {
	// Provider is the machine's provider, whose restarts the budget caps.
	Provider string
	// MachineID is the machine to recover.
	MachineID uuid.UUID
	// Candidates is the recovery candidate query the machine was claimed
	// from (RecoveryCandidates): it must still select the machine.
	Candidates Candidates
	// Window and Max are the circuit breaker's: at most Max restarts of
	// the provider's machines are admitted within Window (at most
	// MaxRecoveryWindow). A rung that does not restart the machine
	// (ladder.Agent) is not capped.
	Window time.Duration
	Max    int64
	// StreakLimit quarantines the machine instead of taking another rung
	// once this many rungs were carried out since its agent's last
	// heartbeat; 0 never does.
	StreakLimit int
	// Ladder is the machine's rungs in the ladder's order; nil means
	// {ladder.Reboot}.
	Ladder []ladder.Rung
	// After, if set, admits the rung above After: After failed in this
	// work item and the recoverer climbs on. Unset, the rung above the
	// last one carried out in the streak is admitted (the top rung again
	// once the top was carried out), or the bottom rung if none was.
	After ladder.Rung
}

// RebootDecision is what AdmitReboot decided.
type RebootDecision string

// Reboot decisions.
const (
	// RebootAdmitted: take the admission's Rung now, then end the work;
	// call RebootFailed if the rung fails.
	RebootAdmitted RebootDecision = "admitted"
	// RebootBudgetExhausted: the window's restarts are used up; give the
	// work back unjudged.
	RebootBudgetExhausted RebootDecision = "budget_exhausted"
	// RebootNotSilent: the machine is no longer silent (its agent
	// heartbeat since the claim, or the provider lost or stopped it); give
	// the work back without acting.
	RebootNotSilent RebootDecision = "not_silent"
	// RebootAlreadyIssued: a rung for this agent incarnation was admitted
	// already (by a worker that could not record its result): do not act
	// again, finish the recovery as if this worker had.
	RebootAlreadyIssued RebootDecision = "already_issued"
	// RebootStreakQuarantined: StreakLimit rungs were carried out without
	// a heartbeat in between; the machine is now quarantined for Recovery
	// (history Quarantined with Cause). Fail the work with Cause.
	RebootStreakQuarantined RebootDecision = "streak_quarantined"
)

// RungAttempt is one rung of the recovery ladder taken for a machine.
type RungAttempt struct {
	Rung ladder.Rung
	// Failed: the rung returned Result, an error; Reached says whether it
	// reached the machine at all. Otherwise the rung was carried out (or
	// is being carried out) and the machine was waited for.
	Failed, Reached bool
	Result          string
	At              time.Time
}

// String is the attempt as history and pages show it.
func (a RungAttempt) String() string {
	if !a.Failed {
		return fmt.Sprintf("%s (%s): done", a.Rung, a.Rung.Describe())
	}
	return fmt.Sprintf("%s (%s): failed: %s", a.Rung, a.Rung.Describe(), a.Result)
}

// RebootAdmission is AdmitReboot's decision and what it was based on.
type RebootAdmission struct {
	Decision RebootDecision
	// Rung is the rung admitted (RebootAdmitted).
	Rung ladder.Rung
	// InWindow counts the provider's restarts in the window, this one
	// included if admitted and it restarts the machine.
	InWindow int64
	// Streak counts the rungs carried out since the agent's last
	// heartbeat, this one included if admitted; StreakSince is when the
	// first of them was admitted.
	Streak      int
	StreakSince time.Time
	// Tried lists the rungs taken since the agent's last heartbeat, failed
	// ones included, before this admission: the ladder's progress.
	Tried []RungAttempt
	// Cause says why the machine was quarantined (RebootStreakQuarantined).
	Cause string

	admission int64
}

// AdmitReboot decides, in one transaction and one decision at a time per
// provider (across all processes), whether and which rung of the recovery
// ladder the session may take for a machine it holds for Recovery (SPEC
// §3.4). It verifies that the session is alive and holds the work
// (ErrSessionExpired if not: do nothing), that the machine is still silent,
// that no rung for the same agent incarnation was admitted already (unless
// climbing: r.After), that the machine's streak is below the limit (else it
// quarantines the machine), and, for a rung that restarts the machine,
// that the provider's restarts in the window leave room. An admitted rung
// is recorded, and counts against the window whatever becomes of the work,
// unless RebootFailed says it never reached the machine.
func (s *Session) AdmitReboot(ctx context.Context, r RebootRequest) (RebootAdmission, error) {
	if r.Candidates == nil {
		return RebootAdmission{}, errors.New("bmdb: admitting a reboot: no candidate query")
	}
	rungs := r.Ladder
	if len(rungs) == 0 {
		rungs = []ladder.Rung{ladder.Reboot}
	}
	above := -1
	if r.After != "" {
		if above = slices.Index(rungs, r.After); above < 0 || above == len(rungs)-1 {
			return RebootAdmission{}, fmt.Errorf("bmdb: admitting a rung: no rung above %q in ladder %s", r.After, ladder.Join(rungs))
		}
	}
	var a RebootAdmission
	err := s.db.transact(ctx, func(ctx context.Context, q *model.Queries) error {
		a = RebootAdmission{}
		// Serialises admissions of the provider's restarts, so that the
		// count below cannot admit two restarts for one free slot.
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
			return fmt.Errorf("reading earlier rungs: %w", err)
		}
		if a.Tried, err = recoveryStreak(ctx, q, r.MachineID); err != nil {
			return err
		}
		lastDone := -1
		for _, t := range a.Tried {
			if !t.Failed {
				if a.Streak == 0 {
					a.StreakSince = t.At
				}
				a.Streak++
				// A rung the ladder no longer has (the configuration
				// changed) counts as the bottom one.
				lastDone = max(slices.Index(rungs, t.Rung), 0)
			}
		}
		if st.AlreadyAdmitted && r.After == "" {
			a.Decision = RebootAlreadyIssued
			return nil
		}
		if r.StreakLimit > 0 && a.Streak >= r.StreakLimit {
			a.Decision = RebootStreakQuarantined
			a.Cause = fmt.Sprintf("%d recovery rungs carried out since %s without a heartbeat in between (%s): the agent starts but never reports "+
				"(can the machine reach the callback server?) or the machine does not come back; reset the machine's Recovery to try again",
				a.Streak, a.StreakSince.UTC().Format(time.RFC3339), DescribeRungs(a.Tried))
			return q.RecoveryQuarantine(ctx, model.RecoveryQuarantineParams{SessionID: uuid.NullUUID{UUID: s.id, Valid: true}, Cause: a.Cause, MachineID: r.MachineID})
		}
		next := min(lastDone+1, len(rungs)-1)
		if above >= 0 {
			next = above + 1
		}
		a.Rung = rungs[next]
		if a.Rung.Restarts() {
			if a.InWindow, err = q.RecoveryRebootsInWindow(ctx, model.RecoveryRebootsInWindowParams{
				Provider: r.Provider, WindowMs: r.Window.Milliseconds()}); err != nil {
				return fmt.Errorf("counting restarts in the window: %w", err)
			}
			if a.InWindow >= r.Max {
				a.Decision = RebootBudgetExhausted
				return nil
			}
		}
		row, err := q.RecoveryAdmit(ctx, model.RecoveryAdmitParams{
			MachineID: r.MachineID, Provider: r.Provider, SessionID: s.id, AgentStartedAt: st.AgentStartedAt,
			Heartbeated: st.Heartbeated, Rung: string(a.Rung)})
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
		if a.Rung.Restarts() {
			a.InWindow++
		}
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

// DescribeRungs lists rung attempts as history shows them.
func DescribeRungs(tried []RungAttempt) string {
	if len(tried) == 0 {
		return "no rung tried"
	}
	s := make([]string, len(tried))
	for i, t := range tried {
		s[i] = t.String()
	}
	return strings.Join(s, "; ")
}

// RebootFailed records that the rung a admitted failed with result (what
// it returned, for history and the ladder's progress), and whether its
// request reached the machine (or its provider's API) at all: a restart
// that certainly did not is not counted by the circuit breaker. A failed
// rung does not extend the machine's streak, and a later claim may take a
// rung for the same agent incarnation again. It works whether or not the
// session still holds the work (the failure happened either way), even when
// ctx is cancelled.
func (s *Session) RebootFailed(ctx context.Context, a RebootAdmission, reached bool, result string) error {
	if a.Decision != RebootAdmitted {
		return fmt.Errorf("bmdb: recording a failed reboot: the reboot was not admitted (%s)", a.Decision)
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	err := s.db.retry(cctx, func(ctx context.Context) error {
		_, err := s.db.q.RecoveryAdmissionFailed(ctx, model.RecoveryAdmissionFailedParams{
			Reached: reached, AdmissionID: a.admission, SessionID: s.id, Result: result})
		return err
	})
	if err != nil {
		return fmt.Errorf("bmdb: recording failed reboot %d: %w", a.admission, err)
	}
	return nil
}

// QuarantineRecovery quarantines a machine the session holds for Recovery
// (history Quarantined with cause), when every rung of its ladder failed: it
// takes the machine out of recovery until an operator resets it. It returns
// ErrSessionExpired when the session no longer holds the work.
func (s *Session) QuarantineRecovery(ctx context.Context, machine uuid.UUID, cause string) error {
	err := s.db.transact(ctx, func(ctx context.Context, q *model.Queries) error {
		held, err := q.WorkHeld(ctx, model.WorkHeldParams{MachineID: machine, Process: string(ProcessRecovery), SessionID: s.id})
		if err != nil {
			return fmt.Errorf("checking the work: %w", err)
		}
		if !held {
			return ErrSessionExpired
		}
		return q.RecoveryQuarantine(ctx, model.RecoveryQuarantineParams{SessionID: uuid.NullUUID{UUID: s.id, Valid: true}, Cause: cause, MachineID: machine})
	})
	switch {
	case errors.Is(err, ErrSessionExpired):
		return err
	case err != nil:
		return fmt.Errorf("bmdb: quarantining machine %s for Recovery: %w", machine, err)
	}
	return nil
}

// RecoveryStreak returns the rungs of the recovery ladder taken for machine
// since its agent last heartbeated, oldest first, failed ones included: the
// ladder's progress, for pages and the CLI.
func (db *DB) RecoveryStreak(ctx context.Context, machine uuid.UUID) ([]RungAttempt, error) {
	return recoveryStreak(ctx, db.q, machine)
}

func recoveryStreak(ctx context.Context, q *model.Queries, machine uuid.UUID) ([]RungAttempt, error) {
	rows, err := q.RecoveryStreak(ctx, machine)
	if err != nil {
		return nil, fmt.Errorf("bmdb: reading the recovery streak of machine %s: %w", machine, err)
	}
	out := make([]RungAttempt, len(rows))
	for i, row := range rows {
		out[i] = RungAttempt{Rung: ladder.Rung(row.Rung), Failed: row.Failed, Reached: row.Reached, Result: row.Result, At: row.AdmittedAt}
	}
	return out, nil
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

// powerOffHoldCause begins the cause of the quarantine with which an
// operator's power off holds a machine's Recovery (HoldRecoveryPoweredOff).
const powerOffHoldCause = "powered off by an operator"

// HoldRecoveryPoweredOff quarantines machine's Recovery because an operator
// powered it off (session is the operator's; detail says who, how and
// why), in the transaction that records the power off: the machine is
// silent on purpose, and the recovery ladder would power it back on. It
// does nothing when Recovery is quarantined already. The operator's power
// on (ReleaseRecoveryPowerOffHold) or a Reset of Recovery ends it.
func (tx *Tx) HoldRecoveryPoweredOff(ctx context.Context, machine, session uuid.UUID, detail string) error {
	cause := powerOffHoldCause
	if detail != "" {
		cause += " (" + detail + ")"
	}
	cause += "; recovery resumes when it is powered on through Shepherd or its Recovery is reset"
	if err := tx.q.RecoveryQuarantine(ctx, model.RecoveryQuarantineParams{
		MachineID: machine, SessionID: uuid.NullUUID{UUID: session, Valid: session != uuid.Nil}, Cause: safetext.Clean(cause)}); err != nil {
		return fmt.Errorf("bmdb: holding the recovery of machine %s: %w", machine, err)
	}
	return nil
}

// ReleaseRecoveryPowerOffHold ends the quarantine HoldRecoveryPoweredOff
// set on machine's Recovery, with history Reset (cause says why), and
// reports whether there was one; another quarantine of Recovery stays.
func (tx *Tx) ReleaseRecoveryPowerOffHold(ctx context.Context, machine, session uuid.UUID, cause string) (bool, error) {
	n, err := tx.q.RecoveryPowerOffRelease(ctx, model.RecoveryPowerOffReleaseParams{
		MachineID: machine, SessionID: uuid.NullUUID{UUID: session, Valid: session != uuid.Nil},
		Cause: safetext.Clean(cause), Prefix: powerOffHoldCause})
	if err != nil {
		return false, fmt.Errorf("bmdb: releasing the recovery of machine %s: %w", machine, err)
	}
	return n > 0, nil
}
