package chaos

import (
	"cmp"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"time"
)

// Kind is a kind of fault.
type Kind string

// The faults of the soak.
const (
	// KillProcess sends SIGKILL to a shepherd process and restarts it
	// after For.
	KillProcess Kind = "kill_process"
	// StopProcess stops a shepherd process (SIGSTOP) for For, longer than
	// a session lease, then continues it: the stalled worker.
	StopProcess Kind = "stop_process"
	// RestartPostgres restarts the primary (fast shutdown, then start).
	RestartPostgres Kind = "restart_postgres"
	// FailoverPostgres stops the primary at once and promotes the standby;
	// a new synchronous standby is built afterwards.
	FailoverPostgres Kind = "failover_postgres"
	// DBBlackhole makes the path from Shepherd to PostgreSQL swallow
	// everything for For: no refusal, no answer.
	DBBlackhole Kind = "db_blackhole"
	// DBDelay delays every chunk between Shepherd and PostgreSQL by Delay
	// for For.
	DBDelay Kind = "db_delay"
	// DBReset resets every connection between Shepherd and PostgreSQL,
	// and new ones, for For.
	DBReset Kind = "db_reset"
	// AgentHang makes the agents of Machines stop heartbeating while their
	// machines stay up: recovery must reboot them.
	AgentHang Kind = "agent_hang"
	// MachineDeath kills Machines (no SSH, no agent, reboots fail) and
	// powers them on again after For.
	MachineDeath Kind = "machine_death"
	// RealAgentKill kills the real agent on real SSH host Target.
	RealAgentKill Kind = "real_agent_kill"
	// RebootFails makes reboots of Machines fail for For and hangs their
	// agents, so that a reboot is needed.
	RebootFails Kind = "reboot_fails"
	// RebootHangs makes reboots of Machines never answer for For and hangs
	// their agents.
	RebootHangs Kind = "reboot_hangs"
	// RackPartition drops the heartbeats of rack Target on the way to the
	// callback server for For: the agents live, the server never hears.
	RackPartition Kind = "rack_partition"
	// HostKeyRotation gives real SSH host Target new host keys for For,
	// then its old ones back.
	HostKeyRotation Kind = "host_key_rotation"
	// HostileClient runs the hostile client against callback server
	// Target for For, forging heartbeats of Machines, whose own agents hang
	// meanwhile (so only the forgeries could keep them alive).
	HostileClient Kind = "hostile_client"
)

// Shape is what a schedule has to aim at.
type Shape struct {
	Processes   int           // shepherd processes
	Servers     int           // of them, those running a callback server (the first ones)
	SimMachines int           // simulated machines
	Racks       int           // racks of simulated machines
	RealHosts   int           // real SSH hosts
	Lease       time.Duration // session lease: stops last longer
}

// Fault is one fault of a schedule.
type Fault struct {
	At       time.Duration // since the soak's fault phase began
	Kind     Kind
	Target   int           // process, rack, real host or server index, by Kind
	Machines []int         // simulated machine indexes, by Kind
	For      time.Duration // how long the fault lasts before it is healed
	Delay    time.Duration // DBDelay's delay
}

func (f Fault) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "t=%6.1fs %s", f.At.Seconds(), f.Kind)
	switch f.Kind {
	case KillProcess, StopProcess:
		fmt.Fprintf(&b, " process=%d", f.Target+1)
	case RackPartition:
		fmt.Fprintf(&b, " rack=%d", f.Target+1)
	case RealAgentKill, HostKeyRotation:
		fmt.Fprintf(&b, " host=%d", f.Target+1)
	case HostileClient:
		fmt.Fprintf(&b, " server=%d", f.Target+1)
	}
	if len(f.Machines) > 0 {
		fmt.Fprintf(&b, " machines=%v", f.Machines)
	}
	if f.Delay > 0 {
		fmt.Fprintf(&b, " delay=%s", f.Delay)
	}
	if f.For > 0 {
		fmt.Fprintf(&b, " for=%s", f.For.Round(100*time.Millisecond))
	}
	return b.String()
}

// rate is how often a kind of fault happens, per minute, and how its
// details are drawn.
type rate struct {
	kind   Kind
	perMin float64
	draw   func(r *rand.Rand, s Shape, f *Fault)
}

func between(r *rand.Rand, lo, hi time.Duration) time.Duration {
	return lo + time.Duration(r.Int64N(int64(hi-lo)+1))
}

