package manager_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/netip"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/logtest"
	"github.com/shepherd/shepherd/internal/metricstest"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/provider"
)

// catalog is a provider whose machines describe themselves and whose
// listing a test edits. It counts listings, and can hold them open to keep
// an updater pass (and its lease) going.
type catalog struct {
	name        string
	undescribed bool // list machines that do not implement provider.Described

	mu       sync.Mutex
	machines map[string]item
	gate     chan struct{} // if set, ListMachines waits for it to close
	entered  chan struct{} // told when a listing waits at the gate

	lists atomic.Int64
}

// item is one machine of a catalog, as the provider describes it.
type item struct {
	id          string
	addr        netip.Addr
	location    string
	reservation string
	status      provider.Status
	failed      bool
}

func (m item) ID() string { return m.id }
func (m item) Addr() netip.AddrPort {
	if !m.addr.IsValid() {
		return netip.AddrPort{}
	}
	return netip.AddrPortFrom(m.addr, 22)
}
func (m item) Availability() provider.Availability { return provider.KnownUsed }
func (m item) Failed() bool                        { return m.failed }
func (m item) Location() string                    { return m.location }
func (m item) ReservationID() string               { return m.reservation }
func (m item) Status() provider.Status             { return m.status }

// bare is an item that does not describe itself.
type bare struct{ m item }

func (b bare) ID() string                          { return b.m.ID() }
func (b bare) Addr() netip.AddrPort                { return b.m.Addr() }
func (b bare) Availability() provider.Availability { return b.m.Availability() }
func (b bare) Failed() bool                        { return b.m.Failed() }

func newCatalog(name string) *catalog {
	return &catalog{name: name, machines: map[string]item{}}
}

func (c *catalog) set(m item) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.machines[m.id] = m
}

func (c *catalog) get(id string) item {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.machines[id]
}

func (c *catalog) remove(ids ...string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, id := range ids {
		delete(c.machines, id)
	}
}

// hold makes the next listings wait until the returned function is called;
// entered receives once per listing that waits.
func (c *catalog) hold() (entered <-chan struct{}, release func()) {
	c.mu.Lock()
	defer c.mu.Unlock()
	gate, in := make(chan struct{}), make(chan struct{}, 16)
	c.gate, c.entered = gate, in
	return in, func() {
		c.mu.Lock()
		c.gate = nil
		c.mu.Unlock()
		close(gate)
	}
}

func (c *catalog) Name() string { return c.name }

func (c *catalog) ListMachines(ctx context.Context) ([]provider.Machine, error) {
	c.lists.Add(1)
	c.mu.Lock()
	gate, entered := c.gate, c.entered
	c.mu.Unlock()
	if gate != nil {
		entered <- struct{}{}
		select {
		case <-gate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]provider.Machine, 0, len(c.machines))
	for _, m := range c.machines {
		if c.undescribed {
			out = append(out, bare{m})
		} else {
			out = append(out, m)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID() < out[j].ID() })
	return out, nil
}

func (c *catalog) GetMachine(_ context.Context, id string) (provider.Machine, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	m, ok := c.machines[id]
	if !ok {
		return nil, fmt.Errorf("machine %s: %w", id, provider.ErrNotFound)
	}
	return m, nil
}

func (c *catalog) CreateMachine(context.Context, provider.CreateRequest) (provider.Machine, error) {
	return nil, provider.ErrUnsupported
}

