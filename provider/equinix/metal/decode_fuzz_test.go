package metal

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"
)

// The fuzz targets below send arbitrary answers through the client's real
// path: the request goes to an http.RoundTripper that answers it with the
// fuzzed status and body, and the client reads, bounds and decodes that
// body as it would an answer off the wire. Nothing may panic; an error
// must say what was requested and what was wrong with the answer; a
// success must be exactly what the answer said.

// answers is an http.RoundTripper that answers each request with the next
// of its bodies (the last one again once they run out) and records the
// requests.
type answers struct {
	status int
	bodies [][]byte

	mu   sync.Mutex
	reqs []*http.Request
	sent [][]byte // the body each request got
}

func (a *answers) RoundTrip(req *http.Request) (*http.Response, error) {
	a.mu.Lock()
	body := a.bodies[min(len(a.reqs), len(a.bodies)-1)]
	a.reqs = append(a.reqs, req)
	a.sent = append(a.sent, body)
	a.mu.Unlock()
	if req.Body != nil {
		_ = req.Body.Close()
	}
	return &http.Response{
		Status:        fmt.Sprintf("%d %s", a.status, http.StatusText(a.status)),
		StatusCode:    a.status,
		Proto:         "HTTP/1.1",
		ProtoMajor:    1,
		ProtoMinor:    1,
		Header:        http.Header{"Content-Type": {"application/json"}},
		Body:          io.NopCloser(bytes.NewReader(body)),
		ContentLength: int64(len(body)),
		Request:       req,
	}, nil
}

// fuzzClient is a client whose every request a answers. Its retries are
// quick, and few: a fuzzed answer is never transient, bar a 5xx.
func fuzzClient(t *testing.T, a *answers) *Client {
	t.Helper()
	c, err := New(Config{
		BaseURL:           "https://metal.test/metal/v1",
		Token:             testToken,
		RequestsPerSecond: 1e6,
		Burst:             1e6,
		PerPage:           2,
		RetryDeadline:     time.Second,
		HTTPClient:        &http.Client{Transport: a},
	})
	if err != nil {
		t.Fatal(err)
	}
	c.backoffBase, c.backoffMax = time.Microsecond, time.Microsecond
	c.maxPages = 8 // a fuzzed listing may say it is endless
	return c
}

// checkRequests fails the test if a request left the API's base URL or
// carried the token anywhere but the X-Auth-Token header.
func checkRequests(t *testing.T, a *answers) {
	t.Helper()
	for _, r := range a.reqs {
		if r.URL.Scheme != "https" || r.URL.Host != "metal.test" || r.URL.User != nil ||
			!strings.HasPrefix(r.URL.EscapedPath(), "/metal/v1/") {
			t.Fatalf("request to %s, outside the API at https://metal.test/metal/v1", r.URL.Redacted())
		}
		if strings.Contains(r.URL.String(), testToken) {
			t.Fatalf("request URL %s carries the token", r.URL.Redacted())
		}
	}
}

// FuzzDecodeDevice answers GET /devices/{id} with 200 and any body.
func FuzzDecodeDevice(f *testing.F) {
	f.Add([]byte(wireDevice))
	f.Add([]byte(`{"id": "d1", "state": "queued", "ip_addresses": [], "hardware_reservation": null}`))
	f.Add([]byte(`{"id": "d1", "created_at": "not a time"}`))
	f.Add([]byte(`{"id": 7}`))
	f.Add([]byte(`{"id": "d1", "tags": "not a list"}`))
	f.Add([]byte(`{}`))
	f.Add([]byte(`null`))
	f.Add([]byte(``))
	f.Add([]byte(`[` + wireDevice + `]`))
	f.Add([]byte(wireDevice[:len(wireDevice)/2]))
	f.Add([]byte("<html>502 Bad Gateway</html>"))
	f.Fuzz(func(t *testing.T, body []byte) {
		a := &answers{status: http.StatusOK, bodies: [][]byte{body}}
		d, err := fuzzClient(t, a).GetDevice(t.Context(), "d1")
		checkRequests(t, a)
		if err != nil {
			if want := "metal: GET /devices/d1: decoding the 200 answer: "; !strings.HasPrefix(err.Error(), want) {
				t.Fatalf("GetDevice error %q, want it to start with %q", err, want)
			}
			if len(a.reqs) != 1 {
				t.Fatalf("%d requests for an answer that does not decode, want 1: it cannot change", len(a.reqs))
			}
			return
		}
		var want Device
		if jerr := json.Unmarshal(body, &want); jerr != nil {
			t.Fatalf("GetDevice accepted an answer that does not decode: %v", jerr)
		}
		if !reflect.DeepEqual(d, want) {
			t.Fatalf("GetDevice = %+v, the answer says %+v", d, want)
		}
		if d.ID == "" {
			t.Fatalf("GetDevice accepted %q, a device without an id", body)
		}
	})
}

