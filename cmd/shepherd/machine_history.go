package main

import (
	"fmt"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/shepherd/shepherd/bmdb"
)

func (c *machineCLI) historyCommand() *cobra.Command {
	var (
		process string
		limit   int
	)
	cmd := &cobra.Command{
		Use:   "history ID",
		Short: "Show what was done to a machine and why (the last --limit events, oldest first)",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			f := bmdb.HistoryFilter{Limit: historyPage}
			if process != "" {
				var err error
				if f.Process, err = parseProcess(process); err != nil {
					return err
				}
			}
			if limit < 0 {
				return fmt.Errorf("--limit must be >= 0 (0 = all), got %d", limit)
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
			f.MachineID = d.MachineID
			// History reads oldest first; keep the last limit events.
			events := []bmdb.HistoryEvent{}
			for {
				page, err := db.History(cmd.Context(), f)
				if err != nil {
					return err
				}
				events = append(events, page...)
				if limit > 0 && len(events) > limit {
					events = slices.Clone(events[len(events)-limit:])
				}
				if len(page) < historyPage {
					break
				}
				f.AfterID = page[len(page)-1].ID
			}
			out := cmd.OutOrStdout()
			if c.output == outputJSON {
				return writeJSON(out, events)
			}
			w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "ID\tAT\tPROCESS\tEVENT\tSESSION\tCAUSE")
			for _, e := range events {
				session := "-"
				if e.SessionID != nil {
					session = e.SessionID.String()
				}
				fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%s\t%s\n", e.ID, e.At.UTC().Format(time.RFC3339), e.Process, e.Event, session, orDash(e.Cause))
			}
			if err := w.Flush(); err != nil {
				return err
			}
			if len(events) == 0 {
				fmt.Fprintln(out, "no history")
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&process, "process", "", "only events of this process (AgentStart, Recovery, ...)")
	cmd.Flags().IntVar(&limit, "limit", 100, "show the last this many events (0 = all)")
	c.bindOutput(cmd)
	return cmd
}

// historyPage is the page size `machine history` reads with.
const historyPage = 1000
