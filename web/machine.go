package web

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"

	"github.com/google/uuid"

	"golang.org/x/crypto/ssh"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb"
)

// historyPage is how many history rows the machine page shows at once,
// newest first: ?history_before=ID shows the ones older than that row,
// ?history_after=ID the ones newer (keyset pages on the history id).
const historyPage = 500

// machineData is the machine page.
type machineData struct {
	M        bmdb.MachineDetail
	Actions  bool   // offer the actions
	Done     string // the message of an action just carried out
	Hardware *hardwareView
	HWError  string
	Install  *installView
	// AgentKey is the agent's public key (bmdb.AgentKeyText); HostKey the type and
	// SHA-256 fingerprint of the SSH host key, OfferedHostKey those of the
	// key the machine presented instead, AcceptHostKey the CLI command that
	// accepts it.
	AgentKey, HostKey             string
	HostKeyError                  string
	OfferedHostKey, AcceptHostKey string
	// Power is the machine's BMC and power state.
	Power powerView
	// Ladder is the recovery ladder's progress: the rungs taken since the
	// agent's last heartbeat, oldest first.
	Ladder []bmdb.RungAttempt
	// History is a page of the machine's history, newest first.
	// HistoryOlder and HistoryNewer link to the neighbouring pages ("" if
	// there is none), HistoryNewest to the first page unless this is it.
	History                                   []bmdb.HistoryEvent
	HistoryOlder, HistoryNewer, HistoryNewest string
	// Timeouts decided the machine's state and whether its agent is
	// silent.
	Timeouts bmdb.SilenceTimeouts
}

// hardwareView is the decoded hardware report.
type hardwareView struct {
	Report   *agentv1.HardwareReport
	Firmware string
}

// powerView is the machine's BMC and last known power state.
type powerView struct {
	// Status is the last known power state, as the last power action or
	// check recorded it; nil if it was never checked.
	Status *bmdb.PowerStatus
	// BMC names the machine's BMC as its provider configures it now; ""
	// if power is not available.
	BMC string
	// Unavailable says why power actions cannot reach the machine from
	// this process; "" if they can.
	Unavailable string
	// Actions are the power actions offered: none if Unavailable or if the
	// UI is read-only.
	Actions []powerLink
}

// powerLink is a power action's link to its confirmation page.
type powerLink struct {
	Name, Title string
	Danger      bool
}

// installView is the decoded installation request and report.
type installView struct {
	bmdb.Installation
	Request *agentv1.OSInstallationRequest
	// RequestError is set when the stored request cannot be decoded.
	RequestError string
	Installed    bool
}

// doneMessages are what the machine page says after an action redirected
// to it. The URL names the action only: a link cannot make the page say
// anything else.
var doneMessages = map[string]string{
	actionReset.name:        "Backoff reset: the machine is a candidate again.",
	actionDecommission.name: "Decommission requested: the decommissioner takes the machine out of the fleet.",
	actionInstall.name:      "Installation requested: the agent picks it up with its next heartbeat.",
	actionHostKey.name:      "SSH host key accepted: the machine is taken over again with it.",
	actionPowerStatus.name:  "Power state requested from the BMC: the Power panel shows what it said once it answered (it is called at its own pace).",
	actionPowerOn.name:      "Power on started: the machine is held for Power until the BMC reports it on; history and the Power panel show the result.",
	actionPowerOff.name:     "Power off started: the machine is held for Power until the BMC reports it off; history and the Power panel show the result.",
	actionPowerCycle.name:   "Power cycle started: the machine is held for Power until the BMC reports it on again; history and the Power panel show the result.",
}