// wirePage is a page of a listing as notes/metal-wire.md writes it.
func wirePage(next string, items ...string) []byte {
	n := "null"
	if next != "" {
		n = `{"href": "` + next + `"}`
	}
	return fmt.Appendf(nil, `{"devices": [%s], "meta": {"first": {"href": "/metal/v1/projects/p1/devices?page=1&per_page=2"},
		"previous": null, "next": %s, "last": {"href": "/metal/v1/projects/p1/devices?page=2&per_page=2"},
		"current_page": 1, "last_page": 2, "total": 3}}`, strings.Join(items, ", "), n)
}

// FuzzDecodeDeviceList answers the first page of GET
// /projects/p1/devices with first and every later page with rest.
func FuzzDecodeDeviceList(f *testing.F) {
	dev := func(id string) string { return `{"id": "` + id + `", "state": "active"}` }
	f.Add(wirePage("/metal/v1/projects/p1/devices?page=2&per_page=2", wireDevice, dev("d2")), wirePage("", dev("d3")))
	f.Add(wirePage("", dev("d1")), []byte(`{}`))
	f.Add(wirePage("/metal/v1/projects/p1/devices?page=2&per_page=2", dev("d1")), wirePage("/metal/v1/projects/p1/devices?page=2&per_page=2", dev("d2")))
	f.Add(wirePage("https://evil.test/metal/v1/projects/p1/devices?page=2", dev("d1")), wirePage(""))
	f.Add(wirePage("//evil.test/metal/v1/x", dev("d1")), wirePage(""))
	f.Add(wirePage("page=2", dev("d1")), wirePage(""))
	f.Add(wirePage("/metal/v1/projects/p1/devices?page=2", dev("d1"), dev("")), wirePage(""))
	f.Add([]byte(`{"devices": null, "meta": null}`), []byte(``))
	f.Add([]byte(`{"devices": [], "meta": {"next": {"href": "/metal/v1/projects/p1/devices?page=2"}, "last_page": 1000000}}`),
		[]byte(`{"devices": [], "meta": {"next": {"href": "/metal/v1/projects/p1/devices?page=3"}}}`))
	f.Add([]byte(`{"meta": {}}`), []byte(``))
	f.Add([]byte(`{"devices": {}, "meta": {}}`), []byte(``))
	f.Add([]byte(`{"devices": [], "meta": {"next": "x"}}`), []byte(``))
	f.Add([]byte(`{"devices": [], "meta": {"next": {"href": "%zz"}}}`), []byte(``))
	f.Add([]byte(`null`), []byte(`null`))
	f.Fuzz(func(t *testing.T, first, rest []byte) {
		a := &answers{status: http.StatusOK, bodies: [][]byte{first, rest}}
		ds, err := fuzzClient(t, a).ListDevices(t.Context(), "p1")
		checkRequests(t, a)
		if err != nil {
			msg := err.Error()
			if !strings.Contains(msg, "GET /projects/p1/devices") && !strings.Contains(msg, "listing devices") {
				t.Fatalf("ListDevices error %q names neither the request nor the listing", msg)
			}
			return
		}
		// Every page is what its answer says, objects seen before left out.
		var want []Device
		seen := map[string]bool{}
		for i, body := range a.sent {
			var page struct {
				Devices []Device `json:"devices"`
			}
			if jerr := json.Unmarshal(body, &page); jerr != nil {
				t.Fatalf("ListDevices accepted page %d, which does not decode: %v", i+1, jerr)
			}
			for _, d := range page.Devices {
				if d.ID == "" {
					t.Fatalf("ListDevices accepted page %d with a device without an id", i+1)
				}
				if !seen[d.ID] {
					seen[d.ID] = true
					want = append(want, d)
				}
			}
		}
		if !reflect.DeepEqual(ds, want) {
			t.Fatalf("ListDevices = %+v, the pages say %+v", ds, want)
		}
	})
}

