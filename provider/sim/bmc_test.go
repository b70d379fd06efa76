package sim_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/uuid"
	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/power"
	"github.com/shepherd/shepherd/provider"
	"github.com/shepherd/shepherd/provider/sim"
)

// The tests whose timing matters run in a synctest bubble: the fleet and
// the power.Controller both read Go's clock, so pacing, transitions and
// call timeouts are checked to the second without waiting for them.

func TestBMCConfigValidate(t *testing.T) {
	t.Parallel()
	one := []string{slotID(1)}
	tests := []struct {
		name    string
		bmc     sim.BMCConfig
		wantErr string
	}{
		{"every machine", sim.BMCConfig{Fraction: 1}, ""},
		{"named machines with faults", sim.BMCConfig{Machines: []string{slotID(1), slotID(50)}, Transition: time.Second,
			Power: power.Config{MinInterval: time.Second, Attempts: 5},
			Busy:  sim.BMCFault{Machines: one, For: time.Minute}, Auth: sim.BMCFault{Fraction: 0.1},
			RefuseOn: sim.BMCFault{Machines: []string{slotID(50)}, For: time.Second}}, ""},
		{"fault on a machine the fraction picked", sim.BMCConfig{Fraction: 1, Hung: sim.BMCFault{Machines: []string{slotID(7)}}}, ""},
		{"no machine gets one", sim.BMCConfig{Transition: time.Second}, "gives no machine a BMC"},
		{"fraction above 1", sim.BMCConfig{Fraction: 1.5}, "BMC.Fraction must be between 0 and 1, got 1.5"},
		{"machine beyond the fleet", sim.BMCConfig{Machines: []string{slotID(51)}}, `BMC.Machines: "sim-000051" is not a machine of the fleet (sim-000001 to sim-000050)`},
		{"not a slot id", sim.BMCConfig{Machines: []string{"node-1"}}, `BMC.Machines: "node-1" is not a machine`},
		{"machine twice", sim.BMCConfig{Machines: []string{slotID(2), slotID(2)}}, "BMC.Machines: sim-000002 given twice"},
		{"negative transition", sim.BMCConfig{Fraction: 1, Transition: -time.Second}, "BMC.Transition must be >= 0"},
		{"bad pacing", sim.BMCConfig{Fraction: 1, Power: power.Config{Attempts: -1}}, "BMC.Power: power attempts -1"},
		{"fault fraction", sim.BMCConfig{Fraction: 1, Busy: sim.BMCFault{Fraction: -0.5}}, "BMC.Busy.Fraction must be between 0 and 1"},
		{"fault on a machine without a BMC", sim.BMCConfig{Machines: one, Auth: sim.BMCFault{Machines: []string{slotID(2)}}},
			"BMC.Auth.Machines: sim-000002 has no BMC"},
		{"fault on an unknown machine", sim.BMCConfig{Fraction: 1, Drop: sim.BMCFault{Machines: []string{"sim-1"}}}, `BMC.Drop.Machines: "sim-1" is not a machine`},
		{"For on a lasting fault", sim.BMCConfig{Fraction: 1, Hung: sim.BMCFault{Fraction: 1, For: time.Second}}, "BMC.Hung.For is only for Busy and RefuseOn"},
		{"negative For", sim.BMCConfig{Fraction: 1, RefuseOn: sim.BMCFault{Fraction: 1, For: -time.Second}}, "BMC.RefuseOn.For must be >= 0"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := sim.Config{BMC: &tt.bmc}
			err := cfg.Validate()
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("Validate() = %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.HasPrefix(err.Error(), "sim: ") || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("Validate() = %v, want an error starting with %q and saying %q", err, "sim: ", tt.wantErr)
			}
			if _, err := sim.New(cfg); err == nil {
				t.Error("New accepted the config Validate rejects")
			}
		})
	}
}

