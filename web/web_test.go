package web_test

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"fmt"
	"html"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/web"
)

func TestMain(m *testing.M) { bmdbtest.Main(m) }

// operatorToken is the secret the action tests use; no response and no
// log line may contain it.
const operatorToken = "s3cret-operator-token-do-not-leak"

// Untrusted strings a machine or a provider API could hand us.
const (
	evilProviderID = `<script>alert("provider id")</script>`
	evilLocation   = `"><img src=x onerror=alert(1)>`
	evilProduct    = `<script>alert('hardware')</script>`
)

// syncBuffer is a log sink for concurrent handlers.
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

// fleet is a small fleet with one quarantined machine and one carrying
// hostile strings in its tags and hardware report.
type fleet struct {
	db          *bmdbtest.DB
	healthy     []uuid.UUID
	quarantined uuid.UUID
	evil        uuid.UUID
}

func newFleet(t testing.TB) *fleet {
	t.Helper()
	db := bmdbtest.New(t)
	ctx := t.Context()
	s := bmdbtest.Session(t, db, "test", 0)
	f := &fleet{db: db}
	for range 3 {
		f.healthy = append(f.healthy, addHeartbeating(t, db, s, bmdb.Provided{Provider: "sim", ProviderID: "sim-" + uuid.NewString()[:8],
			Address: netip.MustParseAddr("10.1.2.3"), Location: "fra1", Status: bmdb.ProviderStatusRunning}, nil))
	}
	// Quarantined for AgentStart after one failure.
	f.quarantined = bmdbtest.AddMachine(t, db, s, "q")
	w, err := s.Work(ctx, bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("q"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Fail(ctx, bmdb.BackoffPolicy{Initial: time.Hour, MaxAttempts: 1}, "ssh: handshake failed"); err != nil {
		t.Fatal(err)
	}
	hw := &agentv1.HardwareReport{
		Cpu:               &agentv1.CPU{Model: evilProduct, Sockets: 1, Cores: 8, Threads: 16},
		MemoryBytes:       64 << 30,
		Dmi:               &agentv1.DMI{SystemVendor: "ACME", ProductName: evilProduct, ProductSerial: "SN-1"},
		BlockDevices:      []*agentv1.BlockDevice{{Name: "nvme0n1", SizeBytes: 1 << 40, Model: evilProduct}},
		NetworkInterfaces: []*agentv1.NetworkInterface{{Name: "eth0", MacAddress: "02:00:00:00:00:01", LinkUp: true, SpeedMbps: 10000}},
		Warnings:          []string{evilProduct},
	}
	f.evil = addHeartbeating(t, db, s, bmdb.Provided{Provider: "sim", ProviderID: evilProviderID, Location: evilLocation,
		Status: bmdb.ProviderStatusRunning}, hw)
	return f
}

// addHeartbeating adds a machine whose agent started and sent a heartbeat
// (with hw, if given).
func addHeartbeating(t testing.TB, db *bmdbtest.DB, s *bmdb.Session, p bmdb.Provided, hw *agentv1.HardwareReport) uuid.UUID {
	t.Helper()
	ctx := t.Context()
	pub, _, err := ed25519.GenerateKey(nil)
	if err != nil {
		t.Fatal(err)
	}
	var id uuid.UUID
	err = s.Transact(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
		if id, err = tx.AddMachine(ctx, p); err != nil {
			return err
		}
		return tx.SetAgentStarted(ctx, id, pub)
	})
	if err != nil {
		t.Fatal(err)
	}
	hb := bmdb.Heartbeat{MachineID: id, AgentKey: pub}
	if hw != nil {
		raw, err := proto.Marshal(hw)
		if err != nil {
			t.Fatal(err)
		}
		hb.Hardware = &bmdb.HardwareReport{Raw: raw, CPUThreads: int32(hw.GetCpu().GetThreads()), MemoryBytes: int64(hw.GetMemoryBytes())}
	}
	res, err := db.RecordHeartbeats(ctx, []bmdb.Heartbeat{hb})
	if err != nil || !res[0].Accepted {
		t.Fatalf("recording a heartbeat: %v (accepted %v)", err, res)
	}
	return id
}

// server is a web UI under test and the log it writes.
type server struct {
	h   http.Handler
	log *syncBuffer
}

func newServer(t testing.TB, db *bmdb.DB, cfg web.Config) *server {
	t.Helper()
	logs := &syncBuffer{}
	cfg.Logger = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	cfg.Registerer = prometheus.NewRegistry()
	s, err := web.New(cfg, db)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("web UI log:\n%s", logs)
		}
	})
	// First, before the database goes: power actions may still run.
	t.Cleanup(s.Close)
	return &server{h: s.Handler(), log: logs}
}