// machine serves a machine's page: every tag, the decoded hardware report,
// its BMC and power state, live work, backoffs and quarantines, the
// recovery ladder's progress, and its history.
func (s *Server) machine(_ http.ResponseWriter, r *http.Request) (*view, error) {
	id, err := machineID(r)
	if err != nil {
		return nil, err
	}
	ctx := r.Context()
	log := s.log.With("machine_id", id.String())
	hf, err := historyFilter(id, r)
	if err != nil {
		return nil, err
	}
	m, timeouts, err := s.getMachine(ctx, id)
	if errors.Is(err, bmdb.ErrNotFound) {
		return nil, notFound("machine %s does not exist", id)
	} else if err != nil {
		return nil, err
	}
	d := &machineData{M: m, Actions: s.cfg.Actions, Done: doneMessages[r.URL.Query().Get("done")], Timeouts: timeouts}
	if len(m.HardwareReportRaw) > 0 {
		var hw agentv1.HardwareReport
		if err := proto.Unmarshal(m.HardwareReportRaw, &hw); err != nil {
			log.WarnContext(ctx, "stored hardware report does not decode", "err", err)
			d.HWError = "the stored report does not decode: " + err.Error()
		} else {
			d.Hardware = &hardwareView{Report: &hw, Firmware: firmwareName(hw.GetFirmwareMode())}
		}
	}
	d.AgentKey = bmdb.AgentKeyText(m.AgentPublicKey)
	if len(m.HostKey) > 0 {
		if k, err := ssh.ParsePublicKey(m.HostKey); err != nil {
			d.HostKeyError = "the recorded key does not parse: " + err.Error()
		} else {
			d.HostKey = k.Type() + " " + ssh.FingerprintSHA256(k)
		}
	}
	if len(m.OfferedHostKey) > 0 {
		d.OfferedHostKey = describeKey(m.OfferedHostKey)
		d.AcceptHostKey = bmdb.AcceptHostKeyCommand(id, bmdb.HostKeyFingerprint(m.OfferedHostKey))
	}
	d.Power = powerView{Status: m.Power}
	pm, why := s.powerMachine(ctx, m)
	d.Power.BMC, d.Power.Unavailable = pm.BMC.Name, why
	if why == "" && s.cfg.Actions {
		for _, a := range powerActions {
			d.Power.Actions = append(d.Power.Actions, powerLink{Name: a.name, Title: a.title, Danger: a.danger})
		}
	}
	d.Ladder = m.Ladder // read in the same snapshot as the rest of the page
	if in := m.Installation; in != nil {
		iv := &installView{Installation: *in, Installed: in.Installed()}
		if in.RequestGeneration > 0 {
			iv.Request = &agentv1.OSInstallationRequest{}
			if err := proto.Unmarshal(in.Request, iv.Request); err != nil {
				iv.Request, iv.RequestError = nil, "the stored request does not decode: "+err.Error()
			}
		}
		d.Install = iv
	}

	if err := d.readHistory(ctx, s.db, hf); err != nil {
		return nil, err
	}
	log.DebugContext(ctx, "machine page", "history_rows", len(d.History))
	return &view{Title: machineTitle(m.MachineSummary), Nav: "machines", Refresh: s.refreshSeconds(), Data: d}, nil
}

// machineTitle names a machine as operators know it: by its provider id
// and provider ("Machine m3 (static)"), the UUID being on the page below;
// by its UUID if it has no provider id.
func machineTitle(m bmdb.MachineSummary) string {
	if m.ProviderID == "" {
		return "Machine " + m.MachineID.String()
	}
	return fmt.Sprintf("Machine %s (%s)", m.ProviderID, m.Provider)
}

// historyFilter reads the history page the query asks for: the newest
// events, those before ?history_before=ID or those after
// ?history_after=ID, one more than a page to tell whether more follow.
func historyFilter(id uuid.UUID, r *http.Request) (bmdb.HistoryFilter, error) {
	f := bmdb.HistoryFilter{MachineID: id, Limit: historyPage + 1, NewestFirst: true}
	q := r.URL.Query()
	before, after := q.Get("history_before"), q.Get("history_after")
	if before != "" && after != "" {
		return f, badRequest("give history_before or history_after, not both")
	}
	var err error
	if before != "" {
		if f.BeforeID, err = strconv.ParseInt(before, 10, 64); err != nil || f.BeforeID < 1 {
			return f, badRequest("history_before=%q is not a history row id", before)
		}
	}
	if after != "" {
		if f.AfterID, err = strconv.ParseInt(after, 10, 64); err != nil || f.AfterID < 0 {
			return f, badRequest("history_after=%q is not a history row id", after)
		}
		// The page just after the row: read it oldest first, show it
		// newest first.
		f.NewestFirst = false
	}
	return f, nil
}

// readHistory reads the history page f and the links to its neighbours.
func (d *machineData) readHistory(ctx context.Context, db *bmdb.DB, f bmdb.HistoryFilter) error {
	events, err := db.History(ctx, f)
	if err != nil {
		return err
	}
	more := len(events) > historyPage
	if more {
		events = events[:historyPage]
	}
	if !f.NewestFirst {
		slices.Reverse(events)
	}
	d.History = events
	link := func(param string, id int64) string {
		return fmt.Sprintf("/machines/%s?%s=%d#history", f.MachineID, param, id)
	}
	newest := f.BeforeID == 0 && f.NewestFirst
	if !newest {
		d.HistoryNewest = fmt.Sprintf("/machines/%s#history", f.MachineID)
	}
	if len(events) == 0 {
		return nil
	}
	top, bottom := events[0].ID, events[len(events)-1].ID
	switch {
	case f.NewestFirst: // the newest page, or the one before BeforeID
		if more {
			d.HistoryOlder = link("history_before", bottom)
		}
		if !newest {
			d.HistoryNewer = link("history_after", top)
		}
	default: // the page after AfterID
		if more {
			d.HistoryNewer = link("history_after", top)
		}
		if f.AfterID > 0 {
			d.HistoryOlder = link("history_before", bottom)
		}
	}
	return nil
}

func firmwareName(m agentv1.FirmwareMode) string {
	switch m {
	case agentv1.FirmwareMode_FIRMWARE_MODE_BIOS:
		return "BIOS"
	case agentv1.FirmwareMode_FIRMWARE_MODE_EFI:
		return "EFI"
	default:
		return "unknown"
	}
}
