package metal

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"google.golang.org/grpc/test/bufconn"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

const (
	testToken   = "tok-7Hq2-SECRET-x9"
	testProject = "proj-1"
	otherProj   = "proj-2"
)

// fake is a small Metal API after notes/metal-wire.md, with hooks to
// inject faults. It decodes request bodies strictly, so a field name the
// client gets wrong fails the test.
type fake struct {
	t    testing.TB
	base string       // the API root
	hc   *http.Client // nil: a client of the default transport reaches the fake
	mux  *http.ServeMux

	mu           sync.Mutex
	seq          int
	devices      []*Device // creation order
	reservations []*HardwareReservation
	keys         []*SSHKey
	hits         []hit
	intercept    func(w http.ResponseWriter, r *http.Request) bool // before the API; true: it answered
	loseResponse func(r *http.Request) bool                        // the API acts, then drops the connection
}

// hit is one request the fake received.
type hit struct {
	method, path string
	query        url.Values
	at           time.Time
}

// newFake starts a fake on a loopback socket.
func newFake(t testing.TB) *fake {
	f := newFakeHandler(t)
	srv := httptest.NewServer(f)
	t.Cleanup(srv.Close)
	f.base = srv.URL + "/metal/v1"
	return f
}

// newMemFake starts a fake that clients reach over in-memory
// connections (grpc's bufconn), through the client f.hc: the fake for tests
// in a synctest bubble, whose clock advances only while every goroutine
// waits on the bubble, which a goroutine reading a real socket does not.
// The wire protocol is the same HTTP/1.1.
func newMemFake(t testing.TB) *fake {
	f := newFakeHandler(t)
	l := bufconn.Listen(1 << 16)
	srv := &http.Server{Handler: f, ReadHeaderTimeout: time.Minute}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close() })
	f.base = "http://metal.test/metal/v1"
	f.hc = &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) { return l.DialContext(ctx) }}}
	return f
}

func newFakeHandler(t testing.TB) *fake {
	f := &fake{t: t, mux: http.NewServeMux()}
	const p = "/metal/v1"
	f.mux.HandleFunc("GET "+p+"/projects/{project}/devices", f.listDevices)
	f.mux.HandleFunc("POST "+p+"/projects/{project}/devices", f.createDevice)
	f.mux.HandleFunc("GET "+p+"/devices/{id}", f.getDevice)
	f.mux.HandleFunc("DELETE "+p+"/devices/{id}", f.deleteDevice)
	f.mux.HandleFunc("POST "+p+"/devices/{id}/actions", f.deviceAction)
	f.mux.HandleFunc("GET "+p+"/projects/{project}/hardware-reservations", f.listReservations)
	f.mux.HandleFunc("GET "+p+"/hardware-reservations/{id}", f.getReservation)
	f.mux.HandleFunc("POST "+p+"/hardware-reservations/{id}/move", f.moveReservation)
	f.mux.HandleFunc("GET "+p+"/projects/{project}/ssh-keys", f.listKeys)
	f.mux.HandleFunc("POST "+p+"/projects/{project}/ssh-keys", f.createKey)
	f.mux.HandleFunc("PUT "+p+"/ssh-keys/{id}", f.updateKey)
	return f
}

// baseURL is the fake's API root.
func (f *fake) baseURL() string { return f.base }

// client returns a client of the fake, as newTestClient makes them.
func (f *fake) client(t testing.TB, mod func(*Config)) (*Client, *prometheus.Registry) {
	t.Helper()
	return newTestClient(t, f.base, func(c *Config) {
		c.HTTPClient = f.hc
		if mod != nil {
			mod(c)
		}
	})
}

func (f *fake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	f.hits = append(f.hits, hit{method: r.Method, path: r.URL.Path, query: r.URL.Query(), at: time.Now()})
	intercept := f.intercept
	f.mu.Unlock()
	if r.Header.Get("X-Auth-Token") != testToken {
		writeJSON(w, http.StatusUnauthorized, errorBody("invalid token"))
		return
	}
	if intercept != nil && intercept(w, r) {
		return
	}
	f.mux.ServeHTTP(w, r)
}

func (f *fake) setIntercept(fn func(w http.ResponseWriter, r *http.Request) bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.intercept = fn
}

func (f *fake) setLoseResponse(fn func(r *http.Request) bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.loseResponse = fn
}

// requests returns the hits with this method and path (below /metal/v1).
func (f *fake) requests(method, path string) []hit {
	f.mu.Lock()
	defer f.mu.Unlock()
	var hs []hit
	for _, h := range f.hits {
		if h.method == method && h.path == "/metal/v1"+path {
			hs = append(hs, h)
		}
	}
	return hs
}

func (f *fake) allHits() []hit {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.hits)
}

