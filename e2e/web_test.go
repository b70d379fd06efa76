package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// chromiumPath finds Debian's Chromium, or fails the test (it does not
// skip: the browser test is part of `make test`) with the install command.
func chromiumPath(t *testing.T) string {
	t.Helper()
	for _, name := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	t.Fatal("the web UI tests need headless Chromium, which is not installed. Install it with:\n" +
		"  sudo apt-get install -y chromium\n(or run scripts/require-chromium)")
	return ""
}

// artifactsDir is where the browser test saves its screenshots:
// $SHEPHERD_TEST_ARTIFACTS/web, default /tmp/shepherd-test-artifacts/web.
func artifactsDir(t *testing.T) string {
	t.Helper()
	base := os.Getenv("SHEPHERD_TEST_ARTIFACTS")
	if base == "" {
		base = filepath.Join(os.TempDir(), "shepherd-test-artifacts")
	}
	dir := filepath.Join(base, "web")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatalf("creating the artifacts directory: %v", err)
	}
	return dir
}

// browser starts a headless Chromium for the test and returns a tab's
// context; the browser is gone when the test ends.
func browser(t *testing.T) context.Context {
	t.Helper()
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(chromiumPath(t)),
		// Chromium's sandbox refuses to run as root, which CI is.
		chromedp.NoSandbox,
		chromedp.WindowSize(1400, 1000),
	)
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(actx, chromedp.WithLogf(t.Logf))
	t.Cleanup(func() {
		_ = chromedp.Cancel(ctx) // closes the browser and waits for it
		cancel()
		cancelAlloc()
	})
	// The first Run starts the browser, under the test's whole lifetime
	// (a timeout here would stop the browser with it).
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("starting Chromium: %v", err)
	}
	return ctx
}

