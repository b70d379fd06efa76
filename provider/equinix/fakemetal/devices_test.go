package fakemetal

import (
	"crypto/ed25519"
	"fmt"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"
)

func TestNewValidates(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		cfg  Config
		want string
	}{
		{"no token", Config{}, "Token"},
		{"negative delay", Config{Token: "x", ProvisionDelay: -1}, "ProvisionDelay"},
		{"negative budget", Config{Token: "x", Budget: -1}, "Budget"},
		{"negative burst", Config{Token: "x", Burst: -1}, "Burst"},
		{"fault rate above 1", Config{Token: "x", Faults: Faults{Rate: 1.5}}, "Faults.Rate"},
		{"negative weight", Config{Token: "x", Faults: Faults{Rate: 0.1, Timeout: -1}}, "Faults.Timeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := New(tt.cfg)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("New() error = %v, want one naming %s", err, tt.want)
			}
		})
	}
}

func TestRoutingErrors(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{})
	e.fake.AddProject("p")
	e.do(http.MethodGet, "/nope", nil).wantError(t, http.StatusNotFound, "not found")
	e.do(http.MethodGet, "/devices/x/y/z", nil).wantError(t, http.StatusNotFound, "not found")
	e.do(http.MethodGet, "/other/v1/devices/x", nil).wantError(t, http.StatusNotFound, "not found")
	e.do(http.MethodPatch, "/projects/p/devices", nil).wantError(t, http.StatusMethodNotAllowed, "method not allowed")
	e.do(http.MethodDelete, "/ssh-keys/k", nil).wantError(t, http.StatusMethodNotAllowed, "method not allowed")
	e.do(http.MethodGet, "/devices/unknown", nil).wantError(t, http.StatusNotFound, "device not found")
	e.do(http.MethodGet, "/projects/unknown/devices", nil).wantError(t, http.StatusNotFound, "project not found")
	r := e.do(http.MethodGet, "/projects/p/devices", nil).want(t, http.StatusOK)
	if ct := r.header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q, want application/json", ct)
	}
}

