package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/power"
	"github.com/shepherd/shepherd/power/ipmi/ipmisim"
)

// powerFixture is a BMDB with static machines, one of them (m3) with a real
// BMC: an ipmi_sim whose machine is on.
type powerFixture struct {
	db      *bmdbtest.DB
	bmc     *ipmisim.BMC
	m       uuid.UUID // static m3, whose bmc block names the ipmi_sim
	noBMC   uuid.UUID // static m4, without a bmc block
	other   uuid.UUID // lab m5: another provider's machine
	cfgPath string    // the static provider's configuration
	pwFile  string    // the BMC password file the inventory names
}

func newPowerFixture(t *testing.T) *powerFixture {
	t.Helper()
	f := &powerFixture{db: bmdbtest.New(t), bmc: ipmisim.Start(t, ipmisim.Config{On: true})}
	dir := t.TempDir()
	f.pwFile = filepath.Join(dir, "bmc.pw")
	inv := filepath.Join(dir, "inventory.yaml")
	f.cfgPath = filepath.Join(dir, "static.yaml")
	inventory := "machines:\n" +
		"  - id: m3\n    address: 192.0.2.3\n    bmc:\n      driver: ipmi\n      address: " + f.bmc.Addr.Addr().String() + "\n" +
		"      port: " + strconv.Itoa(int(f.bmc.Addr.Port())) + "\n      username: " + f.bmc.Username + "\n      password_file: " + f.pwFile + "\n" +
		"  - id: m4\n    address: 192.0.2.4\n"
	for name, data := range map[string]string{f.pwFile: f.bmc.Password.Reveal() + "\n", inv: inventory, f.cfgPath: "inventory: " + inv + "\n"} {
		if err := os.WriteFile(name, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	s := bmdbtest.Session(t, f.db, "setup", time.Minute)
	err := s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		for _, m := range []struct {
			id                   *uuid.UUID
			provider, providerID string
		}{{&f.m, "static", "m3"}, {&f.noBMC, "static", "m4"}, {&f.other, "lab", "m5"}} {
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

// power runs `shepherd machine power args... --provider static` with the
// fixture's configuration and in on standard input.
func (f *powerFixture) power(t *testing.T, in string, args ...string) (string, error) {
	t.Helper()
	args = append([]string{"machine", "power"}, args...)
	return runWithInput(t, in, append(args, "--provider", "static", "--provider-config", f.cfgPath, "--database-url", f.db.URL)...)
}

// state is the power state ipmi_sim records.
func (f *powerFixture) state(t *testing.T) power.State {
	t.Helper()
	s, err := f.bmc.Power()
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// calls are the power calls ipmi_sim got so far.
func (f *powerFixture) calls(t *testing.T) []string {
	t.Helper()
	c, err := f.bmc.Calls()
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// fastPower makes `machine power` pace BMC calls 10 ms apart instead of
// 5 s, for the rest of the test, through the static provider's
// configuration as an operator would (bmc_min_interval, bmc_settle).
func (f *powerFixture) fastPower(t *testing.T) {
	t.Helper()
	cfg, err := os.ReadFile(f.cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(f.cfgPath, append(cfg, "bmc_min_interval: 10ms\nbmc_settle: 5s\n"...), 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestMachinePowerStatus reads the power of a real BMC through the provider
// the flags build (the real registry), records it, and machine show says it.
func TestMachinePowerStatus(t *testing.T) {
	f := newPowerFixture(t)
	out, err := f.power(t, "", "status", f.m.String())
	bmcName := "ipmi://" + f.bmc.Username + "@" + f.bmc.Addr.String()
	if err != nil || !strings.Contains(out, "power on") || !strings.Contains(out, bmcName) || !strings.Contains(out, "static m3") {
		t.Fatalf("machine power status: %v\n%s", err, out)
	}
	if strings.Contains(out, f.bmc.Password.Reveal()) {
		t.Fatalf("machine power status printed the BMC password:\n%s", out)
	}
	// The machine by its provider id, bare and with its provider.
	for _, arg := range []string{"m3", "static/m3"} {
		if out, err := f.power(t, "", "status", arg); err != nil || !strings.Contains(out, "power on") || !strings.Contains(out, f.m.String()) {
			t.Errorf("machine power status %s: %v\n%s", arg, err, out)
		}
	}
	if n := historyCount(t, f.db); n != 0 {
		t.Errorf("status wrote %d history rows; it only reads", n)
	}
	out, err = run(t, "machine", "show", f.m.String(), "--database-url", f.db.URL)
	if err != nil || !strings.Contains(out, bmcName) || !strings.Contains(out, "on, checked") {
		t.Errorf("machine show after status: %v\n%s", err, out)
	}
	out, err = run(t, "machine", "show", f.m.String(), "-o", "json", "--database-url", f.db.URL)
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Power *struct {
			BMC, State, Error string
			StateAt           *time.Time `json:"state_at"`
		} `json:"power"`
	}
	if err := json.Unmarshal([]byte(out), &d); err != nil || d.Power == nil || d.Power.BMC != bmcName || d.Power.State != "on" ||
		d.Power.StateAt == nil || d.Power.Error != "" {
		t.Errorf("machine show -o json power = %+v (%v)\n%s", d.Power, err, out)
	}
	// A machine never checked says how to check it.
	out, err = run(t, "machine", "show", f.noBMC.String(), "--database-url", f.db.URL)
	if err != nil || !strings.Contains(out, "never checked (shepherd machine power status "+f.noBMC.String()+")") {
		t.Errorf("machine show of a machine never checked: %v\n%s", err, out)
	}
}

// TestMachinePowerActions: off asks first and does nothing unless told
// yes; off, on and cycle switch the real BMC under a Power hold whose
// history names the operator (Started) and the states (Finished).
func TestMachinePowerActions(t *testing.T) {
	f := newPowerFixture(t)
	f.fastPower(t)
	bmcName := "ipmi://" + f.bmc.Username + "@" + f.bmc.Addr.String()

	for _, answer := range []string{"", "n\n", "no\n"} {
		out, err := f.power(t, answer, "off", f.m.String())
		if err == nil || !strings.Contains(err.Error(), "not confirmed; nothing done") ||
			!strings.Contains(out, "Power off machine "+f.m.String()+" (static m3) through "+bmcName+"?") ||
			!strings.Contains(out, "The machine stops at once, without a shutdown.") {
			t.Errorf("off answered %q: %v\n%s", answer, err, out)
		}
	}
	if s := f.state(t); s != power.On {
		t.Fatalf("a refused off left the machine %s", s)
	}
	if c := f.calls(t); slices.ContainsFunc(c, func(s string) bool { return strings.HasPrefix(s, "set") }) {
		t.Errorf("a refused off sent %v", c)
	}
	if n := historyCount(t, f.db); n != 0 {
		t.Fatalf("a refused off wrote %d history rows", n)
	}

	operator := "by " + operator() + " with the shepherd CLI"
	want := []string{}
	for _, step := range []struct {
		answer string
		args   []string
		state  power.State
		cause  string
		// recovery is the Recovery history the action adds: a power off
		// holds the machine's recovery (or the ladder would power it back
		// on), the power on releases it.
		recovery string
	}{
		{"", []string{"off", "--yes"}, power.Off, "power off: found on, now off",
			"Recovery Quarantined powered off by an operator (" + operator + "); recovery resumes when it is powered on through Shepherd or its Recovery is reset"},
		{"", []string{"off", "-y"}, power.Off, "power off: found off, now off", ""},
		{"", []string{"on"}, power.On, "power on: found off, now on", "Recovery Reset power on " + operator},
		{"y\n", []string{"cycle"}, power.On, "power cycle: found on, now on", ""},
	} {
		// The machine's agent, as far as the BMDB knows, before each step:
		// a step that switches the power on (from off, or by a cycle) ends
		// it, so that the initializer takes the booted machine over.
		s := bmdbtest.Session(t, f.db, "initializer", time.Minute)
		if err := s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
			return tx.SetAgentStarted(ctx, f.m, make([]byte, 32))
		}); err != nil {
			t.Fatal(err)
		}
		before := len(f.calls(t))
		out, err := f.power(t, step.answer, append(step.args, f.m.String())...)
		if err != nil || !strings.Contains(out, step.cause) {
			t.Fatalf("machine power %v: %v\n%s", step.args, err, out)
		}
		if s := f.state(t); s != step.state {
			t.Errorf("after %v the BMC reports %s, want %s", step.args, s, step.state)
		}
		if strings.Contains(out, f.bmc.Password.Reveal()) {
			t.Errorf("machine power %v printed the BMC password:\n%s", step.args, out)
		}
		action := step.args[0]
		want = append(want, "Power Started power "+action+" "+operator, "Power Finished "+step.cause)
		if step.recovery != "" {
			want = append(want, step.recovery)
		}
		_, _, err = f.db.GetAgentStarted(t.Context(), f.m)
		if cleared := errors.Is(err, bmdb.ErrNotFound); cleared != (action != "off") {
			t.Errorf("after %v the machine's AgentStarted is cleared: %v (%v), want it cleared by on and cycle only", step.args, cleared, err)
		}
		b, err := f.db.GetBackoff(t.Context(), f.m, bmdb.ProcessRecovery)
		if held := err == nil && b.Quarantined; held != (step.state == power.Off) {
			t.Errorf("after %v the machine's Recovery is quarantined: %v (%+v, %v), want it held exactly while off", step.args, held, b, err)
		}
		if diff := cmp.Diff(want, bmdbtest.History(t, f.db, f.m)); diff != "" {
			t.Errorf("history after %v (-want +got):\n%s", step.args, diff)
		}
		var sets []string
		for _, c := range f.calls(t)[before:] {
			if strings.HasPrefix(c, "set power") {
				sets = append(sets, c)
			}
		}
		wantSets := map[string][]string{"off": {"set power 0"}, "on": {"set power 1"}, "cycle": {"set power 0", "set power 1"}}[action]
		if step.cause == "power off: found off, now off" {
			wantSets = []string{"set power 0"} // sent again: already off is no error
		}
		if diff := cmp.Diff(wantSets, sets); diff != "" {
			t.Errorf("power commands of %v (-want +got):\n%s", step.args, diff)
		}
		out, err = run(t, "machine", "show", f.m.String(), "--database-url", f.db.URL)
		if err != nil || !strings.Contains(out, string(step.state)+", checked") || strings.Contains(out, "Last check") {
			t.Errorf("machine show after %v: %v\n%s", step.args, err, out)
		}
	}
	if n := bmdbtest.Scalar[int64](t, f.db, "SELECT count(*) FROM work"); n != 0 {
		t.Errorf("%d work rows after the actions ended", n)
	}
}

// TestMachinePowerFailures: a refused password fails the action with class
// auth in the error and in history, and leaves the machine as it was; a
// machine another process holds is refused before the BMC is asked; a
// machine without a bmc block, of another provider, or not named right is
// refused with what to do.
func TestMachinePowerFailures(t *testing.T) {
	f := newPowerFixture(t)
	f.fastPower(t)
	if out, err := f.power(t, "", "status", f.m.String()); err != nil {
		t.Fatalf("status: %v\n%s", err, out)
	}

	// Another process holds the machine: nothing is done.
	s := bmdbtest.Session(t, f.db, "initializer", time.Minute)
	w, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("static"))
	if err != nil || w.MachineID != f.m {
		t.Fatalf("claiming %s for agent start: %v, %v", f.m, w, err)
	}
	calls := f.calls(t)
	out, err := f.power(t, "", "off", "--yes", f.m.String())
	if err == nil || !strings.Contains(err.Error(), "held by AgentStart") || !strings.Contains(err.Error(), "nothing done") {
		t.Errorf("off of a machine agent start holds: %v\n%s", err, out)
	}
	if got := f.calls(t); !slices.Equal(got, calls) || f.state(t) != power.On {
		t.Errorf("off of a busy machine reached the BMC: calls %v, then %v; state %s", calls, got, f.state(t))
	}
	if diff := cmp.Diff([]string{"AgentStart Started"}, bmdbtest.History(t, f.db, f.m)); diff != "" {
		t.Errorf("history after a refused off (-want +got):\n%s", diff)
	}
	if err := w.Cancel(t.Context()); err != nil {
		t.Fatal(err)
	}

	// A wrong password: class auth, history Failed, the machine untouched.
	if err := os.WriteFile(f.pwFile, []byte("wrong-password\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err = f.power(t, "", "off", "--yes", f.m.String())
	if err == nil || !strings.Contains(err.Error(), "class auth") {
		t.Fatalf("off with a wrong password: %v, want class auth\n%s", err, out)
	}
	if strings.Contains(out+err.Error(), "wrong-password") || strings.Contains(out+err.Error(), f.bmc.Password.Reveal()) {
		t.Errorf("the failure printed a password: %v\n%s", err, out)
	}
	if s := f.state(t); s != power.On {
		t.Errorf("a refused login left the machine %s", s)
	}
	h := bmdbtest.History(t, f.db, f.m)
	if len(h) != 4 || !strings.HasPrefix(h[2], "Power Started power off by ") ||
		!strings.HasPrefix(h[3], "Power Failed power off failed (class auth): ") {
		t.Errorf("history after the refused login: %q", h)
	}
	if _, err := f.db.GetBackoff(t.Context(), f.m, bmdb.ProcessPower); err == nil {
		t.Error("a failed power action backed the machine off")
	}
	out, err = run(t, "machine", "show", f.m.String(), "--database-url", f.db.URL)
	if err != nil || !strings.Contains(out, "on, checked") || !strings.Contains(out, "class auth") {
		t.Errorf("machine show after the refused login: %v\n%s", err, out)
	}
	out, err = f.power(t, "", "status", f.m.String())
	if err == nil || !strings.Contains(err.Error(), "class auth") {
		t.Errorf("status with a wrong password: %v\n%s", err, out)
	}

	// Refused before anything is done.
	unknown := uuid.NewString()
	for name, c := range map[string]struct {
		args []string
		want string
	}{
		"no bmc block":    {[]string{"status", f.noBMC.String()}, "machine " + f.noBMC.String() + " (static m4) has no BMC: add a bmc: block"},
		"no bmc, off":     {[]string{"off", "--yes", f.noBMC.String()}, "has no BMC: add a bmc: block"},
		"other provider":  {[]string{"on", f.other.String()}, `belongs to provider "lab"`},
		"unknown action":  {[]string{"reboot", f.m.String()}, `"reboot" is not a power action: use status, on, off, cycle`},
		"unknown id":      {[]string{"on", "m9"}, `no machine has the id or provider id "m9"`},
		"unknown machine": {[]string{"on", unknown}, "machine " + unknown + " does not exist"},
		"no timeout":      {[]string{"on", f.m.String(), "--timeout", "0s"}, "--timeout must be positive"},
	} {
		before := historyCount(t, f.db)
		out, err := f.power(t, "", c.args...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error saying %q\n%s", name, err, c.want, out)
		}
		if n := historyCount(t, f.db); n != before {
			t.Errorf("%s wrote %d history rows", name, n-before)
		}
	}
	if s := f.state(t); s != power.On {
		t.Errorf("the refusals left the machine %s", s)
	}
	out, err = runWithInput(t, "", "machine", "power", "on", f.m.String(), "--database-url", f.db.URL)
	if err == nil || !strings.Contains(err.Error(), "--provider is required") {
		t.Errorf("power without --provider: %v\n%s", err, out)
	}
	out, err = runWithInput(t, "", "machine", "power", "on", f.m.String(), "--provider", "nope", "--database-url", f.db.URL)
	if err == nil || !strings.Contains(err.Error(), `unknown provider "nope"`) {
		t.Errorf("power with an unknown provider: %v\n%s", err, out)
	}
}

// TestMachinePowerFromTheWebUI runs `shepherd run` with the static provider
// and the web UI's actions, and power-cycles the fixture's machine from its
// page: the web UI reaches the BMC through the provider the process runs
// (the same paced controller as its control loops), and does what `machine
// power cycle` does. A machine of a provider the process does not run gets
// no power actions.
func TestMachinePowerFromTheWebUI(t *testing.T) {
	f := newPowerFixture(t)
	f.fastPower(t)
	dir := t.TempDir()
	const token = "web-power-operator-token-0123"
	tokenFile := filepath.Join(dir, "operator-token")
	if err := os.WriteFile(tokenFile, []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	webAddr := freeAddr(t)
	cmd := startCommand(t, "run", "--components=provisioner", "--database-url", f.db.URL, "--data-dir", dir,
		"--provider", "static", "--provider-config", f.cfgPath, "--log-level", "error",
		"--web-listen", webAddr, "--web-actions", "--web-operator-token-file", tokenFile)
	base := "http://" + webAddr
	client := &http.Client{
		Timeout:       30 * time.Second,
		CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
	}
	get := func(path string) string {
		t.Helper()
		resp, err := client.Get(base + path)
		if err != nil {
			t.Fatalf("GET %s: %v", path, err)
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s = %s, %v:\n%s", path, resp.Status, err, body)
		}
		return string(body)
	}
	bmcName := "ipmi://" + f.bmc.Username + "@" + f.bmc.Addr.String()
	var page string
	bmdbtest.WaitFor(t, 30*time.Second, "the web UI serves the machine page", func(ctx context.Context) (bool, error) {
		cmd.running(t)
		resp, err := client.Get(base + "/machines/" + f.m.String())
		if err != nil {
			return false, err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		page = string(body)
		return err == nil && resp.StatusCode == http.StatusOK, err
	})
	cyclePath := "/machines/" + f.m.String() + "/power-cycle"
	if !strings.Contains(page, bmcName) || !strings.Contains(page, `href="`+cyclePath+`"`) {
		t.Errorf("the machine page does not show the BMC and offer a power cycle:\n%s", page)
	}
	if other := get("/machines/" + f.other.String()); !strings.Contains(other, "no out-of-band power control for provider lab") ||
		strings.Contains(other, "/power-") {
		t.Errorf("the page of a machine of provider lab, which the process does not run, offers power:\n%s", other)
	}

	csrf := regexp.MustCompile(`name="csrf" value="([^"]+)"`).FindStringSubmatch(get(cyclePath))
	if csrf == nil {
		t.Fatal("the power cycle's confirmation page has no CSRF token")
	}
	resp, err := client.PostForm(base+cyclePath, url.Values{"csrf": {csrf[1]}, "token": {token}, "reason": {"hung"}})
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/machines/"+f.m.String()+"?done=power-cycle" {
		t.Fatalf("POST %s = %s (Location %q), want 303 to the machine page", cyclePath, resp.Status, resp.Header.Get("Location"))
	}
	want := []string{"Power Started power cycle by an operator in the web UI: hung", "Power Finished power cycle: found on, now on"}
	bmdbtest.WaitFor(t, time.Minute, "the power cycle is in history", func(context.Context) (bool, error) {
		cmd.running(t)
		diff := cmp.Diff(want, bmdbtest.History(t, f.db, f.m))
		return diff == "", fmt.Errorf("history (-want +got):\n%s", diff)
	})
	var sets []string
	for _, c := range f.calls(t) {
		if strings.HasPrefix(c, "set power") {
			sets = append(sets, c)
		}
	}
	if diff := cmp.Diff([]string{"set power 0", "set power 1"}, sets); diff != "" {
		t.Errorf("power commands of the cycle (-want +got):\n%s", diff)
	}
	page = get("/machines/" + f.m.String())
	if !strings.Contains(page, `id="power-state">on, checked`) || strings.Contains(page, f.bmc.Password.Reveal()) {
		t.Errorf("the machine page after the cycle: want on, checked, and no password:\n%s", page)
	}
	cmd.stop(t)
}