func (f *fake) newID(kind string) string {
	f.seq++
	return fmt.Sprintf("%08x-%04x-4000-8000-%012d", f.seq, len(kind), f.seq)
}

// addReservation adds a free provisionable reservation to the project.
func (f *fake) addReservation(project string) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	id := f.newID("reservation")
	f.reservations = append(f.reservations, &HardwareReservation{
		ID: id, ShortID: id[:8], Provisionable: true, Plan: Slug{"c3.small.x86"},
		Facility: Code{"fr2"}, Metro: Code{"fr"}, Project: &Href{ID: project, Href: "/metal/v1/projects/" + project},
		CreatedAt: time.Now().UTC().Truncate(time.Second), Href: "/metal/v1/hardware-reservations/" + id,
	})
	return id
}

// addDevice adds a device to the project, on a reservation if resID is
// not empty.
func (f *fake) addDevice(project, hostname, resID string, tags ...string) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.addDeviceLocked(project, hostname, resID, DeviceStateActive, tags)
}

func (f *fake) addDeviceLocked(project, hostname, resID, state string, tags []string) string {
	id := f.newID("device")
	now := time.Now().UTC().Truncate(time.Second)
	d := &Device{
		ID: id, ShortID: id[:8], Hostname: hostname, State: state, Tags: slices.Clone(tags),
		CreatedAt: now, UpdatedAt: now, Plan: Slug{"c3.small.x86"}, OperatingSystem: Slug{"ubuntu_22_04"},
		Facility: Code{"fr2"}, Metro: Code{"fr"},
		IPAddresses: []IPAddress{{Address: "147.28.1.2", Public: true, AddressFamily: 4, Management: true}},
		Project:     &Href{ID: project, Href: "/metal/v1/projects/" + project},
		Href:        "/metal/v1/devices/" + id,
	}
	if resID != "" {
		d.HardwareReservation = &Href{ID: resID, Href: "/metal/v1/hardware-reservations/" + resID}
		if res := f.reservationLocked(resID); res != nil {
			res.Device = &Href{ID: id, Href: d.Href}
		}
	}
	f.devices = append(f.devices, d)
	return id
}

func (f *fake) reservationLocked(id string) *HardwareReservation {
	for _, r := range f.reservations {
		if r.ID == id {
			return r
		}
	}
	return nil
}

func (f *fake) deviceLocked(id string) *Device {
	for _, d := range f.devices {
		if d.ID == id {
			return d
		}
	}
	return nil
}

func (f *fake) deviceCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.devices)
}

func (f *fake) keyCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.keys)
}

func errorBody(msgs ...string) map[string][]string { return map[string][]string{"errors": msgs} }

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	if v != nil {
		_ = json.NewEncoder(w).Encode(v)
	}
}

// respond answers, unless loseResponse says to drop the connection
// instead: the API has acted, and the client never hears of it.
func (f *fake) respond(w http.ResponseWriter, r *http.Request, status int, v any) {
	f.mu.Lock()
	lose := f.loseResponse
	f.mu.Unlock()
	if lose != nil && lose(r) {
		dropConnection(w)
		return
	}
	writeJSON(w, status, v)
}

// dropConnection closes the connection without an answer.
func dropConnection(w http.ResponseWriter) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		panic(err)
	}
	_ = conn.Close()
}

// decodeStrict decodes a request body, refusing fields the wire doc does
// not name.
func decodeStrict(r *http.Request, v any) error {
	dec := json.NewDecoder(r.Body)
	dec.DisallowUnknownFields()
	return dec.Decode(v)
}

// paginate answers a listing page like the API: page and per_page (default
// 10, at most 1000), meta with host-relative links.
func paginate[T any](r *http.Request, key string, items []T) map[string]any {
	q := r.URL.Query()
	page, err := strconv.Atoi(q.Get("page"))
	if err != nil || page < 1 {
		page = 1
	}
	perPage, err := strconv.Atoi(q.Get("per_page"))
	if err != nil || perPage < 1 {
		perPage = 10
	}
	perPage = min(perPage, 1000)
	last := max(1, (len(items)+perPage-1)/perPage)
	link := func(p int) map[string]string {
		return map[string]string{"href": fmt.Sprintf("%s?page=%d&per_page=%d", r.URL.Path, p, perPage)}
	}
	meta := map[string]any{
		"first": link(1), "last": link(last), "previous": nil, "next": nil,
		"current_page": page, "last_page": last, "total": len(items),
	}
	if page > 1 {
		meta["previous"] = link(page - 1)
	}
	if page < last {
		meta["next"] = link(page + 1)
	}
	start := min((page-1)*perPage, len(items))
	end := min(start+perPage, len(items))
	return map[string]any{key: items[start:end], "meta": meta}
}

