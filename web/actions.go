package web

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/google/uuid"
	"golang.org/x/crypto/ssh"
	"google.golang.org/protobuf/proto"

	"github.com/shepherd/shepherd/agent/install"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/poweraction"
)

// action is an operator action on one machine. Each has a confirmation
// page (GET /machines/{id}/NAME) whose form posts to the same path.
type action struct {
	name   string // path segment and log value
	title  string // the confirmation page's heading and button
	danger bool   // shown as a destructive action
	// power is the power action (SPEC §5.5) this action carries out
	// through the machine's BMC; "" for the others.
	power poweraction.Action
}

var (
	actionReset        = action{name: "reset", title: "Reset backoff"}
	actionDecommission = action{name: "decommission", title: "Decommission", danger: true}
	actionInstall      = action{name: "install", title: "Request OS installation", danger: true}
	actionHostKey      = action{name: "host-key", title: "Accept SSH host key", danger: true}
	// The power actions of `shepherd machine power`: off and cycle stop the
	// machine without a shutdown.
	actionPowerStatus = action{name: "power-status", title: "Read power state", power: poweraction.Status}
	actionPowerOn     = action{name: "power-on", title: "Power on", power: poweraction.On}
	actionPowerOff    = action{name: "power-off", title: "Power off", danger: true, power: poweraction.Off}
	actionPowerCycle  = action{name: "power-cycle", title: "Power cycle", danger: true, power: poweraction.Cycle}
	powerActions      = []action{actionPowerStatus, actionPowerOn, actionPowerOff, actionPowerCycle}
	actions           = append([]action{actionReset, actionDecommission, actionInstall, actionHostKey}, powerActions...)
)

const (
	// csrfLifetime bounds how long a confirmation page may be left open
	// before its form is refused (reload the page to get a new one).
	csrfLifetime = time.Hour
	// maxFormBytes bounds an action's form; they are a few short fields.
	maxFormBytes = 16 << 10
	// maxReasonLength bounds the reason an operator gives, which goes into
	// history and the decommission record.
	maxReasonLength = 500
)

// csrfKey signs CSRF tokens. It is random per server: restarting the
// server invalidates forms that are open, which is harmless.
type csrfKey [32]byte

// csrfToken returns the token of a form for act on machine: its expiry
// and an HMAC over the action, the machine and the expiry.
func (k *csrfKey) token(act string, machine uuid.UUID, now time.Time) string {
	var exp [8]byte
	binary.BigEndian.PutUint64(exp[:], uint64(now.Add(csrfLifetime).Unix()))
	return base64.RawURLEncoding.EncodeToString(append(exp[:], k.mac(act, machine, exp[:])...))
}

// check reports whether tok is a live token for act on machine.
func (k *csrfKey) check(tok, act string, machine uuid.UUID, now time.Time) bool {
	raw, err := base64.RawURLEncoding.DecodeString(tok)
	if err != nil || len(raw) != 8+sha256.Size {
		return false
	}
	if !hmac.Equal(raw[8:], k.mac(act, machine, raw[:8])) {
		return false
	}
	return now.Unix() <= int64(binary.BigEndian.Uint64(raw[:8]))
}

func (k *csrfKey) mac(act string, machine uuid.UUID, exp []byte) []byte {
	m := hmac.New(sha256.New, k[:])
	m.Write([]byte("shepherd-web-csrf\x00" + act + "\x00" + machine.String() + "\x00"))
	m.Write(exp)
	return m.Sum(nil)
}

// confirmData is what a confirmation page shows and its form carries back.
// It never holds the operator token: a refused form is shown again with
// the token field empty.
type confirmData struct {
	Action  string
	Title   string
	Danger  bool
	Machine machineHeader
	CSRF    string
	Error   string
	// Process is the process whose backoff a reset clears.
	Process string
	Backoff *bmdb.Backoff
	// Reason goes into history (reset) or the decommission record.
	Reason string
	// Install is the installation request being asked for.
	ImageURL, SHA256, TargetDevice string
	Reboot                         bool
	// HostKey is the host key change being accepted: the form carries the
	// presented key's fingerprint, so that the accept changes nothing if
	// the machine presented yet another key since the page was shown.
	HostKey *hostKeyChange
	// Power is what a power action's page shows.
	Power *powerConfirm
}

// powerConfirm is what the confirmation page of a power action shows.
type powerConfirm struct {
	Action poweraction.Action
	// BMC names the BMC the action goes through.
	BMC string
	// Status is the machine's last known power state; nil if never checked.
	Status *bmdb.PowerStatus
	// Consequence says what the action does to a running machine.
	Consequence string
}