func TestPagination(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	e := newEnv(t, Config{Now: clock.Now})
	for i := range 250 {
		if i%100 == 50 {
			clock.Advance(time.Second) // some devices share created_at, some do not
		}
		e.fake.AddDevice("p", DeviceSpec{Hostname: fmt.Sprintf("h%03d", i)})
	}

	t.Run("walk per_page 100", func(t *testing.T) {
		var got []string
		path := "/projects/p/devices?per_page=100"
		for page := 1; ; page++ {
			if page > 3 {
				t.Fatalf("more than 3 pages")
			}
			r := decodeAs[devicesJSON](t, e.do(http.MethodGet, path, nil).want(t, http.StatusOK))
			m := r.Meta
			if m.Total != 250 || m.LastPage != 3 || m.CurrentPage != page {
				t.Fatalf("page %d: meta total=%d last_page=%d current_page=%d, want 250, 3, %d", page, m.Total, m.LastPage, m.CurrentPage, page)
			}
			if want := []int{100, 100, 50}[page-1]; len(r.Devices) != want {
				t.Fatalf("page %d has %d devices, want %d", page, len(r.Devices), want)
			}
			if m.First.Href != PathPrefix+"/projects/p/devices?page=1&per_page=100" ||
				m.Last.Href != PathPrefix+"/projects/p/devices?page=3&per_page=100" {
				t.Errorf("page %d: first %q last %q", page, m.First.Href, m.Last.Href)
			}
			if (m.Previous == nil) != (page == 1) {
				t.Errorf("page %d: previous = %v", page, m.Previous)
			}
			for _, d := range r.Devices {
				got = append(got, d.ID)
			}
			if m.Next == nil {
				if page != 3 {
					t.Fatalf("next is null on page %d of 3", page)
				}
				break
			}
			if want := fmt.Sprintf("%s/projects/p/devices?page=%d&per_page=100", PathPrefix, page+1); m.Next.Href != want {
				t.Fatalf("next %q, want %q", m.Next.Href, want)
			}
			path = m.Next.Href
		}
		var want []string
		snap := e.fake.Devices("p")
		for _, d := range snap {
			want = append(want, d.ID)
		}
		if !slices.Equal(got, want) {
			t.Fatalf("walk listed %d devices, not the %d of the snapshot in order", len(got), len(want))
		}
		if !slices.IsSortedFunc(snap, func(a, b Device) int { return byCreation(a.CreatedAt, a.ID, b.CreatedAt, b.ID) }) {
			t.Fatalf("devices are not in (created_at, id) order")
		}
	})

	t.Run("default per_page is 10", func(t *testing.T) {
		r := decodeAs[devicesJSON](t, e.do(http.MethodGet, "/projects/p/devices", nil))
		if len(r.Devices) != 10 || r.Meta.LastPage != 25 || r.Meta.Next.Href != PathPrefix+"/projects/p/devices?page=2&per_page=10" {
			t.Fatalf("got %d devices, last_page %d, next %v", len(r.Devices), r.Meta.LastPage, r.Meta.Next)
		}
	})

	t.Run("per_page is capped at 1000", func(t *testing.T) {
		r := decodeAs[devicesJSON](t, e.do(http.MethodGet, "/projects/p/devices?per_page=5000", nil))
		if len(r.Devices) != 250 || r.Meta.Next != nil || r.Meta.Last.Href != PathPrefix+"/projects/p/devices?page=1&per_page=1000" {
			t.Fatalf("got %d devices, next %v, last %v", len(r.Devices), r.Meta.Next, r.Meta.Last)
		}
	})

	t.Run("a page past the last is empty", func(t *testing.T) {
		r := e.do(http.MethodGet, "/projects/p/devices?page=9&per_page=100", nil)
		if !strings.Contains(string(r.body), `"devices":[]`) {
			t.Fatalf("body %s, want an empty devices list", r.body)
		}
		if m := decodeAs[devicesJSON](t, r).Meta; m.Next != nil || m.CurrentPage != 9 || m.Total != 250 {
			t.Fatalf("meta %+v", m)
		}
	})

	t.Run("bad page parameters", func(t *testing.T) {
		e.do(http.MethodGet, "/projects/p/devices?page=0", nil).wantError(t, http.StatusBadRequest, "page")
		e.do(http.MethodGet, "/projects/p/devices?per_page=x", nil).wantError(t, http.StatusBadRequest, "per_page")
	})

	t.Run("reservations and ssh keys page too", func(t *testing.T) {
		e.fake.AddReservations("p", "c3.small.x86", "fr2", "fr", 15)
		r := decodeAs[reservationsJSON](t, e.do(http.MethodGet, "/projects/p/hardware-reservations?page=2", nil))
		if len(r.HardwareReservations) != 5 || r.Meta.Total != 15 || r.Meta.Next != nil {
			t.Fatalf("page 2: %d reservations, meta %+v", len(r.HardwareReservations), r.Meta)
		}
		k := decodeAs[sshKeysJSON](t, e.do(http.MethodGet, "/projects/p/ssh-keys", nil))
		if len(k.SSHKeys) != 0 || k.Meta.Total != 0 || k.Meta.LastPage != 1 || k.Meta.Next != nil {
			t.Fatalf("ssh keys: %+v", k)
		}
	})
}

