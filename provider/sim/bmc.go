package sim

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/shepherd/shepherd/power"
	"github.com/shepherd/shepherd/provider"
)

// BMCConfig gives simulated machines BMCs for out-of-band power (SPEC
// §5.5), so that the recovery ladder's power cycle can be exercised at
// scale. Each BMC is a power.Driver behind a power.Controller of its own,
// whose power state drives its machine: Off ends the running system at once
// (agent, SSH, a hang), On boots it as a reboot does (SSH answers again
// with the same host key, no agent runs until a takeover). Zero values
// mean defaults.
//
// Machines and faults are picked from the fleet's Seed, each machine on its
// own, so a fraction is a share on average, the same in every run with the
// same seed; name machines to get an exact set.
type BMCConfig struct {
	// Fraction (0..1) of the machines have a BMC; 1 gives every machine
	// one.
	Fraction float64
	// Machines have a BMC too, whatever Fraction picks.
	Machines []string
	// Transition is how long a power command takes to show at the BMC,
	// which until then reports the state the machine comes from, as
	// Redfish counts PoweringOff as on; default 5 s. The machine goes
	// down at once on Off; after On it boots when the transition is over
	// and answers SSH Config.RebootLatency later.
	Transition time.Duration
	// Power paces and bounds the calls of each BMC's controller:
	// MinInterval (default 5 s) between calls, CallTimeout (30 s) per call,
	// Attempts (3) and Settle (60 s), as power.Config says.
	Power power.Config

	// Faults as real BMCs have them, each for a share of the machines
	// with a BMC and for machines named (which must have a BMC). A BMC
	// with several answers as the first of Hung, Auth, Busy says; Drop
	// and RefuseOn act on the commands it carries out.

	// Busy BMCs answer every call with power.ErrBusy from their first
	// call until Busy.For (default 8 s: the third call of the default
	// pacing gets through) later, then work.
	Busy BMCFault
	// Auth BMCs refuse the credentials: power.ErrAuth to every call.
	Auth BMCFault
	// Hung BMCs never answer: every call blocks until its context ends
	// (the controller's CallTimeout, which makes it power.ErrUnreachable).
	Hung BMCFault
	// Drop BMCs accept their first Off and their first On that would
	// change the power state, and drop them: the state never changes, and
	// the controller's Cycle must send the command again.
	Drop BMCFault
	// RefuseOn BMCs refuse On for RefuseOn.For (default 10 s) after the
	// power went off, answering power.ErrWrongState as IPMI's completion
	// code 0xD5 (not in the present state) does. The controller takes
	// that for "already on", so Cycle polls until Settle and sends On
	// again: the case the controller handles worst, which is why it is
	// this class and not ErrBusy.
	RefuseOn BMCFault
}

// BMCFault selects the machines with a BMC fault.
type BMCFault struct {
	// Fraction (0..1) of the machines with a BMC have the fault.
	Fraction float64
	// Machines have the fault too; each must have a BMC.
	Machines []string
	// For is how long the fault lasts, for Busy and RefuseOn only; 0
	// means their default.
	For time.Duration
}

// Defaults of BMCConfig.
const (
	DefaultBMCTransition  = 5 * time.Second
	DefaultBMCBusyFor     = 8 * time.Second
	DefaultBMCRefuseOnFor = 10 * time.Second
)

// bmcFaultKind names a BMC fault; a BMC's faults are a bit set of them.
type bmcFaultKind uint8

const (
	faultHung bmcFaultKind = iota
	faultAuth
	faultBusy
	faultDrop
	faultRefuseOn
	numFaults
)

// fault returns c's fault of kind k, its field name for messages and
// whether it lasts a while (has For).
func (c *BMCConfig) fault(k bmcFaultKind) (f *BMCFault, name string, timed bool) {
	switch k {
	case faultHung:
		return &c.Hung, "Hung", false
	case faultAuth:
		return &c.Auth, "Auth", false
	case faultBusy:
		return &c.Busy, "Busy", true
	case faultDrop:
		return &c.Drop, "Drop", false
	case faultRefuseOn:
		return &c.RefuseOn, "RefuseOn", true
	}
	panic("sim: unknown BMC fault " + strconv.Itoa(int(k)))
}