func TestParseConfigBMC(t *testing.T) {
	t.Parallel()
	got, err := sim.ParseConfig([]byte(`
machines: 200
bmc_fraction: 0.5
bmc_machines: [sim-000001, sim-000002]
bmc_transition: 3s
bmc_min_interval: 2s
bmc_call_timeout: 10s
bmc_settle: 20s
bmc_attempts: 4
bmc_busy_fraction: 0.1
bmc_busy_machines: [sim-000001]
bmc_busy_for: 7s
bmc_auth_fraction: 0.01
bmc_auth_machines: [sim-000002]
bmc_hung_fraction: 0.02
bmc_hung_machines: [sim-000001]
bmc_drop_fraction: 0.03
bmc_drop_machines: [sim-000002]
bmc_refuse_on_fraction: 0.04
bmc_refuse_on_machines: [sim-000001]
bmc_refuse_on_for: 15s
`))
	if err != nil {
		t.Fatal(err)
	}
	one, two := []string{slotID(1)}, []string{slotID(2)}
	want := sim.Config{Machines: 200, BMC: &sim.BMCConfig{
		Fraction: 0.5, Machines: []string{slotID(1), slotID(2)}, Transition: 3 * time.Second,
		Power:    power.Config{MinInterval: 2 * time.Second, CallTimeout: 10 * time.Second, Settle: 20 * time.Second, Attempts: 4},
		Busy:     sim.BMCFault{Fraction: 0.1, Machines: one, For: 7 * time.Second},
		Auth:     sim.BMCFault{Fraction: 0.01, Machines: two},
		Hung:     sim.BMCFault{Fraction: 0.02, Machines: one},
		Drop:     sim.BMCFault{Fraction: 0.03, Machines: two},
		RefuseOn: sim.BMCFault{Fraction: 0.04, Machines: one, For: 15 * time.Second},
	}}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("ParseConfig (-want +got):\n%s", diff)
	}
	if got, err := sim.ParseConfig([]byte("machines: 5")); err != nil || got.BMC != nil {
		t.Errorf("ParseConfig without bmc_ keys = %+v, %v; want no BMCs", got, err)
	}
	for bad, why := range map[string]string{
		"bmc_min_interval: 2s":                  "gives no machine a BMC",
		"bmc_machines: []":                      "gives no machine a BMC",
		"bmc_fraction: 2":                       "BMC.Fraction",
		"bmc_fraction: 1\nbmc_transition: 5":    "",
		"bmc_machines: sim-000001":              "",
		"bmc_fraction: 1\nbmc_auth_for: 5s":     "bmc_auth_for",
		"bmc_fraction: 1\nbmc_hung_fraction: x": "",
	} {
		_, err := sim.ParseConfig([]byte(bad))
		if err == nil || !strings.Contains(err.Error(), why) {
			t.Errorf("ParseConfig(%q) = %v, want an error saying %q", bad, err, why)
		}
	}
}