// record adds the catalog's machines to the BMDB as the provisioner would
// have on creation: Provisioning, no address yet.
func (c *catalog) record(t *testing.T, s *bmdb.Session, ids ...string) {
	t.Helper()
	err := s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		for _, id := range ids {
			if _, err := tx.AddMachine(ctx, bmdb.Provided{Provider: c.name, ProviderID: id, Status: bmdb.ProviderStatusProvisioning}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// provided returns the BMDB's Provided tag of the catalog's machine id.
func provided(t *testing.T, db *bmdbtest.DB, p, id string) bmdb.ProvidedMachine {
	t.Helper()
	m, err := db.MachineByProviderID(t.Context(), p, id)
	if err != nil {
		t.Fatal(err)
	}
	pm, err := db.GetProvided(t.Context(), m)
	if err != nil {
		t.Fatal(err)
	}
	return pm
}

func TestUpdaterPass(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "updater", time.Minute)
	reg := prometheus.NewRegistry()
	p := newCatalog("lab")
	var ids []string
	for i := range 10 {
		id := fmt.Sprintf("m%d", i)
		ids = append(ids, id)
		p.set(item{id: id, status: provider.StatusProvisioning})
	}
	p.record(t, s, ids...)
	// Machines the BMDB does not have are not the updater's business, nor
	// are another provider's.
	p.set(item{id: "capacity", status: provider.StatusRunning})
	other := newCatalog("other")
	other.record(t, s, "m0")

	u, err := manager.NewUpdater(manager.UpdaterConfig{}, db.DB, p, reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	pass := func(what string) manager.UpdateResult {
		t.Helper()
		r, err := u.Pass(t.Context(), s)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		return r
	}
	passes := func(result string) float64 {
		return metricstest.Value(t, reg, "shepherd_updater_passes_total", "result", result)
	}
	machines := func(action string) float64 {
		return metricstest.Value(t, reg, "shepherd_updater_machines_total", "action", action)
	}

	// Nothing changed yet at the provider; the fleet is provisioning.
	if r := pass("first pass"); r.Updated != 0 || r.Listed != 11 || r.Known != 10 || !r.Changing {
		t.Fatalf("first pass %+v, want nothing updated, 11 listed, 10 known, changing", r)
	}

	// Provisioned: every machine is Running with an address, a location and
	// a reservation.
	for i, id := range ids {
		p.set(item{id: id, addr: netip.AddrFrom4([4]byte{192, 0, 2, byte(i)}), location: "rack-1", reservation: "r-" + id, status: provider.StatusRunning})
	}
	if r := pass("pass after provisioning"); r.Updated != 10 || r.Changing {
		t.Fatalf("pass after provisioning %+v, want 10 updated and nothing changing", r)
	}
	if g := provided(t, db, "lab", "m3"); g.Status != bmdb.ProviderStatusRunning || g.Address != netip.MustParseAddr("192.0.2.3") ||
		g.Location != "rack-1" || g.ReservationID != "r-m3" {
		t.Errorf("m3 after provisioning: %+v", g.Provided)
	}
	if g := provided(t, db, "other", "m0"); g.Status != bmdb.ProviderStatusProvisioning {
		t.Errorf("another provider's machine changed: %+v", g.Provided)
	}
	confirmed, err := db.UpdateConfirmedAt(t.Context(), "lab")
	if err != nil || confirmed.IsZero() {
		t.Fatalf("UpdateConfirmedAt after a pass: %v, %v", confirmed, err)
	}

	// Nothing changed: nothing is written.
	m0 := provided(t, db, "lab", "m0").MachineID
	xmin := func() int64 {
		return bmdbtest.Scalar[int64](t, db, "SELECT xmin::text::bigint FROM machine_provided WHERE machine_id = $1", m0)
	}
	x := xmin()
	if r := pass("pass over an unchanged fleet"); r.Updated != 0 || r.MarkedMissing != 0 || r.Found != 0 {
		t.Fatalf("pass over an unchanged fleet %+v, want no changes", r)
	}
	if xmin() != x {
		t.Error("a pass over an unchanged fleet wrote m0")
	}
	if machines("updated") != 10 {
		t.Errorf("updated machines metric %v, want 10", machines("updated"))
	}

	// Each detail on its own is picked up.
	m := p.get("m3")
	m.status = provider.StatusStopped
	p.set(m)
	m = p.get("m4")
	m.addr = netip.MustParseAddr("2001:db8::4")
	p.set(m)
	m = p.get("m5")
	m.reservation = "r-new"
	p.set(m)
	m = p.get("m6")
	m.location = "rack-2"
	p.set(m)
	m = p.get("m7")
	m.failed = true
	p.set(m)
	if r := pass("pass after five changes"); r.Updated != 5 {
		t.Fatalf("pass after five changes %+v, want 5 updated", r)
	}
	for id, want := range map[string]func(bmdb.ProvidedMachine) bool{
		"m3": func(g bmdb.ProvidedMachine) bool { return g.Status == bmdb.ProviderStatusStopped },
		"m4": func(g bmdb.ProvidedMachine) bool { return g.Address == netip.MustParseAddr("2001:db8::4") },
		"m5": func(g bmdb.ProvidedMachine) bool { return g.ReservationID == "r-new" },
		"m6": func(g bmdb.ProvidedMachine) bool { return g.Location == "rack-2" },
		"m7": func(g bmdb.ProvidedMachine) bool { return g.Status == bmdb.ProviderStatusProvisioningFailedPermanent },
	} {
		if g := provided(t, db, "lab", id); !want(g) {
			t.Errorf("%s after its change: %+v", id, g.Provided)
		}
	}

	// Gone from the listing: Missing; listed again: back, with what the
	// listing says.
	p.remove("m9")
	if r := pass("pass with m9 gone"); r.MarkedMissing != 1 || r.Updated != 0 {
		t.Fatalf("pass with m9 gone %+v, want it marked missing", r)
	}
	if g := provided(t, db, "lab", "m9"); g.Status != bmdb.ProviderStatusMissing {
		t.Fatalf("m9 gone has status %q", g.Status)
	}
	p.set(item{id: "m9", addr: netip.MustParseAddr("192.0.2.99"), location: "rack-9", status: provider.StatusRunning})
	if r := pass("pass with m9 back"); r.Found != 1 || r.Updated != 0 {
		t.Fatalf("pass with m9 back %+v, want it found", r)
	}
	if g := provided(t, db, "lab", "m9"); g.Status != bmdb.ProviderStatusRunning || g.Location != "rack-9" || g.Address != netip.MustParseAddr("192.0.2.99") {
		t.Fatalf("m9 back: %+v", g.Provided)
	}
	if machines("missing") != 1 || machines("found") != 1 {
		t.Errorf("missing and found metrics %v and %v, want 1 and 1", machines("missing"), machines("found"))
	}

	// A listing that lacks 4 of 10 machines (more than 20 % and more than 3)
	// is not believed: nothing changes, not even what it says about the
	// machines it has.
	before, err := db.ListProvided(t.Context(), "lab")
	if err != nil {
		t.Fatal(err)
	}
	confirmed, err = db.UpdateConfirmedAt(t.Context(), "lab")
	if err != nil {
		t.Fatal(err)
	}
	saved := []item{p.get("m0"), p.get("m1"), p.get("m2"), p.get("m3")}
	p.remove("m0", "m1", "m2", "m3")
	m = p.get("m8")
	m.status = provider.StatusStopped
	p.set(m)
	if r := pass("pass over a suspect listing"); !r.Suspect || r.MarkedMissing != 0 || r.Updated != 0 {
		t.Fatalf("pass over a suspect listing %+v, want it suspect and nothing changed", r)
	}
	after, err := db.ListProvided(t.Context(), "lab")
	if err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(after) != fmt.Sprint(before) {
		t.Errorf("a suspect listing changed the BMDB:\n%v\n->\n%v", before, after)
	}
	if at, err := db.UpdateConfirmedAt(t.Context(), "lab"); err != nil || !at.Equal(confirmed) {
		t.Errorf("a suspect listing moved UpdateConfirmedAt from %s to %s (%v)", confirmed, at, err)
	}
	if passes("suspect") != 1 || passes("ok") != 6 || passes("busy") != 0 || passes("error") != 0 {
		t.Errorf("passes by result: ok %v, suspect %v, busy %v, error %v; want 6, 1, 0, 0",
			passes("ok"), passes("suspect"), passes("busy"), passes("error"))
	}
	if n := metricstest.Value(t, reg, "shepherd_updater_pass_duration_seconds", "provider", "lab"); n != 7 {
		t.Errorf("pass durations observed: %v, want 7", n)
	}
	suspectGauge := func() float64 {
		return metricstest.Value(t, reg, "shepherd_updater_suspect_listing_missing_machines", "provider", "lab")
	}
	if g := suspectGauge(); g != 4 {
		t.Errorf("suspect listing gauge %v after a listing lacking 4 machines, want 4", g)
	}

	// Once the listing is whole again, the change it held back is applied.
	for _, m := range saved {
		p.set(m)
	}
	if r := pass("pass after the listing recovered"); r.Suspect || r.Updated != 1 {
		t.Fatalf("pass after the listing recovered %+v, want m8 updated", r)
	}
	if g := suspectGauge(); g != 0 {
		t.Errorf("suspect listing gauge %v after a believed listing, want 0", g)
	}

	// A failing listing is an error, counted, and changes nothing.
	bad := &failing{catalog: p}
	ub, err := manager.NewUpdater(manager.UpdaterConfig{}, db.DB, bad, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ub.Pass(t.Context(), s); !errors.Is(err, errListing) {
		t.Errorf("pass over a failing listing: %v, want %v", err, errListing)
	}
}

var errListing = errors.New("listing failed")

// failing is a catalog whose listings fail.
type failing struct{ *catalog }

func (f *failing) ListMachines(context.Context) ([]provider.Machine, error) { return nil, errListing }

// TestUpdaterChanging checks what counts as changing: Provisioning always,
// Unknown only for providers that tell statuses at all.
func TestUpdaterChanging(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "updater", time.Minute)
	for _, tt := range []struct {
		status      provider.Status
		undescribed bool
		want        bool
	}{
		{provider.StatusProvisioning, false, true},
		{provider.StatusUnknown, false, true},
		{provider.StatusRunning, false, false},
		{provider.StatusStopped, false, false},
		// A provider that does not describe its machines leaves them
		// Unknown for good: polling faster would learn nothing.
		{"", true, false},
	} {
		name := fmt.Sprintf("p-%s-%v", tt.status, tt.undescribed)
		p := newCatalog(name)
		p.undescribed = tt.undescribed
		p.set(item{id: "m1", status: tt.status, location: "x"})
		p.record(t, s, "m1")
		u, err := manager.NewUpdater(manager.UpdaterConfig{}, db.DB, p, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		r, err := u.Pass(t.Context(), s)
		if err != nil {
			t.Fatal(err)
		}
		if r.Changing != tt.want {
			t.Errorf("machine %q (undescribed %v): Changing = %v, want %v (status now %q)",
				tt.status, tt.undescribed, r.Changing, tt.want, provided(t, db, name, "m1").Status)
		}
	}
}

// TestUpdaterPeriod runs an updater whose periods are 50ms while changing
// and an hour when stable: it lists again and again while a machine is
// Provisioning, stops once the machine is Running, and starts again when
// a new machine is recorded Provisioning.
func TestUpdaterPeriod(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "setup", time.Minute)
	p := newCatalog("lab")
	p.set(item{id: "m1", status: provider.StatusProvisioning})
	p.record(t, s, "m1")
	const changing, stable = 50 * time.Millisecond, time.Hour
	u, err := manager.NewUpdater(manager.UpdaterConfig{ChangingPeriod: changing, StablePeriod: stable, Lease: 30 * time.Second}, db.DB, p, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var waits []time.Duration
	var listsAtWait []int64
	manager.SetUpdaterWaitHook(u, func(d time.Duration) {
		mu.Lock()
		defer mu.Unlock()
		waits = append(waits, d)
		listsAtWait = append(listsAtWait, p.lists.Load())
	})
	lastWait := func() (time.Duration, int, int64) {
		mu.Lock()
		defer mu.Unlock()
		if len(waits) == 0 {
			return 0, 0, 0
		}
		return waits[len(waits)-1], len(waits), listsAtWait[len(listsAtWait)-1]
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- u.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})

	// With the stable period an hour, five listings within the deadline
	// mean the changing period is in force.
	bmdbtest.WaitFor(t, time.Minute, "five listings while provisioning", func(context.Context) (bool, error) {
		return p.lists.Load() >= 5, nil
	})
	mu.Lock()
	for i, w := range waits {
		if w != changing {
			t.Errorf("wait %d while provisioning: %s, want %s", i, w, changing)
		}
	}
	mu.Unlock()

	p.set(item{id: "m1", addr: netip.MustParseAddr("192.0.2.1"), status: provider.StatusRunning})
	bmdbtest.WaitFor(t, time.Minute, "the stable period after the machine is Running", func(context.Context) (bool, error) {
		w, _, _ := lastWait()
		return w == stable, nil
	})
	if g := provided(t, db, "lab", "m1"); g.Status != bmdb.ProviderStatusRunning {
		t.Fatalf("updater waits the stable period, but m1 is %q", g.Status)
	}
	// Waiting the stable period (at least half an hour, jittered), it
	// lists no more: the pass before the wait was the last.
	_, n, lists := lastWait()
	if got := p.lists.Load(); got != lists || int64(n) != lists {
		t.Errorf("%d listings, %d at the start of the stable wait, %d passes; want them equal", got, lists, n)
	}

	// The provisioner records a new machine, Provisioning: the stable wait
	// ends early, and the updater polls at the changing period again.
	p.set(item{id: "m2", status: provider.StatusProvisioning})
	p.record(t, s, "m2")
	bmdbtest.WaitFor(t, time.Minute, "listings again after a machine started provisioning", func(context.Context) (bool, error) {
		w, _, _ := lastWait()
		return p.lists.Load() >= lists+3 && w == changing, nil
	})
}

// TestUpdaterLease runs two updaters of one provider, as two processes
// would: while one is in its pass, the other's pass is Busy, and the
// provisioner's lease stays free.
func TestUpdaterLease(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	p := newCatalog("lab")
	p.set(item{id: "m1", status: provider.StatusRunning})
	regA, regB := prometheus.NewRegistry(), prometheus.NewRegistry()
	a, err := manager.NewUpdater(manager.UpdaterConfig{}, db.DB, p, regA, nil)
	if err != nil {
		t.Fatal(err)
	}
	b, err := manager.NewUpdater(manager.UpdaterConfig{}, db.DB, p, regB, nil)
	if err != nil {
		t.Fatal(err)
	}
	sa := bmdbtest.Session(t, db, "updater-a", time.Minute)
	sb := bmdbtest.Session(t, db, "updater-b", time.Minute)
	p.record(t, sa, "m1")

	entered, release := p.hold()
	type result struct {
		r   manager.UpdateResult
		err error
	}
	aDone := make(chan result, 1)
	go func() {
		r, err := a.Pass(t.Context(), sa)
		aDone <- result{r, err}
	}()
	select {
	case <-entered:
	case <-time.After(time.Minute):
		release()
		t.Fatal("A's pass never listed")
	}
	// A holds the update lease, waiting for its listing.
	r, err := b.Pass(t.Context(), sb)
	if err != nil || !r.Busy {
		release()
		t.Fatalf("B's pass while A's runs: %+v, %v; want busy", r, err)
	}
	if v := metricstest.Value(t, regB, "shepherd_updater_passes_total", "result", "busy"); v != 1 {
		t.Errorf("B's busy passes: %v, want 1", v)
	}
	held, err := sb.AcquireProviderLease(t.Context(), "lab")
	if err != nil || !held {
		t.Errorf("the provisioning lease is not free while an updater pass runs: %v, %v", held, err)
	}
	release()
	ra := <-aDone
	if ra.err != nil || ra.r.Busy || ra.r.Updated != 1 {
		t.Fatalf("A's pass: %+v, %v; want it to update m1", ra.r, ra.err)
	}
	// A released the lease when its pass ended.
	if r, err := b.Pass(t.Context(), sb); err != nil || r.Busy {
		t.Fatalf("B's pass after A's: %+v, %v", r, err)
	}
}

// TestUpdaterAtScale updates 20,000 machines in one pass: a listing that
// changed every machine's address and location is written in chunks of
// set-based statements, a few dozen transactions in all, and the next pass
// over the unchanged fleet writes nothing.
func TestUpdaterAtScale(t *testing.T) {
	t.Parallel()
	const n = 20_000
	reg := prometheus.NewRegistry()
	db := bmdbtest.NewWithConfig(t, bmdb.Config{Registerer: reg})
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "big", AwaitingAgent: n})
	refs, err := db.ListProvided(t.Context(), "big")
	if err != nil || len(refs) != n {
		t.Fatalf("fleet of %d: %v", len(refs), err)
	}
	p := newCatalog("big")
	for i, r := range refs {
		p.set(item{
			id: r.ProviderID, addr: netip.AddrFrom4([4]byte{10, byte(i >> 16), byte(i >> 8), byte(i)}),
			location: fmt.Sprintf("rack-%03d", i/100), status: provider.StatusRunning,
		})
	}
	u, err := manager.NewUpdater(manager.UpdaterConfig{}, db.DB, p, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	s := bmdbtest.Session(t, db, "updater", time.Minute)
	transactions := func() float64 {
		return metricstest.Value(t, reg, "shepherd_bmdb_transactions_total", "result", "committed")
	}

	before, start := transactions(), time.Now()
	r, err := u.Pass(t.Context(), s)
	if err != nil {
		t.Fatal(err)
	}
	took, txs := time.Since(start), transactions()-before
	t.Logf("pass updating %d machines: %s, %v transactions", r.Updated, took.Round(time.Millisecond), txs)
	if r.Updated != n || r.Listed != n || r.Known != n {
		t.Fatalf("pass %+v, want all %d machines updated", r, n)
	}
	if limit := float64(n/bmdb.MaxProvidedUpdates + 10); txs > limit {
		t.Errorf("the pass took %v transactions, want at most %v: writes are not batched", txs, limit)
	}
	if g := provided(t, db, "big", refs[n-1].ProviderID); g.Location != fmt.Sprintf("rack-%03d", (n-1)/100) || !g.Address.IsValid() {
		t.Errorf("last machine after the pass: %+v", g.Provided)
	}

	const xmins = "SELECT md5(string_agg(xmin::text, ',' ORDER BY machine_id)) FROM machine_provided"
	written := bmdbtest.Scalar[string](t, db, xmins)
	before, start = transactions(), time.Now()
	r, err = u.Pass(t.Context(), s)
	if err != nil {
		t.Fatal(err)
	}
	took, txs = time.Since(start), transactions()-before
	t.Logf("pass over the unchanged fleet of %d machines: %s, %v transactions", n, took.Round(time.Millisecond), txs)
	if r.Updated != 0 {
		t.Errorf("second pass %+v, want nothing updated", r)
	}
	if bmdbtest.Scalar[string](t, db, xmins) != written {
		t.Error("the pass over an unchanged fleet wrote machines")
	}
}

// TestUpdaterLogs: a pass that changed machines says so at Info, a change
// of a machine's status is logged at Info and any other change of its
// details at Debug, and a pass that changed nothing logs at Debug only;
// the updater's lease is given back without a warning.
func TestUpdaterLogs(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "updater", time.Minute)
	p := newCatalog("lab")
	// Recorded Provisioning: m1 is still, but has a location now; m2 runs.
	p.set(item{id: "m1", status: provider.StatusProvisioning, location: "rack-0"})
	p.set(item{id: "m2", status: provider.StatusRunning, location: "rack-1"})
	p.record(t, s, "m1", "m2")
	logs := logtest.New()
	u, err := manager.NewUpdater(manager.UpdaterConfig{}, db.DB, p, nil, logs.Logger())
	if err != nil {
		t.Fatal(err)
	}
	pass := func(what string, wantUpdated int) {
		t.Helper()
		logs.Reset()
		if r, err := u.Pass(t.Context(), s); err != nil || r.Updated != wantUpdated {
			t.Fatalf("%s: %+v, %v; want %d updated", what, r, err, wantUpdated)
		}
	}
	level := func(msg string) []slog.Level {
		var out []slog.Level
		for _, l := range logs.With(msg) {
			out = append(out, l.Level)
		}
		return out
	}
	pass("first pass", 2)
	if got := level("update pass done"); !slices.Equal(got, []slog.Level{slog.LevelInfo}) {
		t.Errorf("pass-done lines of a pass that updated machines at %v, want one at Info", got)
	}
	changed := map[string]slog.Level{}
	for _, l := range logs.With("machine details changed at the provider") {
		changed[l.Attr("provider_id")] = l.Level
	}
	if want := map[string]slog.Level{"m1": slog.LevelDebug, "m2": slog.LevelInfo}; !maps.Equal(changed, want) {
		t.Errorf("machine change lines %v, want m2's change of status at Info and m1's other change at Debug", changed)
	}
	pass("pass over an unchanged fleet", 0)
	if got := level("update pass done"); !slices.Equal(got, []slog.Level{slog.LevelDebug}) {
		t.Errorf("pass-done lines of a pass that changed nothing at %v, want one at Debug", got)
	}
	p.remove("m2")
	pass("pass with m2 gone", 0)
	if got := level("update pass done"); !slices.Equal(got, []slog.Level{slog.LevelInfo}) {
		t.Errorf("pass-done lines of a pass that marked a machine missing at %v, want one at Info", got)
	}
	if got := logs.With("machine missing at the provider"); len(got) != 1 || got[0].Attr("provider_id") != "m2" || got[0].Level != slog.LevelWarn {
		t.Errorf("lines about the missing machine: %+v, want a warning naming m2", got)
	}
	p.set(item{id: "m2", status: provider.StatusRunning, location: "rack-1"})
	pass("pass with m2 back", 0)
	if got := level("update pass done"); !slices.Equal(got, []slog.Level{slog.LevelInfo}) {
		t.Errorf("pass-done lines of a pass that found a machine again at %v, want one at Info", got)
	}
	if got := logs.With("machine listed by the provider again"); len(got) != 1 || got[0].Attr("provider_id") != "m2" || got[0].Attr("provider_status") != "Running" {
		t.Errorf("lines about the machine found again: %+v, want one naming m2 and its status", got)
	}
	if got := logs.With("releasing the update lease"); len(got) != 0 {
		t.Errorf("warnings about releasing the lease: %+v", got)
	}
}

// TestUpdaterEmptyListingDescribesNothing: a listing without machines says
// nothing about whether the provider describes its machines, so machines
// whose status is Unknown still count as changing after it.
func TestUpdaterEmptyListingDescribesNothing(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "updater", time.Minute)
	p := newCatalog("lab")
	var ids []string
	for i := range 5 {
		id := fmt.Sprintf("m%d", i)
		ids = append(ids, id)
		p.set(item{id: id, status: provider.StatusUnknown})
	}
	p.record(t, s, ids...)
	u, err := manager.NewUpdater(manager.UpdaterConfig{}, db.DB, p, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if r, err := u.Pass(t.Context(), s); err != nil || !r.Changing {
		t.Fatalf("pass over machines of Unknown status: %+v, %v; want them changing", r, err)
	}
	// The listing comes back empty, which the guard does not believe: the
	// machines stay Unknown, and still count as changing.
	p.remove(ids...)
	if r, err := u.Pass(t.Context(), s); err != nil || !r.Suspect || !r.Changing {
		t.Errorf("pass over an empty listing: %+v, %v; want it suspect and the Unknown machines changing", r, err)
	}
}

// TestUpdaterRunLogs: an updater whose passes succeed logs no failure; one
// whose listing fails says so at every pass, and keeps passing.
func TestUpdaterRunLogs(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "setup", time.Minute)
	for _, tt := range []struct {
		name  string
		p     provider.Provider
		fails bool
	}{
		{"good", newCatalog("good"), false},
		{"bad", &failing{catalog: newCatalog("bad")}, true},
	} {
		c := newCatalog(tt.name)
		c.record(t, s, "m1") // Provisioning: the changing period applies
		logs := logtest.New()
		u, err := manager.NewUpdater(manager.UpdaterConfig{ChangingPeriod: 20 * time.Millisecond, StablePeriod: 20 * time.Millisecond},
			db.DB, tt.p, nil, logs.Logger())
		if err != nil {
			t.Fatal(err)
		}
		var passes atomic.Int64
		manager.SetUpdaterWaitHook(u, func(time.Duration) { passes.Add(1) })
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- u.Run(ctx) }()
		bmdbtest.WaitFor(t, 60*time.Second, tt.name+": three passes", func(context.Context) (bool, error) { return passes.Load() >= 3, nil })
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("%s: Run() = %v", tt.name, err)
		}
		failed := logs.With("update pass failed")
		switch {
		case !tt.fails && len(failed) != 0:
			t.Errorf("%s: failures logged: %+v", tt.name, failed)
		case tt.fails && (len(failed) < 2 || failed[0].Level != slog.LevelError || !strings.Contains(failed[0].Attr("err"), "listing failed")):
			t.Errorf("%s: failure lines %+v, want one per failed pass, at Error, with the cause", tt.name, failed)
		}
	}
}