// waitOutput waits for re to match the process's output and returns the
// first submatch (or the whole match).
func waitOutput(t *testing.T, p *process, re *regexp.Regexp, timeout time.Duration) string {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		if m := re.FindStringSubmatch(p.output()); m != nil {
			return m[len(m)-1]
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %q in the output within %s", re, timeout)
		}
		select {
		case <-p.exited:
			p.exitedEarly(t)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// do runs chromedp steps with a deadline, failing the test on error.
func do(t *testing.T, ctx context.Context, what string, steps ...chromedp.Action[chromedp.Void]) {
	t.Helper()
	if _, err := runAction(ctx, chromedp.Steps(steps...)); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
}

// eval evaluates a JavaScript expression in the page.
func eval[T any](t *testing.T, ctx context.Context, what, expr string) T {
	t.Helper()
	v, err := runAction(ctx, chromedp.Evaluate[T](expr))
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	return v
}

func runAction[T any](ctx context.Context, a chromedp.Action[T]) (T, error) {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	return chromedp.Run(ctx, a)
}

// screenshot saves the whole page as name.png in the artifacts directory.
func screenshot(t *testing.T, ctx context.Context, dir, name string) {
	t.Helper()
	png, err := runAction(ctx, chromedp.FullScreenshot(100)) // quality 100: PNG
	if err != nil {
		t.Fatalf("screenshot of %s: %v", name, err)
	}
	path := filepath.Join(dir, name+".png")
	if err := os.WriteFile(path, png, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s", path)
}

// noActions fails the test if the page offers any action: a form that
// posts, a password field, or a link to an action's confirmation page.
func noActions(t *testing.T, ctx context.Context, page string) {
	t.Helper()
	n := eval[int](t, ctx, "looking for actions on "+page, `document.querySelectorAll(
		'form[method="post" i], input[type="password"], a[href$="/reset"], a[href*="/reset?"], a[href$="/decommission"], a[href$="/install"]').length`)
	if n != 0 {
		t.Errorf("%s: %d action forms or links on a read-only UI", page, n)
	}
}

// startDevUI runs `shepherd dev` with a fleet of machines and the web UI
// on a free port (and args), waits until every machine is Healthy, and
// returns the UI's base URL and the dev BMDB.
func startDevUI(t *testing.T, machines int, args ...string) (string, *bmdb.DB) {
	t.Helper()
	chromiumPath(t) // fail early, before starting PostgreSQL
	dataDir, err := os.MkdirTemp("", "shepherd-web-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dataDir) })
	// Not t.TempDir(): its mode 0700 keeps the postgres user out.
	if err := os.Chmod(dataDir, 0o755); err != nil {
		t.Fatal(err)
	}
	args = append([]string{"dev", "--data-dir", dataDir, "--machines", strconv.Itoa(machines), "--web-listen", "127.0.0.1:0"}, args...)
	p := startShepherd(t, args...)
	dbURL := waitOutput(t, p, regexp.MustCompile(`BMDB at (\S+)`), 60*time.Second)
	base := waitOutput(t, p, regexp.MustCompile(`web UI at (http://\S+)`), 60*time.Second)
	waitOutput(t, p, regexp.MustCompile(fmt.Sprintf(`all %d machines are Healthy`, machines)), 90*time.Second)
	db, err := bmdb.Open(t.Context(), bmdb.Config{URL: dbURL, Schema: bmdb.SchemaRequireCurrent})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close)
	return strings.TrimSuffix(base, "/"), db
}

// TestWebUI runs `shepherd dev` and looks at its web UI with headless
// Chromium: the overview's counts are the BMDB's, the list filters by
// state, a machine page shows the machine's history, and nothing offers or
// accepts an action without --web-actions. Screenshots of every page go to
// the artifacts directory.
func TestWebUI(t *testing.T) {
	t.Parallel()
	const machines = 20
	base, db := startDevUI(t, machines)
	// shepherd dev's recovery timeouts, which its UI judges Silent by.
	const firstHeartbeatTimeout, heartbeatTimeout = time.Minute, 30 * time.Second

	ctx := browser(t)
	shots := artifactsDir(t)

	// Overview: every cell of the state table is the BMDB's count. The
	// fleet may move between the two reads, so compare until they agree.
	var lastDiff string
	bmdbtest.WaitFor(t, 30*time.Second, "overview counts match FleetStates", func(context.Context) (bool, error) {
		do(t, ctx, "overview", chromedp.Navigate(base+"/"))
		cells := eval[[][3]string](t, ctx, "overview cells", `Array.from(document.querySelectorAll('#states td[data-state]')).map(
			td => [td.dataset.provider, td.dataset.state, td.textContent.trim()])`)
		want, err := db.FleetStates(t.Context(), "sim", firstHeartbeatTimeout, heartbeatTimeout)
		if err != nil {
			return false, err
		}
		var diffs []string
		seen := 0
		for _, c := range cells {
			if c[0] != "sim" || c[1] == "" {
				continue
			}
			seen++
			if got := c[2]; got != strconv.FormatInt(want[bmdb.MachineState(c[1])], 10) {
				diffs = append(diffs, fmt.Sprintf("%s: page %s, BMDB %d", c[1], got, want[bmdb.MachineState(c[1])]))
			}
		}
		if seen == 0 {
			diffs = append(diffs, "no cells for provider sim")
		}
		lastDiff = strings.Join(diffs, "; ")
		if lastDiff != "" {
			return false, fmt.Errorf("%s", lastDiff)
		}
		return true, nil
	})
	total := eval[string](t, ctx, "overview total", `document.querySelector('#total .n').textContent.trim()`)
	if total != strconv.Itoa(machines) {
		t.Errorf("overview total = %q, want %d", total, machines)
	}
	screenshot(t, ctx, shots, "overview")
	noActions(t, ctx, "overview")

	// The machine list, filtered by state with its form as a person would.
	healthy, err := db.FleetStates(t.Context(), "sim", firstHeartbeatTimeout, heartbeatTimeout)
	if err != nil {
		t.Fatal(err)
	}
	do(t, ctx, "filtering by state",
		chromedp.Navigate(base+"/machines"),
		chromedp.SetValue(chromedp.CSS(`form.filters select[name="state"]`), "Healthy"),
		// Mark this document, so that waiting for an unmarked one waits
		// for the page the form loads.
		chromedp.Func(func(ctx context.Context, t *chromedp.Target) error {
			_, err := chromedp.Evaluate[chromedp.Void](`document.body.dataset.before = "submit"`)(ctx, t)
			return err
		}),
		chromedp.Click(chromedp.CSS(`form.filters button[type="submit"]`)),
		chromedp.WaitVisible(chromedp.CSS(`body:not([data-before]) #machine-count`)))
	loc := eval[string](t, ctx, "location", `location.href`)
	rows := eval[int](t, ctx, "counting rows", `document.querySelectorAll('#machines tbody tr').length`)
	if int64(rows) != healthy[bmdb.StateHealthy] {
		t.Errorf("%s lists %d machines, the BMDB has %d Healthy", loc, rows, healthy[bmdb.StateHealthy])
	}
	states := eval[[]string](t, ctx, "states of the listed machines",
		`Array.from(document.querySelectorAll('#machines tbody td.state')).map(td => td.textContent.trim())`)
	for _, st := range states {
		if st != "Healthy" {
			t.Errorf("%s lists a machine in state %q", loc, st)
		}
	}
	screenshot(t, ctx, shots, "machines")
	noActions(t, ctx, "machine list")
	do(t, ctx, "filtering by a state no machine is in", chromedp.Navigate(base+"/machines?state=Quarantined"))
	if rows := eval[int](t, ctx, "counting rows", `document.querySelectorAll('#machines tbody tr').length`); rows != 0 {
		t.Errorf("state=Quarantined lists %d machines, want none", rows)
	}

	// A machine page, reached from the list, shows the machine's history.
	do(t, ctx, "listing healthy machines", chromedp.Navigate(base+"/machines?state=Healthy"))
	href := eval[string](t, ctx, "first machine link", `document.querySelector('#machines tbody tr a.machine').getAttribute('href')`)
	id := strings.TrimPrefix(href, "/machines/")
	do(t, ctx, "opening a machine",
		chromedp.Click(chromedp.CSS(`#machines tbody tr a.machine`)),
		chromedp.WaitVisible(chromedp.ID("history")))
	shownID := eval[string](t, ctx, "machine id", `document.getElementById('machine-id').textContent.trim()`)
	events := eval[string](t, ctx, "history", `document.querySelector('#history tbody').innerText`)
	historyRows := eval[int](t, ctx, "history rows", `document.querySelectorAll('#history tbody tr').length`)
	if shownID != id {
		t.Errorf("machine page of %s shows id %q", id, shownID)
	}
	uid, err := uuid.Parse(id)
	if err != nil {
		t.Fatal(err)
	}
	hist, err := db.History(t.Context(), bmdb.HistoryFilter{MachineID: uid})
	if err != nil {
		t.Fatal(err)
	}
	if len(hist) < 2 || historyRows < len(hist) {
		t.Errorf("machine page shows %d history rows, the BMDB has %d (want at least Started and Finished)", historyRows, len(hist))
	}
	for _, want := range []string{"AgentStart", "Started", "Finished"} {
		if !strings.Contains(events, want) {
			t.Errorf("machine history lacks %q:\n%s", want, events)
		}
	}
	screenshot(t, ctx, shots, "machine")
	noActions(t, ctx, "machine page")

	do(t, ctx, "sessions page", chromedp.Navigate(base+"/sessions"))
	if n := eval[int](t, ctx, "sessions", `document.querySelectorAll('#sessions tbody tr').length`); n == 0 {
		t.Error("the sessions page lists no session; shepherd dev runs several")
	}
	screenshot(t, ctx, shots, "sessions")
	noActions(t, ctx, "sessions page")

	// Without --web-actions nothing but GET and HEAD is accepted.
	for _, path := range []string{"/", "/machines/" + id + "/reset", "/machines/" + id + "/decommission", "/machines/" + id} {
		resp, err := http.Post(base+path, "application/x-www-form-urlencoded", strings.NewReader("process=AgentStart"))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusMethodNotAllowed {
			t.Errorf("POST %s = %s, want 405 Method Not Allowed", path, resp.Status)
		}
	}
}

// TestWebUIActions runs `shepherd dev --web-actions` and decommissions a
// machine in Chromium as an operator would: from its page, through the
// confirmation form, refused with a wrong token and carried out with the
// right one.
func TestWebUIActions(t *testing.T) {
	t.Parallel()
	tokenFile := filepath.Join(t.TempDir(), "operator-token")
	const token = "e2e-operator-token-0123456789"
	if err := os.WriteFile(tokenFile, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	base, db := startDevUI(t, 5, "--web-actions", "--web-operator-token-file", tokenFile)
	ctx := browser(t)
	shots := artifactsDir(t)

	page, _, err := db.ListMachines(t.Context(), bmdb.MachineFilter{}, uuid.Nil, 1)
	if err != nil || len(page) == 0 {
		t.Fatalf("listing machines: %v", err)
	}
	id := page[0].MachineID
	do(t, ctx, "opening the decommission form",
		chromedp.Navigate(base+"/machines/"+id.String()),
		chromedp.Click(chromedp.CSS(`.actions a[href$="/decommission"]`)),
		chromedp.WaitVisible(chromedp.CSS(`form.action input[name="token"]`)),
		chromedp.SetValue(chromedp.CSS(`form.action input[name="reason"]`), "e2e: retiring"),
		chromedp.SetValue(chromedp.CSS(`form.action input[name="token"]`), "not-the-operator-token"),
		chromedp.Click(chromedp.CSS(`form.action button[type="submit"]`)),
		chromedp.WaitVisible(chromedp.ID("action-error")))
	if msg := eval[string](t, ctx, "error", `document.getElementById('action-error').textContent`); !strings.Contains(msg, "Wrong operator token") {
		t.Errorf("a wrong token shows %q", msg)
	}
	if v := eval[string](t, ctx, "token field", `document.querySelector('form.action input[name="token"]').value`); v != "" {
		t.Error("the refused form gives the typed token back")
	}
	screenshot(t, ctx, shots, "confirm-refused")
	if m, err := db.GetMachine(t.Context(), id); err != nil || m.DecommissionRequested != nil {
		t.Fatalf("after a wrong token: decommission %+v, %v; want none", m.DecommissionRequested, err)
	}

	do(t, ctx, "confirming with the operator token",
		chromedp.SetValue(chromedp.CSS(`form.action input[name="token"]`), token),
		chromedp.Click(chromedp.CSS(`form.action button[type="submit"]`)),
		chromedp.WaitVisible(chromedp.CSS(`p.notice`)))
	if loc := eval[string](t, ctx, "location", `location.pathname + location.search`); loc != "/machines/"+id.String()+"?done=decommission" {
		t.Errorf("after the action the browser is at %s", loc)
	}
	screenshot(t, ctx, shots, "machine-after-action")
	bmdbtest.WaitFor(t, 30*time.Second, "the machine is decommissioned", func(ctx context.Context) (bool, error) {
		m, err := db.GetMachine(ctx, id)
		if err != nil {
			return false, err
		}
		if m.DecommissionRequested == nil || m.DecommissionRequested.Reason != "e2e: retiring" {
			return false, fmt.Errorf("decommission request %+v", m.DecommissionRequested)
		}
		return m.State == bmdb.StateDecommissioned, fmt.Errorf("state %s", m.State)
	})
}