func TestBMCLookup(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	none := newFleet(t, sim.Config{Machines: 2})
	if _, err := none.BMC(ctx, slotID(1)); !errors.Is(err, provider.ErrNoBMC) {
		t.Errorf("BMC of a fleet without BMCs: %v, want ErrNoBMC", err)
	}
	for _, id := range []string{"sim-000003", "sim-1", ""} {
		if _, err := none.BMC(ctx, id); !errors.Is(err, provider.ErrNotFound) || errors.Is(err, provider.ErrNoBMC) {
			t.Errorf("BMC(%q): %v, want ErrNotFound only", id, err)
		}
	}

	f := newFleet(t, sim.Config{Machines: 2, BMC: &sim.BMCConfig{Machines: []string{slotID(2)}}})
	if _, err := f.BMC(ctx, slotID(1)); !errors.Is(err, provider.ErrNoBMC) || !strings.Contains(err.Error(), slotID(1)) {
		t.Errorf("BMC of a machine without one: %v, want ErrNoBMC naming it", err)
	}
	b1, err := f.BMC(ctx, slotID(2))
	if err != nil {
		t.Fatal(err)
	}
	if b1.Name != "sim-bmc sim-000002" || b1.Controller == nil {
		t.Errorf("BMC(%s) = %+v, want Name sim-bmc sim-000002 and a controller", slotID(2), b1)
	}
	if b2, err := f.BMC(ctx, slotID(2)); err != nil || b2.Controller != b1.Controller {
		t.Errorf("BMC asked for twice: %p then %p (%v), want one controller, so its pacing holds", b1.Controller, b2.Controller, err)
	}
	canceled, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := f.BMC(canceled, slotID(2)); !errors.Is(err, context.Canceled) {
		t.Errorf("BMC with a canceled context: %v", err)
	}
	if n := f.BMCCalls(slotID(2)); n != 0 {
		t.Errorf("BMCCalls before any call = %d", n)
	}

	// A fraction picks about that share, the same with the same seed.
	cfg := sim.Config{Machines: 1000, Seed: 7, BMC: &sim.BMCConfig{Fraction: 0.5}}
	a, b := newFleet(t, cfg), newFleet(t, cfg)
	with := 0
	for n := 1; n <= 1000; n++ {
		_, errA := a.BMC(ctx, slotID(n))
		_, errB := b.BMC(ctx, slotID(n))
		if (errA == nil) != (errB == nil) {
			t.Fatalf("two fleets of one seed disagree on %s: %v and %v", slotID(n), errA, errB)
		}
		if errA == nil {
			with++
		} else if !errors.Is(errA, provider.ErrNoBMC) {
			t.Fatalf("BMC(%s): %v", slotID(n), errA)
		}
	}
	if with < 400 || with > 600 {
		t.Errorf("BMC.Fraction 0.5 gave %d of 1000 machines a BMC", with)
	}
}

// TestBMCPowerTransitions follows one machine through Off and On at the
// controller's pace: the machine goes down with Off at once, the BMC
// shows each state only after Transition, and the machine answers SSH
// again, with its host key and without an agent, once it booted.
func TestBMCPowerTransitions(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		ctx := t.Context()
		rec := &recorder{}
		f := newFleet(t, sim.Config{Machines: 1, RebootLatency: time.Second, Observer: rec,
			BMC: &sim.BMCConfig{Fraction: 1, Transition: 7 * time.Second}})
		id := slotID(1)
		if err := f.Provision(id); err != nil {
			t.Fatal(err)
		}
		key := hostKey(t, f, id)
		bmc, err := f.BMC(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		at := func(want time.Duration, what string) {
			t.Helper()
			if got := time.Since(start); got != want {
				t.Fatalf("%s at %s, want %s", what, got, want)
			}
		}
		state := func(want power.State, wantAt time.Duration) {
			t.Helper()
			got, err := bmc.State(ctx)
			if err != nil || got != want {
				t.Fatalf("State() = %q, %v; want %q", got, err, want)
			}
			at(wantAt, "state "+string(want))
		}
		reachable := func(want bool) {
			t.Helper()
			_, got, err := dial(t, f, id)
			switch {
			case want && err != nil:
				t.Fatalf("dialing at %s: %v, want it to answer", time.Since(start), err)
			case want && !keysEqual(got, key):
				t.Fatalf("the machine came back with host key %v, want %v", got, key)
			case !want && !errors.Is(err, sim.ErrUnreachable):
				t.Fatalf("dialing at %s: %v, want ErrUnreachable", time.Since(start), err)
			}
		}

		if err := bmc.Off(ctx); err != nil {
			t.Fatal(err)
		}
		at(0, "Off")
		reachable(false)
		if st := status(t, f, id); st != provider.StatusStopped {
			t.Errorf("status of a powered off machine: %s, want Stopped", st)
		}
		state(power.On, 5*time.Second) // the pace is 5 s, the transition 7 s
		state(power.Off, 10*time.Second)
		if err := bmc.On(ctx); err != nil {
			t.Fatal(err)
		}
		at(15*time.Second, "On")
		reachable(false)
		state(power.Off, 20*time.Second) // powering on counts as off
		time.Sleep(2 * time.Second)      // moves the bubble's clock: on at 22 s
		reachable(false)                 // and booting for RebootLatency
		time.Sleep(time.Second)
		reachable(true)
		state(power.On, 25*time.Second)
		if err := bmc.On(ctx); err != nil {
			t.Errorf("On of a machine that is on: %v, want nil", err)
		}
		if st := status(t, f, id); st != provider.StatusRunning {
			t.Errorf("status of a powered on machine: %s, want Running", st)
		}

		st := f.Stats()
		if st.PowerOffs != 1 || st.PowerOns != 1 || st.Reboots != 1 {
			t.Errorf("Stats() = %+v, want one power off, one power on, counted as a reboot", st)
		}
		if when, n := f.Rebooted(id); n != 1 || !when.Equal(start.Add(15*time.Second)) {
			t.Errorf("Rebooted = %v, %d; want once, at the power on", when.Sub(start), n)
		}
		if r := rec.reboots(); len(r) != 1 || r[0].id != id {
			t.Errorf("the observer saw reboots %v, want the power on of %s", r, id)
		}
		if n := f.BMCCalls(id); n != 7 {
			t.Errorf("BMCCalls = %d, want 7", n)
		}
	})
}

