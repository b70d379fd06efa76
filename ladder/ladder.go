// Package ladder names the rungs of the recovery ladder (SPEC §3.4): the
// actions the recoverer takes, cheapest first, to bring a silent machine's
// agent back. It is a leaf package so that the BMDB (which records each
// rung tried), the providers (which say which rungs a machine allows) and
// the recoverer (which climbs) share one spelling.
package ladder

import (
	"fmt"
	"slices"
	"strings"
)

// Rung is one action of the recovery ladder.
type Rung string

// The rungs, cheapest first. Quarantine, the ladder's end, is not a rung:
// it is what happens when every rung that applies was tried.
const (
	// Agent restarts the agent over SSH without a reboot: the recoverer
	// verifies that the host still answers SSH and hands the machine to
	// the initializer, whose takeover replaces the hung agent.
	Agent Rung = "agent"
	// Reboot is the provider's in-band reboot (over SSH for a static
	// inventory, the cloud's API for a cloud).
	Reboot Rung = "reboot"
	// Power is an out-of-band power cycle through the machine's BMC.
	Power Rung = "power"
	// Reinstall is the provider's reinstall of the operating system.
	Reinstall Rung = "reinstall"
)

// All lists every rung in the order the ladder climbs.
var All = []Rung{Agent, Reboot, Power, Reinstall}

// Default is the ladder of a provider and machine that configure none:
// every rung but Reinstall, which wipes the disk and so is only taken where
// an operator asked for it.
var Default = []Rung{Agent, Reboot, Power}

// Restarts reports whether the rung restarts the machine, so that the
// circuit breaker and the reboot budget count it. Only Agent does not.
func (r Rung) Restarts() bool { return r != Agent }

// Valid reports whether r is one of All.
func (r Rung) Valid() bool { return slices.Contains(All, r) }

// Describe says what the rung does, for history and pages.
func (r Rung) Describe() string {
	switch r {
	case Agent:
		return "restart the agent over SSH"
	case Reboot:
		return "in-band reboot"
	case Power:
		return "power cycle through the BMC"
	case Reinstall:
		return "reinstall through the provider"
	}
	return string(r)
}

// Parse reads a list of rung names (as an operator writes them in a flag or
// an inventory) and returns them in the order the ladder climbs, whatever
// the order given: the ladder always escalates. It refuses an empty list, an
// unknown name and a name given twice, saying which.
func Parse(names []string) ([]Rung, error) {
	rungs := make([]Rung, len(names))
	for i, n := range names {
		rungs[i] = Rung(strings.TrimSpace(n))
	}
	return Order(rungs)
}

// Order checks rungs as Parse checks names (for a ladder set in code) and
// returns them in the order the ladder climbs.
func Order(rungs []Rung) ([]Rung, error) {
	if len(rungs) == 0 {
		return nil, fmt.Errorf("no recovery rungs given; choose from %s", Join(All))
	}
	seen := make(map[Rung]bool, len(rungs))
	for _, r := range rungs {
		if !r.Valid() {
			return nil, fmt.Errorf("unknown recovery rung %q; choose from %s", r, Join(All))
		}
		if seen[r] {
			return nil, fmt.Errorf("recovery rung %q given twice", r)
		}
		seen[r] = true
	}
	out := make([]Rung, 0, len(seen))
	for _, r := range All {
		if seen[r] {
			out = append(out, r)
		}
	}
	return out, nil
}

// ParseList is Parse of a comma-separated list, as a flag takes it.
func ParseList(s string) ([]Rung, error) {
	if strings.TrimSpace(s) == "" {
		return Parse(nil)
	}
	return Parse(strings.Split(s, ","))
}

// Join writes rungs as ParseList reads them.
func Join(rungs []Rung) string {
	s := make([]string, len(rungs))
	for i, r := range rungs {
		s[i] = string(r)
	}
	return strings.Join(s, ",")
}
