package bmdb_test

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

func TestUpdateLease(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	a := bmdbtest.Session(t, db, "updater-a", time.Minute)
	b := bmdbtest.Session(t, db, "updater-b", time.Minute)
	acquire := func(s *bmdb.Session, want bool, what string) {
		t.Helper()
		held, err := s.AcquireUpdateLease(t.Context(), "lab")
		if err != nil || held != want {
			t.Fatalf("%s: AcquireUpdateLease() = %v, %v; want %v", what, held, err, want)
		}
	}

	acquire(a, true, "A takes the free lease")
	acquire(b, false, "B while A holds it")
	acquire(a, true, "A again: it holds the lease already")

	// The provisioning lease of the same provider is another lease: B can
	// provision while A updates.
	if held, err := b.AcquireProviderLease(t.Context(), "lab"); err != nil || !held {
		t.Fatalf("B could not take the provisioning lease while A holds the update lease: %v, %v", held, err)
	}
	if held, err := a.AcquireProviderLease(t.Context(), "lab"); err != nil || held {
		t.Fatalf("A took the provisioning lease B holds: %v, %v", held, err)
	}
	acquire(b, false, "B's provisioning lease does not give it the update lease")

	// Releasing frees it; releasing someone else's lease does nothing.
	if err := b.ReleaseUpdateLease(t.Context(), "lab"); err != nil {
		t.Fatal(err)
	}
	acquire(b, false, "B after releasing a lease it did not hold")
	if err := a.ReleaseUpdateLease(t.Context(), "lab"); err != nil {
		t.Fatal(err)
	}
	acquire(b, true, "B after A released")
	acquire(a, false, "A while B holds it")

	// The lease of a dead session is free; the dead session cannot take it
	// back.
	db.Exec(t, "UPDATE sessions SET deadline = now() - interval '1 second' WHERE session_id = $1", b.ID())
	acquire(a, true, "A after B's session died")
	acquire(b, false, "B with a dead session")
	if held, err := a.AcquireUpdateLease(t.Context(), "other"); err != nil || !held {
		t.Fatalf("leases are per provider: %v, %v", held, err)
	}
}

