package manager_test

import (
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/provider/static"
)

// TestBrokenInventoryChangesNothing edits the inventory of a running static
// fleet into broken files: each is rejected with FILE:LINE, and a
// provisioner pass over the rejected file leaves the BMDB as it was (no
// machine marked Missing, none added). A good edit afterwards does change
// the fleet, so the test would notice a provisioner that ignored the file.
func TestBrokenInventoryChangesNothing(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	path := filepath.Join(t.TempDir(), "inventory.yaml")
	// Six machines: dropping one stays below the suspect-listing guard.
	good := inventoryYAML("a", "b", "c", "d", "e", "f")
	write := func(s string) {
		t.Helper()
		if err := os.WriteFile(path, []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write(good)
	p, err := static.New(static.Config{Name: "lab", Inventory: path, ReloadInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	pr, err := manager.NewProvisioner(manager.ProvisionerConfig{}, db.DB, p, prometheus.NewRegistry(), nil)
	if err != nil {
		t.Fatal(err)
	}
	s := bmdbtest.Session(t, db, "provisioner", time.Minute)
	pass := func() manager.PassResult {
		t.Helper()
		r, err := pr.Pass(t.Context(), s)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	if r := pass(); r.Created != 6 {
		t.Fatalf("first pass %+v, want the 6 machines recorded", r)
	}
	fleet := ourIDs(t, db, "lab")
	history := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work_history")

	for _, tt := range []struct{ name, inventory, want string }{
		{"bad YAML", "machines:\n  - id: a\n    address: [192.0.2.1\n", ":3: "},
		{"duplicate ids", "machines:\n  - id: a\n    address: 192.0.2.1\n  - id: a\n    address: 192.0.2.2\n", `:4: duplicate machine id "a" (first at line 2)`},
		{"missing address", "machines:\n  - id: a\n    address: 192.0.2.1\n  - id: b\n", `:4: machine "b": address is required`},
	} {
		write(tt.inventory)
		err := p.Reload()
		if err == nil || !strings.HasPrefix(err.Error(), path+":") || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: Reload() = %v, want an error at %s%s", tt.name, err, path, tt.want)
		}
		if r := pass(); r.Created != 0 || r.MarkedMissing != 0 || r.Found != 0 {
			t.Errorf("%s: pass over the rejected file %+v, want nothing done", tt.name, r)
		}
		if got := ourIDs(t, db, "lab"); !maps.Equal(got, fleet) {
			t.Errorf("%s: the BMDB fleet became %v, want %v", tt.name, got, fleet)
		}
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work_history"); n != history {
		t.Errorf("history grew from %d to %d rows while the inventory was broken", history, n)
	}

	// A good edit that drops b is acted on.
	write(strings.Replace(good, "  - id: b\n    address: 192.0.2.2\n", "", 1))
	if err := p.Reload(); err != nil {
		t.Fatal(err)
	}
	if r := pass(); r.MarkedMissing != 1 {
		t.Fatalf("pass after dropping b %+v, want b marked Missing", r)
	}
	if got := ourIDs(t, db, "lab")["b"]; got != bmdb.ProviderStatusMissing {
		t.Errorf("b has status %q after leaving the inventory, want Missing", got)
	}
}

// TestSmallFleetLosesAMachine removes one machine of a static fleet of four
// from the inventory: a quarter of the fleet, above the suspect fraction,
// but a single machine, which a small fleet must be able to lose. Both the
// updater and the provisioner mark it Missing instead of refusing every
// listing from then on.
func TestSmallFleetLosesAMachine(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	path := filepath.Join(t.TempDir(), "inventory.yaml")
	inventory := func(ids ...string) {
		t.Helper()
		if err := os.WriteFile(path, []byte(inventoryYAML(ids...)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	inventory("a", "b", "c", "d")
	p, err := static.New(static.Config{Name: "lab", Inventory: path, ReloadInterval: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	pr, err := manager.NewProvisioner(manager.ProvisionerConfig{}, db.DB, p, prometheus.NewRegistry(), nil)
	if err != nil {
		t.Fatal(err)
	}
	up, err := manager.NewUpdater(manager.UpdaterConfig{}, db.DB, p, prometheus.NewRegistry(), nil)
	if err != nil {
		t.Fatal(err)
	}
	s := bmdbtest.Session(t, db, "manager", time.Minute)
	if r, err := pr.Pass(t.Context(), s); err != nil || r.Created != 4 {
		t.Fatalf("first pass %+v, %v; want the 4 machines recorded", r, err)
	}

	// d leaves the inventory: the updater marks it Missing.
	inventory("a", "b", "c")
	if err := p.Reload(); err != nil {
		t.Fatal(err)
	}
	if r, err := up.Pass(t.Context(), s); err != nil || r.Suspect || r.MarkedMissing != 1 {
		t.Fatalf("updater pass without d: %+v, %v; want d marked Missing", r, err)
	}
	if got := ourIDs(t, db, "lab")["d"]; got != bmdb.ProviderStatusMissing {
		t.Errorf("d has status %q after the updater's pass, want Missing", got)
	}

	// c leaves too, one of the three left: the provisioner marks it Missing.
	inventory("a", "b")
	if err := p.Reload(); err != nil {
		t.Fatal(err)
	}
	if r, err := pr.Pass(t.Context(), s); err != nil || r.Suspect || r.MarkedMissing != 1 {
		t.Fatalf("provisioner pass without c: %+v, %v; want c marked Missing", r, err)
	}
	if got := ourIDs(t, db, "lab")["c"]; got != bmdb.ProviderStatusMissing {
		t.Errorf("c has status %q after the provisioner's pass, want Missing", got)
	}
}

// inventoryYAML is a static inventory of machines with these ids, at
// 192.0.2.1 onwards.
func inventoryYAML(ids ...string) string {
	s := "machines:\n"
	for i, id := range ids {
		s += fmt.Sprintf("  - id: %s\n    address: 192.0.2.%d\n", id, i+1)
	}
	return s
}
