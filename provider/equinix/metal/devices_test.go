package metal

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
)

func createReq(resID string) CreateDeviceRequest {
	return CreateDeviceRequest{Hostname: "shepherd-" + resID[:8], Plan: "c3.small.x86", Metro: "fr",
		OperatingSystem: "ubuntu_22_04", HardwareReservationID: resID, ProjectSSHKeys: []string{"k1"},
		Tags: []string{"shepherd"}}
}

// onFirst returns a loseResponse hook that drops the first answer to
// method on a path ending in suffix.
func onFirst(method, suffix string) func(*http.Request) bool {
	var done atomic.Bool
	return func(r *http.Request) bool {
		return r.Method == method && strings.HasSuffix(r.URL.Path, suffix) && done.CompareAndSwap(false, true)
	}
}

func TestCreateDevice(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	res := f.addReservation(testProject)
	var body map[string]any
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		if r.Method == http.MethodPost {
			b, _ := io.ReadAll(r.Body)
			_ = json.Unmarshal(b, &body)
			r.Body = io.NopCloser(strings.NewReader(string(b)))
		}
		return false
	})
	c, _ := newTestClient(t, f.baseURL(), nil)
	req := createReq(res)
	d, err := c.CreateDevice(t.Context(), testProject, req, "w-1")
	if err != nil {
		t.Fatalf("CreateDevice: %v", err)
	}
	if d.ID == "" || d.State != DeviceStateQueued || !slices.Contains(d.Tags, WitnessTag("w-1")) {
		t.Errorf("CreateDevice = %+v, want a queued device with the witness tag", d)
	}
	if !slices.Equal(req.Tags, []string{"shepherd"}) {
		t.Errorf("CreateDevice changed the caller's tags to %v", req.Tags)
	}
	for _, k := range []string{"hostname", "plan", "metro", "operating_system", "hardware_reservation_id",
		"project_ssh_keys", "tags"} {
		if _, ok := body[k]; !ok {
			t.Errorf("request body %v lacks %q", body, k)
		}
	}
	if _, ok := body["facility"]; ok {
		t.Errorf("request body %v has facility, which was not set", body)
	}
}

func TestCreateDeviceLostResponse(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	res := f.addReservation(testProject)
	f.setLoseResponse(onFirst(http.MethodPost, "/devices"))
	c, reg := newTestClient(t, f.baseURL(), nil)

	d, err := c.CreateDevice(t.Context(), testProject, createReq(res), "w-lost")
	if err != nil {
		t.Fatalf("CreateDevice: %v", err)
	}
	if w, _ := d.Witness(); w != "w-lost" || d.HardwareReservation == nil || d.HardwareReservation.ID != res {
		t.Errorf("CreateDevice = %+v, want our device on %s", d, res)
	}
	if n := len(f.requests(http.MethodPost, "/projects/"+testProject+"/devices")); n != 1 {
		t.Errorf("server saw %d creates, want 1: the create is not repeated after the device is found", n)
	}
	if n := f.deviceCount(); n != 1 {
		t.Errorf("%d devices exist, want 1", n)
	}
	if got := metricValue(t, reg, "shepherd_metal_requests_total",
		map[string]string{"endpoint": epProjectDevices, "method": "POST", "status": statusError}); got != 1 {
		t.Errorf("requests_total{POST, error} = %v, want 1", got)
	}
}