func machines(r *rand.Rand, s Shape, lo, hi int) []int {
	n := lo + r.IntN(hi-lo+1)
	out := make([]int, 0, n)
	for len(out) < n {
		m := r.IntN(s.SimMachines)
		if !slices.Contains(out, m) {
			out = append(out, m)
		}
	}
	slices.Sort(out)
	return out
}

// rates are the soak's fault rates. Database faults are rare and short
// enough that the fleet spends most of the time able to make progress, or
// no fault after the first would find anything to break.
var rates = []rate{
	{KillProcess, 1, func(r *rand.Rand, s Shape, f *Fault) {
		f.Target, f.For = r.IntN(s.Processes), between(r, time.Second, 8*time.Second)
	}},
	{StopProcess, 0.7, func(r *rand.Rand, s Shape, f *Fault) {
		f.Target, f.For = r.IntN(s.Processes), between(r, s.Lease+2*time.Second, s.Lease+12*time.Second)
	}},
	{RestartPostgres, 0.3, func(*rand.Rand, Shape, *Fault) {}},
	{FailoverPostgres, 0.2, func(*rand.Rand, Shape, *Fault) {}},
	{DBBlackhole, 0.4, func(r *rand.Rand, s Shape, f *Fault) { f.For = between(r, 3*time.Second, 20*time.Second) }},
	{DBDelay, 0.4, func(r *rand.Rand, s Shape, f *Fault) {
		f.For, f.Delay = between(r, 5*time.Second, 20*time.Second), between(r, 20*time.Millisecond, 500*time.Millisecond)
	}},
	{DBReset, 0.4, func(r *rand.Rand, s Shape, f *Fault) { f.For = between(r, 500*time.Millisecond, 4*time.Second) }},
	{AgentHang, 14, func(r *rand.Rand, s Shape, f *Fault) { f.Machines = machines(r, s, 1, 4) }},
	{MachineDeath, 6, func(r *rand.Rand, s Shape, f *Fault) {
		f.Machines, f.For = machines(r, s, 1, 3), between(r, 5*time.Second, 60*time.Second)
	}},
	{RealAgentKill, 1, func(r *rand.Rand, s Shape, f *Fault) { f.Target = r.IntN(s.RealHosts) }},
	{RebootFails, 3, func(r *rand.Rand, s Shape, f *Fault) {
		f.Machines, f.For = machines(r, s, 1, 3), between(r, 10*time.Second, 60*time.Second)
	}},
	{RebootHangs, 3, func(r *rand.Rand, s Shape, f *Fault) {
		f.Machines, f.For = machines(r, s, 1, 3), between(r, 10*time.Second, 60*time.Second)
	}},
	{RackPartition, 0.4, func(r *rand.Rand, s Shape, f *Fault) {
		f.Target, f.For = r.IntN(s.Racks), between(r, 5*time.Second, 40*time.Second)
	}},
	{HostKeyRotation, 0.5, func(r *rand.Rand, s Shape, f *Fault) {
		f.Target, f.For = r.IntN(s.RealHosts), between(r, 10*time.Second, 40*time.Second)
	}},
	{HostileClient, 0.6, func(r *rand.Rand, s Shape, f *Fault) {
		f.Target, f.For, f.Machines = r.IntN(s.Servers), between(r, 5*time.Second, 15*time.Second), machines(r, s, 1, 3)
	}},
}

