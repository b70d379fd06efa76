package bmdb

import "fmt"

// Process names a kind of work on a machine. The set is closed: the processes
// table holds the same names, and whether each one acts on the machine itself.
type Process string

// The processes Shepherd runs. Those marked machine-exclusive act on the
// machine itself, and the database lets at most one of them hold a machine.
const (
	ProcessAgentStart     Process = "AgentStart"     // machine-exclusive: SSH in and start the agent
	ProcessRecovery       Process = "Recovery"       // machine-exclusive: reboot a silent machine
	ProcessReinstall      Process = "Reinstall"      // machine-exclusive: reinstall through the provider
	ProcessDecommission   Process = "Decommission"   // machine-exclusive: remove from the fleet
	ProcessPower          Process = "Power"          // machine-exclusive: an operator's power action through the BMC
	ProcessProviderUpdate Process = "ProviderUpdate" // refresh provider status; touches only the BMDB
)

var processExclusive = map[Process]bool{
	ProcessAgentStart:     true,
	ProcessRecovery:       true,
	ProcessReinstall:      true,
	ProcessDecommission:   true,
	ProcessPower:          true,
	ProcessProviderUpdate: false,
}

// Processes returns every known process, in no particular order.
func Processes() []Process {
	ps := make([]Process, 0, len(processExclusive))
	for p := range processExclusive {
		ps = append(ps, p)
	}
	return ps
}

// MachineExclusive reports whether p acts on the machine itself and so
// excludes every other machine-exclusive process from it.
func (p Process) MachineExclusive() bool { return processExclusive[p] }

// Validate returns an error naming p if it is not a known process.
func (p Process) Validate() error {
	if _, ok := processExclusive[p]; !ok {
		return fmt.Errorf("bmdb: unknown process %q", string(p))
	}
	return nil
}

// Event is the kind of a history row.
type Event string

// History events (SPEC §2.2, work_history).
const (
	EventStarted     Event = "Started"
	EventFinished    Event = "Finished"
	EventFailed      Event = "Failed"
	EventCanceled    Event = "Canceled"
	EventExpired     Event = "Expired"
	EventQuarantined Event = "Quarantined"
	EventReset       Event = "Reset"
	// EventRequested records an operator's request (decommission, OS
	// installation); it starts no work by itself.
	EventRequested Event = "Requested"
	// EventHeld ends work that a safety limit gave back without acting
	// (the recovery circuit breaker's reboot budget); the cause says
	// which limit and its figures. Unlike Canceled it is not a shutdown.
	EventHeld Event = "Held"
	// EventInstalling, EventInstalled and EventInstallFailed record an
	// OS installation's course (process Reinstall): the request handed to
	// the agent, and the agent's report of success or failure (the cause
	// carries its error). They start and end no work.
	EventInstalling    Event = "Installing"
	EventInstalled     Event = "Installed"
	EventInstallFailed Event = "InstallFailed"
)