// Salts that make the picks of the BMCs and of each fault independent.
const saltBMC = 1

func saltFault(k bmcFaultKind) uint64 { return uint64(k) + 2 }

// validate checks c for a fleet of machines slots seeded with seed, naming
// the field and the bad value.
func (c *BMCConfig) validate(machines int, seed int64) error {
	if err := checkFraction("BMC.Fraction", c.Fraction); err != nil {
		return err
	}
	has, err := slotSet("BMC.Machines", c.Machines, machines)
	if err != nil {
		return err
	}
	if c.Fraction == 0 && len(has) == 0 {
		return errors.New("sim: BMC gives no machine a BMC: set BMC.Fraction (bmc_fraction) or BMC.Machines (bmc_machines)")
	}
	if c.Transition < 0 {
		return fmt.Errorf("sim: BMC.Transition must be >= 0 (0 = default %s), got %s", DefaultBMCTransition, c.Transition)
	}
	if err := c.Power.Validate(); err != nil {
		return fmt.Errorf("sim: BMC.Power: %w", err)
	}
	for k := range numFaults {
		f, name, timed := c.fault(k)
		if err := checkFraction("BMC."+name+".Fraction", f.Fraction); err != nil {
			return err
		}
		ids, err := slotSet("BMC."+name+".Machines", f.Machines, machines)
		if err != nil {
			return err
		}
		for _, id := range f.Machines {
			if _, named := has[id]; !named && !picked(seed, saltBMC, ids[id], c.Fraction) {
				return fmt.Errorf("sim: BMC.%s.Machines: %s has no BMC (not in BMC.Machines, and BMC.Fraction %v did not pick it)", name, id, c.Fraction)
			}
		}
		switch {
		case f.For < 0:
			return fmt.Errorf("sim: BMC.%s.For must be >= 0 (0 = default), got %s", name, f.For)
		case f.For != 0 && !timed:
			return fmt.Errorf("sim: BMC.%s.For is only for Busy and RefuseOn, which last a while; %s lasts for good", name, name)
		}
	}
	return nil
}

func checkFraction(name string, v float64) error {
	if math.IsNaN(v) || v < 0 || v > 1 {
		return fmt.Errorf("sim: %s must be between 0 and 1, got %v", name, v)
	}
	return nil
}

// slotSet parses ids, slot ids of a fleet of machines slots, into a set
// (id to slot index); field names them in messages.
func slotSet(field string, ids []string, machines int) (map[string]int32, error) {
	set := make(map[string]int32, len(ids))
	for _, id := range ids {
		i, ok := slotOf(id, machines)
		if !ok {
			return nil, fmt.Errorf("sim: %s: %q is not a machine of the fleet (%s to %s)", field, id, idPrefix+"000001", fmt.Sprintf("%s%06d", idPrefix, machines))
		}
		if _, dup := set[id]; dup {
			return nil, fmt.Errorf("sim: %s: %s given twice", field, id)
		}
		set[id] = i
	}
	return set, nil
}

// slotOf parses id as the id of a slot of a fleet of machines slots.
func slotOf(id string, machines int) (int32, bool) {
	if len(id) != idWidth || !strings.HasPrefix(id, idPrefix) {
		return 0, false
	}
	n, err := strconv.Atoi(id[len(idPrefix):])
	if err != nil || n < 1 || n > machines || fmt.Sprintf("%s%06d", idPrefix, n) != id {
		return 0, false
	}
	return int32(n - 1), true
}

// picked decides whether slot i is in a share fraction of the fleet, from
// seed and salt: the same in every run, independent for different salts,
// and without a draw from the fleet's generator, whose sequence the
// failure injection of existing configurations depends on.
func picked(seed int64, salt uint64, i int32, fraction float64) bool {
	switch {
	case fraction <= 0:
		return false
	case fraction >= 1:
		return true
	}
	// splitmix64's finaliser over the three inputs.
	x := uint64(seed) + salt*0x9e3779b97f4a7c15 + uint64(i)*0xd1b54a32d192ed03
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	x ^= x >> 31
	return float64(x>>11)/(1<<53) < fraction
}

