package main

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/user"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/spf13/cobra"
	"golang.org/x/crypto/ssh"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb"
)

// machineCLI is what the `shepherd machine` and `shepherd session` commands
// share: the database and the output format.
type machineCLI struct {
	db     databaseFlags
	output string
	// firstHeartbeatTimeout and heartbeatTimeout decide which machines are
	// Silent, as the recoverer's flags of the same names do.
	firstHeartbeatTimeout, heartbeatTimeout time.Duration
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

// bindTimeouts adds the flags that decide Silent to cmd.
func (c *machineCLI) bindTimeouts(cmd *cobra.Command) {
	cmd.Flags().DurationVar(&c.firstHeartbeatTimeout, "first-heartbeat-timeout", bmdb.DefaultFirstHeartbeatTimeout,
		"a started agent without a heartbeat for this long is Silent (as the recoverer's flag)")
	cmd.Flags().DurationVar(&c.heartbeatTimeout, "heartbeat-timeout", bmdb.DefaultHeartbeatTimeout,
		"an agent whose last heartbeat is older than this is Silent (as the recoverer's flag)")
}

// checkOutput validates --output and the timeouts before anything is read.
func (c *machineCLI) checkOutput() error {
	if c.output != outputTable && c.output != outputJSON {
		return fmt.Errorf("--output %q is not an output format: use table or json", c.output)
	}
	if c.firstHeartbeatTimeout < 0 || c.heartbeatTimeout < 0 {
		return errors.New("--first-heartbeat-timeout and --heartbeat-timeout must not be negative")
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

// listPage is the page size `machine list` reads with.
const listPage = 500

func (c *machineCLI) listCommand() *cobra.Command {
	var (
		f     bmdb.MachineFilter
		state string
		limit int
	)
	cmd := &cobra.Command{
		Use:   "list",
		Short: "List machines with their derived states, filtered and searched",
		Long: "Lists machines in id order, following pages until --limit machines. --search matches a\n" +
			"machine id prefix, a provider id substring or an IP address (exact, CIDR network or prefix),\n" +
			"case-insensitively. Decommissioned machines are left out unless asked for.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := c.checkOutput(); err != nil {
				return err
			}
			if limit < 1 {
				return fmt.Errorf("--limit must be at least 1, got %d", limit)
			}
			if state != "" {
				f.State = bmdb.MachineState(state)
				if f.State.Validate() != nil {
					names := make([]string, 0, len(bmdb.MachineStates()))
					for _, s := range bmdb.MachineStates() {
						names = append(names, string(s))
					}
					return fmt.Errorf("--state %q is not a machine state: use one of %s", state, strings.Join(names, ", "))
				}
			}
			f.FirstHeartbeatTimeout, f.HeartbeatTimeout = c.firstHeartbeatTimeout, c.heartbeatTimeout
			db, err := c.open(cmd.Context())
			if err != nil {
				return err
			}
			defer db.Close()
			var machines []bmdb.MachineSummary
			after := uuid.Nil
			for len(machines) < limit {
				page, next, err := db.ListMachines(cmd.Context(), f, after, min(listPage, limit-len(machines)))
				if errors.Is(err, bmdb.ErrInvalidFilter) {
					return fmt.Errorf("invalid filter: %w", err)
				} else if err != nil {
					return err
				}
				machines = append(machines, page...)
				if next == uuid.Nil {
					break
				}
				after = next
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
	c.bindOutput(cmd)
	c.bindTimeouts(cmd)
	return cmd
}

// machineDetailJSON is `machine show --output json`: every tag, with the
// stored protobufs decoded (protojson). The keys are stable; absent tags
// are null.
type machineDetailJSON struct {
	machineJSON
	CreatedAt        time.Time       `json:"created_at"`
	ReservationID    string          `json:"reservation_id"`
	ProviderStatusAt *time.Time      `json:"provider_status_at"`
	AgentPhase       string          `json:"agent_phase"`
	AgentPublicKey   *string         `json:"agent_public_key"` // base64
	HardwareReportAt *time.Time      `json:"hardware_report_at"`
	HardwareReport   json.RawMessage `json:"hardware_report"`
	// HardwareReportError says why a stored report does not decode.
	HardwareReportError *string              `json:"hardware_report_error"`
	Installation        *installationJSON    `json:"installation"`
	Work                []workJSON           `json:"work"`
	Backoffs            []backoffJSON        `json:"backoffs"`
	HostKey             *hostKeyJSON         `json:"host_key"`
	DecommissionRequest *decommissionReqJSON `json:"decommission_request"`
	Power               *powerJSON           `json:"power"`
	RecoveryLadder      []rungJSON           `json:"recovery_ladder"`
}

// rungJSON is one rung of the recovery ladder taken since the last
// heartbeat.
type rungJSON struct {
	Rung    string    `json:"rung"`
	At      time.Time `json:"at"`
	Failed  bool      `json:"failed"`
	Reached bool      `json:"reached"`
	Result  string    `json:"result"`
}

// powerJSON is the last known power state (`machine power`).
type powerJSON struct {
	BMC        string     `json:"bmc"`
	State      string     `json:"state"` // on, off, or "" if never read through this BMC
	StateAt    *time.Time `json:"state_at"`
	ErrorClass string     `json:"error_class"`
	Error      string     `json:"error"`
	CheckedAt  time.Time  `json:"checked_at"`
}

type installationJSON struct {
	RequestGeneration int64           `json:"request_generation"`
	RequestedAt       *time.Time      `json:"requested_at"`
	Request           json.RawMessage `json:"request"`
	ReportGeneration  *int64          `json:"report_generation"`
	ReportSuccess     *bool           `json:"report_success"`
	ReportError       string          `json:"report_error"`
	ReportedAt        *time.Time      `json:"reported_at"`
	Installed         bool            `json:"installed"`
}

type workJSON struct {
	Process   string    `json:"process"`
	SessionID uuid.UUID `json:"session_id"`
	Component string    `json:"component"`
	StartedAt time.Time `json:"started_at"`
}

type backoffJSON struct {
	Process       string     `json:"process"`
	Until         time.Time  `json:"until"`
	IntervalMs    int64      `json:"interval_ms"`
	Attempts      int        `json:"attempts"`
	Quarantined   bool       `json:"quarantined"`
	QuarantinedAt *time.Time `json:"quarantined_at"`
	Active        bool       `json:"active"`
	Cause         string     `json:"cause"`
	UpdatedAt     time.Time  `json:"updated_at"`
}

type hostKeyJSON struct {
	Key         string     `json:"key"` // authorized_keys format, or base64 if it does not parse
	Fingerprint string     `json:"fingerprint"`
	Pinned      bool       `json:"pinned"`
	RecordedAt  *time.Time `json:"recorded_at"`
	// Offered is the key the machine presented instead, to accept; null if none.
	Offered *offeredHostKeyJSON `json:"offered"`
}

type offeredHostKeyJSON struct {
	Key         string     `json:"key"`
	Fingerprint string     `json:"fingerprint"`
	OfferedAt   *time.Time `json:"offered_at"`
	// Accept is the command that accepts the key.
	Accept string `json:"accept"`
}

type decommissionReqJSON struct {
	RequestedAt *time.Time `json:"requested_at"`
	RequestedBy string     `json:"requested_by"`
	Reason      string     `json:"reason"`
}

// protoJSON decodes a stored protobuf into m and renders it as JSON.
func protoJSON(raw []byte, m proto.Message) (json.RawMessage, error) {
	if err := proto.Unmarshal(raw, m); err != nil {
		return nil, err
	}
	b, err := protojson.Marshal(m)
	if err != nil {
		return nil, err
	}
	return json.RawMessage(b), nil
}

// hostKey renders a host key in SSH wire format.
func hostKey(raw []byte) (key, fingerprint string) {
	k, err := ssh.ParsePublicKey(raw)
	if err != nil {
		return base64.StdEncoding.EncodeToString(raw), "unparsable key"
	}
	return strings.TrimSpace(string(ssh.MarshalAuthorizedKey(k))), ssh.FingerprintSHA256(k)
}

func detailJSON(d bmdb.MachineDetail) machineDetailJSON {
	j := machineDetailJSON{
		machineJSON:      summaryJSON(d.MachineSummary),
		CreatedAt:        d.CreatedAt,
		ReservationID:    d.Provided.ReservationID,
		AgentPhase:       string(d.Provided.AgentPhase),
		HardwareReportAt: d.HardwareReportAt,
		Work:             []workJSON{},
		Backoffs:         []backoffJSON{},
	}
	if !d.Provided.StatusAt.IsZero() {
		at := d.Provided.StatusAt
		j.ProviderStatusAt = &at
	}
	if len(d.AgentPublicKey) > 0 {
		k := base64.StdEncoding.EncodeToString(d.AgentPublicKey)
		j.AgentPublicKey = &k
	}
	if len(d.HardwareReportRaw) > 0 {
		hw, err := protoJSON(d.HardwareReportRaw, &agentv1.HardwareReport{})
		if err != nil {
			msg := "stored report does not decode: " + err.Error()
			j.HardwareReportError = &msg
		} else {
			j.HardwareReport = hw
		}
	}
	if in := d.Installation; in != nil {
		ij := &installationJSON{RequestGeneration: in.RequestGeneration, Installed: in.Installed()}
		if in.RequestGeneration > 0 {
			at := in.RequestedAt
			ij.RequestedAt = &at
			if req, err := protoJSON(in.Request, &agentv1.OSInstallationRequest{}); err == nil {
				ij.Request = req
			}
		}
		if r := in.Report; r != nil {
			gen, ok, at := r.Generation, r.Success, in.ReportedAt
			ij.ReportGeneration, ij.ReportSuccess, ij.ReportError, ij.ReportedAt = &gen, &ok, r.Error, &at
		}
		j.Installation = ij
	}
	if p := d.Power; p != nil {
		j.Power = &powerJSON{BMC: p.BMC, State: p.State, StateAt: p.StateAt, ErrorClass: p.ErrorClass, Error: p.Error, CheckedAt: p.CheckedAt}
	}
	for _, r := range d.Ladder {
		j.RecoveryLadder = append(j.RecoveryLadder, rungJSON{Rung: string(r.Rung), At: r.At, Failed: r.Failed, Reached: r.Reached, Result: r.Result})
	}
	for _, w := range d.Work {
		j.Work = append(j.Work, workJSON{Process: string(w.Process), SessionID: w.SessionID, Component: w.Component, StartedAt: w.StartedAt})
	}
	for _, b := range d.Backoffs {
		j.Backoffs = append(j.Backoffs, backoffJSON{
			Process: string(b.Process), Until: b.Until, IntervalMs: b.Interval.Milliseconds(), Attempts: b.Attempts,
			Quarantined: b.Quarantined, QuarantinedAt: b.QuarantinedAt, Active: b.Active, Cause: b.Cause, UpdatedAt: b.UpdatedAt,
		})
	}
	if len(d.HostKey) > 0 {
		k, fp := hostKey(d.HostKey)
		j.HostKey = &hostKeyJSON{Key: k, Fingerprint: fp, Pinned: d.HostKeyPinned, RecordedAt: d.HostKeyRecordedAt}
		if len(d.OfferedHostKey) > 0 {
			k, _ := hostKey(d.OfferedHostKey)
			fp := bmdb.HostKeyFingerprint(d.OfferedHostKey)
			j.HostKey.Offered = &offeredHostKeyJSON{Key: k, Fingerprint: fp, OfferedAt: d.OfferedHostKeyAt, Accept: bmdb.AcceptHostKeyCommand(d.MachineID, fp)}
		}
	}
	if r := d.DecommissionRequested; r != nil {
		dj := &decommissionReqJSON{RequestedBy: r.RequestedBy, Reason: r.Reason}
		if !r.RequestedAt.IsZero() {
			at := r.RequestedAt
			dj.RequestedAt = &at
		}
		j.DecommissionRequest = dj
	}
	return j
}

func (c *machineCLI) showCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "show ID",
		Short: "Show a machine with all of its tags, its work and its backoffs",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			id, err := parseMachineID(args[0])
			if err != nil {
				return err
			}
			if err := c.checkOutput(); err != nil {
				return err
			}
			db, err := c.open(cmd.Context())
			if err != nil {
				return err
			}
			defer db.Close()
			d, err := db.GetMachineWithTimeouts(cmd.Context(), id, c.firstHeartbeatTimeout, c.heartbeatTimeout)
			if errors.Is(err, bmdb.ErrNotFound) {
				return fmt.Errorf("machine %s does not exist", id)
			} else if err != nil {
				return err
			}
			if c.output == outputJSON {
				return writeJSON(cmd.OutOrStdout(), detailJSON(d))
			}
			return writeDetail(cmd.OutOrStdout(), d)
		},
	}
	c.bindOutput(cmd)
	c.bindTimeouts(cmd)
	return cmd
}

// writeDetail writes a machine as aligned "field: value" lines, section by
// section.
func writeDetail(out io.Writer, d bmdb.MachineDetail) error {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	line := func(k, format string, a ...any) { fmt.Fprintf(w, "%s:\t%s\n", k, fmt.Sprintf(format, a...)) }
	section := func(name string) { fmt.Fprintf(w, "\n%s\n", name) }
	line("Machine", "%s", d.MachineID)
	line("State", "%s", d.State)
	line("Created", "%s", timeText(&d.CreatedAt))
	if d.DecommissionedAt != nil {
		line("Decommissioned", "%s", timeText(d.DecommissionedAt))
	}

	section("Provider")
	line("  Provider", "%s", orDash(d.Provider))
	line("  Provider id", "%s", orDash(d.ProviderID))
	line("  Location", "%s", orDash(d.Location))
	if d.Provided.MachineID != uuid.Nil {
		addr := "-"
		if d.Address.IsValid() {
			addr = d.Address.String()
		}
		line("  Address", "%s", addr)
		line("  Reservation", "%s", orDash(d.Provided.ReservationID))
		statusAt := d.Provided.StatusAt
		line("  Status", "%s since %s", d.ProviderStatus, timeText(&statusAt))
		line("  Agent phase", "%s", d.Provided.AgentPhase)
	} else {
		line("  Provided", "no (what the decommission record kept)")
	}

	section("Power")
	writePower(line, d)
	if len(d.Ladder) > 0 {
		section("Recovery ladder (since the last heartbeat)")
		for _, r := range d.Ladder {
			at := r.At
			line("  "+string(r.Rung), "%s: %s", timeText(&at), strings.TrimPrefix(r.String(), string(r.Rung)+" "))
		}
	}

	section("Agent")
	line("  Started", "%s", timeText(d.AgentStartedAt))
	key := "-"
	if len(d.AgentPublicKey) > 0 {
		key = base64.StdEncoding.EncodeToString(d.AgentPublicKey)
	}
	line("  Public key", "%s", key)
	line("  Last heartbeat", "%s", timeText(d.LastHeartbeatAt))
	if len(d.HostKey) > 0 {
		k, fp := hostKey(d.HostKey)
		pinned := "recorded on first use"
		if d.HostKeyPinned {
			pinned = "pinned by the provider"
		}
		line("  SSH host key", "%s (%s, %s)", fp, pinned, timeText(d.HostKeyRecordedAt))
		line("  Host key", "%s", k)
		if len(d.OfferedHostKey) > 0 {
			ok, _ := hostKey(d.OfferedHostKey)
			ofp := bmdb.HostKeyFingerprint(d.OfferedHostKey)
			line("  Presented instead", "%s at %s: %s", ofp, timeText(d.OfferedHostKeyAt), ok)
			line("  Accept it with", "%s", bmdb.AcceptHostKeyCommand(d.MachineID, ofp))
		}
	} else {
		line("  SSH host key", "-")
	}

	section("Hardware")
	if len(d.HardwareReportRaw) == 0 {
		line("  Report", "none yet")
	} else {
		line("  Reported", "%s", timeText(d.HardwareReportAt))
		var hw agentv1.HardwareReport
		if err := proto.Unmarshal(d.HardwareReportRaw, &hw); err != nil {
			line("  Report", "stored report does not decode: %v", err)
		} else {
			writeHardware(line, &hw)
		}
	}

	section("Installation")
	if in := d.Installation; in == nil {
		line("  Requested", "never")
	} else {
		if in.RequestGeneration > 0 {
			var req agentv1.OSInstallationRequest
			desc := "(request does not decode)"
			if proto.Unmarshal(in.Request, &req) == nil {
				desc = fmt.Sprintf("%s (sha256 %s) to %s, reboot %v", req.GetImageUrl(), req.GetImageSha256(), req.GetTargetDevice(), req.GetRebootAfter())
			}
			requestedAt := in.RequestedAt
			line("  Requested", "generation %d at %s: %s", in.RequestGeneration, timeText(&requestedAt), desc)
		}
		reportedAt := in.ReportedAt
		switch {
		case in.Report == nil:
			line("  Report", "none yet")
		case in.Installed():
			line("  Report", "installed (generation %d, %s)", in.Report.Generation, timeText(&reportedAt))
		case in.Report.Success:
			line("  Report", "generation %d succeeded (%s); a newer one is pending", in.Report.Generation, timeText(&reportedAt))
		default:
			line("  Report", "generation %d failed (%s): %s", in.Report.Generation, timeText(&reportedAt), in.Report.Error)
		}
	}

	section("Work")
	if len(d.Work) == 0 {
		line("  Live work", "none")
	}
	for _, wk := range d.Work {
		startedAt := wk.StartedAt
		line("  "+string(wk.Process), "held by %s session %s since %s", wk.Component, wk.SessionID, timeText(&startedAt))
	}

	section("Backoffs")
	if len(d.Backoffs) == 0 {
		line("  Backoffs", "none")
	}
	for _, b := range d.Backoffs {
		var what string
		switch {
		case b.Quarantined:
			what = fmt.Sprintf("QUARANTINED since %s (reset with `shepherd machine reset %s --process %s`)",
				timeText(b.QuarantinedAt), d.MachineID, b.Process)
		case b.Active:
			until := b.Until
			what = fmt.Sprintf("backed off until %s", timeText(&until))
		default:
			what = "not in force (kept for the next interval)"
		}
		line("  "+string(b.Process), "%s; failures in a row: %d, interval %s, last: %s", what, b.Attempts, b.Interval, b.Cause)
	}

	section("Decommission")
	if r := d.DecommissionRequested; r == nil {
		line("  Requested", "no")
	} else {
		requestedAt := r.RequestedAt
		line("  Requested", "%s by %s: %s", timeText(&requestedAt), orDash(r.RequestedBy), orDash(r.Reason))
	}
	return w.Flush()
}

// writePower writes the machine's last known power state.
func writePower(line func(k, format string, a ...any), d bmdb.MachineDetail) {
	p := d.Power
	if p == nil {
		line("  Power", "never checked (shepherd machine power status %s)", d.MachineID)
		return
	}
	line("  BMC", "%s", p.BMC)
	if p.State != "" {
		line("  Power", "%s, checked %s", p.State, timeText(p.StateAt))
	} else {
		line("  Power", "unknown")
	}
	if p.Error != "" {
		// One line: a BMC library's error may span several.
		line("  Last check", "failed %s, class %s: %s", timeText(&p.CheckedAt), p.ErrorClass, strings.Join(strings.Fields(p.Error), " "))
	}
}

// writeHardware writes the readable lines of a hardware report.
func writeHardware(line func(k, format string, a ...any), hw *agentv1.HardwareReport) {
	cpu := hw.GetCpu()
	line("  CPU", "%s: %d sockets, %d cores, %d threads", orDash(cpu.GetModel()), cpu.GetSockets(), cpu.GetCores(), cpu.GetThreads())
	line("  Memory", "%s", bytesText(hw.GetMemoryBytes()))
	firmware := "unknown"
	switch hw.GetFirmwareMode() {
	case agentv1.FirmwareMode_FIRMWARE_MODE_BIOS:
		firmware = "BIOS"
	case agentv1.FirmwareMode_FIRMWARE_MODE_EFI:
		firmware = "EFI"
	}
	line("  Firmware", "%s", firmware)
	dmi := hw.GetDmi()
	line("  System", "%s %s (serial %s)", orDash(dmi.GetSystemVendor()), orDash(dmi.GetProductName()), orDash(dmi.GetProductSerial()))
	for _, n := range hw.GetNetworkInterfaces() {
		link := "down"
		if n.GetLinkUp() {
			link = fmt.Sprintf("up %d Mb/s", n.GetSpeedMbps())
		}
		line("  NIC "+n.GetName(), "%s, driver %s, link %s", orDash(n.GetMacAddress()), orDash(n.GetDriver()), link)
	}
	for _, b := range hw.GetBlockDevices() {
		kind := "SSD"
		if b.GetRotational() {
			kind = "HDD"
		}
		if b.GetVirtio() {
			kind = "virtio"
		}
		line("  Disk "+b.GetName(), "%s %s, %s (serial %s)", bytesText(b.GetSizeBytes()), kind, orDash(b.GetModel()), orDash(b.GetSerial()))
	}
	for _, warn := range hw.GetWarnings() {
		line("  Warning", "%s", warn)
	}
}

// bytesText renders a size in binary units.
func bytesText(n uint64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := uint64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// historyPage is the page size `machine history` reads with.
const historyPage = 1000

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
			id, err := parseMachineID(args[0])
			if err != nil {
				return err
			}
			f := bmdb.HistoryFilter{MachineID: id, Limit: historyPage}
			if process != "" {
				if f.Process, err = parseProcess(process); err != nil {
					return err
				}
			}
			if limit < 0 {
				return fmt.Errorf("--limit must be >= 0 (0 = all), got %d", limit)
			}
			if err := c.checkOutput(); err != nil {
				return err
			}
			db, err := c.open(cmd.Context())
			if err != nil {
				return err
			}
			defer db.Close()
			if _, err := db.GetMachine(cmd.Context(), id); errors.Is(err, bmdb.ErrNotFound) {
				return fmt.Errorf("machine %s does not exist", id)
			} else if err != nil {
				return err
			}
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

func (c *machineCLI) resetCommand() *cobra.Command {
	var process, reason string
	cmd := &cobra.Command{
		Use:   "reset ID --process P",
		Short: "Clear a machine's backoff or quarantine for a process, so it is a candidate again",
		Long: "Clears the backoff and any quarantine of the machine for the process and writes a Reset\n" +
			"history row naming who asked and why (SPEC §2.5).",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			id, err := parseMachineID(args[0])
			if err != nil {
				return err
			}
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

// maxReason bounds --reason of a decommission: a sentence or two.
const maxReason = 1000

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
			id, err := parseMachineID(args[0])
			if err != nil {
				return err
			}
			reason = strings.Join(strings.Fields(reason), " ")
			if reason == "" {
				return errors.New("--reason is required: say why the machine should go")
			}
			if len(reason) > maxReason {
				return fmt.Errorf("--reason is %d bytes, at most %d", len(reason), maxReason)
			}
			db, err := c.open(cmd.Context())
			if err != nil {
				return err
			}
			defer db.Close()
			d, err := db.GetMachine(cmd.Context(), id)
			if errors.Is(err, bmdb.ErrNotFound) {
				return fmt.Errorf("machine %s does not exist", id)
			} else if err != nil {
				return err
			}
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
			if err := c.checkOutput(); err != nil {
				return err
			}
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