// TestHangPowerCycle hangs machines with agents and brings them back with
// a power cycle of each through its BMC, all at once: while hung, their
// agents are silent, SSH fails at once and in-band reboots cannot reach
// them; after the cycle SSH answers with the same host key and no agent
// runs until a takeover.
func TestHangPowerCycle(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		ctx := t.Context()
		// Adopted agents exist without heartbeats: the fleet does not run,
		// so no network is needed inside the bubble.
		f := newFleet(t, sim.Config{Machines: 12, SharedAgentKey: true, BMC: &sim.BMCConfig{Fraction: 1}})
		var ids []string
		var adopt []sim.Adoption
		keys := map[string]ssh.PublicKey{}
		for n := 1; n <= 10; n++ {
			id := slotID(n)
			ids = append(ids, id)
			adopt = append(adopt, sim.Adoption{ProviderID: id, MachineID: uuid.NewString()})
		}
		if _, err := f.Adopt("127.0.0.1:1", nil, adopt); err != nil {
			t.Fatal(err)
		}
		for _, id := range ids {
			keys[id] = hostKey(t, f, id)
		}
		if err := f.Hang(ids...); err != nil {
			t.Fatal(err)
		}
		if err := f.Hang(ids[0]); err != nil {
			t.Errorf("hanging a hung machine: %v, want nil", err)
		}
		start := time.Now()
		for n, id := range ids {
			if mid, alive := f.Agent(id); mid != adopt[n].MachineID || alive {
				t.Errorf("Agent(%s) of a hung machine = %q, %v; want its agent, not alive", id, mid, alive)
			}
			if _, _, err := dial(t, f, id); !errors.Is(err, sim.ErrUnreachable) || !strings.Contains(err.Error(), "hung") {
				t.Errorf("dialing hung %s: %v, want ErrUnreachable saying it hung", id, err)
			}
			for what, reboot := range map[string]func(context.Context, string) error{"RebootMachine": f.RebootMachine, "ReinstallMachine": f.ReinstallMachine} {
				if err := reboot(ctx, id); !errors.Is(err, provider.ErrNotReached) {
					t.Errorf("%s of hung %s: %v, want ErrNotReached", what, id, err)
				}
			}
		}
		if d := time.Since(start); d != 0 {
			t.Errorf("dials and reboots of hung machines took %s, want them to fail at once", d)
		}
		if st := f.Stats(); st.Hung != 10 || st.AgentsSilenced != 10 || st.Reboots != 0 {
			t.Errorf("Stats() of the hung fleet = %+v, want 10 hung and silenced, no reboot", st)
		}

		var wg sync.WaitGroup
		for _, id := range ids {
			wg.Go(func() {
				bmc, err := f.BMC(ctx, id)
				if err != nil {
					t.Error(err)
					return
				}
				if found, err := bmc.Cycle(ctx); err != nil || found != power.On {
					t.Errorf("Cycle(%s) = %q, %v; want found on, no error", id, found, err)
				}
			})
		}
		wg.Wait()
		// State, Off, State, On, State at 5 s apart: each BMC is paced on
		// its own, so the ten cycles take no longer than one.
		if d := time.Since(start); d != 20*time.Second {
			t.Errorf("ten power cycles took %s, want 20s", d)
		}
		for _, id := range ids {
			if mid, _ := f.Agent(id); mid != "" {
				t.Errorf("an agent (%s) runs on %s after its power cycle, want none until a takeover", mid, id)
			}
			_, key, err := dial(t, f, id)
			if err != nil || !keysEqual(key, keys[id]) {
				t.Errorf("dialing %s after its power cycle: key %v, %v; want its host key %v", id, key, err, keys[id])
			}
		}
		if st := f.Stats(); st.Hung != 0 || st.AgentsRunning != 0 || st.AgentsSilenced != 0 || st.Reboots != 10 || st.PowerOns != 10 {
			t.Errorf("Stats() after the cycles = %+v, want nothing hung, no agent, 10 power ons and reboots", st)
		}
		if err := f.RebootMachine(ctx, ids[0]); err != nil {
			t.Errorf("in-band reboot after the power cycle: %v", err)
		}
	})
}

