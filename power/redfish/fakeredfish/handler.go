package fakeredfish

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"mime"
	"net/http"
	"slices"
	"strings"
)

// baseRegistry prefixes the Base message registry's message ids.
const baseRegistry = "Base.1.16."

// message is one entry of @Message.ExtendedInfo.
type message struct {
	ODataType       string   `json:"@odata.type"`
	MessageID       string   `json:"MessageId"`
	Message         string   `json:"Message"`
	MessageArgs     []string `json:"MessageArgs"`
	MessageSeverity string   `json:"MessageSeverity"`
	Severity        string   `json:"Severity"`
	Resolution      string   `json:"Resolution"`
}

// writeError answers with a Redfish error body. Like bmcweb, the error's
// code and message are those of its one message; with the profile's
// GeneralErrorCode, like iDRAC, they are Base's GeneralError and the
// message is only in @Message.ExtendedInfo.
func (b *BMC) writeError(w http.ResponseWriter, r *http.Request, status int, id, msg, resolution string, args ...string) {
	if args == nil {
		args = []string{}
	}
	if !strings.Contains(id, ".") {
		id = baseRegistry + id
	}
	m := message{
		ODataType: "#Message.v1_1_1.Message", MessageID: id, Message: msg, MessageArgs: args,
		MessageSeverity: "Critical", Severity: "Critical", Resolution: resolution,
	}
	if echo, ok := r.Context().Value(echoKey{}).(string); ok {
		msg += " (request: " + echo + ")"
		m.Message = msg
	}
	code, top := id, msg
	if b.cfg.Profile.GeneralErrorCode {
		code = baseRegistry + "GeneralError"
		top = "A general error has occurred. See ExtendedInfo for more information"
	}
	writeJSON(w, status, map[string]any{"error": map[string]any{
		"code": code, "message": top, "@Message.ExtendedInfo": []message{m},
	}})
}

func writeJSON(w http.ResponseWriter, status int, body any) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.Header().Set("OData-Version", "4.0")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(body)
}

func odataLink(path string) map[string]string { return map[string]string{"@odata.id": path} }

// echoKey keys the request's description in its context, for EchoRequests.
type echoKey struct{}

// withEcho describes r (credentials, token and body included) in its
// context, for writeError to put in the error message.
func withEcho(r *http.Request) *http.Request {
	body, _ := io.ReadAll(io.LimitReader(r.Body, 1<<16))
	r.Body = io.NopCloser(bytes.NewReader(body))
	echo := r.Method + " " + r.URL.Path + " X-Auth-Token: " + r.Header.Get("X-Auth-Token") +
		" Authorization: " + r.Header.Get("Authorization") + " body: " + string(body)
	return r.WithContext(context.WithValue(r.Context(), echoKey{}, echo))
}

