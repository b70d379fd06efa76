package main

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// TestMachineListSortByProviderID: machine list --sort provider-id lists by
// provider, then provider id; --limit cuts that order.
func TestMachineListSortByProviderID(t *testing.T) {
	db := bmdbtest.New(t)
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "zeta", Healthy: 3})
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "alpha", Healthy: 2, Stale: 1})
	db.Exec(t, `UPDATE machine_provided p SET provider_id = 'm' || n.n
		FROM (SELECT machine_id, row_number() OVER (PARTITION BY provider ORDER BY machine_id DESC) AS n FROM machine_provided) n
		WHERE n.machine_id = p.machine_id`)
	list := func(args ...string) []string {
		t.Helper()
		out, err := run(t, append([]string{"machine", "list", "-o", "json", "--database-url", db.URL}, args...)...)
		if err != nil {
			t.Fatalf("machine list %v: %v\n%s", args, err, out)
		}
		var ms []machineJSON
		if err := json.Unmarshal([]byte(out), &ms); err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, m := range ms {
			names = append(names, m.Provider+"/"+m.ProviderID)
		}
		return names
	}
	want := []string{"alpha/m1", "alpha/m2", "alpha/m3", "zeta/m1", "zeta/m2", "zeta/m3"}
	if got := list("--sort", "provider-id"); !slices.Equal(got, want) {
		t.Errorf("--sort provider-id listed %v, want %v", got, want)
	}
	if got := list("--sort", "provider-id", "--limit", "4"); !slices.Equal(got, want[:4]) {
		t.Errorf("--sort provider-id --limit 4 listed %v, want %v", got, want[:4])
	}
	if got := list("--sort", "provider-id", "--state", "Silent"); len(got) != 1 || !strings.HasPrefix(got[0], "alpha/") {
		t.Errorf("--sort provider-id --state Silent listed %v, want the one silent machine", got)
	}
	byID := list()
	if slices.Equal(byID, want) || len(byID) != len(want) {
		t.Errorf("the default order is %v: the same as by provider id, or not all machines (the test proves nothing)", byID)
	}
	if out, err := run(t, "machine", "list", "--sort", "name", "--database-url", db.URL); err == nil || !strings.Contains(err.Error(), `--sort "name" is not an order: use id or provider-id`) {
		t.Errorf("--sort name: %v\n%s", err, out)
	}
	out, err := run(t, "machine", "list", "--sort", "provider-id", "--database-url", db.URL)
	if err != nil || strings.Index(out, "alpha") > strings.Index(out, "zeta") || !strings.Contains(out, "6 of 6 matching machines") {
		t.Errorf("table by provider id: %v\n%s", err, out)
	}
}
