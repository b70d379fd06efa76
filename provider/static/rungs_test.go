package static

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/ladder"
	"github.com/shepherd/shepherd/provider"
)

// rungsOf returns RecoveryRungs of every machine of p's inventory, by id.
func rungsOf(t *testing.T, p *Provider) map[string][]ladder.Rung {
	t.Helper()
	ms, err := p.ListMachines(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	got := map[string][]ladder.Rung{}
	for _, m := range ms {
		rungs, err := p.RecoveryRungs(t.Context(), m.ID())
		if err != nil {
			t.Fatalf("RecoveryRungs(%s): %v", m.ID(), err)
		}
		got[m.ID()] = rungs
	}
	return got
}

// TestRecoveryRungs: a machine's recovery_rungs replace the defaults' as a
// whole, the defaults' replace the provider config's, and without any the
// recoverer's default (nil) applies. Every list comes back in ladder order
// whatever order it was written in.
func TestRecoveryRungs(t *testing.T) {
	t.Parallel()
	// a has its own list, b (with a BMC) and c (without) have none.
	const machines = `machines:
  - id: a
    address: 10.0.0.1
    recovery_rungs: [reboot, agent]   # no power: fine without a bmc block
  - id: b
    address: 10.0.0.2
    bmc: {driver: ipmi, address: 10.1.0.2, username: u, password_env: PW}
  - id: c
    address: 10.0.0.3
`
	for _, tt := range []struct {
		name      string
		config    string // the Factory's recovery_rungs line, if any
		inventory string
		want      map[string][]ladder.Rung
	}{
		{"machine, defaults", "recovery_rungs: [power]", "defaults:\n  recovery_rungs:\n    - reboot\n    - agent\n" + machines,
			map[string][]ladder.Rung{"a": {ladder.Agent, ladder.Reboot}, "b": {ladder.Agent, ladder.Reboot}, "c": {ladder.Agent, ladder.Reboot}}},
		{"defaults win over the provider config", "recovery_rungs: [agent]", "defaults:\n  recovery_rungs: [reboot]\n" + machines,
			map[string][]ladder.Rung{"a": {ladder.Agent, ladder.Reboot}, "b": {ladder.Reboot}, "c": {ladder.Reboot}}},
		{"provider config", "recovery_rungs: [reboot, agent]", machines,
			map[string][]ladder.Rung{"a": {ladder.Agent, ladder.Reboot}, "b": {ladder.Agent, ladder.Reboot}, "c": {ladder.Agent, ladder.Reboot}}},
		{"none: the recoverer's default", "", machines,
			map[string][]ladder.Rung{"a": {ladder.Agent, ladder.Reboot}, "b": nil, "c": nil}},
		{"null is left out", "", "defaults:\n  recovery_rungs:\n" + strings.Replace(machines, "[reboot, agent]", "~", 1),
			map[string][]ladder.Rung{"a": nil, "b": nil, "c": nil}},
		{"power where there is a BMC", "", "defaults:\n  recovery_rungs: [agent]\n" + strings.Replace(machines, "password_env: PW}", "password_env: PW}\n    recovery_rungs: [power, agent, reboot]", 1),
			map[string][]ladder.Rung{"a": {ladder.Agent, ladder.Reboot}, "b": {ladder.Agent, ladder.Reboot, ladder.Power}, "c": {ladder.Agent}}},
		// An inherited list is the fleet's: a machine without a BMC takes
		// the rest of it.
		{"inherited power skipped without a BMC", "recovery_rungs: [power, agent]", machines,
			map[string][]ladder.Rung{"a": {ladder.Agent, ladder.Reboot}, "b": {ladder.Agent, ladder.Power}, "c": {ladder.Agent}}},
		{"defaults' power skipped without a BMC", "", "defaults:\n  recovery_rungs: [power]\n" + machines,
			map[string][]ladder.Rung{"a": {ladder.Agent, ladder.Reboot}, "b": {ladder.Power}, "c": {}}},
		{"through aliases", "", "defaults:\n  recovery_rungs: &l [agent, &r reboot]\nmachines:\n  - {id: a, address: 10.0.0.1, recovery_rungs: [*r]}\n  - {id: b, address: 10.0.0.2, recovery_rungs: *l}\n",
			map[string][]ladder.Rung{"a": {ladder.Reboot}, "b": {ladder.Agent, ladder.Reboot}}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			path := filepath.Join(t.TempDir(), "inventory.yaml")
			writeFile(t, path, tt.inventory)
			cfg, err := parseFactoryConfig([]byte("inventory: " + path + "\n" + tt.config))
			if err != nil {
				t.Fatal(err)
			}
			p, err := newProvider(cfg, envMap(map[string]string{"PW": "pw"}))
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(tt.want, rungsOf(t, p)); diff != "" {
				t.Errorf("RecoveryRungs (-want +got):\n%s", diff)
			}
		})
	}
}

