package manager_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sort"
	"strings"
	"sync"
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

func TestMain(m *testing.M) { bmdbtest.Main(m) }

// scripted is a provider whose listing a test edits directly, to put the
// provisioner in situations real providers reach only by accident
// (lost listings, orphans, foreign machines).
type scripted struct {
	mu       sync.Mutex
	name     string
	machines map[string]*scriptedMachine
	failOn   map[string]error // CreateMachine from this id fails
}

type scriptedMachine struct {
	id     string
	avail  provider.Availability
	failed bool
}

func (m scriptedMachine) ID() string                          { return m.id }
func (m scriptedMachine) Addr() netip.AddrPort                { return netip.MustParseAddrPort("192.0.2.1:22") }
func (m scriptedMachine) Availability() provider.Availability { return m.avail }
func (m scriptedMachine) Failed() bool                        { return m.failed }
func (m scriptedMachine) Location() string                    { return "lab/" + m.id }
func (m scriptedMachine) ReservationID() string               { return "" }
func (m scriptedMachine) Status() provider.Status             { return provider.StatusRunning }

func newScripted(name string) *scripted {
	return &scripted{name: name, machines: map[string]*scriptedMachine{}, failOn: map[string]error{}}
}

func (s *scripted) set(id string, a provider.Availability) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.machines[id] = &scriptedMachine{id: id, avail: a}
}

func (s *scripted) remove(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.machines, id)
}

func (s *scripted) Name() string { return s.name }

func (s *scripted) ListMachines(context.Context) ([]provider.Machine, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []provider.Machine
	for _, m := range s.machines {
		out = append(out, *m)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID() < out[j].ID() })
	return out, nil
}

func (s *scripted) GetMachine(_ context.Context, id string) (provider.Machine, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	m, ok := s.machines[id]
	if !ok {
		return nil, fmt.Errorf("machine %s: %w", id, provider.ErrNotFound)
	}
	return *m, nil
}

func (s *scripted) CreateMachine(_ context.Context, req provider.CreateRequest) (provider.Machine, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.failOn[req.From.ID()]; err != nil {
		return nil, err
	}
	m, ok := s.machines[req.From.ID()]
	if !ok {
		return nil, provider.ErrNotFound
	}
	m.avail = provider.KnownUsed
	return *m, nil
}

// ourIDs lists the provider ids the BMDB has for p, with their status.
func ourIDs(t *testing.T, db *bmdbtest.DB, p string) map[string]bmdb.ProviderStatus {
	t.Helper()
	refs, err := db.ListProvided(t.Context(), p)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bmdb.ProviderStatus{}
	for _, r := range refs {
		out[r.ProviderID] = r.Status
	}
	return out
}

func TestProvisionerPass(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	p := newScripted("lab")
	for i := range 8 {
		p.set(fmt.Sprintf("cap-%d", i), provider.KnownUnused)
	}
	p.set("foreign-1", provider.Foreign)
	p.set("broken", provider.KnownUnused)
	p.machines["broken"].failed = true
	p.failOn["cap-7"] = errors.New("out of stock")

	pr, err := manager.NewProvisioner(manager.ProvisionerConfig{ChunkSize: 3, MaxMachines: 6}, db.DB, p, prometheus.NewRegistry(), nil)
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

	// Chunks of 3, up to 6 machines; failed capacity and foreign machines
	// are left alone.
	if r := pass(); r.Created != 3 || r.Foreign != 1 {
		t.Fatalf("first pass %+v, want 3 created and 1 foreign", r)
	}
	if r := pass(); r.Created != 3 {
		t.Fatalf("second pass %+v, want 3 created", r)
	}
	if r := pass(); r.Created != 0 {
		t.Fatalf("third pass %+v, want nothing created at MaxMachines", r)
	}
	ids := ourIDs(t, db, "lab")
	if len(ids) != 6 || ids["broken"] != "" || ids["foreign-1"] != "" {
		t.Fatalf("BMDB machines %v", ids)
	}
	for id := range ids {
		m, err := p.GetMachine(t.Context(), id)
		if err != nil || m.Availability() != provider.KnownUsed {
			t.Errorf("machine %s recorded but not created at the provider (%v)", id, err)
		}
	}

	// An orphan (created at the provider, never recorded: a crash in
	// between) is adopted even at MaxMachines.
	p.set("orphan", provider.KnownUsed)
	if r := pass(); r.Adopted != 1 {
		t.Fatalf("pass with an orphan %+v, want it adopted", r)
	}
	if _, ok := ourIDs(t, db, "lab")["orphan"]; !ok {
		t.Fatal("orphan not in the BMDB")
	}

	// One machine gone at the provider: Missing, and back when it returns.
	var gone string
	for id := range ids {
		gone = id
		break
	}
	p.remove(gone)
	if r := pass(); r.MarkedMissing != 1 {
		t.Fatalf("pass with a machine gone %+v, want 1 marked missing", r)
	}
	if st := ourIDs(t, db, "lab")[gone]; st != bmdb.ProviderStatusMissing {
		t.Fatalf("gone machine has status %q", st)
	}
	p.set(gone, provider.KnownUsed)
	if r := pass(); r.Found != 1 {
		t.Fatalf("pass with the machine back %+v, want it found", r)
	}
	if st := ourIDs(t, db, "lab")[gone]; st != bmdb.ProviderStatusRunning {
		t.Fatalf("returned machine has status %q", st)
	}

	// A listing without most of the fleet is not believed.
	before := ourIDs(t, db, "lab")
	for id := range before {
		p.remove(id)
	}
	if r := pass(); !r.Suspect {
		t.Fatalf("pass over an implausible listing %+v, want it suspect", r)
	}
	if after := ourIDs(t, db, "lab"); fmt.Sprint(after) != fmt.Sprint(before) {
		t.Fatalf("a suspect listing changed the BMDB: %v -> %v", before, after)
	}
}