// TestHangRecoveredByPowerCycle is TestHangPowerCycle for real: agents
// heartbeat to a callback server, so the test checks that a hung machine's
// heartbeats stop while another's go on, and that a takeover after the
// power cycle starts one that heartbeats.
func TestHangRecoveredByPowerCycle(t *testing.T) {
	t.Parallel()
	cb := newCallback(t, nil)
	f := startFleet(t, sim.Config{Machines: 2, BMC: &sim.BMCConfig{Fraction: 1, Transition: 100 * time.Millisecond,
		Power: power.Config{MinInterval: 50 * time.Millisecond, Settle: 10 * time.Second}}})
	hung, healthy := slotID(1), slotID(2)
	machine := map[string]string{hung: newMachineID(), healthy: newMachineID()}
	var key ssh.PublicKey
	for _, id := range []string{hung, healthy} {
		create(t, f, id)
		pipeTakeover(t, f, id, cb, machine[id])
		waitHeartbeat(t, f, id, time.Time{}, "first heartbeat of "+id)
	}
	key = hostKey(t, f, hung)

	hungAt := time.Now()
	if err := f.Hang(hung); err != nil {
		t.Fatal(err)
	}
	// Once the healthy machine heartbeated well after the hang, a
	// heartbeat of the hung one that was in flight then has ended too.
	waitHeartbeat(t, f, healthy, hungAt.Add(5*callbackInterval), "the healthy machine heartbeats after the hang")
	last := f.LastHeartbeat(hung)
	if _, _, err := dial(t, f, hung); !errors.Is(err, sim.ErrUnreachable) {
		t.Errorf("dialing the hung machine: %v, want ErrUnreachable", err)
	}
	if err := f.RebootMachine(testCtx(t), hung); !errors.Is(err, provider.ErrNotReached) {
		t.Errorf("in-band reboot of the hung machine: %v, want ErrNotReached", err)
	}
	bmc, err := f.BMC(testCtx(t), hung)
	if err != nil {
		t.Fatal(err)
	}
	if found, err := bmc.Cycle(testCtx(t)); err != nil || found != power.On {
		t.Fatalf("Cycle = %q, %v; want found on", found, err)
	}
	if got := f.LastHeartbeat(hung); !got.Equal(last) {
		t.Errorf("the hung machine heartbeated at %v (last before: %v)", got, last)
	}
	if mid, _ := f.Agent(hung); mid != "" {
		t.Errorf("agent %s runs after the power cycle, want none", mid)
	}
	if _, got, err := dial(t, f, hung); err != nil || !keysEqual(got, key) {
		t.Fatalf("dialing after the power cycle: key %v, %v; want the machine's host key", got, err)
	}
	again := newMachineID()
	pipeTakeover(t, f, hung, cb, again)
	cb.waitCount(t, again, 2, 30*time.Second, "heartbeats of the agent taken over after the power cycle")
}