func (f *fake) listDevices(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	var ds []Device
	for _, d := range f.devices {
		if d.Project.ID == r.PathValue("project") {
			ds = append(ds, *d)
		}
	}
	f.mu.Unlock()
	writeJSON(w, http.StatusOK, paginate(r, "devices", ds))
}

// wireCreateDevice is CreateDevice as the wire doc spells it.
type wireCreateDevice struct {
	Hostname              string   `json:"hostname"`
	Plan                  string   `json:"plan"`
	Metro                 string   `json:"metro"`
	Facility              []string `json:"facility"`
	OperatingSystem       string   `json:"operating_system"`
	HardwareReservationID string   `json:"hardware_reservation_id"`
	ProjectSSHKeys        []string `json:"project_ssh_keys"`
	Tags                  []string `json:"tags"`
	UserData              string   `json:"userdata"`
}

func (f *fake) createDevice(w http.ResponseWriter, r *http.Request) {
	var req wireCreateDevice
	if err := decodeStrict(r, &req); err != nil {
		writeJSON(w, http.StatusBadRequest, errorBody(err.Error()))
		return
	}
	project := r.PathValue("project")
	f.mu.Lock()
	res := f.reservationLocked(req.HardwareReservationID)
	var status int
	var body any
	switch {
	case res == nil:
		status, body = http.StatusNotFound, errorBody("hardware reservation not found")
	case res.Project.ID != project:
		status, body = http.StatusUnprocessableEntity, errorBody("hardware reservation belongs to another project")
	case res.Device != nil:
		status, body = http.StatusUnprocessableEntity,
			errorBody(fmt.Sprintf("hardware reservation %s already has a device", res.ID))
	default:
		id := f.addDeviceLocked(project, req.Hostname, res.ID, DeviceStateQueued, req.Tags)
		d := *f.deviceLocked(id)
		d.IPAddresses = nil
		status, body = http.StatusCreated, d
	}
	f.mu.Unlock()
	f.respond(w, r, status, body)
}

func (f *fake) getDevice(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	d := f.deviceLocked(r.PathValue("id"))
	var dv Device
	if d != nil {
		dv = *d
	}
	f.mu.Unlock()
	if d == nil {
		writeJSON(w, http.StatusNotFound, errorBody("Not found"))
		return
	}
	writeJSON(w, http.StatusOK, dv)
}

func (f *fake) deleteDevice(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	i := slices.IndexFunc(f.devices, func(d *Device) bool { return d.ID == r.PathValue("id") })
	if i >= 0 {
		d := f.devices[i]
		if d.HardwareReservation != nil {
			if res := f.reservationLocked(d.HardwareReservation.ID); res != nil {
				res.Device = nil
			}
		}
		f.devices = slices.Delete(f.devices, i, i+1)
	}
	f.mu.Unlock()
	if i < 0 {
		writeJSON(w, http.StatusNotFound, errorBody("Not found"))
		return
	}
	f.respond(w, r, http.StatusNoContent, nil)
}

func (f *fake) deviceAction(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Type            string `json:"type"`
		OperatingSystem string `json:"operating_system"`
		DeprovisionFast *bool  `json:"deprovision_fast"`
		PreserveData    *bool  `json:"preserve_data"`
	}
	if err := decodeStrict(r, &req); err != nil {
		writeJSON(w, http.StatusBadRequest, errorBody(err.Error()))
		return
	}
	f.mu.Lock()
	d := f.deviceLocked(r.PathValue("id"))
	status, body := http.StatusAccepted, any(nil)
	switch {
	case d == nil:
		status, body = http.StatusNotFound, errorBody("Not found")
	case d.State != DeviceStateActive:
		status, body = http.StatusUnprocessableEntity, errorBody("device is not active")
	case req.Type == "reboot":
		d.State = DeviceStatePoweringOff // stays so until the test says otherwise
	case req.Type == "reinstall" && req.DeprovisionFast != nil && req.PreserveData != nil:
		d.State = DeviceStateReinstalling
	default:
		status, body = http.StatusUnprocessableEntity, errorBody("bad action "+req.Type)
	}
	f.mu.Unlock()
	if status != http.StatusAccepted {
		writeJSON(w, status, body)
		return
	}
	f.respond(w, r, status, nil)
}

func (f *fake) listReservations(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	var rs []HardwareReservation
	for _, res := range f.reservations {
		if res.Project.ID == r.PathValue("project") {
			rs = append(rs, *res)
		}
	}
	f.mu.Unlock()
	writeJSON(w, http.StatusOK, paginate(r, "hardware_reservations", rs))
}