// hostKeyChange is what the host key accept's confirmation page shows.
type hostKeyChange struct {
	Recorded, Offered string // type and SHA-256 fingerprint
	RecordedPinned    bool
	OfferedAt         *time.Time
	// Fingerprint is the offered key's, as the form posts it.
	Fingerprint string
}

// machineHeader names the machine an action is about.
type machineHeader struct {
	ID         uuid.UUID
	Provider   string
	ProviderID string
	State      bmdb.MachineState
}

// confirm serves the confirmation page of a.
func (s *Server) confirm(a action) pageFunc {
	return func(_ http.ResponseWriter, r *http.Request) (*view, error) {
		id, err := machineID(r)
		if err != nil {
			return nil, err
		}
		d := &confirmData{Process: r.URL.Query().Get("process")}
		if err := s.fillConfirm(r, a, id, d); err != nil {
			return nil, err
		}
		return &view{Title: a.title, Nav: "machines", Data: d}, nil
	}
}

// fillConfirm fills in what the confirmation page of a shows about the
// machine, and a fresh CSRF token.
func (s *Server) fillConfirm(r *http.Request, a action, id uuid.UUID, d *confirmData) error {
	m, _, err := s.getMachine(r.Context(), id)
	if errors.Is(err, bmdb.ErrNotFound) {
		return notFound("machine %s does not exist", id)
	} else if err != nil {
		return err
	}
	d.Action, d.Title, d.Danger = a.name, a.title, a.danger
	d.Machine = machineHeader{ID: id, Provider: m.Provider, ProviderID: m.ProviderID, State: m.State}
	d.CSRF = s.csrf.token(a.name, id, time.Now())
	if a.power != "" {
		pm, why := s.powerMachine(r.Context(), m)
		if why != "" {
			return notFound("%s", why)
		}
		d.Power = &powerConfirm{Action: a.power, BMC: pm.BMC.Name, Status: m.Power, Consequence: a.power.Consequence()}
	}
	if a == actionHostKey {
		if len(m.HostKey) == 0 || len(m.OfferedHostKey) == 0 {
			return notFound("machine %s has presented no SSH host key other than its recorded one: there is nothing to accept", id)
		}
		d.HostKey = &hostKeyChange{
			Recorded: describeKey(m.HostKey), Offered: describeKey(m.OfferedHostKey), RecordedPinned: m.HostKeyPinned,
			OfferedAt: m.OfferedHostKeyAt, Fingerprint: bmdb.HostKeyFingerprint(m.OfferedHostKey),
		}
	}
	if a == actionReset {
		p := bmdb.Process(d.Process)
		if err := p.Validate(); err != nil {
			return badRequest("reset needs the process whose backoff to clear (?process=NAME): %v", err)
		}
		b, err := s.db.GetBackoff(r.Context(), id, p)
		if err == nil {
			d.Backoff = &b
		} else if !errors.Is(err, bmdb.ErrNotFound) {
			return err
		}
	}
	return nil
}