// do sends a request through the handler and returns the response and its body.
func (s *server) do(t *testing.T, method, path string, form url.Values, header ...string) (*http.Response, string) {
	t.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	req := httptest.NewRequest(method, path, body)
	if form != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	rec := httptest.NewRecorder()
	s.h.ServeHTTP(rec, req)
	return rec.Result(), rec.Body.String()
}

func (s *server) get(t *testing.T, path string) string {
	t.Helper()
	resp, body := s.do(t, http.MethodGet, path, nil)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s = %s:\n%s", path, resp.Status, body)
	}
	return body
}

// listedMachine matches a machine of the machine list; its group is the id.
var listedMachine = regexp.MustCompile(`<a class="machine mono" href="/machines/([0-9a-f-]{36})"`)

// listPages reads the machine list's pages from path on, following each
// page's rel="next" link, and returns their paths and bodies. More than
// 10 pages fail the test.
func (s *server) listPages(t *testing.T, path string) (paths, bodies []string) {
	t.Helper()
	next := regexp.MustCompile(`<a rel="next" href="([^"]+)"`)
	for path != "" {
		if len(paths) == 10 {
			t.Fatalf("%s: more than 10 pages", paths[0])
		}
		body := s.get(t, path)
		paths, bodies = append(paths, path), append(bodies, body)
		path = ""
		if m := next.FindStringSubmatch(body); m != nil {
			path = html.UnescapeString(m[1])
		}
	}
	return paths, bodies
}

// pages are every page of the UI for f.
func (f *fleet) pages() []string {
	return []string{
		"/", "/machines", "/machines?state=Healthy", "/machines?q=" + url.QueryEscape("<script>"),
		"/machines?provider=sim&location=" + url.QueryEscape(evilLocation),
		"/machines/" + f.evil.String(), "/machines/" + f.quarantined.String(), "/machines/" + f.healthy[0].String(),
		"/sessions", "/sessions?dead=on", "/static/style.css",
	}
}

func TestPagesAndSecurityHeaders(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	s := newServer(t, f.db.DB, web.Config{})
	for _, path := range f.pages() {
		resp, body := s.do(t, http.MethodGet, path, nil)
		if resp.StatusCode != http.StatusOK {
			t.Errorf("GET %s = %s:\n%s", path, resp.Status, body)
			continue
		}
		h := resp.Header
		csp := h.Get("Content-Security-Policy")
		if !strings.Contains(csp, "frame-ancestors 'none'") || !strings.Contains(csp, "default-src 'none'") || strings.Contains(csp, "unsafe-inline") {
			t.Errorf("GET %s: Content-Security-Policy %q", path, csp)
		}
		if h.Get("X-Content-Type-Options") != "nosniff" {
			t.Errorf("GET %s: X-Content-Type-Options %q", path, h.Get("X-Content-Type-Options"))
		}
		if h.Get("X-Frame-Options") != "DENY" {
			t.Errorf("GET %s: X-Frame-Options %q", path, h.Get("X-Frame-Options"))
		}
	}
	for path, code := range map[string]int{
		"/machines/" + uuid.NewString():           http.StatusNotFound,
		"/machines/not-a-uuid":                    http.StatusNotFound,
		"/machines?state=Sleepy":                  http.StatusBadRequest,
		"/machines?after=nope":                    http.StatusBadRequest,
		"/machines?q=%00":                         http.StatusBadRequest, // no text PostgreSQL takes: was a 500
		"/machines?provider=%FF%FE":               http.StatusBadRequest,
		"/machines?location=fra1%00":              http.StatusBadRequest,
		"/nope":                                   http.StatusNotFound,
		"/machines/" + f.evil.String() + "/reset": http.StatusNotFound, // no actions without Config.Actions
	} {
		if resp, body := s.do(t, http.MethodGet, path, nil); resp.StatusCode != code {
			t.Errorf("GET %s = %s, want %d:\n%s", path, resp.Status, code, body)
		}
	}
	// The machine page shows its tags and the decoded hardware report.
	page := s.get(t, "/machines/"+f.evil.String())
	for _, want := range []string{"ACME", "SN-1", "nvme0n1", "02:00:00:00:00:01", "64.0 GiB", "Healthy"} {
		if !strings.Contains(page, want) {
			t.Errorf("machine page lacks %q", want)
		}
	}
	page = s.get(t, "/machines/"+f.quarantined.String())
	for _, want := range []string{"Quarantined", "ssh: handshake failed", "AgentStart", "Failed"} {
		if !strings.Contains(page, want) {
			t.Errorf("page of the quarantined machine lacks %q", want)
		}
	}
}