func (f *fake) getReservation(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	res := f.reservationLocked(r.PathValue("id"))
	var rv HardwareReservation
	if res != nil {
		rv = *res
	}
	f.mu.Unlock()
	if res == nil {
		writeJSON(w, http.StatusNotFound, errorBody("Not found"))
		return
	}
	writeJSON(w, http.StatusOK, rv)
}

func (f *fake) moveReservation(w http.ResponseWriter, r *http.Request) {
	var req struct {
		ProjectID string `json:"project_id"`
	}
	if err := decodeStrict(r, &req); err != nil {
		writeJSON(w, http.StatusBadRequest, errorBody(err.Error()))
		return
	}
	f.mu.Lock()
	res := f.reservationLocked(r.PathValue("id"))
	var status int
	var body any
	switch {
	case res == nil:
		status, body = http.StatusNotFound, errorBody("Not found")
	case res.Project.ID == req.ProjectID:
		status, body = http.StatusUnprocessableEntity, errorBody("hardware reservation is already in that project")
	default:
		res.Project = &Href{ID: req.ProjectID, Href: "/metal/v1/projects/" + req.ProjectID}
		status, body = http.StatusCreated, *res
	}
	f.mu.Unlock()
	f.respond(w, r, status, body)
}

func (f *fake) listKeys(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	var ks []SSHKey
	for _, k := range f.keys {
		ks = append(ks, *k)
	}
	f.mu.Unlock()
	writeJSON(w, http.StatusOK, paginate(r, "ssh_keys", ks))
}

func (f *fake) createKey(w http.ResponseWriter, r *http.Request) {
	var req sshKeyBody
	if err := decodeStrict(r, &req); err != nil {
		writeJSON(w, http.StatusBadRequest, errorBody(err.Error()))
		return
	}
	f.mu.Lock()
	id := f.newID("key")
	k := &SSHKey{ID: id, Label: req.Label, Key: req.Key, Fingerprint: "fp-" + id[:8],
		CreatedAt: time.Now().UTC().Truncate(time.Second), Href: "/metal/v1/ssh-keys/" + id}
	f.keys = append(f.keys, k)
	kv := *k
	f.mu.Unlock()
	f.respond(w, r, http.StatusCreated, kv)
}

func (f *fake) updateKey(w http.ResponseWriter, r *http.Request) {
	var req sshKeyBody
	if err := decodeStrict(r, &req); err != nil {
		writeJSON(w, http.StatusBadRequest, errorBody(err.Error()))
		return
	}
	f.mu.Lock()
	var kv SSHKey
	found := false
	for _, k := range f.keys {
		if k.ID == r.PathValue("id") {
			k.Label, k.Key = req.Label, req.Key
			kv, found = *k, true
		}
	}
	f.mu.Unlock()
	if !found {
		writeJSON(w, http.StatusNotFound, errorBody("Not found"))
		return
	}
	f.respond(w, r, http.StatusOK, kv)
}

// refusingClient is an HTTP client whose every connection is refused. A
// closed test server would do, were its port not free for the next test
// server to take.
func refusingClient() *http.Client {
	return &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			return nil, &net.OpError{Op: "dial", Net: network, Err: syscall.ECONNREFUSED}
		},
	}}
}

// newTestClient returns a client of baseURL with a generous budget, short
// backoffs and debug logs in the test's output; mod adjusts the config.
func newTestClient(t testing.TB, baseURL string, mod func(*Config)) (*Client, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	cfg := Config{
		BaseURL:           baseURL,
		Token:             testToken,
		RequestsPerSecond: 1000,
		Burst:             1000,
		CallTimeout:       5 * time.Second,
		RetryDeadline:     10 * time.Second,
		Registerer:        reg,
		Logger:            slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug})),
	}
	if mod != nil {
		mod(&cfg)
	}
	c, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	c.backoffBase, c.backoffMax = time.Millisecond, 10*time.Millisecond
	t.Cleanup(c.CloseIdleConnections)
	return c, reg
}

// metricValue returns a counter's value, or a histogram's sample count,
// for the series with these labels (a subset), summed over matches.
func metricValue(t testing.TB, reg *prometheus.Registry, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("gathering metrics: %v", err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metric:
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, lp := range m.GetLabel() {
				got[lp.GetName()] = lp.GetValue()
			}
			for k, v := range labels {
				if got[k] != v {
					continue metric
				}
			}
			if m.Counter != nil {
				sum += m.GetCounter().GetValue()
			} else if m.Histogram != nil {
				sum += float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return sum
}

// waitFor polls cond until it is true, and fails the test at the deadline.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("%s: still false after %s", what, timeout)
		case <-tick.C:
		}
	}
}

// syncBuffer is a bytes.Buffer safe for concurrent writers (log handlers
// in several goroutines).
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
