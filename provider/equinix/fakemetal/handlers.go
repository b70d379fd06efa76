package fakemetal

import (
	"cmp"
	"crypto/md5"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/google/uuid"
)

// The endpoint handlers. Each parses its input without the lock, then
// takes s.mu for the whole of its look-ups and changes, so that every
// request sees and leaves a consistent account.

func (s *Server) listDevices(c call) response {
	p, bad := parsePage(c.r.URL.Query())
	if bad != nil {
		return *bad
	}
	project := c.params[0]
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.projects[project]; !ok {
		return errorResponse(http.StatusNotFound, "project not found")
	}
	ds, meta := paginate(s.devicesOf(project, s.cfg.Now()), p, href("projects", project)+"/devices")
	out := devicesJSON{Devices: make([]deviceJSON, len(ds)), Meta: meta}
	for i, d := range ds {
		out.Devices[i] = d.wire()
	}
	return response{http.StatusOK, out}
}

func (s *Server) createDevice(c call) response {
	var req createDeviceJSON
	if bad := decode(c.body, &req); bad != nil {
		return *bad
	}
	project := c.params[0]
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.projects[project]; !ok {
		return errorResponse(http.StatusNotFound, "project not found")
	}
	unprocessable := func(format string, args ...any) response {
		return errorResponse(http.StatusUnprocessableEntity, fmt.Sprintf(format, args...))
	}
	switch {
	case req.Plan == "":
		return unprocessable("plan is required")
	case req.OperatingSystem == "":
		return unprocessable("operating_system is required")
	}
	facility, metro := "", req.Metro
	if len(req.Facility) > 0 {
		facility = req.Facility[0]
	}
	var r *reservation
	if id := req.HardwareReservationID; id != "" {
		r = s.reservations[id]
		switch {
		case r == nil:
			return errorResponse(http.StatusNotFound, fmt.Sprintf("hardware reservation %s not found", id))
		case r.project != project:
			return unprocessable("hardware reservation %s does not belong to project %s", id, project)
		case !r.provisionable:
			return unprocessable("hardware reservation %s is not provisionable", id)
		case r.device != "":
			return unprocessable("hardware reservation %s already has a device", id)
		case r.plan != req.Plan:
			return unprocessable("plan %s does not match the plan of hardware reservation %s (%s)", req.Plan, id, r.plan)
		case req.Metro != "" && req.Metro != r.metro:
			return unprocessable("hardware reservation %s is in metro %s, not %s", id, r.metro, req.Metro)
		case len(req.Facility) > 0 && !slices.Contains(req.Facility, r.facility):
			return unprocessable("hardware reservation %s is in facility %s, not in %s", id, r.facility, strings.Join(req.Facility, ", "))
		}
		facility, metro = r.facility, r.metro
	} else if facility == "" && metro == "" {
		return unprocessable("metro or facility is required without a hardware reservation")
	}
	for _, id := range req.ProjectSSHKeys {
		if k := s.sshKeys[id]; k == nil || k.project != project {
			return unprocessable("project ssh key %s not found in project %s", id, project)
		}
	}
	now := s.cfg.Now()
	d := s.newDevice(project, now)
	d.hostname = cmp.Or(req.Hostname, "device-"+d.id[:8])
	d.tags = slices.Clone(req.Tags)
	d.plan, d.os, d.userdata = req.Plan, req.OperatingSystem, req.Userdata
	d.facility = cmp.Or(facility, metro+"1")
	d.metro = cmp.Or(metro, strings.TrimRight(facility, "0123456789"))
	d.sshKeys = slices.Clone(req.ProjectSSHKeys)
	delay := s.cfg.ProvisionDelay
	d.setState(now, StateQueued,
		transition{now.Add(delay / 2), StateProvisioning},
		transition{now.Add(delay), StateActive})
	if r != nil {
		d.reservation, r.device = r.id, d.id
	}
	return response{http.StatusCreated, d.wire()}
}