// RecoveryRungs of a machine the inventory does not list is ErrNotFound,
// as GetMachine's; and what it returns is the caller's to change. An empty
// Config.RecoveryRungs is the zero value: the recoverer's default (nil), not
// a ladder without rungs.
func TestRecoveryRungsUnknownAndCopied(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "inventory.yaml")
	writeFile(t, path, "machines:\n  - {id: a, address: 10.0.0.1, recovery_rungs: [agent, reboot]}\n  - {id: b, address: 10.0.0.2}\n")
	given := []ladder.Rung{ladder.Reboot, ladder.Agent}
	p, err := New(Config{Inventory: path, RecoveryRungs: given})
	if err != nil {
		t.Fatal(err)
	}
	_, err = p.RecoveryRungs(t.Context(), "nope")
	if !errors.Is(err, provider.ErrNotFound) || !strings.Contains(err.Error(), `"nope"`) {
		t.Errorf("RecoveryRungs(nope) error = %v, want ErrNotFound naming the id", err)
	}
	given[0] = ladder.Power // the caller's slice is not the provider's
	for _, id := range []string{"a", "b"} {
		rungs, err := p.RecoveryRungs(t.Context(), id)
		if err != nil {
			t.Fatal(err)
		}
		rungs[0] = ladder.Power // nor is the one returned
	}
	want := map[string][]ladder.Rung{"a": {ladder.Agent, ladder.Reboot}, "b": {ladder.Agent, ladder.Reboot}}
	if diff := cmp.Diff(want, rungsOf(t, p)); diff != "" {
		t.Errorf("RecoveryRungs after changing the slices given and returned (-want +got):\n%s", diff)
	}

	p, err = New(Config{Inventory: path, RecoveryRungs: []ladder.Rung{}})
	if err != nil {
		t.Fatal(err)
	}
	want = map[string][]ladder.Rung{"a": {ladder.Agent, ladder.Reboot}, "b": nil}
	if diff := cmp.Diff(want, rungsOf(t, p)); diff != "" {
		t.Errorf("RecoveryRungs with an empty Config.RecoveryRungs (-want +got):\n%s", diff)
	}
}

// TestBrokenRecoveryRungs: every mistake in recovery_rungs is reported at
// its line and names the machine (or the defaults); reinstall is refused
// because a static inventory cannot reinstall, and power for a machine
// without a bmc block, wherever its list comes from.
func TestBrokenRecoveryRungs(t *testing.T) {
	t.Parallel()
	const bmc = "{driver: ipmi, address: 10.1.0.1, username: u, password_env: PW}"
	for _, tt := range []struct {
		name      string
		provider  []ladder.Rung // Config.RecoveryRungs
		inventory string
		want      string
	}{
		{"unknown rung", nil, `machines:
  - id: a
    address: 10.0.0.1
    recovery_rungs:
      - agent
      - powr
`, `FILE:6: machine "a": recovery_rungs: unknown recovery rung "powr"; choose from agent,reboot,power,reinstall`},
		{"rung given twice", nil, `machines:
  - id: a
    address: 10.0.0.1
    recovery_rungs:
      - reboot
      - agent
      - reboot
`, `FILE:7: machine "a": recovery_rungs: recovery rung "reboot" given twice`},
		{"empty list", nil, `machines:
  - id: a
    address: 10.0.0.1
    recovery_rungs: []
`, `FILE:4: machine "a": recovery_rungs is empty (leave it out for the default)`},
		{"not a list", nil, `machines:
  - id: a
    address: 10.0.0.1
    recovery_rungs: agent,reboot
`, `FILE:4: machine "a": recovery_rungs must be a list, not a single value`},
		{"a rung not a name", nil, `machines:
  - id: a
    address: 10.0.0.1
    recovery_rungs:
      - agent
      - {reboot: now}
`, `FILE:6: machine "a": recovery_rungs: a rung must be a single value, not a mapping`},
		{"reinstall", nil, `machines:
  - id: a
    address: 10.0.0.1
    bmc: ` + bmc + `
    recovery_rungs:
      - agent
      - reinstall
      - power
`, `FILE:7: machine "a": recovery_rungs: a static inventory cannot reinstall a machine; leave out reinstall`},
		{"reinstall in the defaults", nil, `defaults:
  recovery_rungs: [agent, reinstall]
machines: []
`, `FILE:2: defaults: recovery_rungs: a static inventory cannot reinstall a machine; leave out reinstall`},
		{"unknown rung in the defaults", nil, `defaults:
  recovery_rungs:
    - Agent
machines: []
`, `FILE:3: defaults: recovery_rungs: unknown recovery rung "Agent"; choose from agent,reboot,power,reinstall`},
		{"defaults given twice", nil, `defaults:
  recovery_rungs: [agent]
  recovery_rungs: [reboot]
machines: []
`, `FILE:3: defaults: field "recovery_rungs" given twice (first at line 2)`},
		{"power without a bmc block", nil, `machines:
  - id: a
    address: 10.0.0.1
    recovery_rungs:
      - agent
      - power
`, `FILE:6: machine "a": recovery_rungs: power needs a bmc block`},
		// A broken list or bmc block is reported where it is written, and
		// nothing more is said about power.
		{"power with a broken bmc block", nil, `machines:
  - id: a
    address: 10.0.0.1
    bmc: {driver: ipmi, username: u, password_env: PW}
    recovery_rungs: [power]
`, `FILE:4: machine "a": bmc: address missing`},
		{"power with a bmc that is not a mapping", nil, `machines:
  - id: a
    address: 10.0.0.1
    bmc: 10.1.0.1
    recovery_rungs: [power]
`, `FILE:4: machine "a": bmc: must be a mapping, not a single value`},
		{"power with a null bmc", nil, `machines:
  - id: a
    address: 10.0.0.1
    bmc:
    recovery_rungs: [power]
`, `FILE:5: machine "a": recovery_rungs: power needs a bmc block`},
		{"broken list over defaults with power", nil, `defaults:
  recovery_rungs: [agent, power]
machines:
  - {id: a, address: 10.0.0.1, recovery_rungs: [agent, rebot]}
`, `FILE:4: machine "a": recovery_rungs: unknown recovery rung "rebot"; choose from agent,reboot,power,reinstall`},
		{"broken defaults over a provider config with power", []ladder.Rung{ladder.Power}, `defaults:
  recovery_rungs: [agent, agent]
machines:
  - {id: a, address: 10.0.0.1}
`, `FILE:2: defaults: recovery_rungs: recovery rung "agent" given twice`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			path := filepath.Join(t.TempDir(), "inventory.yaml")
			writeFile(t, path, tt.inventory)
			_, err := newProvider(Config{Inventory: path, RecoveryRungs: tt.provider}, envMap(map[string]string{"PW": "pw"}))
			want := strings.ReplaceAll(tt.want, "FILE", path)
			if err == nil || err.Error() != want {
				t.Errorf("New() error =\n%v\nwant\n%s", err, want)
			}
		})
	}
}