// machineSet is a set of slots: those named, and a share picked.
type machineSet struct {
	ids      map[int32]bool
	fraction float64
	salt     uint64
}

func (s machineSet) contains(seed int64, i int32) bool {
	return s.ids[i] || picked(seed, s.salt, i, s.fraction)
}

// bmcPlan is a valid BMCConfig compiled for a fleet: which machines have a
// BMC and which faults.
type bmcPlan struct {
	cfg    BMCConfig // with defaults
	seed   int64
	has    machineSet
	faults [numFaults]machineSet
}

// newBMCPlan compiles c, which validate accepted for a fleet of machines
// slots seeded with seed. c is copied: the caller's value is untouched.
func newBMCPlan(c BMCConfig, machines int, seed int64) *bmcPlan {
	c.Transition = cmp.Or(c.Transition, DefaultBMCTransition)
	c.Busy.For = cmp.Or(c.Busy.For, DefaultBMCBusyFor)
	c.RefuseOn.For = cmp.Or(c.RefuseOn.For, DefaultBMCRefuseOnFor)
	c.Power = c.Power.WithDefaults()
	set := func(ids []string, fraction float64, salt uint64) machineSet {
		s := machineSet{ids: make(map[int32]bool, len(ids)), fraction: fraction, salt: salt}
		for _, id := range ids {
			i, _ := slotOf(id, machines)
			s.ids[i] = true
		}
		return s
	}
	p := &bmcPlan{seed: seed, has: set(c.Machines, c.Fraction, saltBMC)}
	c.Machines = append([]string(nil), c.Machines...)
	for k := range numFaults {
		f, _, _ := c.fault(k)
		p.faults[k] = set(f.Machines, f.Fraction, saltFault(k))
		f.Machines = append([]string(nil), f.Machines...)
	}
	p.cfg = c
	return p
}

// hasBMC reports whether slot i has a BMC.
func (p *bmcPlan) hasBMC(i int32) bool { return p.has.contains(p.seed, i) }

// faultsOf returns slot i's BMC faults as a bit set.
func (p *bmcPlan) faultsOf(i int32) uint8 {
	var bits uint8
	for k := range numFaults {
		if p.faults[k].contains(p.seed, i) {
			bits |= 1 << k
		}
	}
	return bits
}

// simBMC is one machine's simulated BMC: a power.Driver whose calls act on
// the machine's slot at once (after the faults had their say), and the
// controller that paces them.
type simBMC struct {
	f      *Fleet
	i      int32
	name   string
	faults uint8 // bit set of bmcFaultKind
	ctrl   *power.Controller

	// Guarded by f.mu.
	calls   int
	called  bool
	first   time.Duration // when the first call came (offset from Fleet.start)
	dropped uint8         // droppedOff, droppedOn: the Drop fault did its work
}

const (
	droppedOff = 1 << iota
	droppedOn
)

var _ power.Driver = (*simBMC)(nil)

func (b *simBMC) has(k bmcFaultKind) bool { return b.faults&(1<<k) != 0 }

