package sim

import (
	"context"
	"fmt"
	"net"
	"time"

	"connectrpc.com/connect"
)

// Observer receives the ground truth of what the simulated fleet did, for a
// test driver to hold Shepherd's view against. The fleet calls it without
// holding its lock, from many goroutines at once (heartbeat workers, SSH
// sessions, provider calls): an implementation must be safe for concurrent
// use and return quickly, since a slow observer slows the heartbeats. Calls
// about one machine made by different goroutines may arrive out of order;
// the times they carry are when things happened.
type Observer interface {
	// HeartbeatAcked: the server answered OK to a heartbeat of machine
	// id's agent (BMDB machine id machineID), sent at sent and answered at
	// acked; hardware says whether the answer said the hardware report was
	// recorded (only when one was sent). It is called for every answer the
	// server gave, also when the agent was stopped (machine rebooted,
	// killed, taken over again) while the heartbeat was in flight.
	HeartbeatAcked(id, machineID string, sent, acked time.Time, hardware bool)
	// HeartbeatRefused: the server answered with an error (code is the
	// connect code, e.g. connect.CodePermissionDenied). It is not called
	// for transport failures, timeouts or heartbeats a Partition dropped.
	HeartbeatRefused(id, machineID string, sent time.Time, code connect.Code)
	// HeartbeatFailed: the heartbeat got no answer from the server (a
	// transport failure or a timeout), so the server may or may not have
	// recorded it. Not called for heartbeats a Partition dropped, which
	// never left the machine.
	HeartbeatFailed(id, machineID string, sent time.Time)
	// Rebooted: machine id was really rebooted at the given time (provider
	// RebootMachine or ReinstallMachine, Config.RebootCommand run over
	// SSH, or its BMC powering it on after an off); not for failed or hung
	// reboots, and not for the agent's own reboot after an installation.
	Rebooted(id string, at time.Time)
	// AgentStarted: a takeover started an agent for machineID on id (Adopt
	// does not call it).
	AgentStarted(id, machineID string, at time.Time)
}

// RebootFault is what happens to reboots of one machine; see SetRebootFault.
type RebootFault int

const (
	// RebootWorks: reboots work (subject to Config.RebootFailureRate).
	// It is every machine's fault until SetRebootFault says otherwise.
	RebootWorks RebootFault = iota
	// RebootFails: a reboot fails and does nothing. RebootMachine and
	// ReinstallMachine return an error; Config.RebootCommand exits with
	// status 1 and a line on stderr. Counted in Stats.RebootsFailed.
	RebootFails
	// RebootHangs: a reboot never answers and does nothing.
	// RebootMachine and ReinstallMachine block until their context ends
	// and return its error, wrapped; Config.RebootCommand never exits, and
	// its session stays open until the client closes it. Counted in
	// Stats.RebootsHung.
	RebootHangs
	// RebootStaysDown: a reboot is carried out (it returns nil and counts
	// as one), and the machine never comes up again: it hangs on the way,
	// without SSH or agent, as a machine that fails to boot, until a power
	// cycle through its BMC (or Kill, Revive, release) ends that system.
	// Counted in Stats.Reboots.
	RebootStaysDown
)

// String names the fault as its constant does.
func (r RebootFault) String() string {
	switch r {
	case RebootWorks:
		return "RebootWorks"
	case RebootFails:
		return "RebootFails"
	case RebootHangs:
		return "RebootHangs"
	case RebootStaysDown:
		return "RebootStaysDown"
	}
	return fmt.Sprintf("RebootFault(%d)", int(r))
}

// SetRebootFault sets what happens to machine id's reboots from now on,
// whichever way they are asked for (the provider's RebootMachine and
// ReinstallMachine, or Config.RebootCommand over SSH). It belongs to the
// machine and lasts until it is set again.
func (f *Fleet) SetRebootFault(id string, fault RebootFault) error {
	if fault < RebootWorks || fault > RebootStaysDown {
		return fmt.Errorf("sim: setting the reboot fault of %s: unknown fault %v", id, fault)
	}
	i, err := f.lookup(id)
	if err != nil {
		return fmt.Errorf("sim: setting the reboot fault: %w", err)
	}
	f.mu.Lock()
	f.slots[i].rebootFault = uint8(fault)
	f.mu.Unlock()
	f.log.Info("reboot fault set", "provider_id", id, "fault", fault.String())
	return nil
}

// rebootOutcomeLocked decides what a reboot of slot i asked for now does:
// the machine's fault, else an injected failure at RebootFailureRate.
// f.mu must be held.
func (f *Fleet) rebootOutcomeLocked(i int32) RebootFault {
	if fault := RebootFault(f.slots[i].rebootFault); fault != RebootWorks {
		return fault
	}
	if f.chance(f.cfg.RebootFailureRate) {
		return RebootFails
	}
	return RebootWorks
}

