package equinix_test

import (
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/provider"
	"github.com/shepherd/shepherd/provider/equinix"
	"github.com/shepherd/shepherd/provider/equinix/fakemetal"
	"github.com/shepherd/shepherd/provider/equinix/metal"
)

// TestReleaseMachine: releasing a device of ours deletes it and makes its
// reservation capacity again; releasing it again reports it gone; a
// foreign device is never deleted.
func TestReleaseMachine(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureConfig{reservations: 1, fake: fakemetal.Config{ProvisionDelay: 10 * time.Millisecond}})
	foreign := f.fake.AddDevice(project, fakemetal.DeviceSpec{Hostname: "db-primary", State: "active"})
	ms, err := f.p.ListMachines(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	var capacity provider.Machine
	for _, m := range ms {
		if m.Availability() == provider.KnownUnused {
			capacity = m
		}
	}
	if capacity == nil {
		t.Fatal("no capacity listed")
	}
	m, err := f.p.CreateMachine(t.Context(), provider.CreateRequest{From: capacity, Session: uuid.New()})
	if err != nil {
		t.Fatal(err)
	}
	if err := f.p.ReleaseMachine(t.Context(), m.ID()); err != nil {
		t.Fatalf("ReleaseMachine(%s): %v", m.ID(), err)
	}
	if _, ok := f.fake.Device(m.ID()); ok {
		t.Errorf("device %s still exists after ReleaseMachine", m.ID())
	}
	ms, err = f.p.ListMachines(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	free := false
	for _, l := range ms {
		if l.ID() == capacity.ID() && l.Availability() == provider.KnownUnused {
			free = true
		}
	}
	if !free {
		t.Errorf("reservation %s is not capacity again after its device was released", capacity.ID())
	}
	if err := f.p.ReleaseMachine(t.Context(), m.ID()); !errors.Is(err, provider.ErrNotFound) {
		t.Errorf("releasing %s again: %v, want an error wrapping provider.ErrNotFound", m.ID(), err)
	}
	if err := f.p.ReleaseMachine(t.Context(), foreign); err == nil || errors.Is(err, provider.ErrNotFound) {
		t.Errorf("releasing the foreign device: %v, want a refusal", err)
	}
	if d, ok := f.fake.Device(foreign); !ok || d.State != "active" {
		t.Errorf("the foreign device changed: %+v (exists: %v)", d, ok)
	}
}

func TestConfigOurs(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		prefix, hostname string
		want             bool
	}{
		{"", "shepherd-1a2b3c4d", true},
		{"", "db-1", false},
		{"", "Shepherd-1a2b3c4d", false},
		{"lab-", "lab-1a2b3c4d", true},
		{"lab-", "shepherd-1a2b3c4d", false},
	} {
		c := equinix.Config{Prefix: tt.prefix}
		if got := c.Ours(metal.Device{Hostname: tt.hostname}); got != tt.want {
			t.Errorf("Config{Prefix: %q}.Ours(%q) = %v, want %v", tt.prefix, tt.hostname, got, tt.want)
		}
	}
}
