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
	if sortBy == sortProviderID {
		return readPages(limit, func(after bmdb.ProviderIDCursor, n int) ([]bmdb.MachineSummary, bmdb.ProviderIDCursor, error) {
			return db.ListMachinesByProviderID(ctx, f, after, n)
		})
	}
	return readPages(limit, func(after uuid.UUID, n int) ([]bmdb.MachineSummary, uuid.UUID, error) {
		return db.ListMachines(ctx, f, after, n)
	})
}

// readPages reads up to limit machines with read, a page of at most n
// after the cursor after at a time, from the zero cursor until read
// returns the zero cursor as the next.
func readPages[C comparable](limit int, read func(after C, n int) ([]bmdb.MachineSummary, C, error)) ([]bmdb.MachineSummary, error) {
	var (
		machines []bmdb.MachineSummary
		after    C
		zero     C
	)
	for len(machines) < limit {
		page, next, err := read(after, min(listPage, limit-len(machines)))
		if err != nil {
			return nil, err
		}
		machines = append(machines, page...)
		if next == zero {
			break
		}
		after = next
	}
	return machines, nil
}
