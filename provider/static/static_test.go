package static

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/power"
	"github.com/shepherd/shepherd/provider"
	"github.com/shepherd/shepherd/provider/providertest"
)

// contractIDs are not UUIDs: a slash and a space, a short one, and one of
// the maximal 128 bytes.
var contractIDs = []string{"rack1/node 1", "n2", "long-" + strings.Repeat("x", 123)}

func TestContract(t *testing.T) {
	var mu sync.Mutex
	servers := map[provider.Provider]*sshServer{}
	providertest.Run(t, providertest.Harness{
		New: func(t *testing.T) provider.Provider {
			client, _ := newKey(t)
			srv := newSSHServer(t, serverAuth{keys: []ssh.PublicKey{client.PublicKey()}})
			var inv strings.Builder
			fmt.Fprintf(&inv, "defaults:\n  port: %d\n  ssh_user: shepherd\nmachines:\n", srv.addr.Port())
			for i, id := range contractIDs {
				fmt.Fprintf(&inv, "  - id: %s\n    address: %s\n    host_key: %q\n    reboot_command: reboot-%d\n",
					strconv.Quote(id), srv.addr.Addr(), authorizedKey(srv.hostKey), i)
			}
			path := filepath.Join(t.TempDir(), "inventory.yaml")
			writeFile(t, path, inv.String())
			p, err := New(Config{
				Inventory:      path,
				ReloadInterval: 10 * time.Millisecond,
				Env:            provider.Env{Registerer: prometheus.NewRegistry(), SSHSigner: client},
			})
			if err != nil {
				t.Fatal(err)
			}
			runProvider(t, p)
			mu.Lock()
			servers[p] = srv
			mu.Unlock()
			return p
		},
		CanReboot: true,
		AfterReboot: func(t *testing.T, p provider.Provider, id string) {
			mu.Lock()
			srv := servers[p]
			mu.Unlock()
			want := run{user: "shepherd", cmd: "reboot-" + strconv.Itoa(slices.Index(contractIDs, id))}
			if got := srv.received(); !slices.Contains(got, want) {
				t.Errorf("after rebooting %q the SSH server ran %v, want %v among them", id, got, want)
			}
		},
	})
}

func TestListAndGet(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "inventory.yaml")
	writeFile(t, path, `
defaults:
  port: 2200
machines:
  - id: zeta
    address: 10.0.0.9
    location: fra1/rack2
  - id: alpha
    address: "2001:db8::1"
    port: 22
`)
	p, err := New(Config{Inventory: path})
	if err != nil {
		t.Fatal(err)
	}
	if p.Name() != "static" {
		t.Errorf("Name() = %q, want the default %q", p.Name(), "static")
	}
	ms, err := p.ListMachines(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	type view struct {
		ID, Location, ReservationID string
		Addr                        string
		Availability                provider.Availability
		Status                      provider.Status
		Failed                      bool
	}
	var got []view
	for _, m := range ms {
		d := m.(provider.Described)
		got = append(got, view{d.ID(), d.Location(), d.ReservationID(), d.Addr().String(), d.Availability(), d.Status(), d.Failed()})
	}
	want := []view{
		{ID: "alpha", Addr: "[2001:db8::1]:22", Availability: provider.PossiblyUsed, Status: provider.StatusRunning},
		{ID: "zeta", Location: "fra1/rack2", Addr: "10.0.0.9:2200", Availability: provider.PossiblyUsed, Status: provider.StatusRunning},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("ListMachines (-want +got):\n%s", diff)
	}

	if m, err := p.GetMachine(t.Context(), "zeta"); err != nil || m.ID() != "zeta" {
		t.Errorf("GetMachine(zeta) = %v, %v", m, err)
	}
	_, err = p.GetMachine(t.Context(), "nope")
	if !errors.Is(err, provider.ErrNotFound) || !strings.Contains(err.Error(), `"nope"`) {
		t.Errorf("GetMachine(nope) error = %v, want ErrNotFound naming the id", err)
	}
	if m, err := p.CreateMachine(t.Context(), provider.CreateRequest{From: ms[0], Session: uuid.New()}); err != nil || m.ID() != "alpha" {
		t.Errorf("CreateMachine(from alpha) = %v, %v", m, err)
	}
	if _, err := p.CreateMachine(t.Context(), provider.CreateRequest{From: &machine{id: "gone"}}); !errors.Is(err, provider.ErrNotFound) {
		t.Errorf("CreateMachine from an unknown machine: %v, want ErrNotFound", err)
	}
	if _, err := p.CreateMachine(t.Context(), provider.CreateRequest{}); err == nil {
		t.Error("CreateMachine without From succeeded")
	}
}

func TestSSHAccess(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	host, _ := newKey(t)
	_, keyPEM := newKey(t)
	path := filepath.Join(dir, "inventory.yaml")
	writeFile(t, filepath.Join(dir, "pw"), "pw\n")
	writeFile(t, filepath.Join(dir, "key"), string(keyPEM))
	writeFile(t, path, fmt.Sprintf(`
defaults:
  ssh_user: ops
machines:
  - id: plain
    address: 10.0.0.1
  - id: full
    address: 10.0.0.2
    ssh_user: admin
    ssh_password_file: %s
    ssh_key_file: %s
    host_key: %q
`, filepath.Join(dir, "pw"), filepath.Join(dir, "key"), authorizedKey(host.PublicKey())))
	p, err := New(Config{Inventory: path, Env: provider.Env{SSHUser: "root"}})
	if err != nil {
		t.Fatal(err)
	}
	plain, err := p.SSHAccess(t.Context(), "plain")
	if err != nil {
		t.Fatal(err)
	}
	if plain.User != "ops" || len(plain.Auth) != 0 || len(plain.Signers) != 0 || plain.HostKey != nil || plain.Dial != nil {
		t.Errorf("SSHAccess(plain) = %+v, want user ops from the defaults and nothing else", plain)
	}
	full, err := p.SSHAccess(t.Context(), "full")
	if err != nil {
		t.Fatal(err)
	}
	if full.User != "admin" || len(full.Signers) != 1 || len(full.Auth) != 1 || full.HostKey == nil || full.Dial != nil {
		t.Errorf("SSHAccess(full) = %+v, want user admin, a key and a password, the pinned host key", full)
	}
	if full.HostKey != nil && authorizedKey(full.HostKey) != authorizedKey(host.PublicKey()) {
		t.Errorf("SSHAccess(full).HostKey = %s, want the pinned key", authorizedKey(full.HostKey))
	}
	if _, err := p.SSHAccess(t.Context(), "nope"); !errors.Is(err, provider.ErrNotFound) {
		t.Errorf("SSHAccess(nope): %v, want ErrNotFound", err)
	}
}

