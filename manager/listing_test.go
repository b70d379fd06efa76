package manager_test

import (
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/metricstest"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/provider"
)

func TestListingGuard(t *testing.T) {
	t.Parallel()
	guard := func(fraction float64, minMissing int) manager.ListingGuard {
		return manager.ListingGuard{Fraction: &fraction, MinMissing: &minMissing}
	}
	for _, tt := range []struct {
		name             string
		guard            manager.ListingGuard
		missing, present int
		want             bool
	}{
		{"defaults: 1 of 4 is a small fleet losing a machine", manager.ListingGuard{}, 1, 4, false},
		{"defaults: 3 of 4 is within the minimum", manager.ListingGuard{}, 3, 4, false},
		{"defaults: 4 of 4", manager.ListingGuard{}, 4, 4, true},
		{"defaults: 3 of 10 is within the minimum", manager.ListingGuard{}, 3, 10, false},
		{"defaults: 4 of 10", manager.ListingGuard{}, 4, 10, true},
		{"defaults: 200 of 1000 is the fraction, not more", manager.ListingGuard{}, 200, 1000, false},
		{"defaults: 201 of 1000", manager.ListingGuard{}, 201, 1000, true},
		{"defaults: nothing missing", manager.ListingGuard{}, 0, 0, false},
		{"fraction 0: 4 of 1000, more than the minimum", guard(0, 3), 4, 1000, true},
		{"fraction 0: 3 of 1000, the minimum", guard(0, 3), 3, 1000, false},
		{"fraction 0, minimum 0: any missing machine", guard(0, 0), 1, 1000, true},
		{"fraction 0, minimum 0: none missing", guard(0, 0), 0, 1000, false},
		{"fraction 1: the guard is off", guard(1, 0), 10, 10, false},
		{"minimum 0: the fraction alone, 1 of 4", guard(0.2, 0), 1, 4, true},
		{"only the fraction set: default minimum", manager.ListingGuard{Fraction: new(0.0)}, 3, 1000, false},
	} {
		if got := manager.ListingSuspect(tt.guard, tt.missing, tt.present); got != tt.want {
			t.Errorf("%s: suspect(%d missing of %d) = %v, want %v", tt.name, tt.missing, tt.present, got, tt.want)
		}
	}
}

func TestListingGuardValidate(t *testing.T) {
	t.Parallel()
	p := newScripted("lab")
	for _, tt := range []struct {
		guard manager.ListingGuard
		want  string // "" for valid
	}{
		{manager.ListingGuard{}, ""},
		{manager.ListingGuard{Fraction: new(0.0), MinMissing: new(0)}, ""},
		{manager.ListingGuard{Fraction: new(1.0)}, ""},
		{manager.ListingGuard{Fraction: new(-0.1)}, "suspect fraction must be within [0, 1], got -0.1"},
		{manager.ListingGuard{Fraction: new(1.5)}, "suspect fraction must be within [0, 1], got 1.5"},
		{manager.ListingGuard{Fraction: new(math.NaN())}, "got NaN"},
		{manager.ListingGuard{MinMissing: new(-1)}, "minimum of missing machines must be >= 0, got -1"},
	} {
		_, perr := manager.NewProvisioner(manager.ProvisionerConfig{Listing: tt.guard}, nil, p, nil, nil)
		_, uerr := manager.NewUpdater(manager.UpdaterConfig{Listing: tt.guard}, nil, p, nil, nil)
		for component, err := range map[string]error{"provisioner": perr, "updater": uerr} {
			switch {
			case tt.want == "" && err != nil:
				t.Errorf("%s with %+v: %v, want it accepted", component, tt.guard, err)
			case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want) || !strings.HasPrefix(err.Error(), component+": ")):
				t.Errorf("%s with %+v: %v, want an error from %s containing %q", component, tt.guard, err, component, tt.want)
			}
		}
	}
}

