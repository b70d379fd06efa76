package static

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/shepherd/shepherd/power"
	"github.com/shepherd/shepherd/provider"
)

// TestBMCBlocks: a machine's bmc block is laid over the defaults' field by
// field; a machine without one has no BMC; the password comes from a file
// or a variable.
func TestBMCBlocks(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "bmcpw"), "rack-pw\n")
	inv, _, err := parse("inv.yaml", []byte(fmt.Sprintf(`
defaults:
  bmc:
    driver: ipmi
    username: ADMIN
    password_file: %s
    cipher_suite: 17
    auth: session        # for the redfish machines only, as cipher_suite is for the ipmi ones
machines:
  - id: a
    address: 10.0.0.1
    bmc:
      address: 10.1.0.1
  - id: b
    address: 10.0.0.2
    bmc:
      address: bmc-b.example
      port: 6230
      username: root
      password_env: BPW
      cipher_suite: 3
  - id: c
    address: 10.0.0.3
  - id: d
    address: 10.0.0.4
    bmc:
      driver: redfish
      address: 10.1.0.4
      ca_file: /etc/shepherd/bmc-ca.pem
      auth: basic
  - id: e
    address: 10.0.0.5
    bmc:
      driver: redfish
      address: 10.1.0.5
      insecure_skip_verify: true
`, filepath.Join(dir, "bmcpw"))), envMap(map[string]string{"BPW": "b-pw"}))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for id, e := range inv.byID {
		if e.bmc == nil {
			got[id] = "none"
			continue
		}
		s := *e.bmc
		got[id] = fmt.Sprintf("%s port=%d suite=%d ca=%q insecure=%v auth=%q pw=%s", s, s.Port, s.CipherSuite, s.CAFile, s.InsecureSkipVerify, s.Auth, s.Password.Reveal())
	}
	want := map[string]string{
		"a": `ipmi://ADMIN@10.1.0.1:623 port=0 suite=17 ca="" insecure=false auth="" pw=rack-pw`,
		"b": `ipmi://root@bmc-b.example:6230 port=6230 suite=3 ca="" insecure=false auth="" pw=b-pw`,
		"c": "none",
		"d": `redfish://ADMIN@10.1.0.4:443 port=0 suite=0 ca="/etc/shepherd/bmc-ca.pem" insecure=false auth="basic" pw=rack-pw`,
		"e": `redfish://ADMIN@10.1.0.5:443 port=0 suite=0 ca="" insecure=true auth="session" pw=rack-pw`,
	}
	for id, w := range want {
		if got[id] != w {
			t.Errorf("machine %s: BMC\n  %s\nwant\n  %s", id, got[id], w)
		}
	}
}

