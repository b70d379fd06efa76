package main

import (
	"context"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
)

// The orders of machine list --sort.
const (
	sortMachineID  = "id"
	sortProviderID = "provider-id"
)

// listMachines reads up to limit machines matching f in the order sortBy
// names, following pages.
func listMachines(ctx context.Context, db *bmdb.DB, f bmdb.MachineFilter, sortBy string, limit int) ([]bmdb.MachineSummary, error) {
	var machines []bmdb.MachineSummary
	if sortBy == sortProviderID {
		var after bmdb.ProviderIDCursor
		for len(machines) < limit {
			page, next, err := db.ListMachinesByProviderID(ctx, f, after, min(listPage, limit-len(machines)))
			if err != nil {
				return nil, err
			}
			machines = append(machines, page...)
			if next.IsZero() {
				break
			}
			after = next
		}
		return machines, nil
	}
	after := uuid.Nil
	for len(machines) < limit {
		page, next, err := db.ListMachines(ctx, f, after, min(listPage, limit-len(machines)))
		if err != nil {
			return nil, err
		}
		machines = append(machines, page...)
		if next == uuid.Nil {
			break
		}
		after = next
	}
	return machines, nil
}