// act carries out a after checking the request: CSRF token, operator
// token, and the action's own fields. The same-origin check ran before
// (http.CrossOriginProtection in routes).
func (s *Server) act(a action) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		id, err := machineID(r)
		if err != nil {
			s.fail(w, r, err)
			return
		}
		log := s.log.With("machine_id", id.String(), "action", a.name, "remote_addr", r.RemoteAddr)
		r.Body = http.MaxBytesReader(w, r.Body, maxFormBytes)
		if err := r.ParseForm(); err != nil {
			s.fail(w, r, badRequest("reading the form: %v", err))
			return
		}
		f := r.PostForm
		d := &confirmData{
			Process:      f.Get("process"),
			Reason:       f.Get("reason"),
			ImageURL:     strings.TrimSpace(f.Get("image_url")),
			SHA256:       strings.ToLower(strings.TrimSpace(f.Get("sha256"))),
			TargetDevice: strings.TrimSpace(f.Get("target_device")),
			Reboot:       f.Get("reboot") == "on",
		}
		// Say no with the form shown again (token field empty).
		refuse := func(code int, msg string) {
			if err := s.fillConfirm(r, a, id, d); err != nil {
				s.fail(w, r, err)
				return
			}
			d.Error = msg
			s.render(w, r, code, "confirm", &view{Title: a.title, Nav: "machines", Data: d})
		}
		if !s.csrf.check(f.Get("csrf"), a.name, id, time.Now()) {
			log.WarnContext(ctx, "refused an action: missing, stale or forged CSRF token")
			refuse(http.StatusForbidden, "This form is stale or did not come from this page: check the details and confirm again.")
			return
		}
		if !s.cfg.OperatorToken.Matches(f.Get("token")) {
			log.WarnContext(ctx, "refused an action: wrong operator token")
			refuse(http.StatusForbidden, "Wrong operator token.")
			return
		}
		reason := strings.Join(strings.Fields(d.Reason), " ")
		if len(reason) > maxReasonLength {
			refuse(http.StatusBadRequest, fmt.Sprintf("The reason is too long (at most %d characters).", maxReasonLength))
			return
		}
		var done string
		switch a {
		case actionReset:
			p := bmdb.Process(d.Process)
			if err := p.Validate(); err != nil {
				refuse(http.StatusBadRequest, err.Error())
				return
			}
			cause := "reset by an operator in the web UI"
			if reason != "" {
				cause += ": " + reason
			}
			err = s.db.ResetBackoff(ctx, id, p, cause)
			if errors.Is(err, bmdb.ErrNotFound) {
				refuse(http.StatusConflict, fmt.Sprintf("Machine %s has no backoff for %s: nothing to reset.", id, p))
				return
			}
			log = log.With("process", string(p))
			done = "reset " + string(p)
		case actionDecommission:
			err = s.db.RequestDecommission(ctx, id, operatorName, reason)
			done = "decommission requested"
		case actionHostKey:
			fp := f.Get("fingerprint")
			var ch bmdb.HostKeyChange
			ch, err = s.db.AcceptHostKey(ctx, id, fp, operatorName, reason)
			switch {
			case errors.Is(err, bmdb.ErrOfferedHostKeyDiffers):
				refuse(http.StatusConflict, "The machine presented another key since this page was shown: check the key below and confirm again.")
				return
			case errors.Is(err, bmdb.ErrNoOfferedHostKey), errors.Is(err, bmdb.ErrNotFound):
				s.fail(w, r, notFound("machine %s has presented no SSH host key other than its recorded one: there is nothing to accept", id))
				return
			}
			log = log.With("old_fingerprint", ch.OldFingerprint, "new_fingerprint", ch.NewFingerprint)
			done = "SSH host key accepted"
		case actionInstall:
			req := &agentv1.OSInstallationRequest{
				ImageUrl: d.ImageURL, ImageSha256: d.SHA256, TargetDevice: d.TargetDevice, RebootAfter: d.Reboot,
			}
			if err := install.CheckRequest(req, install.RequestOptions{}); err != nil {
				refuse(http.StatusBadRequest, "Invalid installation request: "+err.Error())
				return
			}
			raw, merr := proto.Marshal(req)
			if merr != nil {
				s.fail(w, r, fmt.Errorf("encoding the installation request: %w", merr))
				return
			}
			var gen int64
			gen, err = s.db.RequestInstallation(ctx, id, operatorName, raw)
			log = log.With("image_url", d.ImageURL)
			done = fmt.Sprintf("installation generation %d requested", gen)
		default:
			if a.power == "" {
				s.fail(w, r, fmt.Errorf("action %s has no handler", a.name))
				return
			}
			code, msg, perr := s.startPower(ctx, log, a, id, reason)
			switch {
			case perr != nil:
				log.ErrorContext(ctx, "operator action failed", "err", perr)
				s.fail(w, r, perr)
				return
			case msg != "":
				log.WarnContext(ctx, "refused a power action", "refusal", msg)
				refuse(code, msg)
				return
			}
			done = "power " + string(a.power) + " started"
		}
		if errors.Is(err, bmdb.ErrDecommissioned) {
			refuse(http.StatusConflict, fmt.Sprintf("Machine %s is decommissioned or being decommissioned.", id))
			return
		} else if errors.Is(err, bmdb.ErrNotFound) {
			refuse(http.StatusNotFound, fmt.Sprintf("Machine %s does not exist or is not provided.", id))
			return
		} else if err != nil {
			log.ErrorContext(ctx, "operator action failed", "err", err)
			s.fail(w, r, err)
			return
		}
		log.InfoContext(ctx, "operator action", "result", done)
		// The machine page shows a fixed message per action, never text
		// from the URL, which anyone can link to.
		http.Redirect(w, r, "/machines/"+id.String()+"?done="+a.name, http.StatusSeeOther)
	})
}

// describeKey names a host key in SSH wire format by type and SHA-256
// fingerprint.
func describeKey(raw []byte) string {
	k, err := ssh.ParsePublicKey(raw)
	if err != nil {
		return bmdb.HostKeyFingerprint(raw) + " (does not parse: " + err.Error() + ")"
	}
	return k.Type() + " " + ssh.FingerprintSHA256(k)
}

// operatorName is who the BMDB records as asking, for actions from the web
// UI: the token says an operator asked, not which one.
const operatorName = "operator (web UI)"

// machineID parses the {id} of the path.
func machineID(r *http.Request) (uuid.UUID, error) {
	id, err := uuid.Parse(r.PathValue("id"))
	if err != nil {
		return uuid.Nil, notFound("%q is not a machine id", r.PathValue("id"))
	}
	return id, nil
}
