package main

import (
	"bufio"
	"context"
	"encoding/json"
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

// bindOutput adds --output to cmd.
func (c *machineCLI) bindOutput(cmd *cobra.Command) {
	cmd.Flags().StringVarP(&c.output, "output", "o", outputTable, "output format: table or json")
}

// checkOutput validates --output before anything is read.
func (c *machineCLI) checkOutput() error {
	if c.output != outputTable && c.output != outputJSON {
		return fmt.Errorf("--output %q is not an output format: use table or json", c.output)
	}
	return nil
}

func (c *machineCLI) open(ctx context.Context) (*bmdb.DB, error) {
	return c.db.open(ctx, bmdb.SchemaRequireCurrent)
}

// parseMachineID parses the machine id argument.
func parseMachineID(arg string) (uuid.UUID, error) {
	id, err := uuid.Parse(arg)
	if err != nil {
		return uuid.Nil, fmt.Errorf("machine id %q is not a UUID", arg)
	}
	return id, nil
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
			"and asks for machines to be decommissioned.",
	}
	c.db.bind(cmd)
	cmd.AddCommand(c.listCommand(), c.showCommand(), c.historyCommand(), c.resetCommand(), c.decommissionCommand(), c.hostKeyCommand(), c.powerCommand())
	return cmd
}