// FuzzDecodeError answers GET /devices/{id} with a 4xx that retrying
// cannot change (status picks one) and any body.
func FuzzDecodeError(f *testing.F) {
	statuses := []int{http.StatusBadRequest, http.StatusUnauthorized, http.StatusForbidden, http.StatusNotFound,
		http.StatusConflict, http.StatusUnprocessableEntity, http.StatusFound, 418}
	f.Add(uint8(3), []byte(`{"errors": ["Not found"]}`))
	f.Add(uint8(1), []byte(`{"errors": ["token `+testToken+` is invalid"]}`))
	f.Add(uint8(5), []byte(`{"errors": ["hardware reservation r1 already has a device", "second"], "error": "and one"}`))
	f.Add(uint8(0), []byte(`{"error": "bad request"}`))
	f.Add(uint8(0), []byte(`{"errors": "not a list"}`))
	f.Add(uint8(2), []byte(`<html><body>403 Forbidden `+strings.Repeat("x", 200)+testToken+`</body></html>`))
	f.Add(uint8(2), []byte(strings.Repeat("é", 150)))
	f.Add(uint8(4), []byte(`null`))
	f.Add(uint8(4), []byte(``))
	f.Add(uint8(6), []byte("\xff\xfe\x00 not utf-8"))
	f.Fuzz(func(t *testing.T, pick uint8, body []byte) {
		status := statuses[int(pick)%len(statuses)]
		a := &answers{status: status, bodies: [][]byte{body}}
		_, err := fuzzClient(t, a).GetDevice(t.Context(), "d1")
		checkRequests(t, a)
		var ae *APIError
		if !errors.As(err, &ae) {
			t.Fatalf("GetDevice error %v for a %d, want an *APIError", err, status)
		}
		if ae.Method != http.MethodGet || ae.Path != "/devices/d1" || ae.Status != status {
			t.Fatalf("APIError %s %s %d, want GET /devices/d1 %d", ae.Method, ae.Path, ae.Status, status)
		}
		msg := err.Error()
		if want := fmt.Sprintf("metal: GET /devices/d1: %d", status); !strings.HasPrefix(msg, want) {
			t.Fatalf("error %q, want it to start with %q", msg, want)
		}
		for _, s := range []string{msg, fmt.Sprintf("%+v", err), fmt.Sprintf("%#v", ae.Messages)} {
			if strings.Contains(s, testToken) {
				t.Fatalf("error carries the token: %s", s)
			}
		}
		if len(ae.Messages) > maxMessages+1 {
			t.Fatalf("%d messages kept, want at most %d", len(ae.Messages), maxMessages+1)
		}
		for _, m := range ae.Messages {
			if len(m) > maxExcerpt+len("...") {
				t.Fatalf("a message of %d bytes, want at most %d", len(m), maxExcerpt+len("..."))
			}
		}
		if len(a.reqs) != 1 {
			t.Fatalf("%d requests, want 1: a %d is final", len(a.reqs), status)
		}
		if got, want := errors.Is(err, ErrNotFound), status == http.StatusNotFound; got != want {
			t.Fatalf("errors.Is(err, ErrNotFound) = %v for a %d", got, status)
		}
		// An answer that is not the API's JSON is shown as an excerpt.
		var e struct {
			Errors []string `json:"errors"`
			Error  string   `json:"error"`
		}
		if json.Unmarshal(body, &e) != nil {
			if len(ae.Messages) > 1 || len(ae.Messages) == 1 && len(ae.Messages[0]) > 200+len("...") {
				t.Fatalf("messages %q from an answer that is not JSON, want one excerpt of at most 200 bytes", ae.Messages)
			}
		} else if n := len(e.Errors) + min(len(e.Error), 1); len(ae.Messages) != n {
			t.Fatalf("messages %q, want the answer's %d", ae.Messages, n)
		}
	})
}

// TestFuzzClientAnswers checks the fuzz targets' transport with a real
// document, so that a broken harness cannot make every fuzz input pass.
func TestFuzzClientAnswers(t *testing.T) {
	t.Parallel()
	a := &answers{status: http.StatusOK, bodies: [][]byte{
		wirePage("/metal/v1/projects/p1/devices?page=2&per_page=2", wireDevice, `{"id": "d2"}`),
		wirePage("", `{"id": "d3"}`),
	}}
	ds, err := fuzzClient(t, a).ListDevices(t.Context(), "p1")
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, d := range ds {
		ids = append(ids, d.ID)
	}
	if got, want := strings.Join(ids, ","), "5e0c1c2a-8a0f-4f43-9d0b-1c9a2b3c4d5e,d2,d3"; got != want {
		t.Errorf("ListDevices ids %s, want %s", got, want)
	}
	if len(a.reqs) != 2 {
		t.Fatalf("%d requests, want 2", len(a.reqs))
	}
	q, _ := url.ParseQuery(a.reqs[1].URL.RawQuery)
	if q.Get("page") != "2" || a.reqs[1].Header.Get("X-Auth-Token") != testToken {
		t.Errorf("second request %s with token %v, want page 2 with the token", a.reqs[1].URL, a.reqs[1].Header.Get("X-Auth-Token") == testToken)
	}
}