func TestCreateDeviceLifecycle(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	e := newEnv(t, Config{
		Now:            clock.Now,
		ProvisionDelay: 10 * time.Second,
		Address: func(_ string, n int) netip.Addr {
			return netip.AddrFrom4([4]byte{192, 0, 2, byte(100 + n)})
		},
	})
	res := e.fake.AddReservations("p", "c3.small.x86", "fr2", "fr", 1)[0]
	key := decodeAs[sshKeyJSON](t, e.do(http.MethodPost, "/projects/p/ssh-keys",
		sshKeyBodyJSON{Label: "shepherd", Key: testKey(t, 1)}).want(t, http.StatusCreated))

	body := createBody("shepherd-abc", res)
	body.Metro, body.Facility = "fr", []string{"fr2", "fr3"}
	body.ProjectSSHKeys, body.Userdata = []string{key.ID}, "#cloud-config"
	d := decodeAs[deviceJSON](t, e.do(http.MethodPost, "/projects/p/devices", body).want(t, http.StatusCreated))
	if d.State != StateQueued || len(d.IPAddresses) != 0 || d.Hostname != "shepherd-abc" || !slices.Equal(d.Tags, []string{"shepherd"}) {
		t.Fatalf("created device: state %q, %d addresses, hostname %q, tags %q", d.State, len(d.IPAddresses), d.Hostname, d.Tags)
	}
	if d.ShortID != d.ID[:8] || d.Href != PathPrefix+"/devices/"+d.ID || d.Project.ID != "p" || d.Project.Href != PathPrefix+"/projects/p" {
		t.Fatalf("created device: short_id %q, href %q, project %+v", d.ShortID, d.Href, d.Project)
	}
	if d.HardwareReservation == nil || d.HardwareReservation.ID != res || d.HardwareReservation.Href != PathPrefix+"/hardware-reservations/"+res {
		t.Fatalf("created device: hardware_reservation %+v", d.HardwareReservation)
	}
	if d.Plan.Slug != "c3.small.x86" || d.OperatingSystem.Slug != "ubuntu_22_04" || d.Facility.Code != "fr2" || d.Metro.Code != "fr" {
		t.Fatalf("created device: plan %v os %v facility %v metro %v", d.Plan, d.OperatingSystem, d.Facility, d.Metro)
	}
	if !d.CreatedAt.Equal(clock.Now()) {
		t.Fatalf("created_at %s, want %s", d.CreatedAt, clock.Now())
	}
	r := decodeAs[reservationJSON](t, e.do(http.MethodGet, "/hardware-reservations/"+res, nil).want(t, http.StatusOK))
	if r.Device == nil || r.Device.ID != d.ID || r.Device.Href != d.Href {
		t.Fatalf("reservation device %+v, want %s", r.Device, d.ID)
	}

	get := func() deviceJSON {
		return decodeAs[deviceJSON](t, e.do(http.MethodGet, "/devices/"+d.ID, nil).want(t, http.StatusOK))
	}
	clock.Advance(5 * time.Second)
	if got := get(); got.State != StateProvisioning || len(got.IPAddresses) != 0 {
		t.Fatalf("after 5s: state %q with %d addresses, want provisioning without", got.State, len(got.IPAddresses))
	}
	clock.Advance(5 * time.Second)
	got := get()
	if got.State != StateActive || !got.UpdatedAt.Equal(clock.Now()) {
		t.Fatalf("after 10s: state %q updated_at %s, want active at %s", got.State, got.UpdatedAt, clock.Now())
	}
	var mgmt []ipJSON
	for _, ip := range got.IPAddresses {
		if ip.Public && ip.AddressFamily == 4 && ip.Management {
			mgmt = append(mgmt, ip)
		}
	}
	if len(mgmt) != 1 || mgmt[0].Address != "192.0.2.101" {
		t.Fatalf("public IPv4 management addresses %+v, want just 192.0.2.101", mgmt)
	}

	snap, ok := e.fake.Device(d.ID)
	if !ok || snap.State != StateActive || snap.IP != netip.MustParseAddr("192.0.2.101") ||
		!slices.Equal(snap.SSHKeyIDs, []string{key.ID}) || snap.Userdata != "#cloud-config" || snap.ReservationID != res {
		t.Fatalf("snapshot %+v", snap)
	}
	if rs := e.fake.Reservations("p"); len(rs) != 1 || rs[0].DeviceID != d.ID {
		t.Fatalf("reservations %+v", rs)
	}
}

func TestCreateDeviceRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{})
	free := e.fake.AddReservations("p", "c3.small.x86", "fr2", "fr", 1)[0]
	taken := e.fake.AddReservations("p", "c3.small.x86", "fr2", "fr", 1)[0]
	e.fake.AddDevice("p", DeviceSpec{Hostname: "someone-else", ReservationID: taken})
	other := e.fake.AddReservations("q", "c3.small.x86", "fr2", "fr", 1)[0]
	unprov := e.fake.AddReservations("p", "c3.small.x86", "fr2", "fr", 1)[0]
	e.fake.SetReservationProvisionable(unprov, false)

	with := func(f func(b *createDeviceJSON)) createDeviceJSON {
		b := createBody("h", free)
		f(&b)
		return b
	}
	tests := []struct {
		name    string
		project string
		body    any
		status  int
		msg     string
	}{
		{"reservation with a device", "p", createBody("h", taken), 422, "already has a device"},
		{"reservation of another project", "p", createBody("h", other), 422, "does not belong"},
		{"reservation not provisionable", "p", createBody("h", unprov), 422, "not provisionable"},
		{"unknown reservation", "p", createBody("h", "nope"), 404, "not found"},
		{"plan of another reservation", "p", with(func(b *createDeviceJSON) { b.Plan = "m3.large.x86" }), 422, "does not match"},
		{"metro of another reservation", "p", with(func(b *createDeviceJSON) { b.Metro = "am" }), 422, "metro"},
		{"no operating system", "p", with(func(b *createDeviceJSON) { b.OperatingSystem = "" }), 422, "operating_system"},
		{"unknown ssh key", "p", with(func(b *createDeviceJSON) { b.ProjectSSHKeys = []string{"k"} }), 422, "ssh key"},
		{"no reservation and no location", "p", with(func(b *createDeviceJSON) { b.HardwareReservationID = "" }), 422, "metro or facility"},
		{"bad JSON", "p", `{"hostname":`, 400, "invalid JSON"},
		{"empty body", "p", "", 400, "invalid JSON"},
		{"a field outside the contract", "p", `{"hostname":"h","plan":"c3.small.x86","operating_system":"x","hardware_reservation":"r"}`, 422, "unknown field"},
		{"facility as a string", "p", `{"facility":"fr2"}`, 422, "facility"},
		{"unknown project", "nope", createBody("h", free), 404, "project not found"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e.do(http.MethodPost, "/projects/"+tt.project+"/devices", tt.body).wantError(t, tt.status, tt.msg)
		})
	}
	if ds := e.fake.Devices(""); len(ds) != 1 || ds[0].Hostname != "someone-else" {
		t.Fatalf("refused creates left devices: %+v", ds)
	}
	for _, r := range e.fake.Reservations("p") {
		if r.ID == free && r.DeviceID != "" {
			t.Fatalf("refused creates took reservation %+v", r)
		}
	}
}

func TestDeleteFreesReservation(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{})
	res := e.fake.AddReservations("p", "c3.small.x86", "fr2", "fr", 1)[0]
	d := decodeAs[deviceJSON](t, e.do(http.MethodPost, "/projects/p/devices", createBody("a", res)).want(t, http.StatusCreated))

	r := e.do(http.MethodDelete, "/devices/"+d.ID, nil).want(t, http.StatusNoContent)
	if len(r.body) != 0 {
		t.Errorf("DELETE answered a body: %s", r.body)
	}
	e.do(http.MethodGet, "/devices/"+d.ID, nil).wantError(t, http.StatusNotFound, "device not found")
	e.do(http.MethodDelete, "/devices/"+d.ID, nil).wantError(t, http.StatusNotFound, "device not found")
	if !strings.Contains(string(e.do(http.MethodGet, "/hardware-reservations/"+res, nil).body), `"device":null`) {
		t.Fatalf("reservation still has a device after DELETE")
	}

	// Deleted in the portal: the same.
	d2 := decodeAs[deviceJSON](t, e.do(http.MethodPost, "/projects/p/devices", createBody("b", res)).want(t, http.StatusCreated))
	if !e.fake.DeleteDevice(d2.ID) || e.fake.DeleteDevice(d2.ID) {
		t.Fatalf("DeleteDevice: want true, then false")
	}
	if rs := e.fake.Reservations("p"); rs[0].DeviceID != "" {
		t.Fatalf("reservation still has device %s after DeleteDevice", rs[0].DeviceID)
	}
	e.do(http.MethodPost, "/projects/p/devices", createBody("c", res)).want(t, http.StatusCreated)
}

// action posts a device action and returns the reply.
func (e *env) action(id string, body any) reply {
	return e.do(http.MethodPost, "/devices/"+id+"/actions", body)
}

func (e *env) state(t *testing.T, id string) string {
	t.Helper()
	return decodeAs[deviceJSON](t, e.do(http.MethodGet, "/devices/"+id, nil).want(t, http.StatusOK)).State
}

