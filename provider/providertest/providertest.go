// Package providertest is the contract every provider meets (SPEC §5.1).
// A provider's own tests call Run with a Harness that builds fresh
// instances of it.
package providertest

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"golang.org/x/sync/errgroup"

	"github.com/shepherd/shepherd/provider"
)

// Harness builds providers for the contract tests.
type Harness struct {
	// New returns a fresh provider with some capacity (KnownUnused or
	// PossiblyUsed machines) and runs its Runner, if any, until the test
	// ends.
	New func(t *testing.T) provider.Provider
	// CanReboot says the provider implements provider.Recoverer; the
	// contract then checks rebooting.
	CanReboot bool
	// AfterReboot, if set, checks that a reboot of machine id really
	// happened (the simulator restarted the machine, the static inventory
	// ran its command). It may poll; it fails t if not.
	AfterReboot func(t *testing.T, p provider.Provider, id string)
}

// Run runs the contract tests as subtests of t.
func Run(t *testing.T, h Harness) {
	t.Run("listing", func(t *testing.T) { testListing(t, h) })
	t.Run("get", func(t *testing.T) { testGet(t, h) })
	t.Run("create", func(t *testing.T) { testCreate(t, h) })
	t.Run("concurrent use", func(t *testing.T) { testConcurrent(t, h) })
	t.Run("reboot", func(t *testing.T) { testReboot(t, h) })
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

func list(t *testing.T, p provider.Provider) []provider.Machine {
	t.Helper()
	ms, err := p.ListMachines(ctx(t))
	if err != nil {
		t.Fatalf("ListMachines: %v", err)
	}
	return ms
}

// capacity returns a machine of the listing that CreateMachine can use.
func capacity(t *testing.T, ms []provider.Machine) provider.Machine {
	t.Helper()
	for _, m := range ms {
		if (m.Availability() == provider.KnownUnused || m.Availability() == provider.PossiblyUsed) && !m.Failed() {
			return m
		}
	}
	t.Fatal("the provider lists no capacity (KnownUnused or PossiblyUsed machine); the harness must give it some")
	return nil
}

func testListing(t *testing.T, h Harness) {
	p := h.New(t)
	if p.Name() == "" {
		t.Error("Name() is empty")
	}
	ms := list(t, p)
	if len(ms) == 0 {
		t.Fatal("ListMachines returned nothing")
	}
	seen := map[string]bool{}
	for _, m := range ms {
		id := m.ID()
		if !provider.ValidID(id) {
			t.Errorf("id %q is not 1-128 bytes", id)
		}
		if seen[id] {
			t.Errorf("id %q listed twice", id)
		}
		seen[id] = true
		switch m.Availability() {
		case provider.PossiblyUsed, provider.KnownUnused, provider.KnownUsed, provider.Foreign:
		default:
			t.Errorf("machine %q has availability %v", id, m.Availability())
		}
		if d, ok := m.(provider.Described); ok {
			switch d.Status() {
			case provider.StatusMissing, provider.StatusProvisioning, provider.StatusProvisioningFailedPermanent,
				provider.StatusRunning, provider.StatusStopped, provider.StatusUnknown:
			default:
				t.Errorf("machine %q has status %q", id, d.Status())
			}
		}
	}
	// Ids are opaque strings: the contract holds for ids that are not UUIDs.
	nonUUID := false
	for id := range seen {
		if _, err := uuid.Parse(id); err != nil {
			nonUUID = true
		}
	}
	if !nonUUID {
		t.Log("every id is a UUID; the harness should exercise non-UUID ids")
	}
}

func testGet(t *testing.T, h Harness) {
	p := h.New(t)
	for _, m := range list(t, p) {
		got, err := p.GetMachine(ctx(t), m.ID())
		if err != nil {
			t.Errorf("GetMachine(%q): %v", m.ID(), err)
			continue
		}
		if got.ID() != m.ID() || got.Availability() != m.Availability() {
			t.Errorf("GetMachine(%q) = %q (%v), listed as %v", m.ID(), got.ID(), got.Availability(), m.Availability())
		}
	}
	for _, id := range []string{"no-such-machine", uuid.NewString(), "x"} {
		if _, err := p.GetMachine(ctx(t), id); !errors.Is(err, provider.ErrNotFound) {
			t.Errorf("GetMachine(%q) of an unknown machine: %v, want ErrNotFound", id, err)
		}
	}
}

func testCreate(t *testing.T, h Harness) {
	p := h.New(t)
	before := list(t, p)
	from := capacity(t, before)
	req := provider.CreateRequest{From: from, Session: uuid.New()}
	m, err := p.CreateMachine(ctx(t), req)
	if err != nil {
		t.Fatalf("CreateMachine(from %q): %v", from.ID(), err)
	}
	if a := m.Availability(); a != provider.KnownUsed && a != provider.PossiblyUsed {
		t.Errorf("created machine %q has availability %v, want it ours", m.ID(), a)
	}
	if !provider.ValidID(m.ID()) {
		t.Errorf("created machine has id %q", m.ID())
	}
	got, err := p.GetMachine(ctx(t), m.ID())
	if err != nil || got.ID() != m.ID() {
		t.Fatalf("GetMachine of the created machine: %v, %v", got, err)
	}
	after := list(t, p)
	found := false
	for _, x := range after {
		if x.ID() == m.ID() {
			found = true
		}
	}
	if !found {
		t.Errorf("created machine %q is not listed", m.ID())
	}
	// A retried request must not make a second machine.
	again, err := p.CreateMachine(ctx(t), req)
	if err == nil && again.ID() != m.ID() {
		t.Errorf("a retried create made machine %q next to %q", again.ID(), m.ID())
	}
	if n, m := ours(after), ours(list(t, p)); m > n {
		t.Errorf("a retried create added %d machines", m-n)
	}
}

func ours(ms []provider.Machine) int {
	n := 0
	for _, m := range ms {
		if m.Availability() == provider.KnownUsed {
			n++
		}
	}
	return n
}

func testConcurrent(t *testing.T, h Harness) {
	p := h.New(t)
	ms := list(t, p)
	var g errgroup.Group
	var mu sync.Mutex
	created := map[string]int{}
	for i := range 8 {
		g.Go(func() error {
			for range 5 {
				if _, err := p.ListMachines(ctx(t)); err != nil {
					return err
				}
				if _, err := p.GetMachine(ctx(t), ms[i%len(ms)].ID()); err != nil {
					return err
				}
			}
			return nil
		})
	}
	// Concurrent creates from the same capacity give at most one machine.
	from := capacity(t, ms)
	for range 4 {
		g.Go(func() error {
			m, err := p.CreateMachine(ctx(t), provider.CreateRequest{From: from, Session: uuid.New()})
			if err == nil {
				mu.Lock()
				created[m.ID()]++
				mu.Unlock()
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	if len(created) > 1 {
		t.Errorf("concurrent creates from one capacity made %d machines: %v", len(created), created)
	}
}

func testReboot(t *testing.T, h Harness) {
	p := h.New(t)
	r, ok := p.(provider.Recoverer)
	if ok != h.CanReboot {
		t.Fatalf("%s implements Recoverer: %v, the harness says %v", p.Name(), ok, h.CanReboot)
	}
	if !ok {
		return // nothing more to check: the provider cannot reboot
	}
	m, err := p.CreateMachine(ctx(t), provider.CreateRequest{From: capacity(t, list(t, p)), Session: uuid.New()})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.RebootMachine(ctx(t), m.ID()); err != nil {
		t.Fatalf("RebootMachine(%q): %v", m.ID(), err)
	}
	if h.AfterReboot != nil {
		h.AfterReboot(t, p, m.ID())
	}
	if err := r.RebootMachine(ctx(t), "no-such-machine"); !errors.Is(err, provider.ErrNotFound) {
		t.Errorf("RebootMachine of an unknown machine: %v, want ErrNotFound", err)
	}
}
