package sim_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/provider"
	"github.com/shepherd/shepherd/provider/providertest"
	"github.com/shepherd/shepherd/provider/sim"
)

const contractRebootLatency = 2 * time.Second

func TestContract(t *testing.T) {
	t.Parallel()
	providertest.Run(t, providertest.Harness{
		New: func(t *testing.T) provider.Provider {
			return startFleet(t, sim.Config{Machines: 5, RebootLatency: contractRebootLatency})
		},
		CanReboot: true,
		AfterReboot: func(t *testing.T, p provider.Provider, id string) {
			f := p.(*sim.Fleet)
			at, n := f.Rebooted(id)
			if n != 1 || at.IsZero() {
				t.Fatalf("Rebooted(%s) = %v, %d; want one reboot", id, at, n)
			}
			// The machine is down for RebootLatency from the reboot: a dial
			// now fails unless the test was stalled for that long.
			if _, _, err := dial(t, f, id); err == nil && time.Since(at) < contractRebootLatency {
				t.Errorf("dialing %s right after its reboot succeeded", id)
			} else if err != nil && !errors.Is(err, sim.ErrUnreachable) {
				t.Errorf("dialing %s right after its reboot: %v, want ErrUnreachable", id, err)
			}
			bmdbtest.WaitFor(t, 15*time.Second, "SSH answers again after the reboot", func(context.Context) (bool, error) {
				_, _, err := dial(t, f, id)
				return err == nil, err
			})
			if time.Since(at) < contractRebootLatency {
				t.Errorf("SSH answered %s after the reboot, before RebootLatency %s", time.Since(at), contractRebootLatency)
			}
		},
	})
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name    string
		cfg     sim.Config
		wantErr string
	}{
		{"zero is defaults", sim.Config{}, ""},
		{"full", sim.Config{Name: "sim-2", Machines: 100_000, TakeoverFailureRate: 1, SharedAgentKey: true, Connections: 2}, ""},
		{"negative machines", sim.Config{Machines: -1}, "Machines"},
		{"too many machines", sim.Config{Machines: 1_000_000}, "Machines"},
		{"negative latency", sim.Config{SSHLatency: -time.Second}, "SSHLatency"},
		{"negative reboot latency", sim.Config{RebootLatency: -1}, "RebootLatency"},
		{"rate above 1", sim.Config{SSHFailureRate: 1.5}, "SSHFailureRate"},
		{"negative rate", sim.Config{RebootFailureRate: -0.1}, "RebootFailureRate"},
		{"negative connections", sim.Config{Connections: -1}, "Connections"},
		{"negative concurrency", sim.Config{HeartbeatConcurrency: -1}, "HeartbeatConcurrency"},
		{"bad name", sim.Config{Name: "a b"}, "Name"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.cfg.Validate()
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("Validate() = %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("Validate() = %v, want an error naming %s", err, tt.wantErr)
			}
			if _, err := sim.New(tt.cfg); err == nil {
				t.Error("New accepted the config Validate rejects")
			}
		})
	}
}

func TestParseConfig(t *testing.T) {
	t.Parallel()
	got, err := sim.ParseConfig([]byte(`
name: lab
machines: 1000
ssh_latency: 10ms
takeover_latency: 490ms
reboot_latency: 2s
install_latency: 1m
disk_dir: /var/tmp/sim
max_image_bytes: 1048576
install_concurrency: 3
hang_every: 30s
takeover_failure_rate: 0.1
reboot_failure_rate: 0.2
ssh_failure_rate: 0.05
shared_agent_key: true
connections: 8
heartbeat_concurrency: 32
seed: 42
reboot_command: ipmitool power cycle
`))
	if err != nil {
		t.Fatal(err)
	}
	want := sim.Config{
		Name: "lab", Machines: 1000, SSHLatency: 10 * time.Millisecond, TakeoverLatency: 490 * time.Millisecond,
		RebootLatency: 2 * time.Second, InstallLatency: time.Minute, HangEvery: 30 * time.Second, TakeoverFailureRate: 0.1, RebootFailureRate: 0.2,
		DiskDir: "/var/tmp/sim", MaxImageBytes: 1 << 20, InstallConcurrency: 3,
		SSHFailureRate: 0.05, SharedAgentKey: true, Connections: 8, HeartbeatConcurrency: 32, Seed: 42,
		RebootCommand: "ipmitool power cycle",
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("ParseConfig (-want +got):\n%s", diff)
	}
	if got, err := sim.ParseConfig(nil); err != nil || got != (sim.Config{}) {
		t.Errorf("ParseConfig(empty) = %+v, %v; want defaults", got, err)
	}
	for _, bad := range []string{"machine: 5", "ssh_latency: 10", "machines: -5", "ssh_latency: soon", "machines: [1]", "ssh_failure_rate: 2",
		"disk_dir: relative", "max_image_bytes: -1", "install_concurrency: -1"} {
		if _, err := sim.ParseConfig([]byte(bad)); err == nil {
			t.Errorf("ParseConfig(%q) accepted it", bad)
		}
	}
}