// serve is the BMC's HTTP handler.
func (b *BMC) serve(w http.ResponseWriter, r *http.Request) {
	b.mu.Lock()
	echo := b.echo
	b.mu.Unlock()
	if echo {
		r = withEcho(r)
	}
	b.mu.Lock()
	match := b.hang
	b.mu.Unlock()
	hang := match != nil && match(r) // not under mu: match may block
	b.mu.Lock()
	fail := !hang && b.failNext > 0
	if fail {
		b.failNext--
	}
	b.mu.Unlock()
	if hang {
		if err := b.waitHang(r); err == errClosed {
			panic(http.ErrAbortHandler) // drop the connection without an answer
		}
		return
	}
	if fail {
		w.Header().Set("Retry-After", "1")
		b.writeError(w, r, http.StatusServiceUnavailable, "ServiceTemporarilyUnavailable",
			"The service is temporarily unavailable.  Retry in 1 seconds.",
			"Wait for the indicated retry duration and retry the operation.", "1")
		return
	}

	path := trimSlash(r.URL.Path)
	// What Redfish serves without authentication: the version document, the
	// service root, and the login itself.
	switch {
	case path == "/redfish":
		b.only(w, r, http.MethodGet, func() { writeJSON(w, http.StatusOK, map[string]string{"v1": "/redfish/v1/"}) })
		return
	case path == rootPath:
		b.only(w, r, http.MethodGet, func() { writeJSON(w, http.StatusOK, b.serviceRoot()) })
		return
	case path == sessionsPath && r.Method == http.MethodPost && b.cfg.Profile.SessionService:
		b.login(w, r)
		return
	}

	if !b.authenticated(r) {
		w.Header().Set("WWW-Authenticate", `Basic realm="Redfish"`)
		if r.Header.Get("X-Auth-Token") == "" && r.Header.Get("Authorization") == "" {
			b.writeError(w, r, http.StatusUnauthorized, "NoValidSession",
				"There is no valid session established with the implementation.",
				"Establish a session before attempting any operations.")
			return
		}
		b.writeError(w, r, http.StatusUnauthorized, "ResourceAtUriUnauthorized",
			"While accessing the resource at "+r.URL.Path+", the service received an authorization error unauthorized.",
			"Ensure that the appropriate access is provided for the service in order for it to access the URI.",
			r.URL.Path, "unauthorized")
		return
	}

	switch {
	case path == systemsPath:
		b.only(w, r, http.MethodGet, func() { writeJSON(w, http.StatusOK, b.systemsCollection()) })
	case path == b.systemPath():
		switch r.Method {
		case http.MethodGet:
			writeJSON(w, http.StatusOK, b.system())
		case http.MethodPatch:
			b.patchSystem(w, r)
		default:
			b.methodNotAllowed(w, r)
		}
	case path == b.resetPath():
		b.only(w, r, http.MethodPost, func() { b.reset(w, r) })
	case b.cfg.Profile.SessionService && path == sessionServicePath:
		b.only(w, r, http.MethodGet, func() { writeJSON(w, http.StatusOK, b.sessionService()) })
	case b.cfg.Profile.SessionService && path == sessionsPath:
		b.only(w, r, http.MethodGet, func() { writeJSON(w, http.StatusOK, b.sessionsCollection()) })
	case b.cfg.Profile.SessionService && strings.HasPrefix(path, sessionsPath+"/"):
		b.session(w, r, strings.TrimPrefix(path, sessionsPath+"/"))
	default:
		b.notFound(w, r)
	}
}

// only runs serve if r's method is method, and answers 405 otherwise.
func (b *BMC) only(w http.ResponseWriter, r *http.Request, method string, serve func()) {
	if r.Method != method {
		b.methodNotAllowed(w, r)
		return
	}
	serve()
}

func (b *BMC) methodNotAllowed(w http.ResponseWriter, r *http.Request) {
	b.writeError(w, r, http.StatusMethodNotAllowed, "OperationNotAllowed",
		"The HTTP method "+r.Method+" is not allowed on the resource at "+r.URL.Path+".",
		"Use a method the resource supports.")
}

func (b *BMC) notFound(w http.ResponseWriter, r *http.Request) {
	b.writeError(w, r, http.StatusNotFound, "ResourceMissingAtURI",
		"The resource at the URI "+r.URL.Path+" was not found.",
		"Place a valid resource at the URI or correct the URI and resubmit the request.", r.URL.Path)
}

// authenticated checks a session token (when sessions are offered) or basic
// credentials. BMCs that offer sessions accept basic authentication too.
func (b *BMC) authenticated(r *http.Request) bool {
	if tok := r.Header.Get("X-Auth-Token"); tok != "" && b.cfg.Profile.SessionService {
		b.mu.Lock()
		_, ok := b.sessions[tok]
		b.mu.Unlock()
		return ok
	}
	user, pw, ok := r.BasicAuth()
	return ok && b.checkCredentials(user, pw)
}

func (b *BMC) serviceRoot() map[string]any {
	root := map[string]any{
		"@odata.id":      rootPath,
		"@odata.type":    "#ServiceRoot.v1_11_0.ServiceRoot",
		"@odata.context": "/redfish/v1/$metadata#ServiceRoot.ServiceRoot",
		"Id":             "RootService",
		"Name":           "Root Service",
		"RedfishVersion": "1.11.0",
		"UUID":           "92384634-2938-2342-8820-489239905423",
		"Vendor":         b.cfg.Profile.Vendor,
		"Product":        b.cfg.Profile.Product,
		"Systems":        odataLink(systemsPath),
		"Links":          map[string]any{},
	}
	if b.cfg.Profile.SessionService {
		root["SessionService"] = odataLink(sessionServicePath)
		if !b.cfg.Profile.NoSessionsLink {
			root["Links"] = map[string]any{"Sessions": odataLink(sessionsPath)}
		}
	}
	return root
}

