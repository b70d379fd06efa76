package main

import (
	"bytes"
	"fmt"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/provider/equinix/fakemetal"
	"github.com/shepherd/shepherd/provider/equinix/metal"
)

// runIn runs the shepherd command with stdin.
func runIn(t *testing.T, stdin string, args ...string) (string, error) {
	t.Helper()
	cmd := newRootCommand()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetIn(strings.NewReader(stdin))
	cmd.SetArgs(args)
	err := cmd.ExecuteContext(t.Context())
	return out.String(), err
}

// cliToken is the API token of the CLI tests' fake account.
const cliToken = "cli-token-never-printed"

// equinixCLIFixture is a fake Metal account (project "ours") behind real
// HTTP and an equinix provider configuration for it.
type equinixCLIFixture struct {
	fake   *fakemetal.Server
	apiURL string // the API's base URL
	config string // the configuration file
	all    strings.Builder
}

// newEquinixCLIFixture starts a fake account with cfg (its token set) and
// writes a configuration for it, with more YAML appended.
func newEquinixCLIFixture(t *testing.T, cfg fakemetal.Config, more string) *equinixCLIFixture {
	t.Helper()
	cfg.Token = cliToken
	fake, err := fakemetal.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	fake.AddProject("ours")
	srv := httptest.NewServer(fake)
	t.Cleanup(srv.Close)
	f := &equinixCLIFixture{fake: fake, apiURL: srv.URL + "/metal/v1"}
	dir := t.TempDir()
	tokenFile := filepath.Join(dir, "token")
	f.config = filepath.Join(dir, "equinix.yaml")
	if err := os.WriteFile(tokenFile, []byte(cliToken), 0o600); err != nil {
		t.Fatal(err)
	}
	yaml := fmt.Sprintf("project: ours\napi_url: %s\ntoken_file: %s\noperating_system: ubuntu_22_04\n%s", f.apiURL, tokenFile, more)
	if err := os.WriteFile(f.config, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if strings.Contains(f.all.String(), cliToken) {
			t.Error("the API token appears in the CLI's output")
		}
	})
	return f
}

// cli runs `shepherd equinix --config FILE args...` with stdin, and keeps
// its output and error to look for the token in.
func (f *equinixCLIFixture) cli(t *testing.T, stdin string, args ...string) (string, error) {
	t.Helper()
	out, err := runIn(t, stdin, append([]string{"equinix", "--config", f.config}, args...)...)
	f.all.WriteString(out)
	if err != nil {
		f.all.WriteString(err.Error())
	}
	return out, err
}

func TestEquinixCLI(t *testing.T) {
	t.Parallel()
	f := newEquinixCLIFixture(t, fakemetal.Config{Budget: 50, Burst: 10}, "")
	fake := f.fake
	fake.AddProject("spare")
	res := fake.AddReservations("ours", "c3.small.x86", "fr2", "fr", 2)
	fake.AddReservations("spare", "c3.small.x86", "fr2", "fr", 3)
	dev := fake.AddDevice("ours", fakemetal.DeviceSpec{Hostname: "shepherd-a1", State: "active", ReservationID: res[0]})
	fake.AddDevice("ours", fakemetal.DeviceSpec{Hostname: "db-1", State: "active"})
	cli := func(stdin string, args ...string) (string, error) {
		t.Helper()
		return f.cli(t, stdin, args...)
	}

	out, err := cli("", "devices", "list")
	if err != nil || !strings.Contains(out, "shepherd-a1") || !strings.Contains(out, "db-1") {
		t.Fatalf("devices list: %v\n%s", err, out)
	}
	// Columns ID, HOSTNAME, STATE, OURS, …; matched by column, since a
	// random UUID can contain a hostname ("…-92db-1b93-…").
	ours := map[string]string{}
	for _, line := range strings.Split(out, "\n")[1:] {
		if f := strings.Fields(line); len(f) >= 4 {
			ours[f[1]] = f[3]
		}
	}
	if ours["db-1"] != "false" || ours["shepherd-a1"] != "true" {
		t.Errorf("devices list marks ownership %v, want db-1 false and shepherd-a1 true:\n%s", ours, out)
	}
	out, err = cli("", "reservations", "list")
	if err != nil || !strings.Contains(out, res[0]) || !strings.Contains(out, dev) || !strings.Contains(out, res[1]) {
		t.Fatalf("reservations list: %v\n%s", err, out)
	}

	// Destructive commands ask; "n" changes nothing.
	if _, err := cli("n\n", "devices", "reboot", dev); err == nil || !strings.Contains(err.Error(), "not confirmed") {
		t.Errorf("reboot answered n: %v", err)
	}
	if n := fake.Reboots(dev); n != 0 {
		t.Errorf("a refused reboot was sent (%d)", n)
	}
	if out, err := cli("y\n", "devices", "reboot", dev); err != nil || !strings.Contains(out, "[1/1] reboot "+dev+": ok") {
		t.Errorf("reboot answered y: %v\n%s", err, out)
	}
	if n := fake.Reboots(dev); n != 1 {
		t.Errorf("reboots after a confirmed reboot: %d, want 1", n)
	}
	// A bulk action goes on past a failure and says which failed.
	out, err = cli("", "--yes", "devices", "delete", "no-such-device", dev)
	if err == nil || !strings.Contains(out, "[1/2] delete no-such-device: FAILED") || !strings.Contains(out, "[2/2] delete "+dev+": ok") {
		t.Errorf("bulk delete: %v\n%s", err, out)
	}
	if _, ok := fake.Device(dev); ok {
		t.Error("the device still exists after delete")
	}

	// yoink moves the free reservations of another project into ours.
	out, err = cli("", "yoink", "--from", "spare", "--count", "2", "--yes")
	if err != nil || strings.Count(out, ": ok") != 2 {
		t.Fatalf("yoink: %v\n%s", err, out)
	}
	if got := len(fake.Reservations("ours")); got != 4 {
		t.Errorf("our project has %d reservations after yoinking 2, want 4", got)
	}
	if _, err := cli("", "reservations", "move", res[1]); err == nil || !strings.Contains(err.Error(), "--to is required") {
		t.Errorf("move without --to: %v", err)
	}
	if _, err := cli("", "--yes", "reservations", "move", res[1], "--to", "spare"); err != nil {
		t.Errorf("move: %v", err)
	}
	if got := len(fake.Reservations("spare")); got != 2 {
		t.Errorf("the spare project has %d reservations, want 2", got)
	}

	if v := fake.Check(); len(v) > 0 {
		t.Errorf("the CLI broke the API's rate limit: %v", v)
	}
	if _, err := runIn(t, "", "equinix", "devices", "list"); err == nil || !strings.Contains(err.Error(), "--config is required") {
		t.Errorf("without --config: %v", err)
	}
}