func TestFactory(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	p, err := sim.Factory(t.Context(), provider.Env{Registerer: reg}, []byte("machines: 3\nname: dev"))
	if err != nil {
		t.Fatal(err)
	}
	if p.Name() != "dev" {
		t.Errorf("Name() = %q, want dev", p.Name())
	}
	ms, err := p.ListMachines(t.Context())
	if err != nil || len(ms) != 3 {
		t.Fatalf("ListMachines = %d machines, %v; want 3", len(ms), err)
	}
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, mf := range fams {
		names = append(names, mf.GetName())
	}
	want := []string{"shepherd_sim_agents_running", "shepherd_sim_heartbeats_total", "shepherd_sim_reboots_total", "shepherd_sim_takeovers_total"}
	if diff := cmp.Diff(want, names); diff != "" {
		t.Errorf("metrics (-want +got):\n%s", diff)
	}
	if _, err := sim.Factory(t.Context(), provider.Env{}, []byte("machines: 3\ncolour: blue")); err == nil {
		t.Error("Factory accepted an unknown key")
	}
}

func TestListing(t *testing.T) {
	t.Parallel()
	f := newFleet(t, sim.Config{Machines: 250})
	ms, err := f.ListMachines(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if len(ms) != 250 {
		t.Fatalf("ListMachines returned %d machines, want 250", len(ms))
	}
	addrs := map[string]bool{}
	for n, m := range ms {
		if want := slotID(n + 1); m.ID() != want {
			t.Fatalf("machine %d has id %q, want %q", n, m.ID(), want)
		}
		if _, err := uuid.Parse(m.ID()); err == nil {
			t.Errorf("id %q is a UUID", m.ID())
		}
		if m.Availability() != provider.KnownUnused {
			t.Errorf("%s is %v before any create, want KnownUnused", m.ID(), m.Availability())
		}
		a := m.Addr()
		if !a.Addr().Is4() || a.Addr().As4()[0] != 10 || a.Port() != 22 || addrs[a.String()] {
			t.Errorf("%s has address %v: want a unique 10.x.y.z:22", m.ID(), a)
		}
		addrs[a.String()] = true
		d := m.(provider.Described)
		if d.Status() != provider.StatusRunning || d.ReservationID() != "" {
			t.Errorf("%s: status %q reservation %q", m.ID(), d.Status(), d.ReservationID())
		}
	}
	for n, want := range map[int]string{0: "sim-rack-01", 99: "sim-rack-01", 100: "sim-rack-02", 249: "sim-rack-03"} {
		if got := ms[n].(provider.Described).Location(); got != want {
			t.Errorf("slot %d is in %q, want %q", n+1, got, want)
		}
	}
	for _, id := range []string{"sim-000000", "sim-000251", "sim-1", "sim-00001", "SIM-000001", "sim-0000a1", ""} {
		if _, err := f.GetMachine(t.Context(), id); !errors.Is(err, provider.ErrNotFound) {
			t.Errorf("GetMachine(%q) = %v, want ErrNotFound", id, err)
		}
		if _, err := f.SSHAccess(t.Context(), id); !errors.Is(err, provider.ErrNotFound) {
			t.Errorf("SSHAccess(%q) = %v, want ErrNotFound", id, err)
		}
	}
	create(t, f, slotID(7))
	create(t, f, slotID(7))
	if st := f.Stats(); st.Slots != 250 || st.Used != 1 {
		t.Errorf("Stats() = %+v, want 250 slots, 1 used", st)
	}
	m, err := f.GetMachine(t.Context(), slotID(7))
	if err != nil || m.Availability() != provider.KnownUsed {
		t.Errorf("GetMachine of a created machine: %v, %v; want KnownUsed", m, err)
	}
}

// TestHostKeys checks that host keys are reproducible from the seed, differ
// between machines and fleets, and change with a reinstall.
func TestHostKeys(t *testing.T) {
	t.Parallel()
	a := startFleet(t, sim.Config{Machines: 3, Seed: 7})
	b := newFleet(t, sim.Config{Machines: 3, Seed: 7})
	c := newFleet(t, sim.Config{Machines: 3, Seed: 8})
	key := func(f *sim.Fleet, id string) string {
		k, err := f.HostKey(id)
		if err != nil {
			t.Fatal(err)
		}
		return string(k.Marshal())
	}
	if key(a, slotID(1)) != key(b, slotID(1)) {
		t.Error("the same seed gave different host keys")
	}
	if key(a, slotID(1)) == key(c, slotID(1)) || key(a, slotID(1)) == key(a, slotID(2)) {
		t.Error("host keys repeat across seeds or machines")
	}
	create(t, a, slotID(1))
	_, seen := mustDial(t, a, slotID(1))
	if string(seen.Marshal()) != key(a, slotID(1)) {
		t.Error("the SSH server presented another key than HostKey")
	}
	before := key(a, slotID(1))
	if err := a.ReinstallMachine(t.Context(), slotID(1)); err != nil {
		t.Fatal(err)
	}
	if key(a, slotID(1)) == before {
		t.Error("the host key did not change with the reinstall")
	}
	if _, n := a.Rebooted(slotID(1)); n != 1 {
		t.Errorf("a reinstall counted as %d reboots, want 1", n)
	}
}
