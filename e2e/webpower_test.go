package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/google/go-cmp/cmp"
	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/power/ipmi/ipmisim"
)

// TestWebUIPowerCycle runs `shepherd run` with a static inventory whose
// machine has a real BMC (ipmi_sim) and the web UI's actions, and
// power-cycles the machine in Chromium as an operator would: from the
// machine page's Power panel, through the confirmation form, refused with a
// wrong token and carried out with the right one. History and the Power
// panel then show the cycle, and no page shows the BMC's password.
// Screenshots go to the artifacts directory.
func TestWebUIPowerCycle(t *testing.T) {
	t.Parallel()
	chromiumPath(t) // fail early, before starting anything
	db := bmdbtest.New(t)
	bmc := ipmisim.Start(t, ipmisim.Config{On: true})
	dir := t.TempDir()
	write := func(name, data string) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	const token = "e2e-power-operator-token-0123"
	inv := write("inventory.yaml", fmt.Sprintf("machines:\n  - id: m3\n    address: 192.0.2.3\n    bmc:\n      driver: ipmi\n"+
		"      address: %s\n      port: %d\n      username: %s\n      password_file: %s\n",
		bmc.Addr.Addr(), bmc.Addr.Port(), bmc.Username, write("bmc.pw", bmc.Password.Reveal()+"\n")))
	// The BMC's pace of a test, set as an operator would.
	cfg := write("static.yaml", "inventory: "+inv+"\nbmc_min_interval: 50ms\nbmc_settle: 10s\n")
	p := startShepherd(t, "run", "--components", "provisioner", "--database-url", db.URL, "--data-dir", filepath.Join(dir, "data"),
		"--provider", "static", "--provider-config", cfg, "--provisioner-period", "200ms", "--log-level", "info",
		"--web-listen", "127.0.0.1:0", "--web-actions", "--web-operator-token-file", write("operator-token", token+"\n"))
	base := "http://" + waitOutput(t, p, regexp.MustCompile(`msg="web UI listening".*? addr=(\S+)`), 60*time.Second)
	var id uuid.UUID
	bmdbtest.WaitFor(t, time.Minute, "the provisioner records m3", func(ctx context.Context) (bool, error) {
		p.exitedEarly(t)
		var err error
		id, err = uuid.Parse(bmdbtest.Scalar[string](t, db, "SELECT coalesce(max(machine_id::text), '') FROM machine_provided WHERE provider_id = 'm3'"))
		return err == nil, err
	})
	ctx := browser(t)
	shots := artifactsDir(t)
	bmcName := "ipmi://" + bmc.Username + "@" + bmc.Addr.String()

	do(t, ctx, "opening the machine page", chromedp.Navigate(base+"/machines/"+id.String()), chromedp.WaitVisible(chromedp.ID("power")))
	if got := eval[string](t, ctx, "BMC", `document.getElementById('power-bmc').textContent.trim()`); got != bmcName {
		t.Errorf("the Power panel names BMC %q, want %q", got, bmcName)
	}
	if got := eval[string](t, ctx, "power state", `document.getElementById('power-state').textContent.trim()`); got != "never checked" {
		t.Errorf("the power state before any check is %q", got)
	}
	screenshot(t, ctx, shots, "machine-power-never-checked")
	do(t, ctx, "opening the power cycle form",
		chromedp.Click(chromedp.CSS(`#power-actions a[href$="/power-cycle"]`)),
		chromedp.WaitVisible(chromedp.CSS(`form.action input[name="token"]`)))
	if text := eval[string](t, ctx, "confirmation page", `document.querySelector('main').innerText`); !strings.Contains(text, "without a shutdown, and boots again") ||
		!strings.Contains(text, bmcName) {
		t.Errorf("the confirmation page does not say what a cycle does and through which BMC:\n%s", text)
	}
	if cls := eval[string](t, ctx, "button", `document.querySelector('form.action button[type="submit"]').className`); cls != "danger" {
		t.Errorf("the power cycle's button has class %q, want danger", cls)
	}
	screenshot(t, ctx, shots, "confirm-power-cycle")
	do(t, ctx, "confirming with a wrong token",
		chromedp.SetValue(chromedp.CSS(`form.action input[name="reason"]`), "e2e: hung kernel"),
		chromedp.SetValue(chromedp.CSS(`form.action input[name="token"]`), "not-the-operator-token"),
		chromedp.Click(chromedp.CSS(`form.action button[type="submit"]`)),
		chromedp.WaitVisible(chromedp.ID("action-error")))
	if msg := eval[string](t, ctx, "error", `document.getElementById('action-error').textContent`); !strings.Contains(msg, "Wrong operator token") {
		t.Errorf("a wrong token shows %q", msg)
	}
	if h := bmdbtest.History(t, db, id); len(h) != 0 {
		t.Fatalf("a refused power cycle wrote history: %q", h)
	}

	do(t, ctx, "confirming with the operator token",
		chromedp.SetValue(chromedp.CSS(`form.action input[name="token"]`), token),
		chromedp.Click(chromedp.CSS(`form.action button[type="submit"]`)),
		chromedp.WaitVisible(chromedp.CSS(`p.notice`)))
	if loc := eval[string](t, ctx, "location", `location.pathname + location.search`); loc != "/machines/"+id.String()+"?done=power-cycle" {
		t.Errorf("after the action the browser is at %s", loc)
	}
	want := []string{"Power Started power cycle by an operator in the web UI: e2e: hung kernel", "Power Finished power cycle: found on, now on"}
	bmdbtest.WaitFor(t, time.Minute, "the power cycle is in history", func(context.Context) (bool, error) {
		p.exitedEarly(t)
		diff := cmp.Diff(want, bmdbtest.History(t, db, id))
		return diff == "", fmt.Errorf("history (-want +got):\n%s", diff)
	})
	calls, err := bmc.Calls()
	if err != nil {
		t.Fatal(err)
	}
	var sets []string
	for _, c := range calls {
		if strings.HasPrefix(c, "set power") {
			sets = append(sets, c)
		}
	}
	if diff := cmp.Diff([]string{"set power 0", "set power 1"}, sets); diff != "" {
		t.Errorf("power commands the BMC got (-want +got):\n%s", diff)
	}

	do(t, ctx, "reloading the machine page", chromedp.Navigate(base+"/machines/"+id.String()), chromedp.WaitVisible(chromedp.ID("history")))
	if got := eval[string](t, ctx, "power state", `document.getElementById('power-state').textContent.trim()`); !strings.HasPrefix(got, "on, checked ") {
		t.Errorf("the power state after the cycle is %q, want on, checked ...", got)
	}
	if events := eval[string](t, ctx, "history", `document.querySelector('#history tbody').innerText`); !strings.Contains(events, "power cycle: found on, now on") {
		t.Errorf("the machine's history does not show the cycle:\n%s", events)
	}
	screenshot(t, ctx, shots, "machine-after-power-cycle")
	html := eval[string](t, ctx, "page", `document.documentElement.outerHTML`)
	if strings.Contains(html, bmc.Password.Reveal()) || strings.Contains(p.output(), bmc.Password.Reveal()) {
		t.Error("the machine page or the log shows the BMC password")
	}
}