func TestUpdateProvided(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	ctx := t.Context()
	add := func(provider, id string, status bmdb.ProviderStatus, addr string) uuid.UUID {
		t.Helper()
		var m uuid.UUID
		err := s.Transact(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
			p := bmdb.Provided{Provider: provider, ProviderID: id, Status: status, Location: "rack-1"}
			if addr != "" {
				p.Address = netip.MustParseAddr(addr)
			}
			var err error
			m, err = tx.AddMachine(ctx, p)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	m1 := add("p", "m1", bmdb.ProviderStatusRunning, "")
	m2 := add("p", "m2", bmdb.ProviderStatusProvisioning, "10.0.0.2")
	m3 := add("p", "m3", bmdb.ProviderStatusRunning, "10.0.0.3")
	other := add("q", "m1", bmdb.ProviderStatusRunning, "")
	// Every status is an hour old, so a moved StatusAt shows.
	db.Exec(t, "UPDATE machine_provided SET provider_status_at = now() - interval '1 hour'")
	hourAgo := map[uuid.UUID]time.Time{}
	for _, m := range []uuid.UUID{m1, m2, m3, other} {
		hourAgo[m] = getProvided(t, db, m).StatusAt
	}
	xmin := func(m uuid.UUID) int64 {
		return bmdbtest.Scalar[int64](t, db, "SELECT xmin::text::bigint FROM machine_provided WHERE machine_id = $1", m)
	}
	update := func(updates ...bmdb.ProvidedUpdate) int64 {
		t.Helper()
		var n int64
		err := s.Transact(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
			var err error
			n, err = tx.UpdateProvided(ctx, "p", updates)
			return err
		})
		if err != nil {
			t.Fatalf("UpdateProvided: %v", err)
		}
		return n
	}

	changes := []bmdb.ProvidedUpdate{
		// A new address and location, same status.
		{ProviderID: "m1", Status: bmdb.ProviderStatusRunning, Address: netip.MustParseAddr("192.0.2.1"), Location: "rack-2", ReservationID: "r-1"},
		// Provisioned.
		{ProviderID: "m2", Status: bmdb.ProviderStatusRunning, Address: netip.MustParseAddr("10.0.0.2"), Location: "rack-1"},
		// Unchanged.
		{ProviderID: "m3", Status: bmdb.ProviderStatusRunning, Address: netip.MustParseAddr("10.0.0.3"), Location: "rack-1"},
		// Not in the BMDB.
		{ProviderID: "nope", Status: bmdb.ProviderStatusRunning},
	}
	x3 := xmin(m3)
	if n := update(changes...); n != 2 {
		t.Fatalf("UpdateProvided() changed %d machines, want 2 (m1, m2)", n)
	}
	if g := getProvided(t, db, m1); g.Address != netip.MustParseAddr("192.0.2.1") || g.Location != "rack-2" || g.ReservationID != "r-1" ||
		g.Status != bmdb.ProviderStatusRunning || !g.StatusAt.Equal(hourAgo[m1]) {
		t.Errorf("m1 after new details: %+v; want them, and StatusAt kept at %s", g.Provided, hourAgo[m1])
	}
	if g := getProvided(t, db, m2); g.Status != bmdb.ProviderStatusRunning || !g.StatusAt.After(hourAgo[m2].Add(59*time.Minute)) {
		t.Errorf("m2 after its status changed: %+v; want Running since now", g.Provided)
	}
	if xmin(m3) != x3 {
		t.Error("m3 was written although nothing changed")
	}
	if g := getProvided(t, db, other); g.Address.IsValid() || g.Location != "rack-1" {
		t.Errorf("another provider's machine with the same provider id changed: %+v", g.Provided)
	}

	// The same details again write nothing at all.
	before := map[uuid.UUID]int64{m1: xmin(m1), m2: xmin(m2), m3: xmin(m3)}
	if n := update(changes...); n != 0 {
		t.Fatalf("repeating the update changed %d machines, want 0", n)
	}
	for m, x := range before {
		if xmin(m) != x {
			t.Errorf("machine %s was written by an update that changed nothing", m)
		}
	}

	// An unknown address clears it; an empty status is Unknown.
	if n := update(bmdb.ProvidedUpdate{ProviderID: "m1", Location: "rack-2", ReservationID: "r-1"}); n != 1 {
		t.Fatalf("clearing the address changed %d machines, want 1", n)
	}
	if g := getProvided(t, db, m1); g.Address.IsValid() || g.Status != bmdb.ProviderStatusUnknown {
		t.Errorf("m1 after an update without address and status: %+v", g.Provided)
	}

	// Bad batches are refused whole.
	err := s.Transact(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
		_, err := tx.UpdateProvided(ctx, "p", []bmdb.ProvidedUpdate{{ProviderID: "m3", Status: "Exploded"}})
		return err
	})
	if err == nil || !strings.Contains(err.Error(), "Exploded") {
		t.Errorf("an update with a bad status: %v", err)
	}
	err = s.Transact(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
		_, err := tx.UpdateProvided(ctx, "p", make([]bmdb.ProvidedUpdate, bmdb.MaxProvidedUpdates+1))
		return err
	})
	if err == nil || !strings.Contains(err.Error(), "at most") {
		t.Errorf("an update of too many machines: %v", err)
	}

	// SetProviderStatus writes only machines whose status changes.
	setStatus := func(status bmdb.ProviderStatus, ids ...string) int64 {
		t.Helper()
		var n int64
		err := s.Transact(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
			var err error
			n, err = tx.SetProviderStatus(ctx, "p", status, ids)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := setStatus(bmdb.ProviderStatusMissing, "m3"); n != 1 {
		t.Fatalf("marking m3 Missing changed %d machines", n)
	}
	missingSince := getProvided(t, db, m3).StatusAt
	if n := setStatus(bmdb.ProviderStatusMissing, "m3"); n != 0 {
		t.Fatalf("marking m3 Missing again changed %d machines, want 0", n)
	}
	if g := getProvided(t, db, m3); !g.StatusAt.Equal(missingSince) {
		t.Errorf("marking m3 Missing again moved its StatusAt from %s to %s", missingSince, g.StatusAt)
	}
}

func TestProviderHasStatusAndConfirmUpdate(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	ctx := t.Context()
	bmdbtest.AddMachine(t, db, s, "p") // Running
	has := func(provider string, statuses ...bmdb.ProviderStatus) bool {
		t.Helper()
		ok, err := db.ProviderHasStatus(ctx, provider, statuses...)
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	if has("p", bmdb.ProviderStatusProvisioning, bmdb.ProviderStatusUnknown) || !has("p", bmdb.ProviderStatusRunning) ||
		has("q", bmdb.ProviderStatusRunning) || has("p") {
		t.Error("ProviderHasStatus does not match the one Running machine of p")
	}

	at, err := db.UpdateConfirmedAt(ctx, "p")
	if err != nil || !at.IsZero() {
		t.Fatalf("UpdateConfirmedAt() of a provider never updated = %v, %v; want the zero time", at, err)
	}
	// Another lease of the provider makes its row; confirming works either way.
	if _, err := s.AcquireProviderLease(ctx, "q"); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"p", "q"} {
		if err := s.Transact(ctx, func(ctx context.Context, tx *bmdb.Tx) error { return tx.ConfirmUpdate(ctx, p) }); err != nil {
			t.Fatal(err)
		}
		if at, err := db.UpdateConfirmedAt(ctx, p); err != nil || time.Since(at).Abs() > time.Minute {
			t.Errorf("UpdateConfirmedAt(%s) after ConfirmUpdate = %v, %v", p, at, err)
		}
	}
}

// TestProvidedPlansAtScale checks that the updater's statements find their
// rows through indexes in a fleet of 100,000 machines: a chunk of updates
// probes the unique (provider, provider_id) index, and the "is anything
// changing" question reads machine_provided_provider_status.
func TestProvidedPlansAtScale(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "p", AwaitingAgent: 100_000})
	rows, err := db.Pool.Query(t.Context(), "SELECT provider_id FROM machine_provided ORDER BY machine_id LIMIT $1", bmdb.MaxProvidedUpdates)
	if err != nil {
		t.Fatal(err)
	}
	var updates []bmdb.ProvidedUpdate
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		i := len(updates)
		updates = append(updates, bmdb.ProvidedUpdate{
			ProviderID: id, Status: bmdb.ProviderStatusRunning, Location: "rack-1",
			Address: netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i)}),
		})
	}
	if err := rows.Err(); err != nil || len(updates) != bmdb.MaxProvidedUpdates {
		t.Fatalf("reading provider ids: %d, %v", len(updates), err)
	}
	plan, err := db.ExplainUpdateProvided(t.Context(), "p", updates)
	if err != nil {
		t.Fatal(err)
	}
	if bad := fullScans(plan); len(bad) > 0 || !strings.Contains(plan, "machine_provided_provider_provider_id_key") {
		t.Errorf("UpdateProvided of %d machines does not probe the unique index (full scans %q):\n%s", len(updates), bad, plan)
	}
	plan, err = db.ExplainProviderHasStatus(t.Context(), "p", bmdb.ProviderStatusProvisioning, bmdb.ProviderStatusUnknown)
	if err != nil {
		t.Fatal(err)
	}
	if bad := fullScans(plan); len(bad) > 0 || !strings.Contains(plan, "machine_provided_provider_status") {
		t.Errorf("ProviderHasStatus does not read machine_provided_provider_status (full scans %q):\n%s", bad, plan)
	}
}

