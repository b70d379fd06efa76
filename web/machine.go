package web

import (
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"strconv"

	"golang.org/x/crypto/ssh"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb"
)

// historyPage is how many history rows the machine page shows at once;
// ?history_after=ID shows the next ones.
const historyPage = 500

// machineData is the machine page.
type machineData struct {
	M        bmdb.MachineDetail
	Actions  bool   // offer the actions
	Done     string // the message of an action just carried out
	Hardware *hardwareView
	HWError  string
	Install  *installView
	// AgentKey is the agent's public key (base64); HostKey the type and
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
	Ladder       []bmdb.RungAttempt
	History      []bmdb.HistoryEvent
	HistoryNext  string
	HistoryFirst bool
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
	m, err := s.db.GetMachineWithTimeouts(ctx, id, s.cfg.FirstHeartbeatTimeout, s.cfg.HeartbeatTimeout)
	if errors.Is(err, bmdb.ErrNotFound) {
		return nil, notFound("machine %s does not exist", id)
	} else if err != nil {
		return nil, err
	}
	d := &machineData{M: m, Actions: s.cfg.Actions, Done: doneMessages[r.URL.Query().Get("done")]}
	if len(m.HardwareReportRaw) > 0 {
		var hw agentv1.HardwareReport
		if err := proto.Unmarshal(m.HardwareReportRaw, &hw); err != nil {
			log.WarnContext(ctx, "stored hardware report does not decode", "err", err)
			d.HWError = "the stored report does not decode: " + err.Error()
		} else {
			d.Hardware = &hardwareView{Report: &hw, Firmware: firmwareName(hw.GetFirmwareMode())}
		}
	}
	if len(m.AgentPublicKey) > 0 {
		d.AgentKey = base64.StdEncoding.EncodeToString(m.AgentPublicKey)
	}
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

	f := bmdb.HistoryFilter{MachineID: id, Limit: historyPage + 1}
	if a := r.URL.Query().Get("history_after"); a != "" {
		if f.AfterID, err = strconv.ParseInt(a, 10, 64); err != nil || f.AfterID < 0 {
			return nil, badRequest("history_after=%q is not a history row id", a)
		}
	}
	d.HistoryFirst = f.AfterID == 0
	if d.History, err = s.db.History(ctx, f); err != nil {
		return nil, err
	}
	if len(d.History) > historyPage {
		d.History = d.History[:historyPage]
		d.HistoryNext = fmt.Sprintf("/machines/%s?history_after=%d#history", id, d.History[historyPage-1].ID)
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