// TestAnswerWithoutObject: a 2xx answer that should hold an object but is
// empty, null or {} is an error, not a zero object. GetDevice and
// GetHardwareReservation returned a device or a reservation without an id
// (and a free one: without a device); CreateDevice returned a device
// without an id for one it had created. It now treats the answer as lost
// and finds its device by the witness.
func TestAnswerWithoutObject(t *testing.T) {
	t.Parallel()
	for _, body := range []string{"", "null", "{}", `{"state": "active"}`} {
		t.Run(body, func(t *testing.T) {
			t.Parallel()
			f := newFake(t)
			res := f.addReservation(testProject)
			devID := f.addDevice(testProject, "d1", "")
			var mu sync.Mutex
			created := map[string]bool{} // paths posted to
			f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
				mu.Lock()
				first := r.Method == http.MethodPost && !created[r.URL.Path]
				if r.Method == http.MethodPost {
					created[r.URL.Path] = true
				}
				anyCreated := len(created) > 0
				mu.Unlock()
				switch {
				case first: // the first device create and key create
					f.mux.ServeHTTP(httptest.NewRecorder(), r) // the API acts; its answer is replaced
				case r.Method == http.MethodGet && strings.HasSuffix(r.URL.Path, "/"+devID),
					r.Method == http.MethodGet && strings.HasSuffix(r.URL.Path, "/"+res) && !anyCreated:
				default:
					return false
				}
				w.WriteHeader(http.StatusOK)
				_, _ = io.WriteString(w, body)
				return true
			})
			c, _ := newTestClient(t, f.baseURL(), nil)

			if d, err := c.GetDevice(t.Context(), devID); err == nil || !strings.Contains(err.Error(), "decoding the 200 answer") {
				t.Errorf("GetDevice = %+v, %v; want an error saying the answer does not decode", d, err)
			}
			if r, err := c.GetHardwareReservation(t.Context(), res); err == nil || !strings.Contains(err.Error(), "decoding the 200 answer") {
				t.Errorf("GetHardwareReservation = %+v, %v; want an error saying the answer does not decode", r, err)
			}
			d, err := c.CreateDevice(t.Context(), testProject, createReq(res), "w-empty")
			if err != nil {
				t.Fatalf("CreateDevice: %v", err)
			}
			if w, _ := d.Witness(); d.ID == "" || w != "w-empty" {
				t.Errorf("CreateDevice = %+v, want our device, found by its witness", d)
			}
			if n := f.deviceCount(); n != 2 {
				t.Errorf("%d devices exist, want 2 (d1 and the one created)", n)
			}
			// A key create answered so is an open outcome: EnsureSSHKey
			// finds the key it made instead of returning one without an id.
			k, err := c.EnsureSSHKey(t.Context(), testProject, label, key1)
			if err != nil || k.ID == "" || k.Key != key1 {
				t.Errorf("EnsureSSHKey = %+v, %v; want the key created", k, err)
			}
			if n := f.keyCount(); n != 1 {
				t.Errorf("%d keys exist, want 1", n)
			}
		})
	}
}

func TestCreateDeviceServerErrorBeforeActing(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	res := f.addReservation(testProject)
	f.setIntercept(failTimes(2, http.StatusServiceUnavailable, "/projects/"+testProject+"/devices"))
	c, _ := newTestClient(t, f.baseURL(), nil)

	d, err := c.CreateDevice(t.Context(), testProject, createReq(res), "w-5xx")
	if err != nil {
		t.Fatalf("CreateDevice: %v", err)
	}
	if w, _ := d.Witness(); w != "w-5xx" {
		t.Errorf("CreateDevice = %+v, want the witness w-5xx", d)
	}
	if n := len(f.requests(http.MethodPost, "/projects/"+testProject+"/devices")); n != 3 {
		t.Errorf("server saw %d creates, want 3 (two 503s, each checked, then success)", n)
	}
	if n := len(f.requests(http.MethodGet, "/hardware-reservations/"+res)); n != 2 {
		t.Errorf("server saw %d reservation checks, want 2", n)
	}
	if n := f.deviceCount(); n != 1 {
		t.Errorf("%d devices exist, want 1", n)
	}
}

func TestCreateDeviceRateLimitedIsRetried(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	res := f.addReservation(testProject)
	var calls atomic.Int32
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		if r.Method != http.MethodPost || calls.Add(1) > 1 {
			return false
		}
		w.Header().Set("Retry-After", "0")
		writeJSON(w, http.StatusTooManyRequests, errorBody("slow down"))
		return true
	})
	c, _ := newTestClient(t, f.baseURL(), nil)
	if _, err := c.CreateDevice(t.Context(), testProject, createReq(res), "w-429"); err != nil {
		t.Fatalf("CreateDevice: %v", err)
	}
	if n := len(f.requests(http.MethodGet, "/hardware-reservations/"+res)); n != 0 {
		t.Errorf("server saw %d reservation checks, want none after a 429", n)
	}
	if n := f.deviceCount(); n != 1 {
		t.Errorf("%d devices exist, want 1", n)
	}
}

