package bmdb

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/bmdb/model"
	"github.com/shepherd/shepherd/internal/safetext"
)

// ErrMachineBusy means another machine-exclusive process holds the machine
// Hold asked for; the error names it ("held by Recovery"). Nothing was
// changed: try again once that work has ended.
var ErrMachineBusy = errors.New("bmdb: machine busy")

// Hold claims the named machine for process, which must be
// machine-exclusive, under the session, in one statement that locks the
// machine, expires the work of dead sessions on it (history Expired, as
// Work does) and writes history Started with cause (who asked, and why). It
// is how an operator's action (a power cycle from the CLI) keeps the
// control loops off a machine while it runs, and waits for none of them:
// while another machine-exclusive process, or process itself, holds the
// machine, Hold returns an error wrapping ErrMachineBusy that names the
// holder. Backoffs and decommission requests do not keep an operator out.
// It returns ErrNotFound if the machine has no Provided tag (it does not
// exist or was decommissioned), ErrSessionExpired if the session is dead,
// and ErrWorkConflict if it kept losing races with claims. The work ends
// with FinishWithCause, FailWithoutBackoff or Cancel; if the process dies
// first, the work expires with the session.
func (s *Session) Hold(ctx context.Context, process Process, machine uuid.UUID, cause string) (*Work, error) {
	if err := process.Validate(); err != nil {
		return nil, err
	}
	if !process.MachineExclusive() {
		return nil, fmt.Errorf("bmdb: Hold is for machine-exclusive processes, not %s", process)
	}
	params := model.WorkHoldParams{
		Process: string(process), Exclusive: true, MachineID: machine, SessionID: s.id, Cause: safetext.Clean(cause),
	}
	none := fmt.Errorf("%w: machine %s has no Provided tag (it does not exist, or was decommissioned)", ErrNotFound, machine)
	return s.claim(ctx, process, "holding machine "+machine.String(), none, func(ctx context.Context) (claimResult, error) {
		r, err := s.db.q.WorkHold(ctx, params)
		if err != nil {
			return claimResult{}, err
		}
		if r.Holder != "" {
			return claimResult{}, fmt.Errorf("%w: machine %s is held by %s", ErrMachineBusy, machine, r.Holder)
		}
		return claimResult{
			CandidateID: r.CandidateID, ClaimedID: r.ClaimedID, ExpiredCount: r.ExpiredCount, ExpiredSessions: r.ExpiredSessions,
			Provider: r.Provider, ProviderID: r.ProviderID, ProviderReservationID: r.ProviderReservationID,
			ProviderIPAddress: r.ProviderIPAddress, ProviderLocation: r.ProviderLocation,
			ProviderStatus: r.ProviderStatus, ProviderStatusAt: r.ProviderStatusAt, AgentPhase: r.AgentPhase,
		}, nil
	})
}

// Power states as the BMDB records them; they are power.State's values.
const (
	PowerOn  = "on"
	PowerOff = "off"
)

// PowerReading is one look at a machine's power through its BMC: a check
// or an action.
type PowerReading struct {
	// BMC names the BMC (driver, user and endpoint), never a password;
	// required.
	BMC string
	// State is the power state read, PowerOn or PowerOff; "" if none was
	// read (the check or action failed).
	State string
	// ErrorClass and Error say why the check or action failed (power.Class
	// and the error's text); "" if it did not.
	ErrorClass, Error string
}

// PowerStatus is the last known power state of a machine.
type PowerStatus struct {
	// BMC names the BMC it was read through.
	BMC string
	// State is the last state read through BMC, PowerOn or PowerOff, at
	// StateAt; "" and nil if none was.
	State   string
	StateAt *time.Time
	// ErrorClass and Error say why the last check or action failed; "" if
	// it succeeded.
	ErrorClass, Error string
	// CheckedAt is the time of the last check or action, good or bad.
	CheckedAt time.Time
}

// RecordPowerState records r as machine's last look at its power, at the
// database's time. A reading without a state keeps the state last read
// through the same BMC (an error does not make the machine's state
// unknown), and forgets one read through another. It returns ErrNotFound if
// the machine does not exist.
func (db *DB) RecordPowerState(ctx context.Context, machine uuid.UUID, r PowerReading) error {
	if r.BMC == "" {
		return errors.New("bmdb: recording power state: the BMC's name is required")
	}
	var state *string
	switch r.State {
	case "":
	case PowerOn, PowerOff:
		state = &r.State
	default:
		return fmt.Errorf("bmdb: recording power state: state %q is not %q or %q", r.State, PowerOn, PowerOff)
	}
	err := db.retry(ctx, func(ctx context.Context) error {
		_, err := db.q.MachinePowerStateRecord(ctx, model.MachinePowerStateRecordParams{
			MachineID: machine, Bmc: safetext.Clean(r.BMC), State: state,
			ErrorClass: safetext.Clean(r.ErrorClass), ErrorMessage: safetext.Clean(r.Error),
		})
		return err
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("%w: machine %s", ErrNotFound, machine)
	} else if err != nil {
		return fmt.Errorf("bmdb: recording power state of machine %s: %w", machine, err)
	}
	return nil
}

// powerStatus reads machine's last known power state; nil if none was
// recorded.
func powerStatus(ctx context.Context, q *model.Queries, machine uuid.UUID) (*PowerStatus, error) {
	r, err := q.MachinePowerState(ctx, machine)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil
	} else if err != nil {
		return nil, err
	}
	p := &PowerStatus{BMC: r.Bmc, StateAt: r.StateAt, ErrorClass: r.ErrorClass, Error: r.ErrorMessage, CheckedAt: r.CheckedAt}
	if r.State != nil {
		p.State = *r.State
	}
	return p, nil
}