func (b *BMC) systemsCollection() map[string]any {
	return map[string]any{
		"@odata.id":           systemsPath,
		"@odata.type":         "#ComputerSystemCollection.ComputerSystemCollection",
		"Name":                "Computer System Collection",
		"Members":             []any{odataLink(b.systemPath())},
		"Members@odata.count": 1,
	}
}

// bootTargets are the boot override targets every profile accepts.
var bootTargets = []string{"None", "Pxe", "Hdd", "Cd", "Usb", "BiosSetup"}

func (b *BMC) system() map[string]any {
	b.mu.Lock()
	state, boot := b.state, b.boot
	b.mu.Unlock()
	reset := map[string]any{"target": b.resetPath()}
	if b.cfg.Profile.ResetTypes != nil {
		reset["ResetType@Redfish.AllowableValues"] = b.cfg.Profile.ResetTypes
	}
	return map[string]any{
		"@odata.id":    b.systemPath(),
		"@odata.type":  "#ComputerSystem.v1_13_0.ComputerSystem",
		"Id":           b.cfg.Profile.SystemID,
		"Name":         "System",
		"SystemType":   "Physical",
		"Manufacturer": b.cfg.Profile.Vendor,
		"Model":        b.cfg.Profile.Product,
		"PowerState":   state,
		"Status":       map[string]string{"State": "Enabled", "Health": "OK"},
		"Boot": map[string]any{
			"BootSourceOverrideEnabled":                        boot.Enabled,
			"BootSourceOverrideTarget":                         boot.Target,
			"BootSourceOverrideTarget@Redfish.AllowableValues": bootTargets,
			"BootSourceOverrideMode":                           "UEFI",
		},
		"Actions": map[string]any{"#ComputerSystem.Reset": reset},
		"Links":   map[string]any{},
	}
}

// patchSystem accepts the Boot override properties, and refuses others as
// the read-only properties they are here.
func (b *BMC) patchSystem(w http.ResponseWriter, r *http.Request) {
	var body map[string]json.RawMessage
	if !b.readJSON(w, r, &body) {
		return
	}
	for k := range body {
		if k != "Boot" {
			b.writeError(w, r, http.StatusBadRequest, "PropertyNotWritable",
				"The property "+k+" is a read only property and cannot be assigned a value.",
				"Remove the property from the request body and resubmit the request if the operation failed.", k)
			return
		}
	}
	var boot struct {
		BootSourceOverrideEnabled *string
		BootSourceOverrideTarget  *string
		BootSourceOverrideMode    *string
	}
	if raw, ok := body["Boot"]; ok {
		if err := json.Unmarshal(raw, &boot); err != nil {
			b.malformed(w, r)
			return
		}
	}
	if e := boot.BootSourceOverrideEnabled; e != nil && *e != "Disabled" && *e != "Once" && *e != "Continuous" {
		b.valueNotInList(w, r, *e, "BootSourceOverrideEnabled")
		return
	}
	if t := boot.BootSourceOverrideTarget; t != nil && !slices.Contains(bootTargets, *t) {
		b.valueNotInList(w, r, *t, "BootSourceOverrideTarget")
		return
	}
	if m := boot.BootSourceOverrideMode; m != nil && *m != "UEFI" && *m != "Legacy" {
		b.valueNotInList(w, r, *m, "BootSourceOverrideMode")
		return
	}
	b.mu.Lock()
	if boot.BootSourceOverrideEnabled != nil {
		b.boot.Enabled = *boot.BootSourceOverrideEnabled
	}
	if boot.BootSourceOverrideTarget != nil {
		b.boot.Target = *boot.BootSourceOverrideTarget
	}
	b.mu.Unlock()
	w.WriteHeader(http.StatusNoContent)
}

