package fakemetal

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/google/uuid"
)

// Device states of the wire contract.
const (
	StateQueued         = "queued"
	StateProvisioning   = "provisioning"
	StateActive         = "active"
	StatePoweringOff    = "powering_off"
	StatePoweringOn     = "powering_on"
	StateInactive       = "inactive"
	StateReinstalling   = "reinstalling"
	StateDeprovisioning = "deprovisioning"
	StateFailed         = "failed"
)

var states = []string{
	StateQueued, StateProvisioning, StateActive, StatePoweringOff, StatePoweringOn,
	StateInactive, StateReinstalling, StateDeprovisioning, StateFailed,
}

type project struct {
	id      string
	created time.Time
}

// device is a device as the fake keeps it. Its state moves on by the
// deadlines in pending, applied by advance when the device is read.
type device struct {
	id          string
	project     string
	hostname    string
	tags        []string
	plan        string
	os          string
	facility    string
	metro       string
	reservation string // "" for an on-demand device
	sshKeys     []string
	userdata    string
	ip          netip.Addr // the public management address
	n           int        // the n-th device created: numbers its other addresses
	state       string
	pending     []transition
	created     time.Time
	updated     time.Time
	reboots     int
}

// transition makes a device's state next at time at.
type transition struct {
	at   time.Time
	next string
}

// advance applies the transitions that are due at now.
func (d *device) advance(now time.Time) {
	for len(d.pending) > 0 && !now.Before(d.pending[0].at) {
		d.state, d.updated = d.pending[0].next, d.pending[0].at
		d.pending = d.pending[1:]
	}
}

// setState puts the device in state now, then through the transitions.
func (d *device) setState(now time.Time, state string, then ...transition) {
	d.state, d.updated, d.pending = state, now, then
}

type reservation struct {
	id            string
	project       string
	plan          string
	facility      string
	metro         string
	provisionable bool
	spare         bool
	device        string // "" while free
	created       time.Time
}

type sshKey struct {
	id          string
	project     string
	label       string
	key         string
	fingerprint string
	created     time.Time
	updated     time.Time
}

// byCreation orders objects as the API lists them: by creation time, then id.
func byCreation(at1 time.Time, id1 string, at2 time.Time, id2 string) int {
	if c := at1.Compare(at2); c != 0 {
		return c
	}
	return cmp.Compare(id1, id2)
}

// documentationAddr is the default Config.Address: the n-th address (from
// 1) of the documentation networks, then of the benchmarking network
// 198.18.0.0/15; unique for the first 131,832 devices.
func documentationAddr(n int) netip.Addr {
	i := max(n-1, 0)
	switch {
	case i < 254:
		return netip.AddrFrom4([4]byte{198, 51, 100, byte(i + 1)})
	case i < 508:
		return netip.AddrFrom4([4]byte{203, 0, 113, byte(i - 254 + 1)})
	case i < 762:
		return netip.AddrFrom4([4]byte{192, 0, 2, byte(i - 508 + 1)})
	}
	j := (i-762)%(1<<17-2) + 1 // 198.18.0.1 to 198.19.255.254
	return netip.AddrFrom4([4]byte{198, 18 + byte(j>>16), byte(j >> 8), byte(j)})
}

// privateAddr and ipv6Addr are a device's other addresses: a client that
// takes the first management address it sees, not the public IPv4 one,
// gets one of these.
func privateAddr(n int) netip.Addr {
	return netip.AddrFrom4([4]byte{10, byte(n >> 16), byte(n >> 8), byte(n)})
}

func ipv6Addr(n int) netip.Addr {
	b := netip.MustParseAddr("2001:db8::").As16()
	b[12], b[13], b[14], b[15] = byte(n>>24), byte(n>>16), byte(n>>8), byte(n)
	return netip.AddrFrom16(b)
}

// newDevice creates a device in project and numbers its addresses. The
// caller holds s.mu and attaches it to its reservation.
func (s *Server) newDevice(project string, now time.Time) *device {
	s.created++
	d := &device{id: uuid.NewString(), project: project, n: s.created, created: now, updated: now}
	if d.ip = s.cfg.Address(d.id, d.n); !d.ip.IsValid() {
		d.ip = documentationAddr(d.n)
	}
	s.devices[d.id] = d
	return d
}

func (s *Server) addProject(id string, now time.Time) {
	if _, ok := s.projects[id]; !ok {
		s.projects[id] = &project{id: id, created: now}
	}
}

// AddProject adds an empty project to the account; adding one that exists
// changes nothing.
func (s *Server) AddProject(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.addProject(id, s.cfg.Now())
}