func TestReboot(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	e := newEnv(t, Config{Now: clock.Now, RebootDelay: 4 * time.Second})
	id := e.fake.AddDevice("p", DeviceSpec{Hostname: "h", State: StateProvisioning})

	e.action(id, actionJSON{Type: "reboot"}).wantError(t, http.StatusUnprocessableEntity, "provisioning")
	if !e.fake.SetDeviceState(id, StateActive) || e.fake.SetDeviceState(id, "sleeping") || e.fake.SetDeviceState("nope", StateActive) {
		t.Fatalf("SetDeviceState: want true for a known device and state only")
	}
	r := e.action(id, actionJSON{Type: "reboot"}).want(t, http.StatusAccepted)
	if len(r.body) != 0 {
		t.Errorf("reboot answered a body: %s", r.body)
	}
	if s := e.state(t, id); s != StatePoweringOff {
		t.Fatalf("state %q right after reboot, want powering_off", s)
	}
	e.action(id, actionJSON{Type: "reboot"}).wantError(t, http.StatusUnprocessableEntity, "powering_off")
	clock.Advance(2 * time.Second)
	if s := e.state(t, id); s != StatePoweringOn {
		t.Fatalf("state %q half way, want powering_on", s)
	}
	clock.Advance(2 * time.Second)
	if s := e.state(t, id); s != StateActive {
		t.Fatalf("state %q after RebootDelay, want active", s)
	}
	e.action(id, actionJSON{Type: "reboot"}).want(t, http.StatusAccepted)
	if n := e.fake.Reboots(id); n != 2 {
		t.Fatalf("Reboots = %d, want 2 (a refused reboot does not count)", n)
	}

	e.action(id, actionJSON{Type: "explode"}).wantError(t, http.StatusUnprocessableEntity, "unknown action")
	e.action(id, actionJSON{Type: "reboot", OperatingSystem: "x"}).wantError(t, http.StatusUnprocessableEntity, "operating_system")
	e.action(id, `{"type":`).wantError(t, http.StatusBadRequest, "invalid JSON")
	e.action("nope", actionJSON{Type: "reboot"}).wantError(t, http.StatusNotFound, "device not found")
}

func TestReinstall(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	e := newEnv(t, Config{Now: clock.Now, ReinstallDelay: 30 * time.Second})
	id := e.fake.AddDevice("p", DeviceSpec{Hostname: "h", OS: "ubuntu_22_04"})

	e.action(id, actionJSON{Type: "reinstall", OperatingSystem: "debian_12", PreserveData: true}).want(t, http.StatusAccepted)
	if s := e.state(t, id); s != StateReinstalling {
		t.Fatalf("state %q, want reinstalling", s)
	}
	e.action(id, actionJSON{Type: "reinstall"}).wantError(t, http.StatusUnprocessableEntity, "reinstalling")
	clock.Advance(30 * time.Second)
	d := decodeAs[deviceJSON](t, e.do(http.MethodGet, "/devices/"+id, nil))
	if d.State != StateActive || d.OperatingSystem.Slug != "debian_12" {
		t.Fatalf("after ReinstallDelay: state %q os %q, want active debian_12", d.State, d.OperatingSystem.Slug)
	}
	// Without operating_system the device keeps its OS.
	e.action(id, actionJSON{Type: "reinstall"}).want(t, http.StatusAccepted)
	if d, _ := e.fake.Device(id); d.OS != "debian_12" || d.State != StateReinstalling {
		t.Fatalf("snapshot %+v", d)
	}
	if n := e.fake.Reboots(id); n != 0 {
		t.Fatalf("Reboots = %d after reinstalls, want 0", n)
	}
}

func TestPowerOffOn(t *testing.T) {
	t.Parallel()
	clock := newFakeClock()
	e := newEnv(t, Config{Now: clock.Now, RebootDelay: time.Second})
	id := e.fake.AddDevice("p", DeviceSpec{Hostname: "h"})

	e.action(id, actionJSON{Type: "power_on"}).wantError(t, http.StatusUnprocessableEntity, "must be inactive")
	e.action(id, actionJSON{Type: "power_off"}).want(t, http.StatusAccepted)
	if s := e.state(t, id); s != StatePoweringOff {
		t.Fatalf("state %q, want powering_off", s)
	}
	clock.Advance(time.Second)
	if s := e.state(t, id); s != StateInactive {
		t.Fatalf("state %q, want inactive", s)
	}
	e.action(id, actionJSON{Type: "reboot"}).wantError(t, http.StatusUnprocessableEntity, "inactive")
	e.action(id, actionJSON{Type: "power_on"}).want(t, http.StatusAccepted)
	if s := e.state(t, id); s != StatePoweringOn {
		t.Fatalf("state %q, want powering_on", s)
	}
	clock.Advance(time.Second)
	if s := e.state(t, id); s != StateActive {
		t.Fatalf("state %q, want active", s)
	}
}