func TestFactory(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "inventory.yaml")
	writeFile(t, path, "machines:\n  - id: a\n    address: 10.0.0.1\n")
	reg := prometheus.NewRegistry()
	p, err := Factory(t.Context(), provider.Env{Registerer: reg},
		fmt.Appendf(nil, "inventory: %s\nname: lab\nreload_interval: 10ms\nssh_timeout: 1m\nbmc_min_interval: 1s\nbmc_call_timeout: 20s\nbmc_settle: 2m\nbmc_attempts: 5\n", path))
	if err != nil {
		t.Fatal(err)
	}
	sp := p.(*Provider)
	if sp.Name() != "lab" || sp.cfg.ReloadInterval != 10*time.Millisecond || sp.cfg.SSHTimeout != time.Minute ||
		sp.cfg.Power != (power.Config{MinInterval: time.Second, CallTimeout: 20 * time.Second, Settle: 2 * time.Minute, Attempts: 5}) {
		t.Errorf("Factory config = %+v", sp.cfg)
	}
	if v := metricValue(t, reg, "shepherd_static_inventory_machines"); v != 1 {
		t.Errorf("machines gauge = %v, want 1", v)
	}
	// A second provider of the same name cannot share the registerer.
	if _, err := Factory(t.Context(), provider.Env{Registerer: reg}, fmt.Appendf(nil, "inventory: %s\nname: lab\n", path)); err == nil {
		t.Error("a second provider named lab registered its metrics twice")
	}
	if _, err := Factory(t.Context(), provider.Env{Registerer: reg}, fmt.Appendf(nil, "inventory: %s\nname: lab2\n", path)); err != nil {
		t.Errorf("a second provider with another name: %v", err)
	}

	for _, tt := range []struct{ config, want string }{
		{"", "static: Inventory is required"},
		{"# nothing\n", "static: Inventory is required"},
		{"inventory: x\nreload: 5s\n", `static: config line 2: unknown key "reload" (known: inventory, name, reload_interval, ssh_timeout, bmc_min_interval, bmc_call_timeout, bmc_settle, bmc_attempts, recovery_rungs)`},
		{"inventory: x\nbmc_attempts: many\n", `static: config line 2: bmc_attempts: strconv.Atoi: parsing "many": invalid syntax`},
		{"inventory: x\nbmc_settle: -1s\n", "static: power settle -1s: want 0 (default 1m0s) or more"},
		{"inventory: x\nssh_timeout: soon\n", `static: config line 2: ssh_timeout: time: invalid duration "soon"`},
		{"inventory: x\nreload_interval: -1s\n", "static: ReloadInterval must be >= 0 (0 = default), got -1s"},
		{"inventory: x\ninventory: y\n", "static: config line 2: inventory given twice (first at line 1)"},
		{"- inventory\n", "static: config line 1: want a mapping with keys inventory, name, reload_interval, ssh_timeout, bmc_min_interval, bmc_call_timeout, bmc_settle, bmc_attempts, recovery_rungs"},
		{"inventory: [x\n", "static: config: line 1: did not find expected ',' or ']'"},
	} {
		_, err := Factory(t.Context(), provider.Env{}, []byte(tt.config))
		if err == nil || err.Error() != tt.want {
			t.Errorf("Factory(%q) error = %v, want %q", tt.config, err, tt.want)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		cfg  Config
		want string
	}{
		{Config{Inventory: "x"}, ""},
		{Config{}, "static: Inventory is required"},
		{Config{Inventory: "x", ReloadInterval: -time.Second}, "static: ReloadInterval must be >= 0 (0 = default), got -1s"},
		{Config{Inventory: "x", SSHTimeout: -time.Second}, "static: SSHTimeout must be >= 0 (0 = default), got -1s"},
	} {
		err := tt.cfg.Validate()
		if got := fmt.Sprint(err); tt.want == "" && err != nil || tt.want != "" && got != tt.want {
			t.Errorf("%+v.Validate() = %v, want %q", tt.cfg, err, tt.want)
		}
	}
}

func TestRunStopsWithContext(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "inventory.yaml")
	writeFile(t, path, "machines: []\n")
	p, err := New(Config{Inventory: path, ReloadInterval: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := p.Run(ctx); err != nil {
		t.Errorf("Run after cancel = %v, want nil", err)
	}
}

// The Factory's provider loads its inventory at once: a missing file is an
// error naming it.
func TestFactoryMissingInventory(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "nope.yaml")
	_, err := Factory(t.Context(), provider.Env{}, fmt.Appendf(nil, "inventory: %s\n", path))
	if !errors.Is(err, os.ErrNotExist) || !strings.Contains(err.Error(), path) {
		t.Errorf("Factory with a missing inventory: %v, want ErrNotExist naming %s", err, path)
	}
}