// AddSSHKey adds an SSH key to project (added if missing), as someone
// using the portal would, and returns its id. An invalid key panics: it is
// a bug in the test.
func (s *Server) AddSSHKey(project, label, key string) string {
	fp, err := fingerprint(key)
	if err != nil {
		panic("fakemetal: AddSSHKey: " + err.Error())
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.cfg.Now()
	s.addProject(project, now)
	k := &sshKey{id: uuid.NewString(), project: project, label: label, key: key, fingerprint: fp, created: now, updated: now}
	s.sshKeys[k.id] = k
	return k.id
}

// AddReservations adds n provisionable hardware reservations without a
// device to project (added if missing) and returns their ids.
func (s *Server) AddReservations(project, plan, facility, metro string, n int) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.cfg.Now()
	s.addProject(project, now)
	ids := make([]string, n)
	for i := range ids {
		r := &reservation{
			id: uuid.NewString(), project: project, plan: plan, facility: facility, metro: metro,
			provisionable: true, created: now,
		}
		s.reservations[r.id] = r
		ids[i] = r.id
	}
	return ids
}

// SetReservationProvisionable marks a reservation provisionable or not (a
// device cannot be created on one that is not); false if there is no such
// reservation.
func (s *Server) SetReservationProvisionable(id string, provisionable bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.reservations[id]
	if ok {
		r.provisionable = provisionable
	}
	return ok
}

// DeviceSpec describes a device added with AddDevice, as if someone had
// created it elsewhere (in the portal, with another tool).
type DeviceSpec struct {
	Hostname string
	Tags     []string
	// State is the device's state, kept until the API or SetDeviceState
	// changes it; default "active".
	State         string
	ReservationID string // optional: the reservation (of the same project) it occupies
	Plan          string // default: the reservation's plan, or "c3.small.x86"
	OS            string // default "ubuntu_22_04"
	Facility      string // default: the reservation's facility, or "fr2"
	Metro         string // default: the reservation's metro, or "fr"
}

// AddDevice adds a device to project (added if missing) and returns its
// id. It panics if the spec is impossible (an unknown state; a reservation
// that is unknown, of another project or taken): that is a bug in the test.
func (s *Server) AddDevice(project string, spec DeviceSpec) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.cfg.Now()
	spec.State = cmp.Or(spec.State, StateActive)
	if !slices.Contains(states, spec.State) {
		panic(fmt.Sprintf("fakemetal: AddDevice: unknown state %q", spec.State))
	}
	var r *reservation
	if spec.ReservationID != "" {
		r = s.reservations[spec.ReservationID]
		switch {
		case r == nil:
			panic(fmt.Sprintf("fakemetal: AddDevice: no reservation %s", spec.ReservationID))
		case r.project != project:
			panic(fmt.Sprintf("fakemetal: AddDevice: reservation %s is in project %s, not %s", r.id, r.project, project))
		case r.device != "":
			panic(fmt.Sprintf("fakemetal: AddDevice: reservation %s already has device %s", r.id, r.device))
		}
		spec.Plan = cmp.Or(spec.Plan, r.plan)
		spec.Facility = cmp.Or(spec.Facility, r.facility)
		spec.Metro = cmp.Or(spec.Metro, r.metro)
	}
	s.addProject(project, now)
	d := s.newDevice(project, now)
	d.hostname, d.tags, d.state = spec.Hostname, slices.Clone(spec.Tags), spec.State
	d.plan = cmp.Or(spec.Plan, "c3.small.x86")
	d.os = cmp.Or(spec.OS, "ubuntu_22_04")
	d.facility = cmp.Or(spec.Facility, "fr2")
	d.metro = cmp.Or(spec.Metro, "fr")
	if r != nil {
		d.reservation, r.device = r.id, d.id
	}
	return d.id
}

// removeDevice deletes a device and frees its reservation. The caller
// holds s.mu.
func (s *Server) removeDevice(id string) bool {
	d, ok := s.devices[id]
	if !ok {
		return false
	}
	if r := s.reservations[d.reservation]; r != nil && r.device == id {
		r.device = ""
	}
	delete(s.devices, id)
	return true
}

// DeleteDevice deletes a device as if someone had deleted it in the
// portal, freeing its reservation; false if there is no such device.
func (s *Server) DeleteDevice(id string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.removeDevice(id)
}

// SetDeviceState puts a device in state (one of the State* constants) and
// cancels its pending transitions; false if there is no such device or
// state.
func (s *Server) SetDeviceState(id, state string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, ok := s.devices[id]
	if !ok || !slices.Contains(states, state) {
		return false
	}
	d.setState(s.cfg.Now(), state)
	return true
}

// Reboots returns the number of reboot actions the fake accepted for a
// device.
func (s *Server) Reboots(id string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if d, ok := s.devices[id]; ok {
		return d.reboots
	}
	return 0
}