func TestReadOnlyRefusesEverythingButGET(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	s := newServer(t, f.db.DB, web.Config{})
	for _, path := range append(f.pages(), "/machines/"+f.quarantined.String()+"/reset", "/nope") {
		for _, method := range []string{http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete, http.MethodOptions, "TRACE"} {
			resp, _ := s.do(t, method, path, url.Values{"process": {"AgentStart"}, "token": {operatorToken}})
			if resp.StatusCode != http.StatusMethodNotAllowed {
				t.Errorf("%s %s = %s, want 405", method, path, resp.Status)
			}
			if allow := resp.Header.Get("Allow"); allow != "GET, HEAD" {
				t.Errorf("%s %s: Allow %q", method, path, allow)
			}
		}
		resp, body := s.do(t, http.MethodHead, path, nil)
		if resp.StatusCode != http.StatusOK && path != "/nope" && !strings.HasSuffix(path, "/reset") {
			t.Errorf("HEAD %s = %s", path, resp.Status)
		} else if body != "" && !strings.HasSuffix(path, ".css") { // the file server leaves HEAD to net/http
			t.Errorf("HEAD %s has a body", path)
		}
	}
	for _, path := range f.pages() {
		if strings.HasSuffix(path, ".css") {
			continue
		}
		if body := s.get(t, path); actionMarkup.MatchString(body) {
			t.Errorf("read-only page %s offers an action: %q", path, actionMarkup.FindString(body))
		}
	}
	if b, err := backoff(t, f.db, f.quarantined); err != nil || !b.Quarantined {
		t.Errorf("after refused POSTs the quarantine is %+v, %v; want it untouched", b, err)
	}
}

// actionMarkup matches what offers an action: a form that posts, a
// password field, a link to a confirmation page.
var actionMarkup = regexp.MustCompile(`(?i)method="post"|type="password"|href="[^"]*/(reset|decommission|install)\b`)

func backoff(t *testing.T, db *bmdbtest.DB, id uuid.UUID) (bmdb.Backoff, error) {
	t.Helper()
	return db.GetBackoff(t.Context(), id, bmdb.ProcessAgentStart)
}

func TestUntrustedDataIsEscaped(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	for _, actions := range []bool{false, true} {
		cfg := web.Config{}
		if actions {
			cfg.Actions, cfg.OperatorToken = true, mustToken(t)
		}
		s := newServer(t, f.db.DB, cfg)
		paths := f.pages()
		if actions {
			paths = append(paths, "/machines/"+f.evil.String()+"/decommission", "/machines/"+f.evil.String()+"/install",
				"/machines/"+f.evil.String()+"/reset?process=AgentStart")
		}
		for _, path := range paths {
			body := s.get(t, path)
			for _, bad := range []string{"<script", "<img src=x", "onerror=alert"} {
				if strings.Contains(strings.ToLower(body), bad) && !strings.Contains(body, "&lt;img src=x onerror=alert") {
					t.Errorf("GET %s (actions %v) contains %q unescaped", path, actions, bad)
				}
			}
		}
		page := s.get(t, "/machines/"+f.evil.String())
		for _, want := range []string{"&lt;script&gt;alert(&#34;provider id&#34;)&lt;/script&gt;", "&lt;script&gt;alert(&#39;hardware&#39;)&lt;/script&gt;"} {
			if !strings.Contains(page, want) {
				t.Errorf("machine page does not show the escaped %q", want)
			}
		}
	}
}

func mustToken(t testing.TB) web.Token {
	t.Helper()
	tok, err := web.NewToken(operatorToken)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

var csrfField = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

// confirmForm loads a confirmation page and returns its CSRF token.
func (s *server) confirmForm(t *testing.T, path string) string {
	t.Helper()
	body := s.get(t, path)
	m := csrfField.FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("GET %s has no CSRF field:\n%s", path, body)
	}
	if strings.Contains(body, operatorToken) {
		t.Fatalf("GET %s shows the operator token", path)
	}
	return m[1]
}