// TestEquinixCLIDeleteForeign: `devices delete` refuses devices that are
// not Shepherd's (hostname without the provider's prefix), also with --yes,
// and deletes nothing then; --include-foreign deletes them only once the
// operator has typed each one's hostname.
func TestEquinixCLIDeleteForeign(t *testing.T) {
	t.Parallel()
	f := newEquinixCLIFixture(t, fakemetal.Config{}, "")
	fake := f.fake
	ours := fake.AddDevice("ours", fakemetal.DeviceSpec{Hostname: "shepherd-a1", State: "active"})
	db1 := fake.AddDevice("ours", fakemetal.DeviceSpec{Hostname: "db-1", State: "active"})
	db2 := fake.AddDevice("ours", fakemetal.DeviceSpec{Hostname: "db-2", State: "active"})
	cli := func(stdin string, args ...string) (string, error) {
		t.Helper()
		return f.cli(t, stdin, args...)
	}
	exists := func(id string) bool {
		_, ok := fake.Device(id)
		return ok
	}

	// --yes is not enough for a foreign device, alone or among ours.
	for _, ids := range [][]string{{db1}, {ours, db1}} {
		_, err := cli("", append([]string{"--yes", "devices", "delete"}, ids...)...)
		if err == nil || !strings.Contains(err.Error(), "not Shepherd's") || !strings.Contains(err.Error(), "--include-foreign") || !strings.Contains(err.Error(), "db-1") {
			t.Errorf("delete %v with --yes: %v, want a refusal naming db-1 and --include-foreign", ids, err)
		}
		if !exists(db1) || !exists(ours) {
			t.Fatalf("delete %v with --yes deleted a device after refusing", ids)
		}
	}
	// --include-foreign asks for the hostname, even with --yes; a wrong
	// answer deletes nothing.
	if _, err := cli("db-2\n", "--yes", "devices", "delete", "--include-foreign", db1); err == nil || !strings.Contains(err.Error(), "nothing deleted") {
		t.Errorf("delete with the wrong hostname typed: %v, want a refusal", err)
	}
	if _, err := cli("", "--yes", "devices", "delete", "--include-foreign", db1); err == nil || !strings.Contains(err.Error(), "nothing deleted") {
		t.Errorf("delete with no hostname typed: %v, want a refusal", err)
	}
	if !exists(db1) {
		t.Fatal("a foreign device was deleted without its hostname typed")
	}
	// Both hostnames typed, then the usual question answered.
	out, err := cli("db-1\ndb-2\ny\n", "devices", "delete", "--include-foreign", db1, ours, db2)
	if err != nil || strings.Count(out, ": ok") != 3 {
		t.Fatalf("delete with both hostnames typed and confirmed: %v\n%s", err, out)
	}
	for _, id := range []string{db1, db2, ours} {
		if exists(id) {
			t.Errorf("device %s still exists after a confirmed delete", id)
		}
	}
}

// TestEquinixCLISharedBudget: given the BMDB, the CLI takes its requests
// from the budget the fleet's processes share there, under a name that
// does not show the token; a BMDB that cannot be opened is an error, not a
// silent budget of its own.
func TestEquinixCLISharedBudget(t *testing.T) {
	t.Parallel()
	f := newEquinixCLIFixture(t, fakemetal.Config{}, "burst: 7\n")
	f.fake.AddDevice("ours", fakemetal.DeviceSpec{Hostname: "shepherd-a1", State: "active"})
	db := bmdbtest.New(t)
	out, err := f.cli(t, "", "--database-url", db.URL, "devices", "list")
	if err != nil || !strings.Contains(out, "shepherd-a1") {
		t.Fatalf("devices list with the BMDB: %v\n%s", err, out)
	}
	account := metal.Config{BaseURL: f.apiURL, Token: cliToken}.Account()
	if strings.Contains(account, cliToken) {
		t.Fatalf("the budget's account name %q shows the token", account)
	}
	// One request taken from the burst of 7 (plus what refilled since).
	if n := bmdbtest.Scalar[float64](t, db, "SELECT tokens FROM provider_request_budgets WHERE account = $1", account); n > 6.5 {
		t.Errorf("the shared budget holds %v tokens after one request from a burst of 7", n)
	}
	if _, err := f.cli(t, "", "--database-url", "postgres://nobody@127.0.0.1:1/none?connect_timeout=2", "devices", "list"); err == nil || !strings.Contains(err.Error(), "shared request budget") {
		t.Errorf("devices list with a BMDB that cannot be opened: %v, want an error", err)
	}
}