func TestMoveReservation(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{})
	e.fake.AddProject("q")
	ids := e.fake.AddReservations("p", "c3.small.x86", "fr2", "fr", 2)
	free, used := ids[0], ids[1]
	e.fake.AddDevice("p", DeviceSpec{Hostname: "h", ReservationID: used})

	r := decodeAs[reservationJSON](t, e.do(http.MethodPost, "/hardware-reservations/"+free+"/move", moveJSON{ProjectID: "q"}).want(t, http.StatusCreated))
	if r.ID != free || r.Project.ID != "q" || r.Project.Href != PathPrefix+"/projects/q" || r.Device != nil || !r.Provisionable {
		t.Fatalf("moved reservation %+v", r)
	}
	if rs := e.fake.Reservations("q"); len(rs) != 1 || rs[0].ID != free {
		t.Fatalf("project q has %+v", rs)
	}
	list := decodeAs[reservationsJSON](t, e.do(http.MethodGet, "/projects/p/hardware-reservations", nil))
	if len(list.HardwareReservations) != 1 || list.HardwareReservations[0].ID != used {
		t.Fatalf("project p lists %+v", list.HardwareReservations)
	}
	e.do(http.MethodPost, "/hardware-reservations/"+used+"/move", moveJSON{ProjectID: "q"}).wantError(t, http.StatusUnprocessableEntity, "has a device")
	e.do(http.MethodPost, "/hardware-reservations/"+free+"/move", moveJSON{ProjectID: "nope"}).wantError(t, http.StatusUnprocessableEntity, "project nope not found")
	e.do(http.MethodPost, "/hardware-reservations/"+free+"/move", moveJSON{}).wantError(t, http.StatusUnprocessableEntity, "project_id")
	e.do(http.MethodPost, "/hardware-reservations/nope/move", moveJSON{ProjectID: "q"}).wantError(t, http.StatusNotFound, "not found")
	e.do(http.MethodGet, "/hardware-reservations/nope", nil).wantError(t, http.StatusNotFound, "not found")

	// The moved reservation serves its new project only.
	e.do(http.MethodPost, "/projects/p/devices", createBody("h", free)).wantError(t, http.StatusUnprocessableEntity, "does not belong")
	e.do(http.MethodPost, "/projects/q/devices", createBody("h", free)).want(t, http.StatusCreated)
}

// testKey returns a valid ed25519 authorized_keys line, different for each seed.
func testKey(t *testing.T, seed byte) string {
	t.Helper()
	pub := ed25519.NewKeyFromSeed(slices.Repeat([]byte{seed}, ed25519.SeedSize)).Public()
	k, err := ssh.NewPublicKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(ssh.MarshalAuthorizedKey(k))) + " shepherd@test"
}