func TestProvisionerLease(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	p := newScripted("lab")
	p.set("cap-1", provider.KnownUnused)
	pr, err := manager.NewProvisioner(manager.ProvisionerConfig{}, db.DB, p, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	a := bmdbtest.Session(t, db, "provisioner-a", time.Minute)
	b := bmdbtest.Session(t, db, "provisioner-b", time.Minute)
	held, err := a.AcquireProviderLease(t.Context(), "lab")
	if err != nil || !held {
		t.Fatalf("A could not take a free lease: %v", err)
	}
	if r, err := pr.Pass(t.Context(), b); err != nil || !r.Busy {
		t.Fatalf("B's pass while A holds the lease: %+v, %v; want busy", r, err)
	}
	if err := a.ReleaseProviderLease(t.Context(), "lab"); err != nil {
		t.Fatal(err)
	}
	if r, err := pr.Pass(t.Context(), b); err != nil || r.Busy || r.Created != 1 {
		t.Fatalf("B's pass after A released: %+v, %v", r, err)
	}
	// A lease held by a dead session is free.
	held, err = a.AcquireProviderLease(t.Context(), "lab")
	if err != nil || !held {
		t.Fatalf("A could not take the lease B released after its pass: %v", err)
	}
	db.Exec(t, "UPDATE sessions SET deadline = now() - interval '1 second' WHERE session_id = $1", a.ID())
	if held, err := b.AcquireProviderLease(t.Context(), "lab"); err != nil || !held {
		t.Fatalf("B could not take the lease of a dead session: %v", err)
	}
}

// TestProvisionerLimits: MaxMachines counts the machines the BMDB has and
// those a pass adopts, so a pass creates only what is left; a failed
// creation is counted and the pass goes on with the next capacity; the
// missing-machines gauge counts the BMDB's machines that are Missing after
// the pass.
func TestProvisionerLimits(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	p := newScripted("lab")
	for i := range 6 {
		p.set(fmt.Sprintf("cap-%d", i), provider.KnownUnused)
	}
	p.failOn["cap-0"] = errors.New("out of stock")
	reg := prometheus.NewRegistry()
	pr, err := manager.NewProvisioner(manager.ProvisionerConfig{ChunkSize: 10, MaxMachines: 4}, db.DB, p, reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	s := bmdbtest.Session(t, db, "provisioner", time.Minute)
	pass := func(what string) manager.PassResult {
		t.Helper()
		r, err := pr.Pass(t.Context(), s)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		return r
	}
	// cap-0 fails; cap-1 and cap-2 are created (the limit is 4, and two
	// orphans are adopted first).
	p.set("orphan-1", provider.KnownUsed)
	p.set("orphan-2", provider.KnownUsed)
	if r := pass("first pass"); r.Adopted != 2 || r.Created != 2 || r.FailedCreates != 1 {
		t.Fatalf("first pass %+v, want 2 adopted, cap-0 failed and 2 created", r)
	}
	if got := ourIDs(t, db, "lab"); len(got) != 4 {
		t.Fatalf("BMDB machines %v, want 4", got)
	}
	if r := pass("pass at the limit"); r.Created != 0 || r.FailedCreates != 0 {
		t.Fatalf("pass at the limit %+v, want nothing tried", r)
	}
	missing := func() float64 {
		return metricstest.Value(t, reg, "shepherd_provisioner_missing_machines", "provider", "lab")
	}
	if got := missing(); got != 0 {
		t.Errorf("missing machines gauge %v, want 0", got)
	}
	p.remove("orphan-1")
	if r := pass("pass without orphan-1"); r.MarkedMissing != 1 {
		t.Fatalf("pass without orphan-1 %+v, want it marked missing", r)
	}
	if got := missing(); got != 1 {
		t.Errorf("missing machines gauge %v after one went, want 1", got)
	}
	p.remove("orphan-2")
	if r := pass("pass without orphan-2"); r.MarkedMissing != 1 {
		t.Fatalf("pass without orphan-2 %+v, want it marked missing", r)
	}
	if got := missing(); got != 2 {
		t.Errorf("missing machines gauge %v after two went, want 2", got)
	}
	p.set("orphan-1", provider.KnownUsed)
	if r := pass("pass with orphan-1 back"); r.Found != 1 {
		t.Fatalf("pass with orphan-1 back %+v, want it found", r)
	}
	if got := missing(); got != 1 {
		t.Errorf("missing machines gauge %v after one came back, want 1", got)
	}
	if n, got := metricstest.Series(t, reg, "shepherd_provisioner_foreign_machines", "provider", "lab"), metricstest.Value(t, reg, "shepherd_provisioner_foreign_machines", "provider", "lab"); n != 1 || got != 0 {
		t.Errorf("foreign machines gauge %v (%d series), want one reading 0", got, n)
	}
	for action, want := range map[string]float64{"created": 2, "adopted": 2, "missing": 2, "found": 1} {
		if got := metricstest.Value(t, reg, "shepherd_provisioner_machines_total", "action", action); got != want {
			t.Errorf("machines %s: %v, want %v", action, got, want)
		}
	}
}

// duplicating is a scripted provider whose creations return a machine the
// BMDB has already.
type duplicating struct {
	*scripted
	id string
}

func (d duplicating) CreateMachine(context.Context, provider.CreateRequest) (provider.Machine, error) {
	return scriptedMachine{id: d.id, avail: provider.KnownUsed}, nil
}

// TestProvisionerRecordFails: a machine the provider created that cannot be
// recorded ends the pass with the error (the next pass adopts it).
func TestProvisionerRecordFails(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	p := newScripted("lab")
	p.set("a", provider.KnownUsed)
	p.set("cap", provider.KnownUnused)
	s := bmdbtest.Session(t, db, "provisioner", time.Minute)
	pr, err := manager.NewProvisioner(manager.ProvisionerConfig{}, db.DB, duplicating{p, "a"}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	// The first pass adopts a; creating from cap then returns a again.
	r, err := pr.Pass(t.Context(), s)
	if err == nil || r.Adopted != 1 || r.Created != 0 {
		t.Errorf("pass whose creation cannot be recorded: %+v, %v; want a adopted and an error", r, err)
	}
}

// TestProvisionerRun: the provisioner passes every Period, holding its
// session, creating what capacity its chunks allow, and logs no failure
// while its passes succeed; a failing listing is logged at every pass. It
// gives its lease back without a warning.
func TestProvisionerRun(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	for _, tt := range []struct {
		name  string
		fails bool
	}{{"good", false}, {"bad", true}} {
		p := newScripted(tt.name)
		for i := range 3 {
			p.set(fmt.Sprintf("cap-%d", i), provider.KnownUnused)
		}
		var prov provider.Provider = p
		if tt.fails {
			prov = unlistable{p}
		}
		logs := logtest.New()
		reg := prometheus.NewRegistry()
		pr, err := manager.NewProvisioner(manager.ProvisionerConfig{Period: 20 * time.Millisecond, ChunkSize: 1, Lease: 30 * time.Second},
			db.DB, prov, reg, logs.Logger())
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(t.Context())
		done := make(chan error, 1)
		go func() { done <- pr.Run(ctx) }()
		passes := func(result string) float64 {
			return metricstest.Value(t, reg, "shepherd_provisioner_passes_total", "result", result)
		}
		if tt.fails {
			bmdbtest.WaitFor(t, 60*time.Second, "two failed passes, logged", func(context.Context) (bool, error) {
				return passes("error") >= 2 && len(logs.With("reconcile pass failed")) >= 2, nil
			})
		} else {
			bmdbtest.WaitFor(t, 60*time.Second, "every capacity created, a chunk at a time", func(context.Context) (bool, error) {
				return len(ourIDs(t, db, tt.name)) == 3 && passes("ok") >= 4, nil
			})
			if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM sessions WHERE component = 'provisioner' AND closed_at IS NULL"); n != 1 {
				t.Errorf("%d open provisioner sessions while it runs, want 1", n)
			}
		}
		cancel()
		if err := <-done; err != nil {
			t.Fatalf("%s: Run() = %v", tt.name, err)
		}
		failed := logs.With("reconcile pass failed")
		switch {
		case !tt.fails && len(failed) != 0:
			t.Errorf("%s: failures logged: %+v", tt.name, failed)
		case tt.fails && (len(failed) < 2 || failed[0].Level != slog.LevelError || !strings.Contains(failed[0].Attr("err"), "inventory unreadable")):
			t.Errorf("%s: failure lines %+v, want one per failed pass with the cause", tt.name, failed)
		}
		if got := logs.With("releasing the provisioning lease"); len(got) != 0 {
			t.Errorf("%s: warnings about releasing the lease: %+v", tt.name, got)
		}
	}
}

// unlistable is a scripted provider whose listing fails.
type unlistable struct{ *scripted }

func (unlistable) ListMachines(context.Context) ([]provider.Machine, error) {
	return nil, errors.New("inventory unreadable")
}