// Schedule returns the faults of a fault phase of length d for seed: the
// same seed and shape give the same schedule. Each kind arrives as a
// Poisson process at its own rate, so faults overlap in random
// combinations. Faults end within the phase, and database faults that
// replace the primary never overlap one another (the harness runs them one
// at a time anyway, and a failover needs the standby the last one rebuilt).
func Schedule(seed int64, d time.Duration, s Shape) []Fault {
	r := rand.New(rand.NewPCG(uint64(seed), 0x6368616f73)) // "chaos"
	var out []Fault
	for _, k := range rates {
		if (k.kind == RealAgentKill || k.kind == HostKeyRotation) && s.RealHosts == 0 {
			continue
		}
		mean := time.Duration(float64(time.Minute) / k.perMin)
		at := time.Duration(0)
		for {
			at += time.Duration(-math.Log(1-r.Float64()) * float64(mean))
			if at >= d {
				break
			}
			f := Fault{At: at, Kind: k.kind}
			k.draw(r, s, &f)
			if f.Kind == StopProcess && at+f.For > d {
				continue // a stop cut short would not outlast the lease
			}
			f.For = min(f.For, d-at)
			out = append(out, f)
		}
	}
	slices.SortStableFunc(out, func(a, b Fault) int { return cmp.Compare(a.At, b.At) })
	// A failover needs the standby the last one rebuilt (about ten
	// seconds), a restart only a running primary: drop what comes too soon.
	var last *Fault
	kept := out[:0]
	for _, f := range out {
		if f.Kind == RestartPostgres || f.Kind == FailoverPostgres {
			gap := restartGap
			if last != nil && last.Kind == FailoverPostgres {
				gap = failoverGap
			}
			if last != nil && f.At-last.At < gap {
				continue
			}
			last = &f
		}
		if meetsRotation(kept, f) {
			continue
		}
		kept = append(kept, f)
	}
	// Every kind at least once, however short the phase: a run that never
	// fails over tests nothing about failover. A restart or failover goes
	// where it keeps its distance from the others.
	// The failover first: it needs the most room.
	order := slices.Clone(rates)
	slices.SortStableFunc(order, func(a, b rate) int {
		return cmp.Compare(b2i(a.kind != FailoverPostgres), b2i(b.kind != FailoverPostgres))
	})
	for _, k := range order {
		if (k.kind == RealAgentKill || k.kind == HostKeyRotation) && s.RealHosts == 0 ||
			slices.ContainsFunc(kept, func(f Fault) bool { return f.Kind == k.kind }) {
			continue
		}
		for range 1000 {
			f := Fault{At: time.Duration(r.Int64N(int64(d) * 3 / 4)), Kind: k.kind}
			switch f.Kind {
			case FailoverPostgres:
				// Late, leaving the early part to a restart.
				f.At = d/2 + time.Duration(r.Int64N(int64(max(d/2-3*time.Second, time.Second))))
			case RestartPostgres:
				f.At = time.Duration(r.Int64N(int64(max(d-3*time.Second, time.Second))))
			}
			k.draw(r, s, &f)
			if f.Kind == StopProcess && f.At+f.For > d {
				f.At = max(0, d-f.For)
			}
			f.For = min(f.For, d-f.At)
			if f.Kind == FailoverPostgres {
				// It makes room: restarts too close to it go.
				kept = slices.DeleteFunc(kept, func(o Fault) bool { return o.Kind == RestartPostgres && !fitsDB([]Fault{o}, f) })
			}
			if (f.Kind == RestartPostgres || f.Kind == FailoverPostgres) && !fitsDB(kept, f) {
				continue
			}
			if meetsRotation(kept, f) {
				continue
			}
			kept = append(kept, f)
			break
		}
	}
	slices.SortStableFunc(kept, func(a, b Fault) int { return cmp.Compare(a.At, b.At) })
	return kept
}

// fitsDB reports whether restart or failover f keeps its distance from
// those of out: restartGap after a restart, failoverGap after a failover.
func fitsDB(out []Fault, f Fault) bool {
	gap := func(first Fault) time.Duration {
		if first.Kind == FailoverPostgres {
			return failoverGap
		}
		return restartGap
	}
	return !slices.ContainsFunc(out, func(o Fault) bool {
		if o.Kind != RestartPostgres && o.Kind != FailoverPostgres {
			return false
		}
		if o.At <= f.At {
			return f.At-o.At < gap(o)
		}
		return o.At-f.At < gap(f)
	})
}

// killToRecovery is how long after a real agent's death its recovery may
// still be trying SSH: the heartbeat timeout, a loop period and the climb.
const killToRecovery = 30 * time.Second

// agentKillMeetsRotation reports whether a and b are a RealAgentKill and a
// HostKeyRotation of one host whose recovery would meet the changed keys:
// every rung then fails on the key mismatch, and the machine is rightly
// quarantined for an operator (R7) instead of healing, which is not what the
// soak tests.
func agentKillMeetsRotation(a, b Fault) bool {
	if a.Kind == HostKeyRotation {
		a, b = b, a
	}
	if a.Kind != RealAgentKill || b.Kind != HostKeyRotation || a.Target != b.Target {
		return false
	}
	return b.At < a.At+killToRecovery && b.At+b.For > a.At
}

// meetsRotation reports whether f and a fault of out are an agent kill
// and a key rotation that agentKillMeetsRotation keeps apart.
func meetsRotation(out []Fault, f Fault) bool {
	return slices.ContainsFunc(out, func(o Fault) bool { return agentKillMeetsRotation(o, f) })
}

// The least time between PostgreSQL restarts and failovers, after a
// restart and after a failover.
const (
	restartGap  = 10 * time.Second
	failoverGap = 30 * time.Second
)

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}