// readJSON decodes r's body into v, and answers 400 if it cannot: the body
// is not JSON, or, with the profile's RequireJSONContentType, not sent as
// application/json (bmcweb's UnrecognizedRequestBody).
func (b *BMC) readJSON(w http.ResponseWriter, r *http.Request, v any) bool {
	if b.cfg.Profile.RequireJSONContentType {
		if mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type")); err != nil || mt != "application/json" {
			b.writeError(w, r, http.StatusBadRequest, "UnrecognizedRequestBody",
				"The service detected a malformed request body that it was unable to interpret.",
				"Correct the request body and resubmit the request if it failed.")
			return false
		}
	}
	if err := json.NewDecoder(r.Body).Decode(v); err != nil {
		b.malformed(w, r)
		return false
	}
	return true
}

func (b *BMC) malformed(w http.ResponseWriter, r *http.Request) {
	b.writeError(w, r, http.StatusBadRequest, "MalformedJSON",
		"The request body submitted was malformed JSON and could not be parsed by the receiving service.",
		"Ensure that the request body is valid JSON and resubmit the request.")
}

func (b *BMC) valueNotInList(w http.ResponseWriter, r *http.Request, value, property string) {
	b.writeError(w, r, http.StatusBadRequest, "PropertyValueNotInList",
		"The value '"+value+"' for the property "+property+" is not in the list of acceptable values.",
		"Choose a value from the enumeration list that the implementation can support and resubmit the request if the operation failed.",
		value, property)
}

// reset performs the Reset action: it checks the type against the
// profile's allowable values, counts it, and moves the power state (unless
// resets are dropped), refusing a redundant one if the profile does.
func (b *BMC) reset(w http.ResponseWriter, r *http.Request) {
	const action = "#ComputerSystem.Reset"
	var body struct{ ResetType *string }
	if !b.readJSON(w, r, &body) {
		return
	}
	if body.ResetType == nil {
		b.writeError(w, r, http.StatusBadRequest, "ActionParameterMissing",
			"The action "+action+" requires the parameter ResetType to be present in the request body.",
			"Supply the action with the required parameter in the request body when the request is resubmitted.",
			action, "ResetType")
		return
	}
	rt := *body.ResetType
	if !b.cfg.Profile.allows(rt) || !slices.Contains(allResetTypes, rt) {
		b.writeError(w, r, http.StatusBadRequest, "ActionParameterValueNotInList",
			"The value '"+rt+"' for the parameter ResetType in the action "+action+" is not in the list of acceptable values.",
			"Choose a value from the enumeration list that the implementation can support and resubmit the request if the operation failed.",
			rt, "ResetType", action)
		return
	}

	b.mu.Lock()
	b.resets[rt]++
	on := poweredTowardsOn(b.state)
	var want, cycle bool // want: the power the reset asks for; cycle: off and on again
	switch rt {
	case "On", "ForceOn":
		want = true
	case "ForceOff", "GracefulShutdown", "Off":
		want = false
	case "PushPowerButton":
		want = !on
	case "ForceRestart", "GracefulRestart", "PowerCycle":
		want, cycle = true, on
	case "Nmi":
		b.mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
		return
	}
	if want == on && !cycle {
		if b.cfg.Profile.RefuseRedundantReset {
			b.mu.Unlock()
			if b.cfg.Profile.RedundantResetBadRequest {
				b.writeError(w, r, http.StatusBadRequest, "iLO.2.14.InvalidOperationForSystemState",
					"The operation was not successful due to the current power state (for example, attempting to turn the power off when it is already off).",
					"Verify that the system is in the correct power state, and then retry the operation.")
			} else if on {
				b.writeError(w, r, http.StatusConflict, "IDRAC.2.8.PSU501", "Server is already powered ON.",
					"No response action is required.")
			} else {
				b.writeError(w, r, http.StatusConflict, "IDRAC.2.8.PSU502", "Server is already powered OFF.",
					"No response action is required.")
			}
			return
		}
	} else if !b.dropResets {
		if cycle {
			// A restart passes through off at once: the transition delay is
			// for the way back on.
			b.gen++
			if b.timer != nil {
				b.timer.Stop()
				b.timer = nil
			}
			b.setStateLocked(Off)
		}
		b.powerLocked(want)
	}
	b.mu.Unlock()
	b.flushHooks()
	w.WriteHeader(http.StatusNoContent)
}