func TestCreateDeviceRaceLost(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	res := f.addReservation(testProject)
	f.addDevice(testProject, "someone-else", res, WitnessTag("theirs"))
	c, _ := newTestClient(t, f.baseURL(), nil)

	_, err := c.CreateDevice(t.Context(), testProject, createReq(res), "ours")
	if !errors.Is(err, ErrRaceLost) {
		t.Fatalf("CreateDevice error = %v, want ErrRaceLost", err)
	}
	if n := len(f.requests(http.MethodPost, "/projects/"+testProject+"/devices")); n != 1 {
		t.Errorf("server saw %d creates, want 1", n)
	}
}

// TestCreateDeviceRaceLostAfterLostResponse: our create is lost, and
// meanwhile another device took the reservation.
func TestCreateDeviceRaceLostAfterLostResponse(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	res := f.addReservation(testProject)
	var done atomic.Bool
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		if r.Method != http.MethodPost || !done.CompareAndSwap(false, true) {
			return false
		}
		f.addDevice(testProject, "someone-else", res)
		dropConnection(w)
		return true
	})
	c, _ := newTestClient(t, f.baseURL(), nil)
	_, err := c.CreateDevice(t.Context(), testProject, createReq(res), "ours")
	if !errors.Is(err, ErrRaceLost) {
		t.Fatalf("CreateDevice error = %v, want ErrRaceLost", err)
	}
}

// TestCreateDeviceAlreadyCreated: an earlier call with the same witness
// created the device; a 422 leads to it.
func TestCreateDeviceAlreadyCreated(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	res := f.addReservation(testProject)
	id := f.addDevice(testProject, "ours", res, "x", WitnessTag("again"))
	c, _ := newTestClient(t, f.baseURL(), nil)
	d, err := c.CreateDevice(t.Context(), testProject, createReq(res), "again")
	if err != nil || d.ID != id {
		t.Fatalf("CreateDevice = %q, %v; want the existing device %q", d.ID, err, id)
	}
}

func TestCreateDevicePermanentErrors(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	foreign := f.addReservation(otherProj)
	c, _ := newTestClient(t, f.baseURL(), nil)

	_, err := c.CreateDevice(t.Context(), testProject, createReq(foreign), "w")
	if !hasStatus(err, http.StatusUnprocessableEntity) || !IsPermanent(err) || errors.Is(err, ErrRaceLost) {
		t.Errorf("CreateDevice on another project's reservation: %v, want the permanent 422", err)
	}
	_, err = c.CreateDevice(t.Context(), testProject, createReq("00000000-unknown"), "w")
	if !errors.Is(err, ErrNotFound) {
		t.Errorf("CreateDevice on an unknown reservation: %v, want ErrNotFound", err)
	}
	if _, err := c.CreateDevice(t.Context(), testProject, CreateDeviceRequest{Hostname: "h"}, "w"); err == nil {
		t.Error("CreateDevice without a reservation succeeded")
	}
	if _, err := c.CreateDevice(t.Context(), testProject, createReq(foreign), ""); err == nil {
		t.Error("CreateDevice without a witness succeeded")
	}
	req := createReq(foreign)
	req.Tags = append(req.Tags, WitnessTag("other"))
	if _, err := c.CreateDevice(t.Context(), testProject, req, "w"); err == nil {
		t.Error("CreateDevice with another witness tag succeeded")
	}
	if n := f.deviceCount(); n != 0 {
		t.Errorf("%d devices exist, want 0", n)
	}
	if n := len(f.requests(http.MethodPost, "/projects/"+testProject+"/devices")); n != 2 {
		t.Errorf("server saw %d creates, want 2 (bad requests are refused before sending)", n)
	}
}