func TestSSHKeys(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{})
	e.fake.AddProject("p")
	key1, key2 := testKey(t, 1), testKey(t, 2)

	a := decodeAs[sshKeyJSON](t, e.do(http.MethodPost, "/projects/p/ssh-keys", sshKeyBodyJSON{Label: "shepherd", Key: key1}).want(t, http.StatusCreated))
	pk, _, _, _, err := ssh.ParseAuthorizedKey([]byte(key1))
	if err != nil {
		t.Fatal(err)
	}
	if a.Label != "shepherd" || a.Key != key1 || a.Fingerprint != ssh.FingerprintLegacyMD5(pk) || a.Href != PathPrefix+"/ssh-keys/"+a.ID {
		t.Fatalf("created key %+v, want fingerprint %s", a, ssh.FingerprintLegacyMD5(pk))
	}
	// The API accepts a duplicate label; the client must avoid making one.
	b := decodeAs[sshKeyJSON](t, e.do(http.MethodPost, "/projects/p/ssh-keys", sshKeyBodyJSON{Label: "shepherd", Key: key2}).want(t, http.StatusCreated))
	if b.ID == a.ID {
		t.Fatalf("two keys with id %s", a.ID)
	}
	list := decodeAs[sshKeysJSON](t, e.do(http.MethodGet, "/projects/p/ssh-keys", nil).want(t, http.StatusOK))
	if len(list.SSHKeys) != 2 || list.Meta.Total != 2 {
		t.Fatalf("listed %d keys (total %d), want 2", len(list.SSHKeys), list.Meta.Total)
	}

	u := decodeAs[sshKeyJSON](t, e.do(http.MethodPut, "/ssh-keys/"+b.ID, sshKeyBodyJSON{Label: "old"}).want(t, http.StatusOK))
	if u.Label != "old" || u.Key != key2 {
		t.Fatalf("after a label update: %+v", u)
	}
	u = decodeAs[sshKeyJSON](t, e.do(http.MethodPut, "/ssh-keys/"+b.ID, sshKeyBodyJSON{Key: key1}).want(t, http.StatusOK))
	if u.Label != "old" || u.Key != key1 || u.Fingerprint != a.Fingerprint {
		t.Fatalf("after a key update: %+v", u)
	}
	if ks := e.fake.SSHKeys("p"); len(ks) != 2 || ks[1].Label != "old" && ks[0].Label != "old" {
		t.Fatalf("SSHKeys = %+v", ks)
	}

	e.do(http.MethodPost, "/projects/p/ssh-keys", sshKeyBodyJSON{Label: "x", Key: "not a key"}).wantError(t, http.StatusUnprocessableEntity, "key")
	e.do(http.MethodPost, "/projects/p/ssh-keys", sshKeyBodyJSON{Label: "x", Key: "ssh-ed25519 !!!"}).wantError(t, http.StatusUnprocessableEntity, "base64")
	e.do(http.MethodPost, "/projects/p/ssh-keys", sshKeyBodyJSON{Key: key1}).wantError(t, http.StatusUnprocessableEntity, "label")
	e.do(http.MethodPost, "/projects/nope/ssh-keys", sshKeyBodyJSON{Label: "x", Key: key1}).wantError(t, http.StatusNotFound, "project")
	e.do(http.MethodPut, "/ssh-keys/nope", sshKeyBodyJSON{Label: "x"}).wantError(t, http.StatusNotFound, "ssh key not found")
	e.do(http.MethodPut, "/ssh-keys/"+a.ID, "{").wantError(t, http.StatusBadRequest, "invalid JSON")
}

func TestDefaultAddressesAreUnique(t *testing.T) {
	t.Parallel()
	seen := make(map[netip.Addr]int)
	for n := 1; n <= 5000; n++ {
		a := documentationAddr(n)
		if prev, ok := seen[a]; ok {
			t.Fatalf("device %d and %d both get %s", prev, n, a)
		}
		seen[a] = n
		ok := false
		for _, p := range []string{"198.51.100.0/24", "203.0.113.0/24", "192.0.2.0/24", "198.18.0.0/15"} {
			ok = ok || netip.MustParsePrefix(p).Contains(a)
		}
		if !ok || !a.Is4() || a.As4()[3] == 0 && n <= 762 {
			t.Fatalf("device %d gets %s", n, a)
		}
	}
}

func TestCreateOnDemand(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{})
	e.fake.AddProject("p")
	body := createBody("", "")
	body.Metro = "am"
	r := e.do(http.MethodPost, "/projects/p/devices", body).want(t, http.StatusCreated)
	d := decodeAs[deviceJSON](t, r)
	if !strings.Contains(string(r.body), `"hardware_reservation":null`) || d.Metro.Code != "am" || d.Facility.Code != "am1" || d.Hostname != "device-"+d.ShortID {
		t.Fatalf("on-demand device %s", r.body)
	}
}

func TestAddDeviceRefusesImpossibleSpecs(t *testing.T) {
	t.Parallel()
	s, err := New(Config{Token: "x"})
	if err != nil {
		t.Fatal(err)
	}
	taken := s.AddReservations("p", "c3.small.x86", "fr2", "fr", 1)[0]
	s.AddDevice("p", DeviceSpec{ReservationID: taken})
	other := s.AddReservations("q", "c3.small.x86", "fr2", "fr", 1)[0]
	for name, spec := range map[string]DeviceSpec{
		"taken reservation":   {ReservationID: taken},
		"unknown reservation": {ReservationID: "nope"},
		"other project":       {ReservationID: other},
		"unknown state":       {State: "sleeping"},
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: AddDevice did not panic", name)
				}
			}()
			s.AddDevice("p", spec)
		}()
	}
	if n := len(s.Devices("")); n != 1 {
		t.Fatalf("%d devices after refused AddDevice calls, want 1", n)
	}
}