// allResetTypes are the ResetType values of the Redfish schema.
var allResetTypes = []string{"On", "ForceOff", "GracefulShutdown", "GracefulRestart", "ForceRestart",
	"Nmi", "ForceOn", "PushPowerButton", "PowerCycle", "Suspend", "Pause", "Resume", "Off"}

func (b *BMC) sessionService() map[string]any {
	return map[string]any{
		"@odata.id":      sessionServicePath,
		"@odata.type":    "#SessionService.v1_1_8.SessionService",
		"Id":             "SessionService",
		"Name":           "Session Service",
		"Description":    "Session Service",
		"ServiceEnabled": true,
		"SessionTimeout": 1800,
		"Status":         map[string]string{"State": "Enabled", "Health": "OK"},
		"Sessions":       odataLink(sessionsPath),
	}
}

func (b *BMC) sessionsCollection() map[string]any {
	b.mu.Lock()
	members := []any{}
	for _, id := range b.sessions {
		members = append(members, odataLink(sessionPath(id)))
	}
	b.mu.Unlock()
	return map[string]any{
		"@odata.id":           sessionsPath,
		"@odata.type":         "#SessionCollection.SessionCollection",
		"Name":                "Session Collection",
		"Members":             members,
		"Members@odata.count": len(members),
	}
}

func (b *BMC) sessionResource(id string) map[string]any {
	return map[string]any{
		"@odata.id":   sessionPath(id),
		"@odata.type": "#Session.v1_3_0.Session",
		"Id":          id,
		"Name":        "User Session",
		"UserName":    b.cfg.Username,
	}
}

// login creates a session: 201 with X-Auth-Token, Location (as the
// profile's SessionLocation says) and the Session resource; 401 for wrong credentials; 503 SessionLimitExceeded when every
// slot is taken.
func (b *BMC) login(w http.ResponseWriter, r *http.Request) {
	var body struct{ UserName, Password string }
	if !b.readJSON(w, r, &body) {
		return
	}
	if !b.checkCredentials(body.UserName, body.Password) {
		b.writeError(w, r, http.StatusUnauthorized, "ResourceAtUriUnauthorized",
			"While accessing the resource at "+sessionsPath+", the service received an authorization error unauthorized.",
			"Ensure that the appropriate access is provided for the service in order for it to access the URI.",
			sessionsPath, "unauthorized")
		return
	}
	b.mu.Lock()
	if max := b.cfg.Profile.MaxSessions; max > 0 && len(b.sessions) >= max {
		b.mu.Unlock()
		w.Header().Set("Retry-After", "30")
		b.writeError(w, r, http.StatusServiceUnavailable, "SessionLimitExceeded",
			"The session establishment failed due to the number of simultaneous sessions exceeding the limit of the implementation.",
			"Reduce the number of other sessions before trying to establish the session or increase the limit of simultaneous sessions (if supported).")
		return
	}
	b.nextSession++
	id := itoa(b.nextSession)
	tok := newToken()
	b.sessions[tok] = id
	b.sessionsCreated++
	b.tokens = append(b.tokens, tok)
	omit := b.omitTokens
	b.mu.Unlock()
	if !omit {
		w.Header().Set("X-Auth-Token", tok)
	}
	switch b.cfg.Profile.SessionLocation {
	case LocationNone:
	case LocationAbsolute:
		w.Header().Set("Location", "https://"+r.Host+sessionPath(id))
	default:
		w.Header().Set("Location", sessionPath(id))
	}
	writeJSON(w, http.StatusCreated, b.sessionResource(id))
}

// session serves GET and DELETE (logout) of one session.
func (b *BMC) session(w http.ResponseWriter, r *http.Request, id string) {
	b.mu.Lock()
	tok := ""
	for t, sid := range b.sessions {
		if sid == id {
			tok = t
		}
	}
	if tok == "" {
		b.mu.Unlock()
		b.notFound(w, r)
		return
	}
	switch r.Method {
	case http.MethodGet:
		b.mu.Unlock()
		writeJSON(w, http.StatusOK, b.sessionResource(id))
	case http.MethodDelete:
		delete(b.sessions, tok)
		b.mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	default:
		b.mu.Unlock()
		b.methodNotAllowed(w, r)
	}
}
