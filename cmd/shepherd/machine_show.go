package main

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
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

// machineDetailJSON is `machine show --output json`: every tag, with the
// stored protobufs decoded (protojson). The keys are stable; absent tags
// are null.
type machineDetailJSON struct {
	machineJSON
	CreatedAt        time.Time  `json:"created_at"`
	ReservationID    string     `json:"reservation_id"`
	ProviderStatusAt *time.Time `json:"provider_status_at"`
	// AgentPhase is what the agent does: Silent for a silent agent, else
	// the tag phase (AgentTagPhase).
	AgentPhase     string  `json:"agent_phase"`
	AgentTagPhase  string  `json:"agent_tag_phase"`
	AgentSilent    bool    `json:"agent_silent"`
	AgentPublicKey *string `json:"agent_public_key"` // bmdb.AgentKeyText
	// SilenceTimeouts decided the state and AgentSilent.
	SilenceTimeouts  silenceTimeoutsJSON `json:"silence_timeouts"`
	HardwareReportAt *time.Time          `json:"hardware_report_at"`
	HardwareReport   json.RawMessage     `json:"hardware_report"`
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

// silenceTimeoutsJSON are the heartbeat timeouts a machine was judged by.
type silenceTimeoutsJSON struct {
	FirstHeartbeatTimeoutMs int64 `json:"first_heartbeat_timeout_ms"`
	HeartbeatTimeoutMs      int64 `json:"heartbeat_timeout_ms"`
	// Recorded is false when no recoverer recorded its timeouts: the
	// defaults were used.
	Recorded bool   `json:"recorded"`
	Source   string `json:"source"`
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
	RequestedBy       string          `json:"requested_by"`
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

func detailJSON(d bmdb.MachineDetail, t bmdb.SilenceTimeouts) machineDetailJSON {
	j := machineDetailJSON{
		machineJSON:      summaryJSON(d.MachineSummary),
		CreatedAt:        d.CreatedAt,
		ReservationID:    d.Provided.ReservationID,
		AgentPhase:       d.AgentStatus(),
		AgentTagPhase:    string(d.Provided.AgentPhase),
		AgentSilent:      d.AgentSilent,
		SilenceTimeouts:  silenceTimeoutsJSON{FirstHeartbeatTimeoutMs: t.FirstHeartbeat.Milliseconds(), HeartbeatTimeoutMs: t.Heartbeat.Milliseconds(), Recorded: t.Recorded, Source: t.Describe()},
		HardwareReportAt: d.HardwareReportAt,
		Work:             []workJSON{},
		Backoffs:         []backoffJSON{},
	}
	if !d.Provided.StatusAt.IsZero() {
		at := d.Provided.StatusAt
		j.ProviderStatusAt = &at
	}
	if len(d.AgentPublicKey) > 0 {
		k := bmdb.AgentKeyText(d.AgentPublicKey)
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
			ij.RequestedAt, ij.RequestedBy = &at, in.RequestedBy
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
			db, err := c.open(cmd.Context())
			if err != nil {
				return err
			}
			defer db.Close()
			d, timeouts, err := findMachine(cmd.Context(), db, args[0])
			if err != nil {
				return err
			}
			if c.output == outputJSON {
				return writeJSON(cmd.OutOrStdout(), detailJSON(d, timeouts))
			}
			return writeDetail(cmd.OutOrStdout(), d, timeouts)
		},
	}
	c.bindOutput(cmd)
	return cmd
}

// writeDetail writes a machine as aligned "field: value" lines, section by
// section.
func writeDetail(out io.Writer, d bmdb.MachineDetail, t bmdb.SilenceTimeouts) error {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	line := func(k, format string, a ...any) { fmt.Fprintf(w, "%s:\t%s\n", k, fmt.Sprintf(format, a...)) }
	section := func(name string) { fmt.Fprintf(w, "\n%s\n", name) }
	line("Machine", "%s", d.MachineID)
	line("State", "%s", d.State)
	line("Silence timeouts", "%s", t.Describe())
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
		if d.AgentSilent && d.Provided.AgentPhase != "" {
			line("  Agent phase", "Silent (tag phase %s)", d.Provided.AgentPhase)
		} else {
			line("  Agent phase", "%s", d.AgentStatus())
		}
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
	line("  Public key", "%s", orDash(bmdb.AgentKeyText(d.AgentPublicKey)))
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
			line("  Requested", "generation %d at %s by %s: %s", in.RequestGeneration, timeText(&requestedAt), orDash(in.RequestedBy), desc)
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