func getProvided(t *testing.T, db *bmdbtest.DB, m uuid.UUID) bmdb.ProvidedMachine {
	t.Helper()
	g, err := db.GetProvided(t.Context(), m)
	if err != nil {
		t.Fatal(fmt.Errorf("reading machine %s: %w", m, err))
	}
	return g
}

// TestListingAcceptanceTakenOnce has sessions of several processes find the
// same suspect listing at once: the operator's acceptance believes one
// listing, so exactly one of them takes it.
func TestListingAcceptanceTakenOnce(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	for _, bad := range []struct {
		provider string
		max      int
		valid    time.Duration
		want     string
	}{
		{"", 1, time.Hour, "provider name is empty"},
		{"lab", 0, time.Hour, "max missing must be between 1"},
		{"lab", 1, 0, "validity must be within"},
		{"lab", 1, 25 * time.Hour, "validity must be within"},
	} {
		if _, err := db.AcceptListing(t.Context(), bad.provider, bad.max, bad.valid, "test"); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("AcceptListing(%q, %d, %s) = %v, want an error containing %q", bad.provider, bad.max, bad.valid, err, bad.want)
		}
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM provider_state"); n != 0 {
		t.Fatalf("refused acceptances left %d provider_state rows", n)
	}

	if _, err := db.AcceptListing(t.Context(), "lab", 5, time.Hour, "alice"); err != nil {
		t.Fatal(err)
	}
	const takers = 4
	results := make(chan bool, takers)
	errs := make(chan error, takers)
	for i := range takers {
		s := bmdbtest.Session(t, db, fmt.Sprintf("updater-%d", i), time.Minute)
		go func() {
			var took bool
			err := s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
				acc, ok, err := tx.TakeListingAcceptance(ctx, "lab", 5)
				if ok && (acc.By != "alice" || acc.MaxMissing != 5) {
					return fmt.Errorf("took %+v", acc)
				}
				took = ok
				return err
			})
			results <- took
			errs <- err
		}()
	}
	taken := 0
	for range takers {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	close(results)
	for ok := range results {
		if ok {
			taken++
		}
	}
	if taken != 1 {
		t.Errorf("%d sessions took the one acceptance, want exactly 1", taken)
	}
}
