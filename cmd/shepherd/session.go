package main

import (
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/spf13/cobra"
)

func newSessionCommand() *cobra.Command {
	c := &machineCLI{}
	cmd := &cobra.Command{
		Use:   "session",
		Short: "Look at the sessions of running components",
	}
	c.db.bind(cmd)
	cmd.AddCommand(c.sessionListCommand())
	return cmd
}

// sessionJSON is a session in `session list --output json`.
type sessionJSON struct {
	SessionID uuid.UUID  `json:"session_id"`
	Component string     `json:"component"`
	Hostname  string     `json:"hostname"`
	PID       int        `json:"pid"`
	Version   string     `json:"version"`
	StartedAt time.Time  `json:"started_at"`
	RenewedAt time.Time  `json:"renewed_at"`
	ExpiresAt time.Time  `json:"expires_at"`
	LeaseMs   int64      `json:"lease_ms"`
	Alive     bool       `json:"alive"`
	ClosedAt  *time.Time `json:"closed_at"`
	Work      int        `json:"work"`
}

func (c *machineCLI) sessionListCommand() *cobra.Command {
	var (
		all   bool
		limit int
	)
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List live sessions (with --all, closed and expired ones too), newest first",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if limit < 1 {
				return fmt.Errorf("--limit must be at least 1, got %d", limit)
			}
			db, err := c.open(cmd.Context())
			if err != nil {
				return err
			}
			defer db.Close()
			sessions, err := db.ListSessions(cmd.Context(), all, limit)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if c.output == outputJSON {
				js := make([]sessionJSON, len(sessions))
				for i, s := range sessions {
					js[i] = sessionJSON{
						SessionID: s.SessionID, Component: s.Component, Hostname: s.Hostname, PID: s.PID, Version: s.Version,
						StartedAt: s.StartedAt, RenewedAt: s.RenewedAt, ExpiresAt: s.ExpiresAt, LeaseMs: s.Lease.Milliseconds(),
						Alive: s.Alive, ClosedAt: s.ClosedAt, Work: s.Work,
					}
				}
				return writeJSON(out, js)
			}
			w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "SESSION ID\tCOMPONENT\tHOST\tPID\tVERSION\tSTARTED\tSTATE\tWORK")
			for _, s := range sessions {
				state := "alive, renewed " + timeText(&s.RenewedAt)
				switch {
				case s.ClosedAt != nil:
					state = "closed " + timeText(s.ClosedAt)
				case !s.Alive:
					state = "expired " + timeText(&s.ExpiresAt)
				}
				fmt.Fprintf(w, "%s\t%s\t%s\t%d\t%s\t%s\t%s\t%d\n", s.SessionID, s.Component, orDash(s.Hostname), s.PID,
					orDash(s.Version), timeText(&s.StartedAt), state, s.Work)
			}
			if err := w.Flush(); err != nil {
				return err
			}
			if len(sessions) == 0 {
				fmt.Fprintln(out, "no sessions")
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&all, "all", false, "include closed and expired sessions")
	cmd.Flags().IntVar(&limit, "limit", 100, "list at most this many sessions")
	c.bindOutput(cmd)
	return cmd
}
