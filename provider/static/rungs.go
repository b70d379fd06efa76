package static

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"go.yaml.in/yaml/v3"

	"github.com/shepherd/shepherd/ladder"
)

// errNoReinstall refuses the Reinstall rung: ReinstallMachine returns
// provider.ErrUnsupported, so a ladder that names it would end every climb
// with a rung that cannot work. Refusing it when the file is read says so
// where it can be fixed, instead of in a quarantine cause much later.
var errNoReinstall = errors.New("a static inventory cannot reinstall a machine; leave out reinstall")

// rungList is a recovery_rungs list as written, in the defaults or in a
// machine: a machine's list replaces the defaults' list as a whole (a
// ladder is read as one decision, so lists are not merged).
type rungList struct {
	rungs []ladder.Rung       // in ladder order; nil if not given or broken
	lines map[ladder.Rung]int // the line of each rung, for messages
	line  int                 // of the recovery_rungs key
	set   bool                // given and not null, even if broken
}

// rungList parses the recovery_rungs list of f (where names its owner for
// messages).
func (p *parser) rungList(where string, f field) rungList {
	l := rungList{line: f.line}
	if isNull(f.val) {
		return l // null is left out, as for every field
	}
	l.set = true
	rungs, lines, line, err := readRungs(f.key, f.val)
	if err != nil {
		p.errorf(line, "%s%v", where, err)
		return l
	}
	l.rungs, l.lines = rungs, lines
	return l
}

// readRungs reads n, the list of the field key, with ladder.Parse, and
// refuses an empty list and Reinstall. It returns the rungs in ladder order
// and the line of each; on error, the line of the problem and an error
// that starts with key.
func readRungs(key string, n *yaml.Node) ([]ladder.Rung, map[ladder.Rung]int, int, error) {
	if n.Kind != yaml.SequenceNode {
		return nil, nil, n.Line, fmt.Errorf("%s must be a list, not %s", key, kindName(n))
	}
	if len(n.Content) == 0 {
		return nil, nil, n.Line, fmt.Errorf("%s is empty (leave it out for the default)", key)
	}
	names := make([]string, len(n.Content))
	at := make([]int, len(n.Content))
	for i, item := range n.Content {
		item = resolve(item)
		if item.Kind != yaml.ScalarNode {
			return nil, nil, item.Line, fmt.Errorf("%s: a rung must be a single value, not %s", key, kindName(item))
		}
		names[i], at[i] = item.Value, item.Line
	}
	rungs, err := ladder.Parse(names)
	if err != nil {
		// ladder.Parse names the first name it refuses, not where it is:
		// that name ends the shortest prefix of the list it refuses.
		line := n.Line
		for i := range names {
			if _, perr := ladder.Parse(names[:i+1]); perr != nil {
				line = at[i]
				break
			}
		}
		return nil, nil, line, fmt.Errorf("%s: %w", key, err)
	}
	lines := make(map[ladder.Rung]int, len(rungs))
	for i := range names {
		r, _ := ladder.Parse(names[i : i+1]) // the name as Parse spells it (trimmed)
		lines[r[0]] = at[i]
	}
	if slices.Contains(rungs, ladder.Reinstall) {
		return nil, nil, lines[ladder.Reinstall], fmt.Errorf("%s: %w", key, errNoReinstall)
	}
	return rungs, lines, 0, nil
}

// checkRungs is what readRungs checks, for Config.RecoveryRungs set in
// code, and returns the rungs in ladder order.
func checkRungs(rungs []ladder.Rung) ([]ladder.Rung, error) {
	out, err := ladder.Order(rungs)
	if err != nil {
		return nil, err
	}
	if slices.Contains(out, ladder.Reinstall) {
		return nil, errNoReinstall
	}
	return out, nil
}

// machineRungs picks a machine's ladder: its own list, else the defaults',
// else the provider's (Config.RecoveryRungs, given as fallback); nil if none
// gives one. Power needs the machine's BMC. A machine's own list that names
// power without a bmc block is refused: the operator forgot the block or
// meant another ladder, and the file should say which. A list the machine
// inherits is meant for the fleet, in which some machines have BMCs and some
// do not: a machine without one takes the rest of the list (possibly none,
// which the recoverer reports when it needs a rung). A broken list was
// reported where it is written; the machine is then left alone here.
func (p *parser) machineRungs(where string, own, dflt rungList, fallback []ladder.Rung, hasBMC bool) []ladder.Rung {
	switch {
	case own.set:
		if !hasBMC && slices.Contains(own.rungs, ladder.Power) {
			p.errorf(own.lines[ladder.Power], "%srecovery_rungs: power needs a bmc block", where)
		}
		return own.rungs
	case dflt.set:
		return withoutPower(dflt.rungs, hasBMC)
	default:
		return withoutPower(fallback, hasBMC)
	}
}

// withoutPower is rungs without Power unless the machine has a BMC.
func withoutPower(rungs []ladder.Rung, hasBMC bool) []ladder.Rung {
	if hasBMC || !slices.Contains(rungs, ladder.Power) {
		return rungs
	}
	out := []ladder.Rung{}
	for _, r := range rungs {
		if r != ladder.Power {
			out = append(out, r)
		}
	}
	return out
}

// RecoveryRungs returns the rungs of the recovery ladder for machine id,
// in ladder order: its own recovery_rungs, else the defaults', else
// Config.RecoveryRungs, else nil (the recoverer's default). It reads the
// inventory in force, so a reload applies at once; an unknown id is an
// error wrapping provider.ErrNotFound.
func (p *Provider) RecoveryRungs(_ context.Context, id string) ([]ladder.Rung, error) {
	e, err := p.entry(id)
	if err != nil {
		return nil, err
	}
	// A copy: the inventory is shared and never changed.
	return slices.Clone(e.rungs), nil
}
