package chaos

import (
	"slices"
	"sync"
	"time"

	"connectrpc.com/connect"
)

// Ack is a heartbeat the callback server answered OK.
type Ack struct {
	Sent, Acked time.Time
	MachineID   string
	Hardware    bool // the answer said the hardware report was recorded
}

// Refusal is a heartbeat the callback server answered with an error.
type Refusal struct {
	Sent      time.Time
	MachineID string
	Code      connect.Code
}

// Failure is a heartbeat that got no answer (a transport error, a timeout,
// a partition): the server may have recorded it all the same.
type Failure struct {
	Sent      time.Time
	MachineID string
}

// Start is a takeover that started an agent.
type Start struct {
	At        time.Time
	MachineID string
}

// MachineTruth is what really happened to one simulated machine.
type MachineTruth struct {
	Acks     []Ack
	Refusals []Refusal
	Failures []Failure
	Reboots  []time.Time // reboots that happened (not failed or hung ones)
	Starts   []Start
}

// Truth is the simulator's ground truth, recorded as it happens: it is the
// simulated fleet's Observer. Safe for concurrent use.
type Truth struct {
	mu       sync.Mutex
	machines map[string]*MachineTruth // by provider id
}

// NewTruth returns an empty record.
func NewTruth() *Truth { return &Truth{machines: map[string]*MachineTruth{}} }

func (t *Truth) machine(id string) *MachineTruth {
	m := t.machines[id]
	if m == nil {
		m = &MachineTruth{}
		t.machines[id] = m
	}
	return m
}

// HeartbeatAcked records a heartbeat the server answered OK.
func (t *Truth) HeartbeatAcked(id, machineID string, sent, acked time.Time, hardware bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	m := t.machine(id)
	m.Acks = append(m.Acks, Ack{Sent: sent, Acked: acked, MachineID: machineID, Hardware: hardware})
}

// HeartbeatRefused records a heartbeat the server answered with an error.
func (t *Truth) HeartbeatRefused(id, machineID string, sent time.Time, code connect.Code) {
	t.mu.Lock()
	defer t.mu.Unlock()
	m := t.machine(id)
	m.Refusals = append(m.Refusals, Refusal{Sent: sent, MachineID: machineID, Code: code})
}

// HeartbeatFailed records a heartbeat that got no answer.
func (t *Truth) HeartbeatFailed(id, machineID string, sent time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	m := t.machine(id)
	m.Failures = append(m.Failures, Failure{Sent: sent, MachineID: machineID})
}

// Rebooted records a reboot that happened.
func (t *Truth) Rebooted(id string, at time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	m := t.machine(id)
	m.Reboots = append(m.Reboots, at)
}

// AgentStarted records a takeover that started an agent.
func (t *Truth) AgentStarted(id, machineID string, at time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	m := t.machine(id)
	m.Starts = append(m.Starts, Start{At: at, MachineID: machineID})
}

// Machine returns a copy of what happened to machine id.
func (t *Truth) Machine(id string) MachineTruth {
	t.mu.Lock()
	defer t.mu.Unlock()
	m := t.machines[id]
	if m == nil {
		return MachineTruth{}
	}
	return MachineTruth{
		Acks: slices.Clone(m.Acks), Refusals: slices.Clone(m.Refusals), Failures: slices.Clone(m.Failures),
		Reboots: slices.Clone(m.Reboots), Starts: slices.Clone(m.Starts),
	}
}

// LastAcks returns, per machine, the latest-sent heartbeat the server
// acknowledged so far.
func (t *Truth) LastAcks() map[string]Ack {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make(map[string]Ack, len(t.machines))
	for id, m := range t.machines {
		for _, a := range m.Acks {
			if a.Sent.After(out[id].Sent) {
				out[id] = a
			}
		}
	}
	return out
}

// The checks below judge a machine's record; margin absorbs the clock
// granularity between PostgreSQL's now() and Go's (one clock, this host's).
const margin = 50 * time.Millisecond

// AliveAt returns a heartbeat that proves the machine's agent was alive
// and recorded within timeout before at: sent after at-timeout and
// acknowledged (so committed) before at. A reboot admitted at at, for a
// machine silent for timeout, is false if there is one (I2).
func (m MachineTruth) AliveAt(at time.Time, timeout time.Duration) (Ack, bool) {
	for _, a := range m.Acks {
		if a.Acked.Before(at.Add(-margin)) && a.Sent.After(at.Add(-timeout+margin)) {
			return a, true
		}
	}
	return Ack{}, false
}

// RebootsWithoutStart returns the reboots that followed another reboot
// with no agent started in between: a second reboot of one silence (I3).
func (m MachineTruth) RebootsWithoutStart() []time.Time {
	var out []time.Time
	for i := 1; i < len(m.Reboots); i++ {
		prev, cur := m.Reboots[i-1], m.Reboots[i]
		started := slices.ContainsFunc(m.Starts, func(s Start) bool { return s.At.After(prev) && !s.At.After(cur) })
		if !started {
			out = append(out, cur)
		}
	}
	return out
}

// Explains reports whether a heartbeat time the BMDB holds for the machine
// can come from an honest heartbeat: one acknowledged, sent at or before it
// and answered at or after it, or one sent at most unansweredBound before it
// that got no answer or a refusal that leaves its outcome open (it may
// have been recorded). A time no honest heartbeat explains
// was written by someone else (I8).
func (m MachineTruth) Explains(at time.Time) bool {
	return slices.ContainsFunc(m.Acks, func(a Ack) bool {
		return !a.Sent.After(at.Add(margin)) && !a.Acked.Before(at.Add(-margin))
	}) || slices.ContainsFunc(m.Failures, func(f Failure) bool {
		return !f.Sent.After(at.Add(margin)) && !at.After(f.Sent.Add(unansweredBound))
	}) || slices.ContainsFunc(m.Refusals, func(r Refusal) bool {
		return r.MaybeRecorded() && !r.Sent.After(at.Add(margin)) && !at.After(r.Sent.Add(unansweredBound))
	})
}

// MaybeRecorded reports whether the server may have recorded the heartbeat
// it refused: it answers Unavailable (or timed out, or failed inside) when
// the database did not say how a write went, such as a commit whose reply
// a database restart cut off. Refusals for cause (a wrong key, a bad
// request) were never written.
func (r Refusal) MaybeRecorded() bool {
	switch r.Code {
	case connect.CodeUnavailable, connect.CodeDeadlineExceeded, connect.CodeCanceled,
		connect.CodeUnknown, connect.CodeInternal, connect.CodeAborted:
		return true
	}
	return false
}

// unansweredBound is how long after it was sent a heartbeat that got no
// answer may still be recorded: the agent's RPC timeout and the server's
// time to commit a batch, with room.
const unansweredBound = 30 * time.Second

// Counts sums the record over every machine, for the soak's report: checks
// that found nothing had this much to look at.
func (t *Truth) Counts() (acks, refusals, failures, reboots, starts int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, m := range t.machines {
		acks += len(m.Acks)
		refusals += len(m.Refusals)
		failures += len(m.Failures)
		reboots += len(m.Reboots)
		starts += len(m.Starts)
	}
	return acks, refusals, failures, reboots, starts
}

// RefusalCodes counts the refused heartbeats by the server's answer.
func (t *Truth) RefusalCodes() map[string]int {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := map[string]int{}
	for _, m := range t.machines {
		for _, r := range m.Refusals {
			out[r.Code.String()]++
		}
	}
	return out
}