// TestAcceptSuspectListing removes half of a fleet of 20 at the provider,
// which no pass believes, until an operator accepts a listing that lacks
// that many machines: the next pass marks them Missing and uses the
// acceptance up.
func TestAcceptSuspectListing(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	p := newScripted("lab")
	for i := range 20 {
		p.set(fmt.Sprintf("m%02d", i), provider.KnownUnused)
	}
	reg := prometheus.NewRegistry()
	pr, err := manager.NewProvisioner(manager.ProvisionerConfig{ChunkSize: 20}, db.DB, p, reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	up, err := manager.NewUpdater(manager.UpdaterConfig{}, db.DB, p, reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	s := bmdbtest.Session(t, db, "manager", time.Minute)
	if r, err := pr.Pass(t.Context(), s); err != nil || r.Created != 20 {
		t.Fatalf("first pass %+v, %v; want 20 machines created", r, err)
	}
	gauge := func(component string) float64 {
		return metricstest.Value(t, reg, "shepherd_"+component+"_suspect_listing_missing_machines", "provider", "lab")
	}
	missing := func() int {
		n := 0
		for _, st := range ourIDs(t, db, "lab") {
			if st == bmdb.ProviderStatusMissing {
				n++
			}
		}
		return n
	}
	for i := range 10 {
		p.remove(fmt.Sprintf("m%02d", i))
	}
	if r, err := pr.Pass(t.Context(), s); err != nil || !r.Suspect || r.MarkedMissing != 0 {
		t.Fatalf("pass with half the fleet gone: %+v, %v; want it suspect", r, err)
	}
	if r, err := up.Pass(t.Context(), s); err != nil || !r.Suspect {
		t.Fatalf("updater pass with half the fleet gone: %+v, %v; want it suspect", r, err)
	}
	if g, u := gauge("provisioner"), gauge("updater"); g != 10 || u != 10 {
		t.Errorf("suspect listing gauges: provisioner %v, updater %v; want 10 and 10", g, u)
	}

	// An acceptance of fewer machines than the listing lacks does not
	// cover it, nor does one that lapsed.
	if _, err := db.AcceptListing(t.Context(), "lab", 9, time.Hour, "test"); err != nil {
		t.Fatal(err)
	}
	if r, err := pr.Pass(t.Context(), s); err != nil || !r.Suspect {
		t.Fatalf("pass with an acceptance of 9 machines: %+v, %v; want it suspect", r, err)
	}
	if _, err := db.AcceptListing(t.Context(), "lab", 10, time.Hour, "test"); err != nil {
		t.Fatal(err)
	}
	db.Exec(t, "UPDATE provider_state SET listing_accept_until = now() - interval '1 second' WHERE provider = 'lab'")
	if r, err := pr.Pass(t.Context(), s); err != nil || !r.Suspect {
		t.Fatalf("pass with a lapsed acceptance: %+v, %v; want it suspect", r, err)
	}
	if n := missing(); n != 0 {
		t.Fatalf("%d machines Missing before the listing was accepted", n)
	}

	// Accepted: the updater's next pass believes the listing.
	acc, err := db.AcceptListing(t.Context(), "lab", 10, time.Hour, "alice@ops")
	if err != nil {
		t.Fatal(err)
	}
	if acc.MaxMissing != 10 || acc.By != "alice@ops" || !acc.Until.After(acc.At) {
		t.Errorf("AcceptListing returned %+v", acc)
	}
	if r, err := up.Pass(t.Context(), s); err != nil || r.Suspect || !r.Accepted || r.MarkedMissing != 10 {
		t.Fatalf("updater pass after the acceptance: %+v, %v; want 10 marked Missing", r, err)
	}
	if n := missing(); n != 10 {
		t.Errorf("%d machines Missing after the accepted listing, want 10", n)
	}
	if u := gauge("updater"); u != 0 {
		t.Errorf("updater's suspect listing gauge %v after the accepted listing, want 0", u)
	}
	// The provisioner agrees now: nothing more is missing.
	if r, err := pr.Pass(t.Context(), s); err != nil || r.Suspect || r.MarkedMissing != 0 {
		t.Fatalf("provisioner pass after the accepted listing: %+v, %v", r, err)
	}

	// The acceptance is used up: the next implausible listing is suspect.
	for i := 10; i < 15; i++ {
		p.remove(fmt.Sprintf("m%02d", i))
	}
	if r, err := pr.Pass(t.Context(), s); err != nil || !r.Suspect {
		t.Fatalf("pass with 5 of the 10 left gone after the acceptance was used: %+v, %v; want it suspect", r, err)
	}
}