// BMC returns the controller of machine id's simulated BMC, one per
// machine for the fleet's life, so that its pacing holds across callers;
// an error wrapping provider.ErrNoBMC if Config.BMC gives the machine
// none, or provider.ErrNotFound if id is unknown.
func (f *Fleet) BMC(ctx context.Context, id string) (provider.BMC, error) {
	if err := ctx.Err(); err != nil {
		return provider.BMC{}, err
	}
	i, err := f.lookup(id)
	if err != nil {
		return provider.BMC{}, err
	}
	if f.bmc == nil || !f.bmc.hasBMC(i) {
		return provider.BMC{}, fmt.Errorf("sim: machine %s: %w", id, provider.ErrNoBMC)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	b := f.bmcs[i]
	if b == nil {
		b = &simBMC{f: f, i: i, name: "sim-bmc " + id, faults: f.bmc.faultsOf(i)}
		b.ctrl = power.NewController(b, f.bmc.cfg.Power)
		f.bmcs[i] = b
	}
	return provider.BMC{Name: b.name, Controller: b.ctrl}, nil
}

// BMCCalls returns how many calls machine id's BMC got (each State, On and
// Off its controller sent, refused and hung ones included); 0 for a
// machine whose BMC was never asked for, or an unknown id.
func (f *Fleet) BMCCalls(id string) int {
	i, ok := f.index(id)
	if !ok {
		return 0
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if b := f.bmcs[i]; b != nil {
		return b.calls
	}
	return 0
}

// State reads the power state: the last command's once its Transition is
// over, the one before until then.
func (b *simBMC) State(ctx context.Context) (power.State, error) {
	var st power.State
	err := b.do(ctx, "reading power state", func(now time.Duration) (func(), error) {
		s := &b.f.slots[b.i]
		on := !s.off
		if now < s.powerAt {
			on = !on
		}
		st = power.Off
		if on {
			st = power.On
		}
		return nil, nil
	})
	return st, err
}

// On powers the machine on: it boots when Transition is over. A machine on,
// or powering on, already: nil, as most BMCs answer.
func (b *simBMC) On(ctx context.Context) error {
	return b.do(ctx, "powering on", func(now time.Duration) (func(), error) { return b.onLocked(ctx, now) })
}

// Off powers the machine off at once; the BMC shows it when Transition is
// over. A machine off, or powering off, already: nil.
func (b *simBMC) Off(ctx context.Context) error {
	return b.do(ctx, "powering off", func(now time.Duration) (func(), error) { return b.offLocked(ctx, now) })
}

// do answers a call as the BMC's faults say, or runs act at now with f.mu
// held, which returns what to run once it is released.
func (b *simBMC) do(ctx context.Context, what string, act func(now time.Duration) (func(), error)) error {
	if err := ctx.Err(); err != nil {
		return b.ctxErr(what, err)
	}
	f := b.f
	f.mu.Lock()
	now := f.now()
	b.calls++
	if !b.called {
		b.called, b.first = true, now
	}
	var after func()
	var err error
	switch {
	case f.stopped:
		err = fmt.Errorf("%s: %s: the simulated fleet has stopped: %w", b.name, what, power.ErrUnreachable)
	case b.has(faultHung):
		f.mu.Unlock()
		<-ctx.Done()
		return b.ctxErr(what, ctx.Err())
	case b.has(faultAuth):
		err = fmt.Errorf("%s: %s: invalid user name or password (simulated fault): %w", b.name, what, power.ErrAuth)
	case b.has(faultBusy) && now < b.first+f.bmc.cfg.Busy.For:
		err = fmt.Errorf("%s: %s: node busy for another %s (simulated fault): %w",
			b.name, what, (b.first + f.bmc.cfg.Busy.For - now).Round(time.Millisecond), power.ErrBusy)
	default:
		after, err = act(now)
	}
	f.mu.Unlock()
	if after != nil {
		after()
	}
	return err
}

// ctxErr is the error of a call whose context ended, as the real drivers
// give it: a passed deadline is no answer (power.ErrUnreachable), a
// cancellation stays context.Canceled.
func (b *simBMC) ctxErr(what string, err error) error {
	if errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("%s: %s: no answer before the deadline: %w (%w)", b.name, what, power.ErrUnreachable, err)
	}
	return fmt.Errorf("%s: %s: %w", b.name, what, err)
}

// offLocked carries out Off at now: the machine's running system ends at
// once. f.mu must be held.
func (b *simBMC) offLocked(ctx context.Context, now time.Duration) (func(), error) {
	f := b.f
	s := &f.slots[b.i]
	if s.off {
		return nil, nil
	}
	if b.has(faultDrop) && b.dropped&droppedOff == 0 {
		b.dropped |= droppedOff
		return func() { f.log.InfoContext(ctx, "BMC dropped a power off (simulated fault)", "provider_id", f.id(b.i)) }, nil
	}
	s.off, s.powerAt = true, now+f.bmc.cfg.Transition
	f.stats.PowerOffs++
	closeAfter := f.shutdownLocked(b.i)
	return func() {
		closeAfter()
		f.log.InfoContext(ctx, "machine powered off through its BMC", "provider_id", f.id(b.i))
	}, nil
}

// onLocked carries out On at now: the machine boots, as after a reboot,
// once Transition is over. f.mu must be held.
func (b *simBMC) onLocked(ctx context.Context, now time.Duration) (func(), error) {
	f := b.f
	s := &f.slots[b.i]
	if !s.off {
		return nil, nil
	}
	if hold := f.bmc.cfg.RefuseOn.For; b.has(faultRefuseOn) && now < s.powerAt+hold {
		return nil, fmt.Errorf("%s: powering on: completion code 0xD5 (not in the present state): power-on is held for %s after power-off (simulated fault): %w",
			b.name, hold, power.ErrWrongState)
	}
	if b.has(faultDrop) && b.dropped&droppedOn == 0 {
		b.dropped |= droppedOn
		return func() { f.log.InfoContext(ctx, "BMC dropped a power on (simulated fault)", "provider_id", f.id(b.i)) }, nil
	}
	s.off, s.powerAt = false, now+f.bmc.cfg.Transition
	f.stats.PowerOns++
	closeAfter := f.restartLocked(b.i, now, s.powerAt+f.cfg.RebootLatency)
	return func() {
		closeAfter()
		f.rebooted(ctx, b.i, now, false)
	}, nil
}

// yamlBMC is BMCConfig as the fleet's YAML spells it: flat bmc_* keys, the
// pacing ones named as the static provider's. Any of them gives the fleet
// BMCs, so bmc_fraction or bmc_machines must be among them.
type yamlBMC struct {
	Fraction         float64       `yaml:"bmc_fraction"`
	Machines         []string      `yaml:"bmc_machines"`
	Transition       time.Duration `yaml:"bmc_transition"`
	MinInterval      time.Duration `yaml:"bmc_min_interval"`
	CallTimeout      time.Duration `yaml:"bmc_call_timeout"`
	Settle           time.Duration `yaml:"bmc_settle"`
	Attempts         int           `yaml:"bmc_attempts"`
	BusyFraction     float64       `yaml:"bmc_busy_fraction"`
	BusyMachines     []string      `yaml:"bmc_busy_machines"`
	BusyFor          time.Duration `yaml:"bmc_busy_for"`
	AuthFraction     float64       `yaml:"bmc_auth_fraction"`
	AuthMachines     []string      `yaml:"bmc_auth_machines"`
	HungFraction     float64       `yaml:"bmc_hung_fraction"`
	HungMachines     []string      `yaml:"bmc_hung_machines"`
	DropFraction     float64       `yaml:"bmc_drop_fraction"`
	DropMachines     []string      `yaml:"bmc_drop_machines"`
	RefuseOnFraction float64       `yaml:"bmc_refuse_on_fraction"`
	RefuseOnMachines []string      `yaml:"bmc_refuse_on_machines"`
	RefuseOnFor      time.Duration `yaml:"bmc_refuse_on_for"`
}

// config returns the BMCConfig y spells, or nil if it has no bmc_* key.
func (y yamlBMC) config() *BMCConfig {
	if reflect.ValueOf(y).IsZero() {
		return nil
	}
	return &BMCConfig{
		Fraction:   y.Fraction,
		Machines:   y.Machines,
		Transition: y.Transition,
		Power:      power.Config{MinInterval: y.MinInterval, CallTimeout: y.CallTimeout, Settle: y.Settle, Attempts: y.Attempts},
		Busy:       BMCFault{Fraction: y.BusyFraction, Machines: y.BusyMachines, For: y.BusyFor},
		Auth:       BMCFault{Fraction: y.AuthFraction, Machines: y.AuthMachines},
		Hung:       BMCFault{Fraction: y.HungFraction, Machines: y.HungMachines},
		Drop:       BMCFault{Fraction: y.DropFraction, Machines: y.DropMachines},
		RefuseOn:   BMCFault{Fraction: y.RefuseOnFraction, Machines: y.RefuseOnMachines, For: y.RefuseOnFor},
	}
}