func TestDeleteDevice(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	res := f.addReservation(testProject)
	id := f.addDevice(testProject, "d", res)
	f.setLoseResponse(onFirst(http.MethodDelete, "/devices/"+id))
	c, _ := newTestClient(t, f.baseURL(), nil)

	// The first answer is lost; the repetition finds the device gone.
	if err := c.DeleteDevice(t.Context(), id); err != nil {
		t.Fatalf("DeleteDevice: %v", err)
	}
	if n := f.deviceCount(); n != 0 {
		t.Errorf("%d devices exist, want 0", n)
	}
	r, err := c.GetHardwareReservation(t.Context(), res)
	if err != nil || r.Device != nil {
		t.Errorf("reservation after delete = %+v, %v; want it free", r, err)
	}
	if err := c.DeleteDevice(t.Context(), id); !errors.Is(err, ErrNotFound) {
		t.Errorf("deleting a deleted device: %v, want ErrNotFound", err)
	}
	if _, err := c.GetDevice(t.Context(), id); !errors.Is(err, ErrNotFound) {
		t.Errorf("GetDevice of a deleted device: %v, want ErrNotFound", err)
	}
	if err := c.DeleteDevice(t.Context(), ""); err == nil {
		t.Error("DeleteDevice with an empty id succeeded")
	}
}

func TestDeviceActions(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	a := f.addDevice(testProject, "a", "")
	b := f.addDevice(testProject, "b", "")
	f.setLoseResponse(onFirst(http.MethodPost, "/devices/"+a+"/actions"))
	c, _ := newTestClient(t, f.baseURL(), nil)

	// The reboot's answer is lost; the repetition gets 422 because the
	// device is powering off, which is what we asked for.
	if err := c.RebootDevice(t.Context(), a); err != nil {
		t.Fatalf("RebootDevice: %v", err)
	}
	if n := len(f.requests(http.MethodPost, "/devices/"+a+"/actions")); n != 2 {
		t.Errorf("server saw %d reboot requests, want 2", n)
	}
	// A device that is busy for another reason gets the 422.
	if err := c.ReinstallDevice(t.Context(), a, ReinstallRequest{OperatingSystem: "debian_12"}); !hasStatus(err, 422) {
		t.Errorf("ReinstallDevice of a powering-off device: %v, want 422", err)
	}
	if err := c.ReinstallDevice(t.Context(), b, ReinstallRequest{OperatingSystem: "debian_12", PreserveData: true}); err != nil {
		t.Fatalf("ReinstallDevice: %v", err)
	}
	d, err := c.GetDevice(t.Context(), b)
	if err != nil || d.State != DeviceStateReinstalling {
		t.Errorf("device after reinstall = %q, %v; want reinstalling", d.State, err)
	}
	if err := c.RebootDevice(t.Context(), "nope"); !errors.Is(err, ErrNotFound) {
		t.Errorf("RebootDevice of an unknown device: %v, want ErrNotFound", err)
	}
}

func TestMoveHardwareReservation(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	res := f.addReservation(testProject)
	f.setLoseResponse(onFirst(http.MethodPost, "/move"))
	c, _ := newTestClient(t, f.baseURL(), nil)

	r, err := c.MoveHardwareReservation(t.Context(), res, otherProj)
	if err != nil {
		t.Fatalf("MoveHardwareReservation: %v", err)
	}
	if r.Project == nil || r.Project.ID != otherProj {
		t.Errorf("reservation after move = %+v, want it in %s", r, otherProj)
	}
	if n := len(f.requests(http.MethodPost, "/hardware-reservations/"+res+"/move")); n != 1 {
		t.Errorf("server saw %d moves, want 1", n)
	}
	// Moving it where it is succeeds.
	if r, err := c.MoveHardwareReservation(t.Context(), res, otherProj); err != nil || r.Project.ID != otherProj {
		t.Errorf("moving again = %+v, %v; want success", r, err)
	}
	if _, err := c.MoveHardwareReservation(t.Context(), "nope", otherProj); !errors.Is(err, ErrNotFound) {
		t.Errorf("moving an unknown reservation: %v, want ErrNotFound", err)
	}
	rs, err := c.ListHardwareReservations(t.Context(), otherProj)
	if err != nil || len(rs) != 1 || rs[0].ID != res {
		t.Errorf("ListHardwareReservations(%s) = %v, %v; want the moved one", otherProj, rs, err)
	}
}
