package sim_test

import (
	"errors"
	"testing"
	"time"

	"github.com/shepherd/shepherd/provider"
	"github.com/shepherd/shepherd/provider/sim"
)

// TestReleaseMachine: releasing a machine stops its agent at once, makes it
// unreachable and turns the slot into capacity again; releasing it again
// (or a free slot) changes nothing.
func TestReleaseMachine(t *testing.T) {
	t.Parallel()
	const interval = 100 * time.Millisecond
	e := newEnv(t, interval)
	f := startFleet(t, sim.Config{Machines: 2})
	a, b := slotID(1), slotID(2)
	for _, id := range []string{a, b} {
		create(t, f, id)
		e.takeover(t, f, id, e.addMachine(t, f, id))
		waitHeartbeat(t, f, id, time.Time{}, "first heartbeat of "+id)
	}

	releasedAt := time.Now()
	if err := f.ReleaseMachine(t.Context(), a); err != nil {
		t.Fatalf("ReleaseMachine(%s): %v", a, err)
	}
	// Once b has heartbeated well after the release, a heartbeat of a that
	// was in flight then has ended too.
	waitHeartbeat(t, f, b, releasedAt.Add(2*interval), "b heartbeats after a was released")
	lastA := f.LastHeartbeat(a)
	waitHeartbeat(t, f, b, time.Now().Add(5*interval), "b keeps heartbeating")
	if got := f.LastHeartbeat(a); !got.Equal(lastA) {
		t.Errorf("released machine %s heartbeated at %v (last before: %v)", a, got, lastA)
	}
	if st := f.Stats(); st.AgentsRunning != 1 || st.Used != 1 || st.Releases != 1 {
		t.Errorf("Stats() = %+v, want 1 agent, 1 slot used, 1 release", st)
	}
	m, err := f.GetMachine(t.Context(), a)
	if err != nil || m.Availability() != provider.KnownUnused {
		t.Errorf("released machine: %v, %v; want free capacity (KnownUnused)", m, err)
	}
	if _, _, err := dial(t, f, a); !errors.Is(err, sim.ErrUnreachable) {
		t.Errorf("dialing a released machine: %v, want ErrUnreachable", err)
	}
	if err := f.ReleaseMachine(t.Context(), a); err != nil {
		t.Errorf("releasing %s again: %v, want nil", a, err)
	}
	if err := f.ReleaseMachine(t.Context(), "sim-999999"); !errors.Is(err, provider.ErrNotFound) {
		t.Errorf("releasing an unknown slot: %v, want provider.ErrNotFound", err)
	}
	if st := f.Stats(); st.Releases != 1 {
		t.Errorf("Stats().Releases = %d after releasing a free slot, want still 1", st.Releases)
	}
}
