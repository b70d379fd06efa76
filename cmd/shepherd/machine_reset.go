package main

import (
	"errors"
	"fmt"
	"strings"

	"github.com/google/uuid"
	"github.com/spf13/cobra"

	"github.com/shepherd/shepherd/bmdb"
)

// maxResetListed is how many machines a filtered reset names before it
// asks; the rest are counted.
const maxResetListed = 20

func (c *machineCLI) resetCommand() *cobra.Command {
	var (
		process, reason, state, providerName string
		all, yes                             bool
	)
	cmd := &cobra.Command{
		Use:   "reset {ID... | --state S | --provider NAME | --all} --process P",
		Short: "Clear machines' backoffs or quarantines for a process, so they are candidates again",
		Long: "Clears the backoff and any quarantine of each machine for the process and writes a Reset\n" +
			"history row naming who asked and why (SPEC §2.5). Name the machines (machine ids or provider\n" +
			"ids), or select every machine with a backoff for the process that is in the derived state\n" +
			"--state (as machine list shows it) and of the provider --provider, or --all of them: such a\n" +
			"reset lists the machines it selected and asks for confirmation unless --yes.",
		Example: "  shepherd machine reset m3 --process AgentStart\n" +
			"  shepherd machine reset --state Quarantined --provider static --process AgentStart --reason 'key installed'",
		RunE: func(cmd *cobra.Command, args []string) error {
			if process == "" {
				return errors.New("--process is required: the process whose backoff to clear")
			}
			p, err := parseProcess(process)
			if err != nil {
				return err
			}
			filtered := state != "" || providerName != "" || all
			switch {
			case len(args) > 0 && filtered:
				return errors.New("name machines or select them with --state, --provider or --all, not both")
			case len(args) == 0 && !filtered:
				return errors.New("name the machines to reset (machine ids or provider ids), or select them with --state, --provider or --all")
			case all && (state != "" || providerName != ""):
				return errors.New("--all selects every machine with a backoff: leave out --state and --provider, or --all")
			}
			f := bmdb.MachineFilter{Provider: providerName}
			if state != "" {
				if f.State, err = parseState(state); err != nil {
					return err
				}
			}
			cause := "reset by " + operator() + " with the shepherd CLI"
			if reason = strings.Join(strings.Fields(reason), " "); reason != "" {
				cause += ": " + reason
			}
			db, err := c.open(cmd.Context())
			if err != nil {
				return err
			}
			defer db.Close()
			if len(args) == 0 {
				// States are judged as the recoverer judges them, by the
				// timeouts it recorded in the BMDB.
				timeouts, err := db.SilenceTimeouts(cmd.Context())
				if err != nil {
					return err
				}
				f.FirstHeartbeatTimeout, f.HeartbeatTimeout = timeouts.FirstHeartbeat, timeouts.Heartbeat
				return c.resetSelected(cmd, db, p, f, all, yes, cause)
			}
			// Every named machine is found before any is reset.
			ids := make([]uuid.UUID, len(args))
			for i, a := range args {
				d, _, err := findMachine(cmd.Context(), db, a)
				if err != nil {
					return err
				}
				ids[i] = d.MachineID
			}
			for _, id := range ids {
				if err := resetOne(cmd, db, id, p, cause); err != nil {
					return err
				}
			}
			return nil
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&process, "process", "", "the process whose backoff to clear (required)")
	fl.StringVar(&reason, "reason", "", "why, for the history")
	fl.StringVar(&state, "state", "", "select the machines with a backoff for --process in this derived state (Quarantined, Provided, ...)")
	fl.StringVar(&providerName, "provider", "", "select the machines with a backoff for --process of this provider")
	fl.BoolVar(&all, "all", false, "select every machine with a backoff for --process")
	fl.BoolVarP(&yes, "yes", "y", false, "do not ask for confirmation of a selected reset")
	return cmd
}

// resetOne resets the backoff for p of machine id, which exists.
func resetOne(cmd *cobra.Command, db *bmdb.DB, id uuid.UUID, p bmdb.Process, cause string) error {
	b, err := db.GetBackoff(cmd.Context(), id, p)
	if errors.Is(err, bmdb.ErrNotFound) {
		return fmt.Errorf("machine %s has no backoff for %s: nothing to reset", id, p)
	} else if err != nil {
		return err
	}
	if err := db.ResetBackoff(cmd.Context(), id, p, cause); errors.Is(err, bmdb.ErrNotFound) {
		return fmt.Errorf("machine %s has no backoff for %s any more: nothing to reset", id, p)
	} else if err != nil {
		return err
	}
	fmt.Fprintf(cmd.OutOrStdout(), "machine %s: cleared the %s %s (failures in a row: %d, last: %s) and wrote history Reset; %s may work on it again\n",
		id, p, backoffWord(b), b.Attempts, b.Cause, p)
	return nil
}

func backoffWord(b bmdb.Backoff) string {
	if b.Quarantined {
		return "quarantine"
	}
	return "backoff"
}

// resetSelected resets the backoffs for p of the machines f selects (all
// of them with all), after the operator confirmed the list.
func (c *machineCLI) resetSelected(cmd *cobra.Command, db *bmdb.DB, p bmdb.Process, f bmdb.MachineFilter, all, yes bool, cause string) error {
	ctx := cmd.Context()
	backoffs, err := db.Backoffs(ctx, p)
	if err != nil {
		return err
	}
	var selected []bmdb.MachineSummary
	after := uuid.Nil
	for len(backoffs) > 0 {
		page, next, err := db.ListMachines(ctx, f, after, bmdb.MaxMachinePage)
		if errors.Is(err, bmdb.ErrInvalidFilter) {
			return fmt.Errorf("invalid filter: %w", err)
		} else if err != nil {
			return err
		}
		for _, m := range page {
			if _, ok := backoffs[m.MachineID]; ok {
				selected = append(selected, m)
			}
		}
		if next == uuid.Nil {
			break
		}
		after = next
	}
	what := selection(p, f, all)
	if len(selected) == 0 {
		return fmt.Errorf("no machine matches (%s): nothing to reset", what)
	}
	out := cmd.OutOrStdout()
	fmt.Fprintf(out, "%d machines match (%s):\n", len(selected), what)
	for i, m := range selected {
		if i == maxResetListed {
			fmt.Fprintf(out, "  ... and %d more\n", len(selected)-maxResetListed)
			break
		}
		b := backoffs[m.MachineID]
		fmt.Fprintf(out, "  %s  %s/%s  %s  %s, failures in a row: %d, last: %s\n", m.MachineID, orDash(m.Provider), orDash(m.ProviderID),
			m.State, backoffWord(b), b.Attempts, b.Cause)
	}
	if !yes {
		fmt.Fprintf(out, "Clear their %s backoffs and quarantines? [y/N] ", p)
		if !confirmed(cmd) {
			return errors.New("not confirmed: nothing was reset")
		}
	}
	var cleared, gone int
	for _, m := range selected {
		err := db.ResetBackoff(ctx, m.MachineID, p, cause)
		switch {
		case errors.Is(err, bmdb.ErrNotFound):
			gone++ // succeeded or reset meanwhile
		case err != nil:
			return fmt.Errorf("after clearing %d of %d: %w", cleared, len(selected), err)
		default:
			cleared++
		}
	}
	fmt.Fprintf(out, "cleared the %s backoffs of %d machines and wrote history Reset; %s may work on them again", p, cleared, p)
	if gone > 0 {
		fmt.Fprintf(out, " (%d had none any more)", gone)
	}
	fmt.Fprintln(out)
	return nil
}

// selection describes what a filtered reset selects.
func selection(p bmdb.Process, f bmdb.MachineFilter, all bool) string {
	parts := []string{"a backoff for " + string(p)}
	if f.State != "" {
		parts = append(parts, "state "+string(f.State))
	}
	if f.Provider != "" {
		parts = append(parts, "provider "+f.Provider)
	}
	if all {
		parts = append(parts, "all")
	}
	return strings.Join(parts, ", ")
}