// Partition cuts (on) or restores (off) the network between machine id and
// the callback server. While it is on, the heartbeats of whatever agent
// runs on the machine are dropped on the way: they never reach the server,
// and the agent sees each one fail as if the RPC had timed out and retries
// after its usual backoff (the simulated timeout is added to the wait; no
// worker waits for it). A heartbeat already in flight when it is turned on
// is not affected. The partition belongs to the machine, not to its agent:
// it survives reboots and takeovers until it is turned off. Turning it off
// lets an agent that is waiting out a dropped heartbeat send at once, as
// the retransmission of a request reaches the server once the network
// heals. SSH is not affected.
func (f *Fleet) Partition(id string, on bool) error {
	i, err := f.lookup(id)
	if err != nil {
		return fmt.Errorf("sim: partitioning: %w", err)
	}
	f.mu.Lock()
	s := &f.slots[i]
	s.partitioned = on
	if a := s.agent; !on && a != nil && a.dropped && a.index >= 0 && !a.silenced {
		f.scheduleLocked(a, f.now())
	}
	f.mu.Unlock()
	f.log.Info("partition", "provider_id", id, "on", on)
	return nil
}

// Hang freezes machines as a kernel hang does: their agents stop sending
// heartbeats (they stay, silenced, as Agent reports), their SSH servers
// stop answering (open connections close, and dials fail at once with
// ErrUnreachable), and in-band reboots (RebootMachine, ReinstallMachine,
// Config.RebootCommand) cannot reach them: the provider's fail with an
// error wrapping provider.ErrNotReached. What ends the running system ends
// the hang: a power cycle through the machine's BMC (see Config.BMC), Kill,
// release; Revive ends it too, as if the machine recovered by itself.
// Hanging a hung machine does nothing. Nothing is hung if any id is unknown
// or names a machine that is not running (not provisioned, killed, powered
// off), so a benchmark hangs N machines with one call.
func (f *Fleet) Hang(ids ...string) error {
	idx := make([]int32, len(ids))
	for n, id := range ids {
		i, err := f.lookup(id)
		if err != nil {
			return fmt.Errorf("sim: hanging: %w", err)
		}
		idx[n] = i
	}
	f.mu.Lock()
	for n, i := range idx {
		s := &f.slots[i]
		var why string
		switch {
		case !s.used:
			why = "not provisioned"
		case s.killed:
			why = "killed"
		case s.off:
			why = "powered off"
		}
		if why != "" {
			f.mu.Unlock()
			return fmt.Errorf("sim: hanging %s: the machine is %s, nothing runs on it to hang", ids[n], why)
		}
	}
	var conns []net.Conn
	for _, i := range idx {
		s := &f.slots[i]
		if s.hung {
			continue
		}
		s.hung = true
		f.stats.Hung++
		if a := s.agent; a != nil && !a.silenced {
			a.silenced = true
			f.queue.remove(a)
			f.stats.AgentsSilenced++
		}
		for c := range f.conns[i] {
			conns = append(conns, c)
		}
		delete(f.conns, i)
	}
	f.mu.Unlock()
	for _, c := range conns {
		c.Close()
	}
	f.log.Info("machines hung", "machines", len(ids))
	return nil
}

// Provision marks slots as machines of ours without taking them over, as
// the machines of a static inventory are: each becomes used (reachable over
// SSH, rebootable), with no agent. Provisioning a used slot does nothing.
// Nothing is provisioned if any id is unknown.
func (f *Fleet) Provision(ids ...string) error {
	idx := make([]int32, len(ids))
	for n, id := range ids {
		i, err := f.lookup(id)
		if err != nil {
			return fmt.Errorf("sim: provisioning: %w", err)
		}
		idx[n] = i
	}
	f.mu.Lock()
	for _, i := range idx {
		if s := &f.slots[i]; !s.used {
			s.used = true
			f.stats.Used++
		}
	}
	f.mu.Unlock()
	return nil
}

// Agent reports the agent running on machine id: the BMDB machine id it
// heartbeats as ("" if no agent runs), and whether it is alive: running,
// not silenced, on a machine that is not killed or hung. A partitioned agent is
// alive. Unknown ids report "", false.
func (f *Fleet) Agent(id string) (machineID string, alive bool) {
	i, ok := f.index(id)
	if !ok {
		return "", false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	s := &f.slots[i]
	if s.agent == nil {
		return "", false
	}
	return s.agent.machineID, !s.agent.silenced && !s.killed && !s.hung
}

// observeRebooted tells the observer, if any, that slot i rebooted at at.
// f.mu must not be held.
func (f *Fleet) observeRebooted(i int32, at time.Duration) {
	if o := f.cfg.Observer; o != nil {
		o.Rebooted(f.id(i), f.at(at))
	}
}

// hangEvery hangs one running machine every d until ctx ends
// (Config.HangEvery): a machine of ours with an agent that heartbeats, not
// killed, off or hung already, picked by the fleet's random source.
func (f *Fleet) hangEvery(ctx context.Context, d time.Duration) {
	tick := time.NewTicker(d)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		f.mu.Lock()
		var running []int32
		for i := range f.slots {
			s := &f.slots[i]
			if s.used && !s.killed && !s.off && !s.hung && s.agent != nil && !s.agent.silenced {
				running = append(running, int32(i))
			}
		}
		var id string
		if len(running) > 0 {
			id = f.id(running[f.rng.IntN(len(running))])
		}
		f.mu.Unlock()
		if id == "" {
			continue
		}
		if err := f.Hang(id); err != nil {
			f.log.WarnContext(ctx, "hanging a machine (hang_every)", "provider_id", id, "err", err)
		}
	}
}