// device looks up a device and brings its state up to date. The caller
// holds s.mu.
func (s *Server) device(id string) (*device, *response) {
	d, ok := s.devices[id]
	if !ok {
		r := errorResponse(http.StatusNotFound, "device not found")
		return nil, &r
	}
	d.advance(s.cfg.Now())
	return d, nil
}

func (s *Server) getDevice(c call) response {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, bad := s.device(c.params[0])
	if bad != nil {
		return *bad
	}
	return response{http.StatusOK, d.wire()}
}

func (s *Server) deleteDevice(c call) response {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.removeDevice(c.params[0]) {
		return errorResponse(http.StatusNotFound, "device not found")
	}
	return response{status: http.StatusNoContent}
}

func (s *Server) deviceAction(c call) response {
	var req actionJSON
	if bad := decode(c.body, &req); bad != nil {
		return *bad
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	d, bad := s.device(c.params[0])
	if bad != nil {
		return *bad
	}
	need := StateActive
	if req.Type == "power_on" {
		need = StateInactive
	}
	switch req.Type {
	case "reboot", "reinstall", "power_off", "power_on":
	default:
		return errorResponse(http.StatusUnprocessableEntity, fmt.Sprintf("unknown action type %q", req.Type))
	}
	if req.Type != "reinstall" && (req.OperatingSystem != "" || req.DeprovisionFast || req.PreserveData) {
		return errorResponse(http.StatusUnprocessableEntity, req.Type+" takes no operating_system, deprovision_fast or preserve_data")
	}
	if d.state != need {
		return errorResponse(http.StatusUnprocessableEntity, fmt.Sprintf("cannot %s a device that is %s (it must be %s)", req.Type, d.state, need))
	}
	now := s.cfg.Now()
	rd := s.cfg.RebootDelay
	switch req.Type {
	case "reboot":
		d.setState(now, StatePoweringOff,
			transition{now.Add(rd / 2), StatePoweringOn},
			transition{now.Add(rd), StateActive})
		d.reboots++
	case "power_off":
		d.setState(now, StatePoweringOff, transition{now.Add(rd), StateInactive})
	case "power_on":
		d.setState(now, StatePoweringOn, transition{now.Add(rd), StateActive})
	case "reinstall":
		d.os = cmp.Or(req.OperatingSystem, d.os)
		d.setState(now, StateReinstalling, transition{now.Add(s.cfg.ReinstallDelay), StateActive})
	}
	return response{status: http.StatusAccepted}
}

func (s *Server) listReservations(c call) response {
	p, bad := parsePage(c.r.URL.Query())
	if bad != nil {
		return *bad
	}
	project := c.params[0]
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.projects[project]; !ok {
		return errorResponse(http.StatusNotFound, "project not found")
	}
	rs, meta := paginate(s.reservationsOf(project), p, href("projects", project)+"/hardware-reservations")
	out := reservationsJSON{HardwareReservations: make([]reservationJSON, len(rs)), Meta: meta}
	for i, r := range rs {
		out.HardwareReservations[i] = r.wire()
	}
	return response{http.StatusOK, out}
}

func (s *Server) getReservation(c call) response {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.reservations[c.params[0]]
	if !ok {
		return errorResponse(http.StatusNotFound, "hardware reservation not found")
	}
	return response{http.StatusOK, r.wire()}
}

func (s *Server) moveReservation(c call) response {
	var req moveJSON
	if bad := decode(c.body, &req); bad != nil {
		return *bad
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.reservations[c.params[0]]
	switch {
	case !ok:
		return errorResponse(http.StatusNotFound, "hardware reservation not found")
	case req.ProjectID == "":
		return errorResponse(http.StatusUnprocessableEntity, "project_id is required")
	case s.projects[req.ProjectID] == nil:
		return errorResponse(http.StatusUnprocessableEntity, fmt.Sprintf("project %s not found", req.ProjectID))
	case r.device != "":
		return errorResponse(http.StatusUnprocessableEntity, fmt.Sprintf("hardware reservation %s has a device; delete it before moving the reservation", r.id))
	}
	r.project = req.ProjectID
	return response{http.StatusCreated, r.wire()}
}

func (s *Server) listSSHKeys(c call) response {
	p, bad := parsePage(c.r.URL.Query())
	if bad != nil {
		return *bad
	}
	project := c.params[0]
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.projects[project]; !ok {
		return errorResponse(http.StatusNotFound, "project not found")
	}
	ks, meta := paginate(s.sshKeysOf(project), p, href("projects", project)+"/ssh-keys")
	out := sshKeysJSON{SSHKeys: make([]sshKeyJSON, len(ks)), Meta: meta}
	for i, k := range ks {
		out.SSHKeys[i] = k.wire()
	}
	return response{http.StatusOK, out}
}

// createSSHKey adds a key. Like the real API it accepts a label that
// another key already has: avoiding duplicates is the client's job.
func (s *Server) createSSHKey(c call) response {
	var req sshKeyBodyJSON
	if bad := decode(c.body, &req); bad != nil {
		return *bad
	}
	if req.Label == "" {
		return errorResponse(http.StatusUnprocessableEntity, "label is required")
	}
	fp, err := fingerprint(req.Key)
	if err != nil {
		return errorResponse(http.StatusUnprocessableEntity, err.Error())
	}
	project := c.params[0]
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.projects[project]; !ok {
		return errorResponse(http.StatusNotFound, "project not found")
	}
	now := s.cfg.Now()
	k := &sshKey{id: uuid.NewString(), project: project, label: req.Label, key: req.Key, fingerprint: fp, created: now, updated: now}
	s.sshKeys[k.id] = k
	return response{http.StatusCreated, k.wire()}
}

// updateSSHKey changes the label, the key or both; an empty field is left
// as it is.
func (s *Server) updateSSHKey(c call) response {
	var req sshKeyBodyJSON
	if bad := decode(c.body, &req); bad != nil {
		return *bad
	}
	var fp string
	if req.Key != "" {
		var err error
		if fp, err = fingerprint(req.Key); err != nil {
			return errorResponse(http.StatusUnprocessableEntity, err.Error())
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	k, ok := s.sshKeys[c.params[0]]
	if !ok {
		return errorResponse(http.StatusNotFound, "ssh key not found")
	}
	if req.Label != "" {
		k.label = req.Label
	}
	if req.Key != "" {
		k.key, k.fingerprint = req.Key, fp
	}
	k.updated = s.cfg.Now()
	return response{http.StatusOK, k.wire()}
}

// fingerprint checks an authorized_keys line ("ssh-ed25519 AAAA… comment")
// and returns the MD5 fingerprint of its key blob, colon-separated hex as
// the real API shows it.
func fingerprint(key string) (string, error) {
	f := strings.Fields(key)
	if len(f) < 2 {
		return "", errors.New("key must be an OpenSSH public key: type, base64 key, optional comment")
	}
	if !strings.HasPrefix(f[0], "ssh-") && !strings.HasPrefix(f[0], "ecdsa-") && !strings.HasPrefix(f[0], "sk-") {
		return "", fmt.Errorf("key has unknown type %q", f[0])
	}
	blob, err := base64.StdEncoding.DecodeString(f[1])
	if err != nil {
		if blob, err = base64.RawStdEncoding.DecodeString(f[1]); err != nil {
			return "", errors.New("key is not valid base64")
		}
	}
	sum := md5.Sum(blob)
	hx := hex.EncodeToString(sum[:])
	parts := make([]string, len(sum))
	for i := range parts {
		parts[i] = hx[2*i : 2*i+2]
	}
	return strings.Join(parts, ":"), nil
}
