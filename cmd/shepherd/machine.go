package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/user"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/spf13/cobra"

	"github.com/shepherd/shepherd/bmdb"
)

// machineCLI is what the `shepherd machine` and `shepherd session` commands
// share: the database and the output format.
type machineCLI struct {
	db     databaseFlags
	output string
}

// Output formats of the machine and session commands.
const (
	outputTable = "table"
	outputJSON  = "json"
)

// bindOutput adds --output to cmd, checked before cmd runs.
func (c *machineCLI) bindOutput(cmd *cobra.Command) {
	cmd.Flags().StringVarP(&c.output, "output", "o", outputTable, "output format: table or json")
	cmd.PreRunE = func(*cobra.Command, []string) error {
		if c.output != outputTable && c.output != outputJSON {
			return fmt.Errorf("--output %q is not an output format: use table or json", c.output)
		}
		return nil
	}
}

func (c *machineCLI) open(ctx context.Context) (*bmdb.DB, error) {
	return c.db.open(ctx, bmdb.SchemaRequireCurrent)
}

// resolveMachine finds the machine arg names: its machine id (a UUID),
// its provider id (m3), or provider/id (static/m3) where the same provider
// id is at two providers. A bare provider id found at several providers is
// an error listing them. A UUID that is no machine's provider id is
// returned as the machine id whether or not such a machine exists; the
// caller says if it does not. (Provider ids may be UUIDs too: Equinix
// names devices by UUID.)
func resolveMachine(ctx context.Context, db *bmdb.DB, arg string) (uuid.UUID, error) {
	refs, err := db.MachinesWithProviderID(ctx, arg)
	if err != nil {
		return uuid.Nil, err
	}
	if provider, pid, ok := strings.Cut(arg, "/"); ok && provider != "" && pid != "" {
		at, err := db.MachinesWithProviderID(ctx, pid)
		if err != nil {
			return uuid.Nil, err
		}
		// None of these is in refs: its provider id is pid, not arg.
		for _, r := range at {
			if r.Provider == provider {
				refs = append(refs, r)
			}
		}
	}
	id, uuidErr := uuid.Parse(arg)
	switch {
	case len(refs) == 1:
		return refs[0].MachineID, nil
	case len(refs) > 1:
		names := make([]string, len(refs))
		for i, r := range refs {
			names[i] = fmt.Sprintf("%s/%s (machine %s", r.Provider, r.ProviderID, r.MachineID)
			if r.Decommissioned {
				names[i] += ", decommissioned"
			}
			names[i] += ")"
		}
		return uuid.Nil, fmt.Errorf("%q names %d machines: %s; name one as provider/id or by its machine id",
			arg, len(refs), strings.Join(names, ", "))
	case uuidErr == nil:
		return id, nil
	}
	return uuid.Nil, fmt.Errorf("no machine has the id or provider id %q (a machine id is a UUID; a provider id is as machine list shows it, or provider/id)", arg)
}

// findMachine reads the machine arg names (resolveMachine), its state
// judged by the heartbeat timeouts the recoverers recorded in the BMDB (the
// defaults if none did), as the recoverer judges it; it returns those
// timeouts too. A machine that does not exist is an error saying so.
func findMachine(ctx context.Context, db *bmdb.DB, arg string) (bmdb.MachineDetail, bmdb.SilenceTimeouts, error) {
	id, err := resolveMachine(ctx, db, arg)
	if err != nil {
		return bmdb.MachineDetail{}, bmdb.SilenceTimeouts{}, err
	}
	timeouts, err := db.SilenceTimeouts(ctx)
	if err != nil {
		return bmdb.MachineDetail{}, bmdb.SilenceTimeouts{}, err
	}
	d, err := db.GetMachineWithTimeouts(ctx, id, timeouts.FirstHeartbeat, timeouts.Heartbeat)
	if errors.Is(err, bmdb.ErrNotFound) {
		return d, timeouts, fmt.Errorf("machine %s does not exist", id)
	}
	return d, timeouts, err
}

// parseState parses --state: a derived state as machine list shows it.
func parseState(s string) (bmdb.MachineState, error) {
	st := bmdb.MachineState(s)
	if st.Validate() != nil {
		names := make([]string, 0, len(bmdb.MachineStates()))
		for _, k := range bmdb.MachineStates() {
			names = append(names, string(k))
		}
		return "", fmt.Errorf("--state %q is not a machine state: use one of %s", s, strings.Join(names, ", "))
	}
	return st, nil
}

// parseProcess parses --process.
func parseProcess(s string) (bmdb.Process, error) {
	p := bmdb.Process(s)
	if p.Validate() != nil {
		names := make([]string, 0, len(bmdb.Processes()))
		for _, k := range bmdb.Processes() {
			names = append(names, string(k))
		}
		slices.Sort(names)
		return "", fmt.Errorf("--process %q is not a process: use one of %s", s, strings.Join(names, ", "))
	}
	return p, nil
}

// operator names who runs the CLI, for history and decommission requests.
func operator() string {
	name := "unknown"
	if u, err := user.Current(); err == nil && u.Username != "" {
		name = u.Username
	}
	if h, err := os.Hostname(); err == nil && h != "" {
		name += "@" + h
	}
	return name
}

// confirmed reads the operator's answer to the question just asked: y or
// yes, in any case, is a yes; anything else, or no answer, is a no.
func confirmed(cmd *cobra.Command) bool {
	line, _ := bufio.NewReader(cmd.InOrStdin()).ReadString('\n')
	a := strings.ToLower(strings.TrimSpace(line))
	return a == "y" || a == "yes"
}

// writeJSON writes v as indented JSON.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// timeText formats an optional time for tables: UTC, to the second, with
// how long ago it was.
func timeText(t *time.Time) string {
	if t == nil || t.IsZero() {
		return "-"
	}
	ago := time.Since(*t).Round(time.Second)
	if ago < 0 {
		return t.UTC().Format(time.RFC3339)
	}
	return fmt.Sprintf("%s (%s ago)", t.UTC().Format(time.RFC3339), ago)
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func newMachineCommand() *cobra.Command {
	c := &machineCLI{}
	cmd := &cobra.Command{
		Use:   "machine",
		Short: "List, inspect, reset, power and decommission machines, and accept changed host keys",
		Long: "Reads the machines of the BMDB with their derived states (SPEC §3.7), their tags and their\n" +
			"history, resets backoffs and quarantines, reads and switches their power through their BMCs,\n" +
			"and asks for machines to be decommissioned. A command's ID is the machine's id (a UUID) or its\n" +
			"provider id as machine list shows it (m3), or provider/id (static/m3) where two providers have it.",
	}
	c.db.bind(cmd)
	cmd.AddCommand(c.listCommand(), c.showCommand(), c.historyCommand(), c.resetCommand(), c.decommissionCommand(), c.hostKeyCommand(), c.powerCommand())
	return cmd
}