// Device is a snapshot of a device, mirroring its wire shape.
type Device struct {
	ID            string
	ShortID       string
	Project       string
	Hostname      string
	State         string // at the time of the snapshot, by Config.Now
	Tags          []string
	Plan          string
	OS            string
	Facility      string
	Metro         string
	ReservationID string // "" for an on-demand device
	SSHKeyIDs     []string
	Userdata      string
	// IP is the public IPv4 management address (Config.Address). The API
	// shows it once the device is provisioned; the snapshot always does.
	IP        netip.Addr
	CreatedAt time.Time
	UpdatedAt time.Time
}

func (d *device) snapshot() Device {
	return Device{
		ID: d.id, ShortID: d.id[:8], Project: d.project, Hostname: d.hostname, State: d.state,
		Tags: slices.Clone(d.tags), Plan: d.plan, OS: d.os, Facility: d.facility, Metro: d.metro,
		ReservationID: d.reservation, SSHKeyIDs: slices.Clone(d.sshKeys), Userdata: d.userdata,
		IP: d.ip, CreatedAt: d.created, UpdatedAt: d.updated,
	}
}

// devicesOf returns the devices of project ("" for all) in list order,
// advanced to now. The caller holds s.mu.
func (s *Server) devicesOf(project string, now time.Time) []*device {
	var ds []*device
	for _, d := range s.devices {
		if project == "" || d.project == project {
			d.advance(now)
			ds = append(ds, d)
		}
	}
	slices.SortFunc(ds, func(a, b *device) int { return byCreation(a.created, a.id, b.created, b.id) })
	return ds
}

// Devices returns the devices of project ("" for every project) in the
// order the API lists them.
func (s *Server) Devices(project string) []Device {
	s.mu.Lock()
	defer s.mu.Unlock()
	ds := s.devicesOf(project, s.cfg.Now())
	out := make([]Device, len(ds))
	for i, d := range ds {
		out[i] = d.snapshot()
	}
	return out
}

// Device returns a snapshot of one device; false if there is no such
// device.
func (s *Server) Device(id string) (Device, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	d, ok := s.devices[id]
	if !ok {
		return Device{}, false
	}
	d.advance(s.cfg.Now())
	return d.snapshot(), true
}

// Reservation is a snapshot of a hardware reservation.
type Reservation struct {
	ID            string
	ShortID       string
	Project       string
	Plan          string
	Facility      string
	Metro         string
	Provisionable bool
	Spare         bool
	DeviceID      string // "" while free
	CreatedAt     time.Time
}

func (r *reservation) snapshot() Reservation {
	return Reservation{
		ID: r.id, ShortID: r.id[:8], Project: r.project, Plan: r.plan, Facility: r.facility,
		Metro: r.metro, Provisionable: r.provisionable, Spare: r.spare, DeviceID: r.device,
		CreatedAt: r.created,
	}
}

// reservationsOf returns the reservations of project ("" for all) in list
// order. The caller holds s.mu.
func (s *Server) reservationsOf(project string) []*reservation {
	var rs []*reservation
	for _, r := range s.reservations {
		if project == "" || r.project == project {
			rs = append(rs, r)
		}
	}
	slices.SortFunc(rs, func(a, b *reservation) int { return byCreation(a.created, a.id, b.created, b.id) })
	return rs
}

// Reservations returns the hardware reservations of project ("" for every
// project) in the order the API lists them.
func (s *Server) Reservations(project string) []Reservation {
	s.mu.Lock()
	defer s.mu.Unlock()
	rs := s.reservationsOf(project)
	out := make([]Reservation, len(rs))
	for i, r := range rs {
		out[i] = r.snapshot()
	}
	return out
}

// SSHKey is a snapshot of a project SSH key.
type SSHKey struct {
	ID          string
	Project     string
	Label       string
	Key         string
	Fingerprint string
	CreatedAt   time.Time
	UpdatedAt   time.Time
}

// sshKeysOf returns the SSH keys of project ("" for all) in list order.
// The caller holds s.mu.
func (s *Server) sshKeysOf(project string) []*sshKey {
	var ks []*sshKey
	for _, k := range s.sshKeys {
		if project == "" || k.project == project {
			ks = append(ks, k)
		}
	}
	slices.SortFunc(ks, func(a, b *sshKey) int { return byCreation(a.created, a.id, b.created, b.id) })
	return ks
}

// SSHKeys returns the SSH keys of project ("" for every project) in the
// order the API lists them.
func (s *Server) SSHKeys(project string) []SSHKey {
	s.mu.Lock()
	defer s.mu.Unlock()
	ks := s.sshKeysOf(project)
	out := make([]SSHKey, len(ks))
	for i, k := range ks {
		out[i] = SSHKey{
			ID: k.id, Project: k.project, Label: k.label, Key: k.key, Fingerprint: k.fingerprint,
			CreatedAt: k.created, UpdatedAt: k.updated,
		}
	}
	return out
}