func TestActions(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	s := newServer(t, f.db.DB, web.Config{Actions: true, OperatorToken: mustToken(t)})
	var bodies []string
	post := func(path string, form url.Values, header ...string) (*http.Response, string) {
		resp, body := s.do(t, http.MethodPost, path, form, header...)
		bodies = append(bodies, body)
		return resp, body
	}
	q := f.quarantined.String()
	resetPath := "/machines/" + q + "/reset"

	// The machine page offers the reset of its quarantine.
	if page := s.get(t, "/machines/"+q); !strings.Contains(page, `href="`+resetPath+`?process=AgentStart"`) {
		t.Errorf("machine page offers no reset of the quarantine")
	}
	csrf := s.confirmForm(t, resetPath+"?process=AgentStart")
	otherCSRF := s.confirmForm(t, "/machines/"+f.healthy[0].String()+"/reset?process=AgentStart")
	decomCSRF := s.confirmForm(t, "/machines/"+q+"/decommission")

	refused := []struct {
		name   string
		form   url.Values
		header []string
		code   int
	}{
		{"no token", url.Values{"csrf": {csrf}, "process": {"AgentStart"}}, nil, http.StatusForbidden},
		{"wrong token", url.Values{"csrf": {csrf}, "process": {"AgentStart"}, "token": {operatorToken + "x"}}, nil, http.StatusForbidden},
		{"token prefix", url.Values{"csrf": {csrf}, "process": {"AgentStart"}, "token": {operatorToken[:10]}}, nil, http.StatusForbidden},
		{"no CSRF token", url.Values{"process": {"AgentStart"}, "token": {operatorToken}}, nil, http.StatusForbidden},
		{"forged CSRF token", url.Values{"csrf": {strings.Repeat("A", len(csrf))}, "process": {"AgentStart"}, "token": {operatorToken}}, nil, http.StatusForbidden},
		{"CSRF token of another machine", url.Values{"csrf": {otherCSRF}, "process": {"AgentStart"}, "token": {operatorToken}}, nil, http.StatusForbidden},
		{"CSRF token of another action", url.Values{"csrf": {decomCSRF}, "process": {"AgentStart"}, "token": {operatorToken}}, nil, http.StatusForbidden},
		{"cross-site request", url.Values{"csrf": {csrf}, "process": {"AgentStart"}, "token": {operatorToken}},
			[]string{"Sec-Fetch-Site", "cross-site"}, http.StatusForbidden},
		{"foreign origin", url.Values{"csrf": {csrf}, "process": {"AgentStart"}, "token": {operatorToken}},
			[]string{"Origin", "https://evil.example"}, http.StatusForbidden},
		{"unknown process", url.Values{"csrf": {csrf}, "process": {"Nap"}, "token": {operatorToken}}, nil, http.StatusBadRequest},
	}
	for _, tt := range refused {
		resp, body := post(resetPath, tt.form, tt.header...)
		if resp.StatusCode != tt.code {
			t.Errorf("%s: POST = %s, want %d:\n%s", tt.name, resp.Status, tt.code, body)
		}
		if b, err := backoff(t, f.db, f.quarantined); err != nil || !b.Quarantined {
			t.Fatalf("%s: the quarantine is gone (%+v, %v)", tt.name, b, err)
		}
	}

	// The right token, from the page's own form, resets the quarantine.
	resp, body := post(resetPath, url.Values{"csrf": {csrf}, "process": {"AgentStart"}, "token": {operatorToken},
		"reason": {"disk replaced"}}, "Sec-Fetch-Site", "same-origin")
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/machines/"+q+"?done=reset" {
		t.Fatalf("reset: POST = %s (Location %q), want 303 to the machine page:\n%s", resp.Status, resp.Header.Get("Location"), body)
	}
	if b, err := backoff(t, f.db, f.quarantined); err == nil {
		t.Errorf("after the reset the backoff is still there: %+v", b)
	}
	hist, err := f.db.History(t.Context(), bmdb.HistoryFilter{MachineID: f.quarantined})
	if err != nil {
		t.Fatal(err)
	}
	last := hist[len(hist)-1]
	if last.Event != bmdb.EventReset || last.Process != bmdb.ProcessAgentStart || !strings.Contains(last.Cause, "web UI") ||
		!strings.Contains(last.Cause, "disk replaced") {
		t.Errorf("last history row = %+v, want Reset of AgentStart by the web UI with the reason", last)
	}
	if page := s.get(t, "/machines/"+q+"?done=reset"); !strings.Contains(page, "Backoff reset") {
		t.Error("the machine page does not confirm the reset")
	}
	// Nothing left to reset: a conflict, not a success.
	if resp, _ := post(resetPath, url.Values{"csrf": {csrf}, "process": {"AgentStart"}, "token": {operatorToken}}); resp.StatusCode != http.StatusConflict {
		t.Errorf("second reset: POST = %s, want 409", resp.Status)
	}

	// Install: validated with the CLI's rules before anything is stored.
	h := f.healthy[1].String()
	installPath := "/machines/" + h + "/install"
	icsrf := s.confirmForm(t, installPath)
	good := url.Values{"csrf": {icsrf}, "token": {operatorToken}, "image_url": {"https://images.example/os.img"},
		"sha256": {strings.Repeat("ab", 32)}, "target_device": {"/dev/sda"}, "reboot": {"on"}}
	bad := url.Values{}
	for k, v := range good {
		bad[k] = v
	}
	bad.Set("sha256", "not-hex")
	if resp, body := post(installPath, bad); resp.StatusCode != http.StatusBadRequest || !strings.Contains(body, "Invalid installation request") {
		t.Errorf("install with a bad SHA-256: POST = %s:\n%s", resp.Status, body)
	}
	bad.Set("sha256", strings.Repeat("ab", 32))
	bad.Set("target_device", "/var/lib/disk.img") // a file: the web UI asks for block devices only
	if resp, body := post(installPath, bad); resp.StatusCode != http.StatusBadRequest || !strings.Contains(body, "not a device under /dev") {
		t.Errorf("install to a target outside /dev: POST = %s:\n%s", resp.Status, body)
	}
	if in, err := f.db.GetInstallation(t.Context(), f.healthy[1]); err != nil || in.RequestGeneration != 0 {
		t.Errorf("a refused install stored a request: %+v, %v", in, err)
	}
	if resp, body := post(installPath, good); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("install: POST = %s:\n%s", resp.Status, body)
	}
	in, err := f.db.GetInstallation(t.Context(), f.healthy[1])
	if err != nil || in.RequestGeneration != 1 || in.RequestedBy != "operator (web UI)" {
		t.Fatalf("after install: %+v, %v; want generation 1 requested by operator (web UI)", in, err)
	}
	// The page names the requester the BMDB recorded, as `machine show` does.
	if page := s.get(t, "/machines/"+h); !strings.Contains(page, "by operator (web UI)") {
		t.Errorf("the machine page does not name who requested the installation")
	}
	var req agentv1.OSInstallationRequest
	if err := proto.Unmarshal(in.Request, &req); err != nil || req.GetImageUrl() != "https://images.example/os.img" || !req.GetRebootAfter() ||
		req.GetTargetDevice() != "/dev/sda" {
		t.Errorf("stored request = %v, %v", &req, err)
	}

	// Decommission.
	d := f.healthy[2].String()
	dcsrf := s.confirmForm(t, "/machines/"+d+"/decommission")
	if resp, body := post("/machines/"+d+"/decommission", url.Values{"csrf": {dcsrf}, "token": {operatorToken}, "reason": {"retired"}}); resp.StatusCode != http.StatusSeeOther {
		t.Fatalf("decommission: POST = %s:\n%s", resp.Status, body)
	}
	m, err := f.db.GetMachine(t.Context(), f.healthy[2])
	if err != nil || m.State != bmdb.StateDecommissioning {
		t.Errorf("after decommission the machine is %v (%v), want Decommissioning", m.State, err)
	}
	// No installation on a machine being decommissioned: a conflict that
	// says why, and nothing stored.
	good.Set("csrf", s.confirmForm(t, "/machines/"+d+"/install"))
	if resp, body := post("/machines/"+d+"/install", good); resp.StatusCode != http.StatusConflict || !strings.Contains(body, "decommissioned or being decommissioned") {
		t.Errorf("install on a machine being decommissioned: POST = %s, want 409 saying so:\n%s", resp.Status, body)
	}
	if in, err := f.db.GetInstallation(t.Context(), f.healthy[2]); err != nil || in.RequestGeneration != 0 {
		t.Errorf("an install refused for decommissioning stored a request: %+v, %v", in, err)
	}

	// The token never shows: not in a page, not in the log.
	for _, path := range f.pages() {
		bodies = append(bodies, s.get(t, path))
	}
	for i, b := range bodies {
		if strings.Contains(b, operatorToken) || strings.Contains(b, operatorToken[:10]) {
			t.Errorf("response %d contains the operator token", i)
		}
	}
	if logs := s.log.String(); strings.Contains(logs, operatorToken[:10]) {
		t.Errorf("the log contains the operator token:\n%s", logs)
	} else if !strings.Contains(logs, "wrong operator token") || !strings.Contains(logs, "machine_id="+q) {
		t.Errorf("the log does not record the refused actions with the machine id:\n%s", logs)
	}
	if got := fmt.Sprintf("%v %+v %#v %s", mustToken(t), mustToken(t), mustToken(t), mustToken(t)); strings.Contains(got, operatorToken) {
		t.Errorf("formatting the token shows it: %s", got)
	}
}