// TestBMCFaults checks what each fault makes of a power cycle (or a state
// read) through the controller: the error class, how many calls the BMC
// got and how long it took at the default pace (5 s apart, 5 s
// transitions).
func TestBMCFaults(t *testing.T) {
	t.Parallel()
	me := []string{slotID(1)}
	cycle := func(ctx context.Context, b provider.BMC) error { _, err := b.Cycle(ctx); return err }
	state := func(ctx context.Context, b provider.BMC) error { _, err := b.State(ctx); return err }
	tests := []struct {
		name      string
		bmc       sim.BMCConfig
		do        func(context.Context, provider.BMC) error
		wantClass string // power.Class; "" for no error
		wantCalls int
		wantTook  time.Duration
		wantState power.State // afterwards, read from a BMC without faults' view: the machine
	}{
		{"no fault: state, off, state, on, state", sim.BMCConfig{}, cycle, "", 5, 20 * time.Second, power.On},
		{"no fault at a faster pace", sim.BMCConfig{Transition: 2 * time.Second, Power: power.Config{MinInterval: time.Second}},
			cycle, "", 7, 6 * time.Second, power.On},
		{"auth: one call, never retried", sim.BMCConfig{Auth: sim.BMCFault{Machines: me}}, cycle, "auth", 1, 0, power.On},
		{"hung: each attempt times out, unreachable", sim.BMCConfig{Hung: sim.BMCFault{Machines: me}}, state, "unreachable", 3, 90 * time.Second, power.On},
		{"hung with a short call timeout", sim.BMCConfig{Hung: sim.BMCFault{Machines: me}, Power: power.Config{CallTimeout: 2 * time.Second}},
			cycle, "unreachable", 3, 12 * time.Second, power.On},
		{"busy for a while: the third attempt gets through", sim.BMCConfig{Busy: sim.BMCFault{Machines: me}}, state, "", 3, 10 * time.Second, power.On},
		{"busy beyond the attempts", sim.BMCConfig{Busy: sim.BMCFault{Machines: me, For: 11 * time.Second}}, cycle, "busy", 3, 10 * time.Second, power.On},
		{"busy, then a whole cycle", sim.BMCConfig{Busy: sim.BMCFault{Machines: me}}, cycle, "", 7, 30 * time.Second, power.On},
		{"dropped commands are sent again after Settle", sim.BMCConfig{Drop: sim.BMCFault{Machines: me}, Power: power.Config{Settle: 10 * time.Second}},
			cycle, "", 11, 50 * time.Second, power.On},
		{"a dropped command with one attempt is not reached", sim.BMCConfig{Drop: sim.BMCFault{Machines: me}, Power: power.Config{Settle: 10 * time.Second, Attempts: 1}},
			cycle, "not_reached", 4, 15 * time.Second, power.On},
		{"power on refused for a while: taken for on, sent again after Settle", sim.BMCConfig{RefuseOn: sim.BMCFault{Machines: me}, Power: power.Config{Settle: 10 * time.Second}},
			cycle, "", 8, 35 * time.Second, power.On},
		{"power on refused beyond the attempts", sim.BMCConfig{RefuseOn: sim.BMCFault{Machines: me, For: time.Minute}, Power: power.Config{Settle: 10 * time.Second}},
			cycle, "not_reached", 12, 55 * time.Second, power.Off},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				ctx := t.Context()
				cfg := tt.bmc
				cfg.Machines = []string{slotID(1), slotID(2)}
				f := newFleet(t, sim.Config{Machines: 2, BMC: &cfg})
				if err := f.Provision(slotID(1)); err != nil {
					t.Fatal(err)
				}
				bmc, err := f.BMC(ctx, slotID(1))
				if err != nil {
					t.Fatal(err)
				}
				start := time.Now()
				err = tt.do(ctx, bmc)
				took := time.Since(start)
				if got := power.Class(err); got != tt.wantClass {
					t.Errorf("error %v: class %q, want %q", err, got, tt.wantClass)
				}
				// ErrNotReached is the controller's own conclusion; every
				// other error is the BMC's answer and names it.
				if err != nil && tt.wantClass != "not_reached" && !strings.Contains(err.Error(), "sim-bmc "+slotID(1)) {
					t.Errorf("error %q does not name the BMC", err)
				}
				if n := f.BMCCalls(slotID(1)); n != tt.wantCalls {
					t.Errorf("the BMC got %d calls, want %d", n, tt.wantCalls)
				}
				if took != tt.wantTook {
					t.Errorf("took %s, want %s", took, tt.wantTook)
				}
				if n := f.BMCCalls(slotID(2)); n != 0 {
					t.Errorf("the other machine's BMC got %d calls", n)
				}
				wantStatus := provider.StatusRunning
				if tt.wantState == power.Off {
					wantStatus = provider.StatusStopped
				}
				if st := status(t, f, slotID(1)); st != wantStatus {
					t.Errorf("the machine is %s afterwards, want %s (power %s)", st, wantStatus, tt.wantState)
				}
			})
		})
	}
}

