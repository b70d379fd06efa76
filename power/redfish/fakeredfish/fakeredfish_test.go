package fakeredfish_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/shepherd/shepherd/internal/eventually"
	"github.com/shepherd/shepherd/power/redfish/fakeredfish"
)

// client trusts b's CA only.
func client(t *testing.T, b *fakeredfish.BMC) *http.Client {
	t.Helper()
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(b.CAPEM()) {
		t.Fatal("CAPEM holds no certificate")
	}
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

func do(t *testing.T, c *http.Client, b *fakeredfish.BMC, method, path, user, password string, body any) (*http.Response, []byte) {
	t.Helper()
	var rd *bytes.Reader
	if body != nil {
		data, _ := json.Marshal(body)
		rd = bytes.NewReader(data)
	} else {
		rd = bytes.NewReader(nil)
	}
	req, err := http.NewRequestWithContext(t.Context(), method, b.URL()+path, rd)
	if err != nil {
		t.Fatal(err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if user != "" {
		req.SetBasicAuth(user, password)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var buf bytes.Buffer
	_, _ = buf.ReadFrom(resp.Body)
	return resp, buf.Bytes()
}

// TestTLSVersions: a TLS 1.2-only profile negotiates 1.2 with a client
// that offers 1.3, and OpenBMC negotiates 1.3.
func TestTLSVersions(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		p    fakeredfish.Profile
		want uint16
	}{{fakeredfish.IDRAC(), tls.VersionTLS12}, {fakeredfish.OpenBMC(), tls.VersionTLS13}} {
		b := start(t, fakeredfish.Config{Profile: tc.p})
		pool := x509.NewCertPool()
		pool.AppendCertsFromPEM(b.CAPEM())
		conn, err := tls.Dial("tcp", b.Host()+":"+strconv.Itoa(b.Port()), &tls.Config{RootCAs: pool, MaxVersion: tls.VersionTLS13})
		if err != nil {
			t.Fatalf("%s: %v", tc.p.Name, err)
		}
		if got := conn.ConnectionState().Version; got != tc.want {
			t.Errorf("%s: negotiated %s, want %s", tc.p.Name, tls.VersionName(got), tls.VersionName(tc.want))
		}
		conn.Close()
	}
}

// TestErrorsAreRedfishErrors: a wrong password is 401 with a Redfish error
// body whose code and @Message.ExtendedInfo come from the Base registry.
func TestErrorsAreRedfishErrors(t *testing.T) {
	t.Parallel()
	b := start(t, fakeredfish.Config{})
	resp, body := do(t, client(t, b), b, http.MethodGet, "/redfish/v1/Systems", b.Username(), "wrong", nil)
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("status %d, want 401", resp.StatusCode)
	}
	var e struct {
		Error struct {
			Code    string                                `json:"code"`
			Message string                                `json:"message"`
			Info    []struct{ MessageID, Message string } `json:"@Message.ExtendedInfo"`
		} `json:"error"`
	}
	if err := json.Unmarshal(body, &e); err != nil || e.Error.Code != "Base.1.16.ResourceAtUriUnauthorized" ||
		e.Error.Message == "" || len(e.Error.Info) != 1 || e.Error.Info[0].MessageID != e.Error.Code {
		t.Fatalf("body %s (decode error %v) is not a Redfish error", body, err)
	}
}

// TestRequireJSONContentType: OpenBMC, like bmcweb, refuses a body not sent
// as application/json with 400 UnrecognizedRequestBody, login included, and
// accepts one with a charset.
func TestRequireJSONContentType(t *testing.T) {
	t.Parallel()
	b := start(t, fakeredfish.Config{Profile: fakeredfish.OpenBMC()})
	c := client(t, b)
	login := func(contentType string) (int, []byte) {
		t.Helper()
		body := `{"UserName":"` + b.Username() + `","Password":"` + b.Password() + `"}`
		req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, b.URL()+"/redfish/v1/SessionService/Sessions", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		if contentType != "" {
			req.Header.Set("Content-Type", contentType)
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var buf bytes.Buffer
		_, _ = buf.ReadFrom(resp.Body)
		return resp.StatusCode, buf.Bytes()
	}
	for _, ct := range []string{"", "text/plain"} {
		if st, body := login(ct); st != http.StatusBadRequest || !bytes.Contains(body, []byte("UnrecognizedRequestBody")) {
			t.Errorf("login with Content-Type %q: status %d %s, want 400 UnrecognizedRequestBody", ct, st, body)
		}
	}
	if st, body := login("application/json; charset=utf-8"); st != http.StatusCreated {
		t.Errorf("login as application/json: status %d %s, want 201", st, body)
	}
	if n := b.SessionsCreated(); n != 1 {
		t.Errorf("%d sessions created, want 1", n)
	}
}

// TestDropResets: a dropped reset is accepted and counted, and the power
// state never changes.
func TestDropResets(t *testing.T) {
	t.Parallel()
	b := start(t, fakeredfish.Config{Profile: fakeredfish.IDRAC(), PowerState: fakeredfish.On})
	b.DropResets(true)
	resp, body := do(t, client(t, b), b, http.MethodPost, "/redfish/v1/Systems/System.Embedded.1/Actions/ComputerSystem.Reset",
		b.Username(), b.Password(), map[string]string{"ResetType": "ForceOff"})
	if resp.StatusCode != http.StatusNoContent {
		t.Fatalf("reset: status %d %s, want 204", resp.StatusCode, body)
	}
	if b.PowerState() != fakeredfish.On || b.Resets()["ForceOff"] != 1 {
		t.Fatalf("power %s, resets %v; want On and one ForceOff", b.PowerState(), b.Resets())
	}
}

// TestPowerChangeHook: the hook sees every state in order, including the
// transition's, and is called for the timer's change too.
func TestPowerChangeHook(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var seen []string
	b := start(t, fakeredfish.Config{Transition: 30 * time.Millisecond, OnPowerChange: func(s string) {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, s)
	}})
	c := client(t, b)
	reset := func(rt string) {
		resp, body := do(t, c, b, http.MethodPost, "/redfish/v1/Systems/system/Actions/ComputerSystem.Reset",
			b.Username(), b.Password(), map[string]string{"ResetType": rt})
		if resp.StatusCode != http.StatusNoContent {
			t.Fatalf("reset %s: status %d %s", rt, resp.StatusCode, body)
		}
	}
	// Waits for the hook, not the state: the hook runs just after the
	// state changes.
	wait := func(n int) {
		eventually.Holds(t, 10*time.Second, "hook called "+strconv.Itoa(n)+" times", func(context.Context) (bool, error) {
			mu.Lock()
			defer mu.Unlock()
			return len(seen) >= n, nil
		})
	}
	reset("On")
	wait(2)
	reset("ForceOff")
	wait(4)
	mu.Lock()
	defer mu.Unlock()
	want := []string{"PoweringOn", "On", "PoweringOff", "Off"}
	if diff := cmp.Diff(want, seen); diff != "" {
		t.Fatalf("hook calls (-want +got):\n%s", diff)
	}
}
