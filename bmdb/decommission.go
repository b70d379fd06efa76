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

// StateDecommissioned is the derived state (SPEC §3.7) of a machine that was
// decommissioned: it has no live tags any more, only its machines row, its
// history and its DecommissionRecord. FleetStates and the fleet gauges count
// the machines of the fleet and so never report it; views of one machine
// show it. Until the decommissioner is done, a machine with a decommission
// request is StateDecommissioning.
const StateDecommissioned MachineState = "Decommissioned"

// DecommissionCandidates selects provided machines of provider with a
// decommission request, oldest request first. It is the decommissioner's
// query, the one candidate query that does not exclude machines with a
// decommission request.
func DecommissionCandidates(provider string) Candidates {
	return decommissionCandidates{provider: provider}
}

type decommissionCandidates struct{ provider string }

func (c decommissionCandidates) String() string {
	return fmt.Sprintf("decommission (provider %q)", c.provider)
}

func (c decommissionCandidates) list(ctx context.Context, q *model.Queries, p Process, limit int32) ([]uuid.UUID, error) {
	return q.ListDecommissionCandidates(ctx, model.ListDecommissionCandidatesParams{
		Provider: c.provider, Process: string(p), Exclusive: p.MachineExclusive(), RowLimit: limit})
}

func (c decommissionCandidates) count(ctx context.Context, q *model.Queries, p Process) (int64, error) {
	return q.CountDecommissionCandidates(ctx, model.CountDecommissionCandidatesParams{
		Provider: c.provider, Process: string(p), Exclusive: p.MachineExclusive()})
}

func (c decommissionCandidates) matching(ctx context.Context, q *model.Queries) (int64, error) {
	return q.CountDecommissionMatching(ctx, c.provider)
}

func (c decommissionCandidates) matches(ctx context.Context, q *model.Queries, machine uuid.UUID) (bool, error) {
	return q.DecommissionMatches(ctx, model.DecommissionMatchesParams{Provider: c.provider, MachineID: machine})
}

func (c decommissionCandidates) claim(ctx context.Context, q *model.Queries, a claimParams) (claimResult, error) {
	if a.strategy == ClaimPlainLimit {
		r, err := q.ClaimDecommissionCandidatePlain(ctx, model.ClaimDecommissionCandidatePlainParams{
			Provider: c.provider, Process: string(a.process), Exclusive: a.process.MachineExclusive(), SessionID: a.session})
		return claimResult(r), err
	}
	r, err := q.ClaimDecommissionCandidate(ctx, model.ClaimDecommissionCandidateParams{
		Provider: c.provider, Process: string(a.process), Exclusive: a.process.MachineExclusive(),
		ScanLimit: a.scan, SessionID: a.session})
	return claimResult(r), err
}

// DecommissionBackoff is the default backoff of the decommissioner: a
// provider that cannot release a machine now (an API outage) is asked again
// after a minute, then less and less often, up to every hour. There is no
// quarantine: an operator asked for the machine to go, and it should go once
// the provider lets it.
func DecommissionBackoff() BackoffPolicy {
	return BackoffPolicy{Initial: time.Minute, Maximum: time.Hour, Exponent: 2}
}

// DecommissionRecord is what is kept of a decommissioned machine besides its
// machines row and its history: where it was, who asked for it to go and
// why, and whether the provider released it.
type DecommissionRecord struct {
	MachineID        uuid.UUID
	DecommissionedAt time.Time
	// Provider, ProviderID, ReservationID and Location are what its
	// Provided tag said.
	Provider, ProviderID, ReservationID, Location string
	// RequestedAt is the zero time if the machine was decommissioned
	// without a request.
	RequestedAt time.Time
	RequestedBy string
	Reason      string
	// Released says whether the provider released the machine (deleted the
	// device, freed the slot); false where it cannot and only forgot it.
	Released bool
}

// Decommission takes the machine out of the fleet (SPEC §3.8): it deletes
// all of its live tags (Provided included) and its backoffs, keeps a
// DecommissionRecord (released says whether the provider released it),
// and sets its decommissioned-at time. The machines row and its history
// stay. It returns ErrNotFound if the machine has no Provided tag. The
// decommissioner calls it when it finishes a machine's Decommission work.
func (t *Tx) Decommission(ctx context.Context, machine uuid.UUID, released bool) (DecommissionRecord, error) {
	r, err := t.q.MachineDecommission(ctx, model.MachineDecommissionParams{MachineID: machine, Released: released})
	if errors.Is(err, pgx.ErrNoRows) {
		return DecommissionRecord{}, fmt.Errorf("bmdb: decommissioning machine %s: no Provided tag: %w", machine, ErrNotFound)
	} else if err != nil {
		return DecommissionRecord{}, fmt.Errorf("bmdb: decommissioning machine %s: %w", machine, err)
	}
	rec := DecommissionRecord{MachineID: machine, Provider: r.Provider, ProviderID: r.ProviderID, Released: released}
	if r.DecommissionedAt != nil {
		rec.DecommissionedAt = *r.DecommissionedAt
	}
	return rec, nil
}

// GetDecommissioned returns the record of a decommissioned machine, or
// ErrNotFound if the machine is unknown or was not decommissioned.
func (db *DB) GetDecommissioned(ctx context.Context, machine uuid.UUID) (DecommissionRecord, error) {
	r, err := db.q.DecommissionedGet(ctx, machine)
	if errors.Is(err, pgx.ErrNoRows) {
		return DecommissionRecord{}, ErrNotFound
	} else if err != nil {
		return DecommissionRecord{}, fmt.Errorf("bmdb: reading decommission of machine %s: %w", machine, err)
	}
	rec := DecommissionRecord{
		MachineID:     r.MachineID,
		Provider:      r.Provider,
		ProviderID:    r.ProviderID,
		ReservationID: r.ProviderReservationID,
		Location:      r.ProviderLocation,
		RequestedBy:   r.RequestedBy,
		Reason:        r.Reason,
		Released:      r.Released,
	}
	if r.DecommissionedAt != nil {
		rec.DecommissionedAt = *r.DecommissionedAt
	}
	if r.RequestedAt != nil {
		rec.RequestedAt = *r.RequestedAt
	}
	return rec, nil
}

// DecommissionedProviderIDs returns the set of provider ids that machines of
// provider had when they were decommissioned. The provisioner never takes a
// machine with one of them into the fleet again, whatever the provider's
// listing says about it: a static inventory keeps listing a machine Shepherd
// cannot release, and a released id must not come back as a new machine.
func (db *DB) DecommissionedProviderIDs(ctx context.Context, provider string) (map[string]struct{}, error) {
	ids, err := db.q.DecommissionedProviderIDs(ctx, provider)
	if err != nil {
		return nil, fmt.Errorf("bmdb: listing decommissioned machines of %s: %w", provider, err)
	}
	out := make(map[string]struct{}, len(ids))
	for _, id := range ids {
		out[id] = struct{}{}
	}
	return out, nil
}