// TestHangRefused checks that Hang hangs nothing when one machine cannot
// hang, and that Revive ends a hang.
func TestHangRefused(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		ctx := t.Context()
		f := newFleet(t, sim.Config{Machines: 4, BMC: &sim.BMCConfig{Machines: []string{slotID(4)}}})
		up, free, dead, off := slotID(1), slotID(2), slotID(3), slotID(4)
		if err := f.Provision(up, dead, off); err != nil {
			t.Fatal(err)
		}
		if err := f.Kill(dead); err != nil {
			t.Fatal(err)
		}
		bmc, err := f.BMC(ctx, off)
		if err != nil {
			t.Fatal(err)
		}
		if err := bmc.Off(ctx); err != nil {
			t.Fatal(err)
		}
		for _, tt := range []struct {
			ids  []string
			want string
		}{
			{[]string{up, "sim-000009"}, "not found"},
			{[]string{up, free}, "sim-000002: the machine is not provisioned"},
			{[]string{up, dead}, "sim-000003: the machine is killed"},
			{[]string{up, off}, "sim-000004: the machine is powered off"},
		} {
			if err := f.Hang(tt.ids...); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Hang(%v) = %v, want an error saying %q", tt.ids, err, tt.want)
			}
		}
		if st := f.Stats(); st.Hung != 0 {
			t.Fatalf("%d machines hung after refused Hangs, want none", st.Hung)
		}
		if _, _, err := dial(t, f, up); err != nil {
			t.Fatalf("dialing %s: %v", up, err)
		}
		if err := f.Hang(up); err != nil {
			t.Fatal(err)
		}
		if err := f.Revive(up); err != nil {
			t.Fatal(err)
		}
		if _, _, err := dial(t, f, up); err != nil {
			t.Errorf("dialing %s after Revive ended its hang: %v", up, err)
		}
		if st := f.Stats(); st.Hung != 0 {
			t.Errorf("Stats().Hung = %d after Revive", st.Hung)
		}
	})
}