func TestNewRefusesActionsWithoutToken(t *testing.T) {
	t.Parallel()
	if _, err := web.New(web.Config{Actions: true}, nil); err == nil {
		t.Error("New accepted Actions without an OperatorToken")
	}
	for _, tok := range []string{"", "short", "has a space in it 1234"} {
		if _, err := web.NewToken(tok); err == nil {
			t.Errorf("NewToken(%q) accepted it", tok)
		} else if tok != "" && strings.Contains(err.Error(), tok) {
			t.Errorf("NewToken's error shows the token: %v", err)
		}
	}
}

func TestListPaginatesAndFilters(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "big", Healthy: 70, AwaitingAgent: 30, Stale: 7})
	s := newServer(t, db.DB, web.Config{PageSize: 25})
	for _, tt := range []struct {
		query string
		want  int
	}{
		{"", 107},
		{"?state=Healthy", 70},
		{"?state=Provided&provider=big", 30},
		{"?state=Silent", 7},
		{"?provider=other", 0},
	} {
		seen := map[string]bool{}
		_, bodies := s.listPages(t, "/machines"+tt.query)
		for _, body := range bodies {
			for _, m := range listedMachine.FindAllStringSubmatch(body, -1) {
				if seen[m[1]] {
					t.Errorf("%s: machine %s on two pages", tt.query, m[1])
				}
				seen[m[1]] = true
			}
			if !strings.Contains(body, fmt.Sprintf(`id="machine-count">%d<`, tt.want)) {
				t.Errorf("%s: page does not say %d machines match", tt.query, tt.want)
			}
		}
		if len(seen) != tt.want {
			t.Errorf("%s: %d machines over all pages, want %d", tt.query, len(seen), tt.want)
		}
	}
}

