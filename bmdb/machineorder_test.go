package bmdb_test

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// TestListMachinesByProviderID: the list in provider id order holds the
// machines ListMachines holds for the same filter, in (provider, provider
// id, machine id) order, each once over all pages, whatever the page size.
func TestListMachinesByProviderID(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "b", Healthy: 12, AwaitingAgent: 5, Stale: 4})
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "a", Healthy: 6, Stale: 2})
	// Provider ids m1, m2, ... per provider: the same ids at both, and
	// m10 before m2 in text order.
	db.Exec(t, `UPDATE machine_provided p SET provider_id = 'm' || n.n
		FROM (SELECT machine_id, row_number() OVER (PARTITION BY provider ORDER BY machine_id) AS n FROM machine_provided) n
		WHERE n.machine_id = p.machine_id`)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	gone := bmdbtest.AddMachine(t, db, s, "a")
	if err := s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		_, err := tx.Decommission(ctx, gone, true)
		return err
	}); err != nil {
		t.Fatal(err)
	}

	for _, f := range []bmdb.MachineFilter{
		{},
		{State: bmdb.StateHealthy},
		{State: bmdb.StateSilent, Provider: "b"},
		{Provider: "a", IncludeDecommissioned: true},
		{Search: "m1"},
		{State: bmdb.StateDecommissioned},
		{Provider: "nobody"},
	} {
		t.Run(fmt.Sprintf("%+v", f), func(t *testing.T) {
			all, next, err := db.ListMachines(t.Context(), f, uuid.Nil, bmdb.MaxMachinePage)
			if err != nil || next != uuid.Nil {
				t.Fatalf("ListMachines: %v (next %s)", err, next)
			}
			// Every filter but the last matches machines, so that the
			// comparison below is not of two empty lists.
			if (len(all) == 0) != (f.Provider == "nobody") {
				t.Fatalf("ListMachines listed %d machines", len(all))
			}
			slices.SortFunc(all, func(x, y bmdb.MachineSummary) int {
				return cmp.Or(cmp.Compare(x.Provider, y.Provider), cmp.Compare(x.ProviderID, y.ProviderID), bytes.Compare(x.MachineID[:], y.MachineID[:]))
			})
			for _, size := range []int{1, 3, 7, 100} {
				var got []bmdb.MachineSummary
				var after bmdb.ProviderIDCursor
				for pages := 0; ; pages++ {
					if pages > len(all)+1 {
						t.Fatalf("page size %d: more pages than machines", size)
					}
					page, next, err := db.ListMachinesByProviderID(t.Context(), f, after, size)
					if err != nil {
						t.Fatal(err)
					}
					if len(page) > size {
						t.Fatalf("page size %d: a page of %d", size, len(page))
					}
					got = append(got, page...)
					if next.IsZero() {
						break
					}
					after = next
				}
				if !slices.EqualFunc(got, all, func(x, y bmdb.MachineSummary) bool {
					return x.MachineID == y.MachineID && x.State == y.State && x.ProviderID == y.ProviderID
				}) {
					t.Errorf("page size %d: listed %v, want %v", size, providerIDs(got), providerIDs(all))
				}
			}
		})
	}
	if _, _, err := db.ListMachinesByProviderID(t.Context(), bmdb.MachineFilter{}, bmdb.ProviderIDCursor{Provider: "a\x00"}, 10); err == nil {
		t.Error("a cursor holding a NUL byte was taken")
	}
}

func providerIDs(ms []bmdb.MachineSummary) []string {
	out := make([]string, len(ms))
	for i, m := range ms {
		out[i] = m.Provider + "/" + m.ProviderID
	}
	return out
}