func hostKey(t *testing.T, f *sim.Fleet, id string) ssh.PublicKey {
	t.Helper()
	k, err := f.HostKey(id)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func keysEqual(a, b ssh.PublicKey) bool {
	return a != nil && b != nil && string(a.Marshal()) == string(b.Marshal())
}

func status(t *testing.T, f *sim.Fleet, id string) provider.Status {
	t.Helper()
	m, err := f.GetMachine(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	return m.(provider.Described).Status()
}

// TestRebootStaysDown: a reboot with RebootStaysDown is carried out (nil,
// counted) and the machine never comes back by itself: no SSH, further
// in-band reboots cannot reach it, until a power cycle through its BMC
// boots it.
func TestRebootStaysDown(t *testing.T) {
	t.Parallel()
	cb := newCallback(t, nil)
	f := startFleet(t, sim.Config{Machines: 1, RebootLatency: 10 * time.Millisecond, BMC: &sim.BMCConfig{Fraction: 1,
		Transition: 50 * time.Millisecond, Power: power.Config{MinInterval: 20 * time.Millisecond, Settle: 10 * time.Second}}})
	id := slotID(1)
	create(t, f, id)
	pipeTakeover(t, f, id, cb, newMachineID())
	if err := f.SetRebootFault(id, sim.RebootStaysDown); err != nil {
		t.Fatal(err)
	}
	if err := f.RebootMachine(testCtx(t), id); err != nil {
		t.Fatalf("RebootMachine: %v, want the reboot carried out", err)
	}
	if _, n := f.Rebooted(id); n != 1 {
		t.Errorf("%d reboots counted, want 1", n)
	}
	if _, _, err := dial(t, f, id); !errors.Is(err, sim.ErrUnreachable) {
		t.Errorf("dialing the machine that stayed down: %v, want ErrUnreachable", err)
	}
	if err := f.RebootMachine(testCtx(t), id); !errors.Is(err, provider.ErrNotReached) {
		t.Errorf("in-band reboot of the machine that stayed down: %v, want ErrNotReached", err)
	}
	if err := f.SetRebootFault(id, sim.RebootWorks); err != nil {
		t.Fatal(err)
	}
	bmc, err := f.BMC(testCtx(t), id)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := bmc.Cycle(testCtx(t)); err != nil {
		t.Fatalf("Cycle: %v", err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, _, err := dial(t, f, id)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the machine does not answer SSH after the power cycle: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := f.SetRebootFault(id, sim.RebootStaysDown+1); err == nil {
		t.Error("SetRebootFault accepted an unknown fault")
	}
}

// TestHangEvery: a fleet with HangEvery hangs its running machines one at
// a time, each only once, and never a machine that runs no agent.
func TestHangEvery(t *testing.T) {
	t.Parallel()
	if _, err := sim.New(sim.Config{HangEvery: -time.Second}); err == nil || !strings.Contains(err.Error(), "HangEvery must be >= 0") {
		t.Errorf("sim.New with a negative HangEvery: %v", err)
	}
	cb := newCallback(t, nil)
	f := startFleet(t, sim.Config{Machines: 3, HangEvery: 50 * time.Millisecond})
	ids := []string{slotID(1), slotID(2)}
	for _, id := range ids {
		create(t, f, id)
		pipeTakeover(t, f, id, cb, newMachineID())
	}
	create(t, f, slotID(3)) // provisioned, no agent: nothing to hang
	deadline := time.Now().Add(30 * time.Second)
	for f.Stats().Hung < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("%d machines hung after 30s, want 2", f.Stats().Hung)
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, id := range ids {
		if _, _, err := dial(t, f, id); !errors.Is(err, sim.ErrUnreachable) {
			t.Errorf("dialing %s: %v, want ErrUnreachable (hung)", id, err)
		}
	}
	if _, _, err := dial(t, f, slotID(3)); err != nil {
		t.Errorf("the machine without an agent was hung: %v", err)
	}
	if n := f.Stats().Hung; n != 2 {
		t.Errorf("%d hangs, want each running machine hung once", n)
	}
}
