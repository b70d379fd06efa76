package main

import (
	"errors"
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"github.com/shepherd/shepherd/bmdb"
)

func (c *machineCLI) resetCommand() *cobra.Command {
	var process, reason string
	cmd := &cobra.Command{
		Use:   "reset ID --process P",
		Short: "Clear a machine's backoff or quarantine for a process, so it is a candidate again",
		Long: "Clears the backoff and any quarantine of the machine for the process and writes a Reset\n" +
			"history row naming who asked and why (SPEC §2.5).",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if process == "" {
				return errors.New("--process is required: the process whose backoff to clear")
			}
			p, err := parseProcess(process)
			if err != nil {
				return err
			}
			db, err := c.open(cmd.Context())
			if err != nil {
				return err
			}
			defer db.Close()
			id, err := resolveMachine(cmd.Context(), db, args[0])
			if err != nil {
				return err
			}
			if _, err := db.GetMachine(cmd.Context(), id); errors.Is(err, bmdb.ErrNotFound) {
				return fmt.Errorf("machine %s does not exist", id)
			} else if err != nil {
				return err
			}
			b, err := db.GetBackoff(cmd.Context(), id, p)
			if errors.Is(err, bmdb.ErrNotFound) {
				return fmt.Errorf("machine %s has no backoff for %s: nothing to reset", id, p)
			} else if err != nil {
				return err
			}
			cause := "reset by " + operator() + " with the shepherd CLI"
			if reason = strings.Join(strings.Fields(reason), " "); reason != "" {
				cause += ": " + reason
			}
			if err := db.ResetBackoff(cmd.Context(), id, p, cause); errors.Is(err, bmdb.ErrNotFound) {
				return fmt.Errorf("machine %s has no backoff for %s any more: nothing to reset", id, p)
			} else if err != nil {
				return err
			}
			what := "backoff"
			if b.Quarantined {
				what = "quarantine"
			}
			fmt.Fprintf(cmd.OutOrStdout(), "machine %s: cleared the %s %s (failures in a row: %d, last: %s) and wrote history Reset; %s may work on it again\n",
				id, p, what, b.Attempts, b.Cause, p)
			return nil
		},
	}
	cmd.Flags().StringVar(&process, "process", "", "the process whose backoff to clear (required)")
	cmd.Flags().StringVar(&reason, "reason", "", "why, for the history")
	return cmd
}