func TestOverviewCountsAreTheBMDBs(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	bmdbtest.AddFleet(t, f.db, bmdbtest.Fleet{Provider: "big", Healthy: 11, AwaitingAgent: 4, Stale: 2})
	s := newServer(t, f.db.DB, web.Config{Providers: []string{"empty"}, Breaker: func(_ context.Context, provider string, _ bmdb.SilenceTimeouts) (web.BreakerState, error) {
		return web.BreakerState{Started: 13, Silent: 2, SilentFraction: 0.25, Budget: 1, Window: 10 * time.Minute}, nil
	}})
	body := s.get(t, "/")
	cell := regexp.MustCompile(`data-provider="([^"]*)" data-state="([^"]*)"><a href="[^"]*">(\d+)</a>`)
	got := map[[2]string]string{}
	for _, m := range cell.FindAllStringSubmatch(body, -1) {
		got[[2]string{m[1], m[2]}] = m[3]
	}
	for _, p := range []string{"big", "sim", "q", "empty"} {
		want, err := f.db.FleetStates(t.Context(), p, 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		var total int64
		for st, n := range want {
			total += n
			if g := got[[2]string{p, string(st)}]; g != fmt.Sprint(n) {
				t.Errorf("overview: %s %s = %q, BMDB %d", p, st, g, n)
			}
		}
		if g := got[[2]string{p, ""}]; g != fmt.Sprint(total) {
			t.Errorf("overview: %s total = %q, want %d", p, g, total)
		}
	}
	for _, want := range []string{`id="quarantined"><span class="n">1</span>`, "closed: reboots allowed", "2 / 13"} {
		if !strings.Contains(body, want) {
			t.Errorf("overview lacks %q", want)
		}
	}
	// Every provider's breaker is read: the configured one (alongside the
	// snapshot) and those that only have machines (after it).
	breakers := body[strings.Index(body, `id="breakers"`):]
	for _, p := range []string{"big", "sim", "q", "empty"} {
		row := regexp.MustCompile(`(?s)<tr data-provider="` + p + `">.*?</tr>`).FindString(breakers)
		if !strings.Contains(row, "closed: reboots allowed") || !strings.Contains(row, "2 / 13") {
			t.Errorf("breaker row of %s lacks the breaker:\n%s", p, row)
		}
	}
}
