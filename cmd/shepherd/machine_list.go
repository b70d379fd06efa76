package main

import (
	"errors"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/spf13/cobra"

	"github.com/shepherd/shepherd/bmdb"
)

// machineJSON is a machine in `machine list --output json`: the keys are
// stable, and absent values are null (times) or "" (text).
type machineJSON struct {
	MachineID        uuid.UUID  `json:"machine_id"`
	State            string     `json:"state"`
	Provider         string     `json:"provider"`
	ProviderID       string     `json:"provider_id"`
	Location         string     `json:"location"`
	Address          string     `json:"address"`
	ProviderStatus   string     `json:"provider_status"`
	AgentStartedAt   *time.Time `json:"agent_started_at"`
	LastHeartbeatAt  *time.Time `json:"last_heartbeat_at"`
	DecommissionedAt *time.Time `json:"decommissioned_at"`
}

func summaryJSON(m bmdb.MachineSummary) machineJSON {
	j := machineJSON{
		MachineID:        m.MachineID,
		State:            string(m.State),
		Provider:         m.Provider,
		ProviderID:       m.ProviderID,
		Location:         m.Location,
		ProviderStatus:   string(m.ProviderStatus),
		AgentStartedAt:   m.AgentStartedAt,
		LastHeartbeatAt:  m.LastHeartbeatAt,
		DecommissionedAt: m.DecommissionedAt,
	}
	if m.Address.IsValid() {
		j.Address = m.Address.String()
	}
	return j
}

func (c *machineCLI) listCommand() *cobra.Command {
	var (
		f      bmdb.MachineFilter
		state  string
		limit  int
		sortBy string
	)
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List machines with their derived states, filtered and searched",
		Long: "Lists machines in id order (--sort provider-id: by provider and provider id), following pages until --limit machines. --search matches a\n" +
			"machine id prefix, a provider id substring or an IP address (exact, CIDR network or prefix),\n" +
			"case-insensitively. Decommissioned machines are left out unless asked for.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if limit < 1 {
				return fmt.Errorf("--limit must be at least 1, got %d", limit)
			}
			if sortBy != sortMachineID && sortBy != sortProviderID {
				return fmt.Errorf("--sort %q is not an order: use %s or %s", sortBy, sortMachineID, sortProviderID)
			}
			if state != "" {
				var err error
				if f.State, err = parseState(state); err != nil {
					return err
				}
			}
			db, err := c.open(cmd.Context())
			if err != nil {
				return err
			}
			defer db.Close()
			// Silent is judged by the timeouts the recoverers recorded in
			// the BMDB (the defaults if none did), as the recoverer judges.
			timeouts, err := db.SilenceTimeouts(cmd.Context())
			if err != nil {
				return err
			}
			f.FirstHeartbeatTimeout, f.HeartbeatTimeout = timeouts.FirstHeartbeat, timeouts.Heartbeat
			machines, err := listMachines(cmd.Context(), db, f, sortBy, limit)
			if errors.Is(err, bmdb.ErrInvalidFilter) {
				return fmt.Errorf("invalid filter: %w", err)
			} else if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if c.output == outputJSON {
				js := make([]machineJSON, len(machines))
				for i, m := range machines {
					js[i] = summaryJSON(m)
				}
				return writeJSON(out, js)
			}
			total, err := db.CountMachines(cmd.Context(), f)
			if err != nil {
				return err
			}
			w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "MACHINE ID\tSTATE\tPROVIDER\tPROVIDER ID\tLOCATION\tADDRESS\tSTATUS\tLAST HEARTBEAT")
			for _, m := range machines {
				addr := "-"
				if m.Address.IsValid() {
					addr = m.Address.String()
				}
				fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", m.MachineID, m.State, orDash(m.Provider), orDash(m.ProviderID),
					orDash(m.Location), addr, orDash(string(m.ProviderStatus)), timeText(m.LastHeartbeatAt))
			}
			if err := w.Flush(); err != nil {
				return err
			}
			fmt.Fprintf(out, "%d of %d matching machines\n", len(machines), total)
			fmt.Fprintf(out, "Silent judged by the %s\n", timeouts.Describe())
			return nil
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&state, "state", "", "only machines in this derived state (Healthy, Silent, Quarantined, ...)")
	fl.StringVar(&f.Provider, "provider", "", "only machines of this provider")
	fl.StringVar(&f.Location, "location", "", "only machines in this location")
	fl.StringVar(&f.Search, "search", "", "machine id prefix, provider id substring or IP address")
	fl.BoolVar(&f.IncludeDecommissioned, "include-decommissioned", false, "list decommissioned machines too")
	fl.IntVar(&limit, "limit", 100, "list at most this many machines")
	fl.StringVar(&sortBy, "sort", sortMachineID, "order: "+sortMachineID+", or "+sortProviderID+" (by provider, then provider id)")
	c.bindOutput(cmd)
	return cmd
}

// listPage is the page size `machine list` reads with.
const listPage = 500
