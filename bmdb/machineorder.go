package bmdb

import (
	"context"
	"fmt"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb/model"
	"github.com/shepherd/shepherd/internal/safetext"
)

// ProviderIDCursor is where a page of the machine list in provider id
// order continues: after the machine it names. The zero cursor starts at
// the first machine.
type ProviderIDCursor struct {
	Provider, ProviderID string
	MachineID            uuid.UUID
}

// IsZero reports whether c is the cursor of the first page.
func (c ProviderIDCursor) IsZero() bool { return c == ProviderIDCursor{} }

// ListMachinesByProviderID is ListMachines in provider id order: by
// provider, then provider id (text order: m10 before m2), then machine id,
// starting after the machine after names. next is the cursor of the
// following page, the zero cursor on the last page. Each page scans the
// fleet once, as a filtered page of ListMachines may.
func (db *DB) ListMachinesByProviderID(ctx context.Context, f MachineFilter, after ProviderIDCursor, limit int) (page []MachineSummary, next ProviderIDCursor, err error) {
	p, rowLimit, err := f.pageParams(limit)
	if err != nil {
		return nil, ProviderIDCursor{}, err
	}
	for _, v := range []string{after.Provider, after.ProviderID} {
		if !safetext.Storable(v) {
			return nil, ProviderIDCursor{}, fmt.Errorf("%w: the cursor is not text", ErrInvalidFilter)
		}
	}
	q := model.New(customPlans{db.pool})
	rows, err := q.MachineListByProviderID(ctx, model.MachineListByProviderIDParams{
		FirstHeartbeatTimeoutMs: p.firstMs,
		HeartbeatTimeoutMs:      p.heartbeatMs,
		IncludeDecommissioned:   p.includeDecommissioned,
		AfterProvider:           after.Provider,
		AfterProviderID:         after.ProviderID,
		After:                   after.MachineID,
		State:                   p.state,
		Provider:                p.provider,
		Location:                p.location,
		Search:                  p.search,
		SearchIDFrom:            p.searchIDFrom,
		SearchIDTo:              p.searchIDTo,
		SearchIp:                p.searchIP,
		SearchNet:               p.searchNet,
		SearchPattern:           p.searchPattern,
		SearchIpPrefix:          p.searchIPPrefix,
		RowLimit:                rowLimit,
	})
	if err != nil {
		return nil, ProviderIDCursor{}, fmt.Errorf("bmdb: listing machines by provider id: %w", err)
	}
	page, last := pageOf(rows, limit, func(r model.MachineListByProviderIDRow) MachineSummary {
		return machineSummary(model.MachineListAllRow(r))
	})
	if last.MachineID != uuid.Nil {
		next = ProviderIDCursor{Provider: last.Provider, ProviderID: last.ProviderID, MachineID: last.MachineID}
	}
	return page, next, nil
}
