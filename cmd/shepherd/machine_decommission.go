package main

import (
	"errors"
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"github.com/shepherd/shepherd/bmdb"
)

func (c *machineCLI) decommissionCommand() *cobra.Command {
	var (
		reason string
		yes    bool
	)
	cmd := &cobra.Command{
		Use:   "decommission ID --reason TEXT",
		Short: "Ask for a machine to leave the fleet",
		Long: "Records a decommission request. The decommissioner then asks the provider to release the\n" +
			"machine, which ends its agent with it; a provider that cannot release (a static inventory) only\n" +
			"forgets the machine, and its agent is stopped over SSH where the host is reachable with a pinned or\n" +
			"recorded host key. It then deletes the machine's live tags (SPEC §3.8); history stays. An agent still\n" +
			"running is refused from then on with PermissionDenied, on which it exits for good.\n" +
			"Asks for confirmation unless --yes.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			reason, err := cleanReason(reason)
			if err != nil {
				return err
			}
			if reason == "" {
				return errors.New("--reason is required: say why the machine should go")
			}
			db, err := c.open(cmd.Context())
			if err != nil {
				return err
			}
			defer db.Close()
			d, _, err := findMachine(cmd.Context(), db, args[0])
			if err != nil {
				return err
			}
			id := d.MachineID
			out := cmd.OutOrStdout()
			if d.State == bmdb.StateDecommissioned {
				return fmt.Errorf("machine %s was decommissioned already at %s", id, timeText(d.DecommissionedAt))
			}
			if r := d.DecommissionRequested; r != nil {
				fmt.Fprintf(out, "machine %s: decommission was requested already at %s by %s: %s; nothing changed\n",
					id, timeText(&r.RequestedAt), orDash(r.RequestedBy), orDash(r.Reason))
				return nil
			}
			if !yes {
				fmt.Fprintf(cmd.ErrOrStderr(), "Decommission machine %s (%s %s, %s, state %s)?\nIt leaves the fleet and the provider is asked to release it. Proceed? [y/N] ",
					id, d.Provider, d.ProviderID, orDash(d.Location), d.State)
				if !confirmed(cmd) {
					return errors.New("not confirmed; nothing changed (pass --yes to skip the question)")
				}
			}
			if err := db.RequestDecommission(cmd.Context(), id, operator(), reason); errors.Is(err, bmdb.ErrNotFound) {
				return fmt.Errorf("machine %s is not in the fleet (decommissioned meanwhile?)", id)
			} else if err != nil {
				return err
			}
			fmt.Fprintf(out, "machine %s: decommission requested; the decommissioner takes it out of the fleet\n", id)
			return nil
		},
	}
	cmd.Flags().StringVar(&reason, "reason", "", "why the machine should go (required)")
	cmd.Flags().BoolVarP(&yes, "yes", "y", false, "do not ask for confirmation")
	return cmd
}

// maxReason bounds an operator's --reason: a sentence or two.
const maxReason = 1000

// cleanReason returns an operator's --reason on one line with single
// spaces, or an error if it is longer than maxReason.
func cleanReason(reason string) (string, error) {
	reason = strings.Join(strings.Fields(reason), " ")
	if len(reason) > maxReason {
		return "", fmt.Errorf("--reason is %d bytes, at most %d", len(reason), maxReason)
	}
	return reason, nil
}