// The Factory's recovery_rungs is a list read like the inventory's, with
// the config's line in its messages; Config.RecoveryRungs set in code is
// checked by Validate.
func TestRecoveryRungsConfig(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "inventory.yaml")
	writeFile(t, path, "machines:\n  - {id: a, address: 10.0.0.1}\n")
	p, err := Factory(t.Context(), provider.Env{Registerer: prometheus.NewRegistry()},
		fmt.Appendf(nil, "inventory: %s\nrecovery_rungs:\n  - reboot\n  - agent\n", path))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := p.(*Provider).cfg.RecoveryRungs, []ladder.Rung{ladder.Agent, ladder.Reboot}; !cmp.Equal(got, want) {
		t.Errorf("Factory's RecoveryRungs = %v, want %v", got, want)
	}
	// Null is left out, as in the inventory.
	if cfg, err := parseFactoryConfig([]byte("inventory: x\nrecovery_rungs:\n")); err != nil || cfg.RecoveryRungs != nil {
		t.Errorf("Factory config with recovery_rungs null = %v, %v; want no RecoveryRungs", cfg.RecoveryRungs, err)
	}

	for _, tt := range []struct{ config, want string }{
		{"inventory: x\nrecovery_rungs: agent\n", "static: config line 2: recovery_rungs must be a list, not a single value"},
		{"inventory: x\nrecovery_rungs: []\n", "static: config line 2: recovery_rungs is empty (leave it out for the default)"},
		{"inventory: x\nrecovery_rungs:\n  - agent\n  - [reboot]\n", "static: config line 4: recovery_rungs: a rung must be a single value, not a list"},
		{"inventory: x\nrecovery_rungs:\n  - agent\n  - bounce\n", `static: config line 4: recovery_rungs: unknown recovery rung "bounce"; choose from agent,reboot,power,reinstall`},
		{"inventory: x\nrecovery_rungs: [power, power]\n", `static: config line 2: recovery_rungs: recovery rung "power" given twice`},
		{"inventory: x\nrecovery_rungs:\n  - agent\n  - reinstall\n", "static: config line 4: recovery_rungs: a static inventory cannot reinstall a machine; leave out reinstall"},
		{"inventory: x\nrecovery_rungs: [agent]\nrecovery_rungs: [reboot]\n", "static: config line 3: recovery_rungs given twice (first at line 2)"},
	} {
		_, err := Factory(t.Context(), provider.Env{}, []byte(tt.config))
		if err == nil || err.Error() != tt.want {
			t.Errorf("Factory(%q) error = %v, want %q", tt.config, err, tt.want)
		}
	}

	for _, tt := range []struct {
		rungs []ladder.Rung
		want  string
	}{
		{[]ladder.Rung{ladder.Power, ladder.Agent}, ""},
		{[]ladder.Rung{}, ""}, // zero: the default
		{[]ladder.Rung{ladder.Reinstall}, "static: RecoveryRungs: a static inventory cannot reinstall a machine; leave out reinstall"},
		{[]ladder.Rung{"cycle"}, `static: RecoveryRungs: unknown recovery rung "cycle"; choose from agent,reboot,power,reinstall`},
		{[]ladder.Rung{ladder.Agent, ladder.Agent}, `static: RecoveryRungs: recovery rung "agent" given twice`},
	} {
		err := Config{Inventory: "x", RecoveryRungs: tt.rungs}.Validate()
		if got := fmt.Sprint(err); tt.want == "" && err != nil || tt.want != "" && got != tt.want {
			t.Errorf("Validate() of RecoveryRungs %v = %v, want %q", tt.rungs, err, tt.want)
		}
	}
}