// TestBrokenBMCBlocks: every mistake in a bmc block is reported at its line,
// names the machine, and never prints a password.
func TestBrokenBMCBlocks(t *testing.T) {
	t.Parallel()
	env := envMap(map[string]string{"PW": "hunter2", "EMPTY": ""})
	for _, tt := range []struct{ name, bmc, want string }{
		{"inline password", "driver: ipmi\n      address: 10.1.0.1\n      username: u\n      password: hunter2",
			`FILE:8: machine "a": bmc: field "password" is not allowed: the BMC password must come from a file (password_file) or an environment variable (password_env), not inline
FILE:4: machine "a": bmc: password missing`},
		{"unknown field", "driver: ipmi\n      address: 10.1.0.1\n      username: u\n      password_env: PW\n      cipher: 3",
			`FILE:9: machine "a": bmc: unknown field "cipher"`},
		{"no driver", "address: 10.1.0.1\n      username: u\n      password_env: PW",
			`FILE:4: machine "a": bmc: driver missing: want ipmi or redfish`},
		{"bad driver", "driver: amt\n      address: 10.1.0.1\n      username: u\n      password_env: PW",
			`FILE:4: machine "a": bmc: driver "amt": want ipmi or redfish`},
		{"no address", "driver: ipmi\n      username: u\n      password_env: PW",
			`FILE:4: machine "a": bmc: address missing`},
		{"empty address", "driver: ipmi\n      address: ''\n      username: u\n      password_env: PW",
			`FILE:6: machine "a": bmc: address is empty (leave it out for the default)`},
		{"bad port", "driver: ipmi\n      address: 10.1.0.1\n      port: 70000\n      username: u\n      password_env: PW",
			`FILE:7: machine "a": bmc: port must be a number from 1 to 65535, got "70000"`},
		{"bad suite", "driver: ipmi\n      address: 10.1.0.1\n      username: u\n      password_env: PW\n      cipher_suite: aes",
			`FILE:9: machine "a": bmc: cipher_suite must be 3 or 17, got "aes"`},
		{"unsupported suite", "driver: ipmi\n      address: 10.1.0.1\n      username: u\n      password_env: PW\n      cipher_suite: 1",
			`FILE:4: machine "a": bmc: cipher_suite 1: want 3 or 17`},
		{"suite for redfish", "driver: redfish\n      address: 10.1.0.1\n      username: u\n      password_env: PW\n      cipher_suite: 3",
			`FILE:4: machine "a": bmc: cipher_suite is for ipmi, not redfish`},
		{"bad insecure", "driver: redfish\n      address: 10.1.0.1\n      username: u\n      password_env: PW\n      insecure_skip_verify: yes",
			`FILE:9: machine "a": bmc: insecure_skip_verify must be true or false, got "yes"`},
		{"ca and insecure", "driver: redfish\n      address: 10.1.0.1\n      username: u\n      password_env: PW\n      ca_file: /ca.pem\n      insecure_skip_verify: true",
			`FILE:4: machine "a": bmc: ca_file and insecure_skip_verify exclude each other`},
		{"no password", "driver: ipmi\n      address: 10.1.0.1\n      username: u",
			`FILE:4: machine "a": bmc: password missing`},
		{"unset variable", "driver: ipmi\n      address: 10.1.0.1\n      username: u\n      password_env: NOPE",
			`FILE:8: machine "a": bmc: password_env: environment variable NOPE is not set
FILE:4: machine "a": bmc: password missing`},
		{"empty variable", "driver: ipmi\n      address: 10.1.0.1\n      username: u\n      password_env: EMPTY",
			`FILE:8: machine "a": bmc: the password from password_env EMPTY is empty
FILE:4: machine "a": bmc: password missing`},
		{"file and variable", "driver: ipmi\n      address: 10.1.0.1\n      username: u\n      password_env: PW\n      password_file: /x",
			`FILE:9: machine "a": bmc: give password_file or password_env, not both
FILE:4: machine "a": bmc: password missing`},
		{"not a mapping", "[ipmi]", `FILE:4: machine "a": bmc: must be a mapping, not a list`},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			path := filepath.Join(dir, "inventory.yaml")
			inv := "machines:\n  - id: a\n    address: 10.0.0.1\n    bmc:\n      " + tt.bmc + "\n"
			if tt.name == "not a mapping" {
				inv = "machines:\n  - id: a\n    address: 10.0.0.1\n    bmc: " + tt.bmc + "\n"
			}
			writeFile(t, path, inv)
			var logs syncBuffer
			_, err := newProvider(Config{Inventory: path, Env: provider.Env{Logger: bufferLogger(&logs)}}, env)
			want := strings.ReplaceAll(tt.want, "FILE", path)
			if err == nil || err.Error() != want {
				t.Errorf("New() error =\n%v\nwant\n%s", err, want)
			}
			if strings.Contains(fmt.Sprint(err)+logs.String(), "hunter2") {
				t.Errorf("a password reached the error or the log: %v\n%s", err, logs.String())
			}
		})
	}
}

// countingDriver is a power.Driver that counts how often it was opened;
// the drivers themselves are tested against real BMC simulators.
type countingDriver struct{ state power.State }

