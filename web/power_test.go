package web_test

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/ladder"
	"github.com/shepherd/shepherd/power"
	"github.com/shepherd/shepherd/power/ipmi/ipmisim"
	"github.com/shepherd/shepherd/provider"
	"github.com/shepherd/shepherd/provider/static"
	"github.com/shepherd/shepherd/web"
)

// wrongBMCPassword is the password the inventory gives one machine's BMC,
// which the BMC refuses. Like the right one, no page may show it.
const wrongBMCPassword = "not-the-bmc-pw-42"

// powerFleet is a BMDB with static machines and the static provider that
// knows them, built from a real inventory whose BMC is a real ipmi_sim
// (its machine is on).
type powerFleet struct {
	db      *bmdbtest.DB
	bmc     *ipmisim.BMC
	p       *static.Provider
	bmcName string    // the BMC as the provider names it
	m       uuid.UUID // static m3, whose bmc block names the ipmi_sim
	noBMC   uuid.UUID // static m4, without a bmc block
	badPW   uuid.UUID // static m5: the same BMC, with a wrong password
	other   uuid.UUID // lab m9: a provider this process does not run
}

func newPowerFleet(t *testing.T) *powerFleet {
	t.Helper()
	f := &powerFleet{db: bmdbtest.New(t), bmc: ipmisim.Start(t, ipmisim.Config{On: true})}
	f.bmcName = "ipmi://" + f.bmc.Username + "@" + f.bmc.Addr.String()
	dir := t.TempDir()
	write := func(name, data string) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	bmcBlock := func(pwFile string) string {
		return fmt.Sprintf("    bmc:\n      driver: ipmi\n      address: %s\n      port: %d\n      username: %s\n      password_file: %s\n",
			f.bmc.Addr.Addr(), f.bmc.Addr.Port(), f.bmc.Username, pwFile)
	}
	inv := write("inventory.yaml", "machines:\n"+
		"  - id: m3\n    address: 192.0.2.3\n"+bmcBlock(write("bmc.pw", f.bmc.Password.Reveal()+"\n"))+
		"  - id: m4\n    address: 192.0.2.4\n"+
		"  - id: m5\n    address: 192.0.2.5\n"+bmcBlock(write("wrong.pw", wrongBMCPassword+"\n")))
	var err error
	// The BMC's pace of a test, as `shepherd machine power`'s tests set it
	// through the provider's configuration (bmc_min_interval, bmc_settle).
	f.p, err = static.New(static.Config{Inventory: inv, Power: power.Config{MinInterval: 10 * time.Millisecond, Settle: 5 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	s := bmdbtest.Session(t, f.db, "setup", time.Minute)
	err = s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		for _, m := range []struct {
			id                   *uuid.UUID
			provider, providerID string
		}{{&f.m, "static", "m3"}, {&f.noBMC, "static", "m4"}, {&f.badPW, "static", "m5"}, {&f.other, "lab", "m9"}} {
			var err error
			if *m.id, err = tx.AddMachine(ctx, bmdb.Provided{Provider: m.provider, ProviderID: m.providerID, Status: bmdb.ProviderStatusRunning}); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// power is web.Config.Power of a process that runs the static provider.
func (f *powerFleet) power(name string) provider.PowerController {
	if name == f.p.Name() {
		return f.p
	}
	return nil
}

// setCalls are the power commands ipmi_sim got so far.
func (f *powerFleet) setCalls(t *testing.T) []string {
	t.Helper()
	calls, err := f.bmc.Calls()
	if err != nil {
		t.Fatal(err)
	}
	var sets []string
	for _, c := range calls {
		if strings.HasPrefix(c, "set ") {
			sets = append(sets, c)
		}
	}
	return sets
}

// noPasswords fails the test if any of the texts holds a BMC password.
func (f *powerFleet) noPasswords(t *testing.T, what string, texts ...string) {
	t.Helper()
	for i, text := range texts {
		for _, pw := range []string{f.bmc.Password.Reveal(), wrongBMCPassword} {
			if strings.Contains(text, pw) {
				t.Errorf("%s %d shows a BMC password", what, i)
			}
		}
	}
}

// powerLinks matches the links to the power actions' confirmation pages.
var powerLinks = regexp.MustCompile(`href="/machines/[0-9a-f-]+/power-(status|on|off|cycle)"`)

// TestMachinePagePower: the machine page shows the machine's BMC as its
// provider names it, never a password, and its last known power state
// with the last check's error; it offers the power actions only with
// actions on and a BMC to reach, and otherwise says why power is not
// available.
func TestMachinePagePower(t *testing.T) {
	t.Parallel()
	f := newPowerFleet(t)
	s := newServer(t, f.db.DB, web.Config{Actions: true, OperatorToken: mustToken(t), Power: f.power})
	ro := newServer(t, f.db.DB, web.Config{Power: f.power})
	var bodies []string
	get := func(s *server, path string) string {
		body := s.get(t, path)
		bodies = append(bodies, body)
		return body
	}

	page := get(s, "/machines/"+f.m.String())
	for _, want := range []string{`id="power-bmc">` + f.bmcName + "<", `id="power-state">never checked<`} {
		if !strings.Contains(page, want) {
			t.Errorf("page of %s lacks %q", f.m, want)
		}
	}
	var offered []string
	for _, l := range powerLinks.FindAllStringSubmatch(page, -1) {
		offered = append(offered, l[1])
	}
	if diff := cmp.Diff([]string{"status", "on", "off", "cycle"}, offered); diff != "" {
		t.Errorf("power actions offered (-want +got):\n%s", diff)
	}
	if !strings.Contains(page, `href="/machines/`+f.m.String()+`/power-cycle" class="danger"`) {
		t.Error("the power cycle is not marked dangerous")
	}
	if page := get(ro, "/machines/"+f.m.String()); !strings.Contains(page, f.bmcName) || powerLinks.MatchString(page) {
		t.Errorf("read-only page: shows the BMC %v, offers power actions %q", strings.Contains(page, f.bmcName), powerLinks.FindString(page))
	}

	// Where power cannot reach, the page says why and offers nothing.
	for id, why := range map[uuid.UUID]string{
		f.noBMC: "Power is not available: machine " + f.noBMC.String() + " (static m4) has no BMC: add a bmc: block",
		f.other: "Power is not available: this process runs no out-of-band power control for provider lab.",
	} {
		for _, s := range []*server{s, ro} {
			page := get(s, "/machines/"+id.String())
			if !strings.Contains(page, why) || powerLinks.MatchString(page) {
				t.Errorf("page of %s: want %q and no power actions:\n%s", id, why, page)
			}
		}
		resp, body := s.do(t, http.MethodGet, "/machines/"+id.String()+"/power-cycle", nil)
		if resp.StatusCode != http.StatusNotFound || !strings.Contains(body, "has no BMC") && !strings.Contains(body, "provider lab") {
			t.Errorf("confirmation page of a power cycle of %s: %s, want 404 saying why:\n%s", id, resp.Status, body)
		}
	}
	noPower := newServer(t, f.db.DB, web.Config{Actions: true, OperatorToken: mustToken(t)})
	if page := get(noPower, "/machines/"+f.m.String()); !strings.Contains(page, "no out-of-band power control for provider static") ||
		powerLinks.MatchString(page) {
		t.Errorf("page without Config.Power: want power not available, no actions:\n%s", page)
	}

	// The last known state, and the last check's failure.
	ctx := t.Context()
	if err := f.db.RecordPowerState(ctx, f.m, bmdb.PowerReading{BMC: f.bmcName, State: bmdb.PowerOn}); err != nil {
		t.Fatal(err)
	}
	if page := get(s, "/machines/"+f.m.String()); !regexp.MustCompile(`id="power-state">on, checked (0s|[1-9]\d?s) ago`).MatchString(page) ||
		strings.Contains(page, `id="power-error"`) {
		t.Errorf("page after a check found the machine on:\n%s", page)
	}
	err := f.db.RecordPowerState(ctx, f.m, bmdb.PowerReading{BMC: f.bmcName, ErrorClass: "unreachable", Error: "no answer from <b>the BMC</b>"})
	if err != nil {
		t.Fatal(err)
	}
	page = get(s, "/machines/"+f.m.String())
	for _, want := range []string{`id="power-state">on, checked`, "class unreachable: ", "no answer from &lt;b&gt;the BMC&lt;/b&gt;"} {
		if !strings.Contains(page, want) {
			t.Errorf("page after a failed check lacks %q:\n%s", want, page)
		}
	}
	f.noPasswords(t, "page", bodies...)
}

// TestRecoveryLadderOnMachinePage: the machine page lists the rungs of the
// recovery ladder taken since the agent's last heartbeat, with their time
// and result, and nothing for a machine without any.
func TestRecoveryLadderOnMachinePage(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	ctx := t.Context()
	s := bmdbtest.Session(t, f.db, "recoverer", time.Minute)
	var silent uuid.UUID
	err := s.Transact(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
		var err error
		if silent, err = tx.AddMachine(ctx, bmdb.Provided{Provider: "ladder", ProviderID: "l1", Status: bmdb.ProviderStatusRunning}); err != nil {
			return err
		}
		return tx.SetAgentStarted(ctx, silent, make([]byte, 32))
	})
	if err != nil {
		t.Fatal(err)
	}
	// Silent once a millisecond passed without a first heartbeat.
	cands := bmdb.RecoveryCandidates("ladder", time.Millisecond, time.Millisecond)
	var w *bmdb.Work
	bmdbtest.WaitFor(t, 10*time.Second, "the silent machine is a recovery candidate", func(ctx context.Context) (bool, error) {
		w, err = s.Work(ctx, bmdb.ProcessRecovery, cands)
		return err == nil, err
	})
	req := bmdb.RebootRequest{Provider: "ladder", MachineID: silent, Candidates: cands, Window: time.Hour, Max: 10,
		Ladder: []ladder.Rung{ladder.Agent, ladder.Reboot, ladder.Power}}
	a, err := s.AdmitReboot(ctx, req)
	if err != nil || a.Decision != bmdb.RebootAdmitted || a.Rung != ladder.Agent {
		t.Fatalf("admitting the first rung: %+v, %v", a, err)
	}
	if err := s.RebootFailed(ctx, a, false, "ssh: connect: <connection refused>"); err != nil {
		t.Fatal(err)
	}
	req.After = ladder.Agent
	if a, err = s.AdmitReboot(ctx, req); err != nil || a.Decision != bmdb.RebootAdmitted || a.Rung != ladder.Reboot {
		t.Fatalf("admitting the second rung: %+v, %v", a, err)
	}
	if err := w.Finish(ctx, nil); err != nil {
		t.Fatal(err)
	}

	srv := newServer(t, f.db.DB, web.Config{})
	page := srv.get(t, "/machines/"+silent.String())
	rows := regexp.MustCompile(`(?s)<table class="grid" id="ladder">.*?<tbody>(.*?)</tbody>`).FindStringSubmatch(page)
	if rows == nil {
		t.Fatalf("the page of a machine two rungs up the ladder shows no ladder:\n%s", page)
	}
	tr := regexp.MustCompile(`(?s)<tr><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td></tr>`).FindAllStringSubmatch(rows[1], -1)
	tags := regexp.MustCompile(`<[^>]+>`)
	var got []string
	for _, r := range tr {
		if !strings.Contains(r[1], " ago)") {
			t.Errorf("ladder row without its time: %q", r[1])
		}
		got = append(got, tags.ReplaceAllString(r[2]+" | "+r[3], ""))
	}
	want := []string{
		"agent (restart the agent over SSH) | failed without reaching the machine: ssh: connect: &lt;connection refused&gt;",
		"reboot (in-band reboot) | done",
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("ladder rows (-want +got):\n%s", diff)
	}
	if page := srv.get(t, "/machines/"+f.healthy[0].String()); strings.Contains(page, "Recovery ladder") || strings.Contains(page, `id="ladder"`) {
		t.Error("the page of a healthy machine shows a recovery ladder")
	}
}

// TestPowerActionRefused: a power action is not offered without
// --web-actions, and is refused, before the BMC is asked and without
// history, without the operator token, with a missing, forged or another
// form's CSRF token, from another site, and while another process holds
// the machine, which the refusal names.
func TestPowerActionRefused(t *testing.T) {
	t.Parallel()
	f := newPowerFleet(t)
	path := "/machines/" + f.m.String() + "/power-cycle"

	ro := newServer(t, f.db.DB, web.Config{Power: f.power})
	if resp, _ := ro.do(t, http.MethodGet, path, nil); resp.StatusCode != http.StatusNotFound {
		t.Errorf("read-only: GET %s = %s, want 404", path, resp.Status)
	}
	if resp, _ := ro.do(t, http.MethodPost, path, url.Values{"token": {operatorToken}}); resp.StatusCode != http.StatusMethodNotAllowed {
		t.Errorf("read-only: POST %s = %s, want 405", path, resp.Status)
	}

	s := newServer(t, f.db.DB, web.Config{Actions: true, OperatorToken: mustToken(t), Power: f.power})
	confirm := s.get(t, path)
	for _, want := range []string{"The machine stops at once, without a shutdown, and boots again.", f.bmcName, `<button type="submit" class="danger">Power cycle</button>`} {
		if !strings.Contains(confirm, want) {
			t.Errorf("the power cycle's confirmation page lacks %q", want)
		}
	}
	csrf := s.confirmForm(t, path)
	statusCSRF := s.confirmForm(t, "/machines/"+f.m.String()+"/power-status")
	otherCSRF := s.confirmForm(t, "/machines/"+f.badPW.String()+"/power-cycle")
	resetCSRF := s.confirmForm(t, "/machines/"+f.m.String()+"/reset?process=Power")
	sets := f.setCalls(t)
	for _, tt := range []struct {
		name   string
		form   url.Values
		header []string
		msg    string
	}{
		{"no token", url.Values{"csrf": {csrf}}, nil, "Wrong operator token."},
		{"wrong token", url.Values{"csrf": {csrf}, "token": {operatorToken + "x"}}, nil, "Wrong operator token."},
		{"no CSRF token", url.Values{"token": {operatorToken}}, nil, "This form is stale"},
		{"forged CSRF token", url.Values{"csrf": {strings.Repeat("A", len(csrf))}, "token": {operatorToken}}, nil, "This form is stale"},
		{"CSRF token of the status action", url.Values{"csrf": {statusCSRF}, "token": {operatorToken}}, nil, "This form is stale"},
		{"CSRF token of a reset", url.Values{"csrf": {resetCSRF}, "token": {operatorToken}}, nil, "This form is stale"},
		{"CSRF token of another machine", url.Values{"csrf": {otherCSRF}, "token": {operatorToken}}, nil, "This form is stale"},
		{"cross-site request", url.Values{"csrf": {csrf}, "token": {operatorToken}}, []string{"Sec-Fetch-Site", "cross-site"}, "cross-origin request refused"},
	} {
		resp, body := s.do(t, http.MethodPost, path, tt.form, tt.header...)
		if resp.StatusCode != http.StatusForbidden || !strings.Contains(body, tt.msg) {
			t.Errorf("%s: POST = %s, want 403 saying %q:\n%s", tt.name, resp.Status, tt.msg, body)
		}
		if strings.Contains(body, operatorToken) {
			t.Errorf("%s: the refusal shows the operator token", tt.name)
		}
	}

	// Another process holds the machine: refused at once, saying by whom.
	hold, err := bmdbtest.Session(t, f.db, "recoverer", time.Minute).Hold(t.Context(), bmdb.ProcessRecovery, f.m, "recovering")
	if err != nil {
		t.Fatal(err)
	}
	resp, body := s.do(t, http.MethodPost, path, url.Values{"csrf": {csrf}, "token": {operatorToken}})
	if resp.StatusCode != http.StatusConflict || !strings.Contains(body, "Nothing done: ") || !strings.Contains(body, "is held by Recovery") ||
		!strings.Contains(body, `id="action-error"`) {
		t.Errorf("power cycle of a machine Recovery holds: POST = %s, want 409 naming the holder on the form:\n%s", resp.Status, body)
	}
	if diff := cmp.Diff([]string{"Recovery Started recovering"}, bmdbtest.History(t, f.db, f.m)); diff != "" {
		t.Errorf("history after the refusals (-want +got):\n%s", diff)
	}
	if got := f.setCalls(t); !slices.Equal(got, sets) {
		t.Errorf("the refusals reached the BMC: power commands %q, then %q", sets, got)
	}
	if s, err := f.bmc.Power(); err != nil || s != power.On {
		t.Errorf("after the refusals the BMC reports %s (%v), want on", s, err)
	}
	if err := hold.Cancel(t.Context()); err != nil {
		t.Fatal(err)
	}
	if logs := s.log.String(); !strings.Contains(logs, "refused a power action") || !strings.Contains(logs, "machine_id="+f.m.String()) {
		t.Errorf("the log does not record the refused power action with the machine id:\n%s", logs)
	}
}

// TestPowerActions: a power cycle from the web UI does what `shepherd
// machine power cycle` does: it holds the machine for Power (history
// Started, naming the web UI and the reason), cycles the real BMC, records
// the state, and ends the hold (history Finished with what it found); the
// machine page then shows the state and the history. A status check only
// records the state. A BMC that refuses the password fails the action with
// class auth, which the page shows. No page shows a BMC password.
func TestPowerActions(t *testing.T) {
	t.Parallel()
	f := newPowerFleet(t)
	s := newServer(t, f.db.DB, web.Config{Actions: true, OperatorToken: mustToken(t), Power: f.power})
	ctx := t.Context()
	var bodies []string
	post := func(id uuid.UUID, act string, form url.Values) {
		t.Helper()
		path := "/machines/" + id.String() + "/" + act
		form.Set("csrf", s.confirmForm(t, path))
		form.Set("token", operatorToken)
		resp, body := s.do(t, http.MethodPost, path, form)
		bodies = append(bodies, body)
		if want := "/machines/" + id.String() + "?done=" + act; resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != want {
			t.Fatalf("POST %s = %s (Location %q), want 303 to %s:\n%s", path, resp.Status, resp.Header.Get("Location"), want, body)
		}
	}
	waitHistory := func(id uuid.UUID, want []string) {
		t.Helper()
		bmdbtest.WaitFor(t, 60*time.Second, "history of "+id.String(), func(context.Context) (bool, error) {
			if diff := cmp.Diff(want, bmdbtest.History(t, f.db, id)); diff != "" {
				return false, fmt.Errorf("(-want +got):\n%s", diff)
			}
			return true, nil
		})
	}

	post(f.m, "power-cycle", url.Values{"reason": {"kernel  hung"}})
	waitHistory(f.m, []string{
		"Power Started power cycle by an operator in the web UI: kernel hung",
		"Power Finished power cycle: found on, now on",
	})
	if diff := cmp.Diff([]string{"set power 0", "set power 1"}, f.setCalls(t)); diff != "" {
		t.Errorf("power commands of the cycle (-want +got):\n%s", diff)
	}
	if n := bmdbtest.Scalar[int64](t, f.db, "SELECT count(*) FROM work"); n != 0 {
		t.Errorf("%d work rows after the cycle ended", n)
	}
	if n := bmdbtest.Scalar[int64](t, f.db, "SELECT count(*) FROM sessions WHERE component = 'web' AND closed_at IS NULL"); n != 0 {
		t.Errorf("%d sessions of the web UI still open after the cycle", n)
	}
	page := s.get(t, "/machines/"+f.m.String()+"?done=power-cycle")
	bodies = append(bodies, page)
	for _, want := range []string{"Power cycle started", `id="power-state">on, checked`, "power cycle: found on, now on",
		"power cycle by an operator in the web UI: kernel hung"} {
		if !strings.Contains(page, want) {
			t.Errorf("the machine page after the cycle lacks %q", want)
		}
	}
	if strings.Contains(page, `id="power-error"`) {
		t.Error("the machine page after the cycle shows a failed check")
	}

	// Status reads and records, and writes no history.
	before, err := f.db.GetMachine(ctx, f.m)
	if err != nil {
		t.Fatal(err)
	}
	post(f.m, "power-status", url.Values{})
	bmdbtest.WaitFor(t, 30*time.Second, "the status is recorded", func(ctx context.Context) (bool, error) {
		d, err := f.db.GetMachine(ctx, f.m)
		if err != nil {
			return false, err
		}
		return d.Power.CheckedAt.After(before.Power.CheckedAt), fmt.Errorf("power %+v", d.Power)
	})
	if h := bmdbtest.History(t, f.db, f.m); len(h) != 2 {
		t.Errorf("status wrote history: %q", h)
	}

	// A refused password: class auth in history and on the page.
	post(f.badPW, "power-off", url.Values{})
	bmdbtest.WaitFor(t, 60*time.Second, "the refused login is in history", func(context.Context) (bool, error) {
		h := bmdbtest.History(t, f.db, f.badPW)
		return len(h) == 2 && strings.HasPrefix(h[1], "Power Failed power off failed (class auth): "), fmt.Errorf("history %q", h)
	})
	if st, err := f.bmc.Power(); err != nil || st != power.On {
		t.Errorf("after the refused login the BMC reports %s (%v), want on", st, err)
	}
	page = s.get(t, "/machines/"+f.badPW.String())
	bodies = append(bodies, page)
	for _, want := range []string{`id="power-state">unknown<`, "class auth: ", "power off failed (class auth)"} {
		if !strings.Contains(page, want) {
			t.Errorf("the machine page after the refused login lacks %q", want)
		}
	}
	for _, path := range []string{"/machines/" + f.m.String(), "/machines/" + f.badPW.String() + "/power-cycle", "/machines/" + f.m.String() + "/power-off"} {
		bodies = append(bodies, s.get(t, path))
	}
	f.noPasswords(t, "response", bodies...)
	f.noPasswords(t, "log", s.log.String())
	if logs := s.log.String(); !strings.Contains(logs, "power action done") || !strings.Contains(logs, "power action failed") {
		t.Errorf("the log does not record the actions' results:\n%s", logs)
	}
}