// A reload applies a changed recovery_rungs at once; a reload that breaks
// it (here: a bmc block removed from a machine whose list names power)
// fails, and the last good inventory, with its ladders, stays in force.
func TestReloadRecoveryRungs(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "inventory.yaml")
	const inv = `defaults:
  recovery_rungs: [agent, reboot]
machines:
  - id: a
    address: 10.0.0.1
    bmc: {driver: redfish, address: 10.1.0.1, username: u, password_env: PW}
    recovery_rungs: [agent, power]
  - id: b
    address: 10.0.0.2
`
	writeFile(t, path, inv)
	reg := prometheus.NewRegistry()
	p, err := newProvider(Config{Inventory: path, Env: provider.Env{Registerer: reg}}, envMap(map[string]string{"PW": "pw"}))
	if err != nil {
		t.Fatal(err)
	}
	first := map[string][]ladder.Rung{"a": {ladder.Agent, ladder.Power}, "b": {ladder.Agent, ladder.Reboot}}
	if diff := cmp.Diff(first, rungsOf(t, p)); diff != "" {
		t.Fatalf("RecoveryRungs after New (-want +got):\n%s", diff)
	}

	// The defaults' list changes, and a machine arrives with a list of
	// its own.
	writeFile(t, path, strings.Replace(inv, "[agent, reboot]", "[reboot]", 1)+"  - {id: c, address: 10.0.0.3, recovery_rungs: [agent]}\n")
	if err := p.Reload(); err != nil {
		t.Fatal(err)
	}
	second := map[string][]ladder.Rung{"a": {ladder.Agent, ladder.Power}, "b": {ladder.Reboot}, "c": {ladder.Agent}}
	if diff := cmp.Diff(second, rungsOf(t, p)); diff != "" {
		t.Errorf("RecoveryRungs after a reload (-want +got):\n%s", diff)
	}

	// a loses its bmc block but still names power.
	writeFile(t, path, strings.Replace(inv, "    bmc: {driver: redfish, address: 10.1.0.1, username: u, password_env: PW}\n", "", 1))
	err = p.Reload()
	if want := path + `:6: machine "a": recovery_rungs: power needs a bmc block`; err == nil || err.Error() != want {
		t.Errorf("Reload without a's bmc block: %v, want %q", err, want)
	}
	if diff := cmp.Diff(second, rungsOf(t, p)); diff != "" {
		t.Errorf("RecoveryRungs after a failed reload (-want +got): the last good inventory must stay\n%s", diff)
	}
	if v, e := metricValue(t, reg, metricValid), metricValue(t, reg, metricReloadErrors); v != 0 || e != 1 {
		t.Errorf("after a failed reload: valid %v, reload errors %v; want 0, 1", v, e)
	}

	// A machine that leaves the file is not found any more.
	writeFile(t, path, "machines:\n  - {id: b, address: 10.0.0.2}\n")
	if err := p.Reload(); err != nil {
		t.Fatal(err)
	}
	if _, err := p.RecoveryRungs(t.Context(), "a"); !errors.Is(err, provider.ErrNotFound) {
		t.Errorf("RecoveryRungs(a) after a left the file: %v, want ErrNotFound", err)
	}
	if diff := cmp.Diff(map[string][]ladder.Rung{"b": nil}, rungsOf(t, p)); diff != "" {
		t.Errorf("RecoveryRungs after the lists left the file (-want +got):\n%s", diff)
	}
}