func (d *countingDriver) State(context.Context) (power.State, error) { return d.state, nil }
func (d *countingDriver) On(context.Context) error                   { d.state = power.On; return nil }
func (d *countingDriver) Off(context.Context) error                  { d.state = power.Off; return nil }

// TestProviderBMC: BMC opens a machine's BMC once and keeps its controller
// while the spec stays the same; machines without one get ErrNoBMC, unknown
// machines ErrNotFound; a changed password opens it anew.
func TestProviderBMC(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "inventory.yaml")
	pwFile := filepath.Join(dir, "pw")
	writeFile(t, pwFile, "one\n")
	inv := fmt.Sprintf(`
defaults:
  bmc: {driver: ipmi, username: u, password_file: %s}
machines:
  - {id: a, address: 10.0.0.1, bmc: {address: 10.1.0.1}}
  - {id: b, address: 10.0.0.2, bmc: {address: 10.1.0.1}}
  - {id: c, address: 10.0.0.3}
`, pwFile)
	writeFile(t, path, inv)
	var mu sync.Mutex
	var opened []string
	p, err := newProvider(Config{Inventory: path, OpenBMC: func(s power.Spec) (power.Driver, error) {
		mu.Lock()
		defer mu.Unlock()
		opened = append(opened, s.Endpoint()+" "+s.Password.Reveal())
		return &countingDriver{state: power.On}, nil
	}}, envMap(nil))
	if err != nil {
		t.Fatal(err)
	}
	a, err := p.BMC(t.Context(), "a")
	if err != nil || a.Name != "ipmi://u@10.1.0.1:623" {
		t.Fatalf("BMC(a) = %q, %v", a.Name, err)
	}
	if s, err := a.State(t.Context()); err != nil || s != power.On {
		t.Errorf("State() = %s, %v", s, err)
	}
	b, err := p.BMC(t.Context(), "b")
	if err != nil || b.Controller != a.Controller {
		t.Errorf("BMC(b) = %v, %v: want the controller of a's BMC, which it shares", b.Controller, err)
	}
	if _, err := p.BMC(t.Context(), "c"); !errors.Is(err, provider.ErrNoBMC) {
		t.Errorf("BMC(c) = %v, want ErrNoBMC", err)
	}
	if _, err := p.BMC(t.Context(), "zz"); !errors.Is(err, provider.ErrNotFound) {
		t.Errorf("BMC(zz) = %v, want ErrNotFound", err)
	}
	writeFile(t, pwFile, "two\n")
	if err := p.Reload(); err != nil {
		t.Fatal(err)
	}
	a2, err := p.BMC(t.Context(), "a")
	if err != nil || a2.Controller == a.Controller {
		t.Errorf("BMC(a) after a new password = %v, %v: want a new controller", a2.Controller, err)
	}
	mu.Lock()
	defer mu.Unlock()
	if got := strings.Join(opened, ","); got != "10.1.0.1:623 one,10.1.0.1:623 two" {
		t.Errorf("opened %s", got)
	}
}

// TestProviderBMCOpenFails: a driver that cannot be opened is an error that
// names the machine and the BMC, never the password.
func TestProviderBMCOpenFails(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "inventory.yaml")
	writeFile(t, path, "machines:\n  - {id: a, address: 10.0.0.1, bmc: {driver: redfish, address: 10.1.0.1, username: u, password_env: PW}}\n")
	p, err := newProvider(Config{Inventory: path, OpenBMC: func(s power.Spec) (power.Driver, error) {
		return nil, fmt.Errorf("bad CA file: %w", power.ErrCertificate)
	}}, envMap(map[string]string{"PW": "hunter2"}))
	if err != nil {
		t.Fatal(err)
	}
	_, err = p.BMC(t.Context(), "a")
	if !errors.Is(err, power.ErrCertificate) || !strings.Contains(err.Error(), "machine a: BMC redfish://u@10.1.0.1:443") || strings.Contains(err.Error(), "hunter2") {
		t.Errorf("BMC(a) = %v", err)
	}
}
