package static

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/provider"
)

func TestBrokenInventories(t *testing.T) {
	t.Parallel()
	_, goodKey := newKey(t)
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	block, err := ssh.MarshalPrivateKeyWithPassphrase(priv, "", []byte("passphrase"))
	if err != nil {
		t.Fatal(err)
	}
	lockedKey := pem.EncodeToMemory(block)
	env := envMap(map[string]string{"PW": "pw", "EMPTY": "", "NOT_A_KEY": "garbage", "LOCKED_KEY": string(lockedKey), "KEY": string(goodKey)})

	// In inventories and wants, DIR is the test's directory (which holds
	// the inventory) and FILE is the inventory's path.
	tests := []struct {
		name, inventory, want string
	}{
		{"bad YAML syntax", `
machines:
  - id: a
    address: [10.0.0.1
`, `FILE:4: did not find expected ',' or ']'`},
		{"tab indentation", "machines:\n\t- id: a\n", `FILE:2: found character that cannot start any token`},
		{"empty file", "", `FILE:1: the inventory is empty (write "machines: []" for an inventory without machines)`},
		{"only comments", "# nothing yet\n", `FILE:1: the inventory is empty (write "machines: []" for an inventory without machines)`},
		{"two documents", "machines: []\n---\nmachines: []\n", `FILE:2: a second YAML document: the inventory is a single document`},
		{"not a mapping", "- id: a\n", `FILE:1: the inventory must be a mapping with a "machines" list, not a list`},
		{"no machines", "defaults:\n  port: 22\n", `FILE:1: "machines" is required (write "machines: []" for an inventory without machines)`},
		{"machines not a list", "machines:\n  id: a\n", `FILE:2: "machines" must be a list, not a mapping`},
		{"machine not a mapping", "machines:\n  - a\n", `FILE:2: machine #1: must be a mapping, not a single value`},
		{"unknown top-level field", "machines: []\nmachine: []\n", `FILE:2: unknown field "machine"`},
		{"duplicate ids", `machines:
  - id: a
    address: 10.0.0.1
  - id: a
    address: 10.0.0.2
`, `FILE:4: duplicate machine id "a" (first at line 2)`},
		{"duplicate field", `machines:
  - id: a
    address: 10.0.0.1
    address: 10.0.0.2
`, `FILE:4: machine "a": field "address" given twice (first at line 3)`},
		{"missing address", `machines:
  - id: a
    port: 22
`, `FILE:2: machine "a": address is required`},
		{"bad IP", `machines:
  - id: a
    address: 10.0.0.300
`, `FILE:3: machine "a": address "10.0.0.300" is not an IPv4 or IPv6 address`},
		{"host name", `machines:
  - id: a
    address: node7.example.com
`, `FILE:3: machine "a": address "node7.example.com" is not an IPv4 or IPv6 address`},
		{"port 0", `machines:
  - id: a
    address: 10.0.0.1
    port: 0
`, `FILE:4: machine "a": port must be a number from 1 to 65535, got "0"`},
		{"port 70000", `machines:
  - id: a
    address: 10.0.0.1
    port: 70000
`, `FILE:4: machine "a": port must be a number from 1 to 65535, got "70000"`},
		{"port not a number", `machines:
  - id: a
    address: 10.0.0.1
    port: ssh
`, `FILE:4: machine "a": port must be a number from 1 to 65535, got "ssh"`},
		{"bad default port", `defaults:
  port: -1
machines: []
`, `FILE:2: defaults: port must be a number from 1 to 65535, got "-1"`},
		{"unknown field", `machines:
  - id: a
    adress: 10.0.0.1
`, `FILE:3: machine "a": unknown field "adress"
FILE:2: machine "a": address is required`},
		{"unknown default", "defaults:\n  user: root\nmachines: []\n", `FILE:2: defaults: unknown field "user"`},
		{"a list for a value", `machines:
  - id: a
    address: [10.0.0.1]
`, `FILE:3: machine "a": address must be a single value, not a list
FILE:2: machine "a": address is required`},
		{"inline password", `machines:
  - id: a
    address: 10.0.0.1
    password: hunter2
`, `FILE:4: machine "a": field "password" is not allowed: secrets must come from a file (ssh_password_file) or an environment variable (ssh_password_env), not inline`},
		{"inline ssh_password", `machines:
  - id: a
    address: 10.0.0.1
    ssh_password: hunter2
`, `FILE:4: machine "a": field "ssh_password" is not allowed: secrets must come from a file (ssh_password_file) or an environment variable (ssh_password_env), not inline`},
		{"inline password in defaults", `defaults:
  ssh_password: hunter2
machines: []
`, `FILE:2: defaults: field "ssh_password" is not allowed: secrets must come from a file (ssh_password_file) or an environment variable (ssh_password_env), not inline`},
		{"inline key", `machines:
  - id: a
    address: 10.0.0.1
    ssh_key: "-----BEGIN OPENSSH PRIVATE KEY-----"
`, `FILE:4: machine "a": field "ssh_key" is not allowed: secrets must come from a file (ssh_key_file) or an environment variable (ssh_key_env), not inline`},
		{"inline private_key", `machines:
  - id: a
    address: 10.0.0.1
    private_key: x
    key: y
`, `FILE:4: machine "a": field "private_key" is not allowed: secrets must come from a file (ssh_key_file) or an environment variable (ssh_key_env), not inline
FILE:5: machine "a": field "key" is not allowed: secrets must come from a file (ssh_key_file) or an environment variable (ssh_key_env), not inline`},
		{"password file and env", `machines:
  - id: a
    address: 10.0.0.1
    ssh_password_file: DIR/pw
    ssh_password_env: PW
`, `FILE:5: machine "a": give ssh_password_file or ssh_password_env, not both`},
		{"key file and env", `machines:
  - id: a
    address: 10.0.0.1
    ssh_key_env: KEY
    ssh_key_file: DIR/key
`, `FILE:5: machine "a": give ssh_key_file or ssh_key_env, not both`},
		{"missing password file", `machines:
  - id: a
    address: 10.0.0.1
    ssh_password_file: DIR/nope
`, `FILE:4: machine "a": ssh_password_file: open DIR/nope: no such file or directory`},
		{"empty password file", `machines:
  - id: a
    address: 10.0.0.1
    ssh_password_file: DIR/empty
`, `FILE:4: machine "a": the password from ssh_password_file DIR/empty is empty`},
		{"unset env var", `machines:
  - id: a
    address: 10.0.0.1
    ssh_password_env: NODE7_PASSWORD
`, `FILE:4: machine "a": ssh_password_env: environment variable NODE7_PASSWORD is not set`},
		{"empty env var", `machines:
  - id: a
    address: 10.0.0.1
    ssh_password_env: EMPTY
`, `FILE:4: machine "a": the password from ssh_password_env EMPTY is empty`},
		{"missing key file", `machines:
  - id: a
    address: 10.0.0.1
    ssh_key_file: DIR/nope
`, `FILE:4: machine "a": ssh_key_file: open DIR/nope: no such file or directory`},
		{"not a key", `machines:
  - id: a
    address: 10.0.0.1
    ssh_key_env: NOT_A_KEY
`, `FILE:4: machine "a": the key from ssh_key_env NOT_A_KEY is not a usable private key: ssh: no key found`},
		{"key with passphrase", `machines:
  - id: a
    address: 10.0.0.1
    ssh_key_env: LOCKED_KEY
`, `FILE:4: machine "a": the key from ssh_key_env LOCKED_KEY is protected by a passphrase, which is not supported`},
		{"id longer than 128 bytes", fmt.Sprintf(`machines:
  - id: %s
    address: 10.0.0.1
`, strings.Repeat("x", 129)), `FILE:2: machine #1: id must be 1 to 128 bytes long, got 129 bytes`},
		{"empty id", `machines:
  - id: ""
    address: 10.0.0.1
`, `FILE:2: machine #1: id must be 1 to 128 bytes long, got 0 bytes`},
		{"missing id", `machines:
  - id: a
    address: 10.0.0.1
  - address: 10.0.0.2
`, `FILE:4: machine #2: id is required`},
		{"bad host_key", `machines:
  - id: a
    address: 10.0.0.1
    host_key: "ssh-ed25519 AAAAnotakey"
`, `FILE:4: machine "a": host_key is not a public key in authorized_keys format: ssh: no key found; last parsing error for ignored line: illegal base64 data at input byte 8`},
		{"trust_on_first_use not a boolean", `defaults:
  trust_on_first_use: yes please
machines:
  - {id: a, address: 10.0.0.1, trust_on_first_use: 1}
`, `FILE:2: defaults: trust_on_first_use must be true or false, got "yes please"
FILE:4: machine "a": trust_on_first_use must be true or false, got "1"`},
		{"DSA host_key", `machines:
  - id: a
    address: 10.0.0.1
    host_key: "ssh-dss AAAAB3NzaC1kc3MAAACBAPLUSoXwQ2x8VSNNRzvQdrBmXMlYs1/6sVHyqjmmCHAm4FmQi1sS5w3hCEIrG9JOnXDoR9nZeeuBIC+6N0h6vV34b+cdrjSHpLDkDsNI2x4gOQ0D0YgDTe5r3QWEYVSZ+r7Xx9/rhtCPlcQO8xSG/SCJzzmHoXUyk2ZHQzKoq9PHAAAAFQCY8B9Lf8DnMCoChwgxQmgq+/B3/QAAAIAr/I9VyYQ5mCrtl3DZ6yNN9b8T0c2L3JZxnSPWjyD0BxdgrYxF0ZpZG0TrDXYgeVHfu9h0BgrkqE+gcvMnt3z4b3XlvUJKhR/aRmRdtVvaRcslYUTxpZkZ1N0GmeZdn7JCpOTLUp6HJgdS+4NHxvgbLEmjyeoQxy+b0HVRfKY0ZwAAAIEAwGsxbF4SHyjqgHIL64QWZPDozwq6W6g/ShDNPPVyjYNkCm3bwTEBvYuhu41FP2IfmXDHi3lvV6blRpxP3Dkw3e8wr7oGSzs8zmbDYW8fWvLqsrY6AyemVAv/QwoT3Ulb5uaKE0+jaxbDbPWd4ZIxvzMyaHtT3GcGp7eP1Wlpc1Q="
`, `FILE:4: machine "a": host_key: SSH host keys of type ssh-dss cannot be verified (use an ed25519, ECDSA or RSA key)`},
		{"broken second document", "machines: []\n---\n[\n", `FILE:3: did not find expected node content`},
		{"key not a plain name", "machines:\n  - {[x]: 1, id: a, address: 10.0.0.1}\n", `FILE:2: machine "a": a key must be a plain name, not a list`},
		{"defaults not a mapping", "defaults: 22\nmachines: []\n", `FILE:1: defaults must be a mapping, not a single value`},
		{"empty password file name", `machines:
  - id: a
    address: 10.0.0.1
    ssh_password_file: ""
`, `FILE:4: machine "a": ssh_password_file is empty (leave it out for the default)`},
		{"empty key variable name", `machines:
  - id: a
    address: 10.0.0.1
    ssh_key_env: " "
`, `FILE:4: machine "a": ssh_key_env is empty (leave it out for the default)`},
		{"password file is a directory", `machines:
  - id: a
    address: 10.0.0.1
    ssh_password_file: DIR
`, `FILE:4: machine "a": ssh_password_file: reading DIR: read DIR: is a directory`},
		{"empty reboot_command", `machines:
  - id: a
    address: 10.0.0.1
    reboot_command: ""
`, `FILE:4: machine "a": reboot_command is empty (leave it out for the default)`},
		{"problems everywhere", `machines:
  - id: a
  - id: b
    address: x
  - id: a
    address: 10.0.0.1
`, `FILE:2: machine "a": address is required
FILE:4: machine "b": address "x" is not an IPv4 or IPv6 address
FILE:5: duplicate machine id "a" (first at line 2)`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			path := filepath.Join(dir, "inventory.yaml")
			writeFile(t, filepath.Join(dir, "pw"), "pw\n")
			writeFile(t, filepath.Join(dir, "key"), string(goodKey))
			writeFile(t, filepath.Join(dir, "empty"), "\n")
			writeFile(t, path, strings.ReplaceAll(tt.inventory, "DIR", dir))
			var logs syncBuffer
			_, err := newProvider(Config{Inventory: path, Env: provider.Env{Logger: bufferLogger(&logs)}}, env)
			want := strings.NewReplacer("FILE", path, "DIR", dir).Replace(tt.want)
			if err == nil || err.Error() != want {
				t.Errorf("New() error =\n%v\nwant\n%s", err, want)
			}
			if strings.Contains(tt.inventory, "hunter2") && strings.Contains(fmt.Sprint(err)+logs.String(), "hunter2") {
				t.Errorf("the inline password reached the error or the log: %v\n%s", err, logs.String())
			}
		})
	}
}

// An error lists up to maxProblems problems, each on its line; the rest
// are summed up in one more line.
func TestManyProblems(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		problems  int
		wantLines int
		wantLast  string // the error's last line
	}{
		{maxProblems, maxProblems, "inv.yaml:21: machine \"m19\": address is required"},
		{maxProblems + 1, maxProblems + 1, "inv.yaml: 1 more problems"},
		{30, maxProblems + 1, "inv.yaml: 10 more problems"},
	} {
		t.Run(fmt.Sprint(tt.problems), func(t *testing.T) {
			t.Parallel()
			var inv strings.Builder
			inv.WriteString("machines:\n")
			for i := range tt.problems {
				fmt.Fprintf(&inv, "  - id: m%d\n", i) // no address: one problem each
			}
			_, _, err := parse("inv.yaml", []byte(inv.String()), noEnv)
			if err == nil {
				t.Fatal("no error")
			}
			lines := strings.Split(err.Error(), "\n")
			if len(lines) != tt.wantLines || lines[len(lines)-1] != tt.wantLast {
				t.Errorf("error has %d lines, ending %q; want %d lines, ending %q", len(lines), lines[len(lines)-1], tt.wantLines, tt.wantLast)
			}
		})
	}
}

// A port is a number from 1 to 65535, in a machine and in the defaults:
// both ends are accepted, one past either is refused with FILE:LINE, where
// and the value.
func TestPortBounds(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		port string
		want string // the error; "" means accepted
	}{
		{"1", ""},
		{"65535", ""},
		{"0", `port must be a number from 1 to 65535, got "0"`},
		{"65536", `port must be a number from 1 to 65535, got "65536"`},
	} {
		t.Run(tt.port, func(t *testing.T) {
			t.Parallel()
			for _, c := range []struct{ where, inventory, wantAt string }{
				{"machine", "machines:\n  - id: a\n    address: 10.0.0.1\n    port: " + tt.port + "\n", `inv.yaml:4: machine "a": `},
				{"defaults", "defaults:\n  port: " + tt.port + "\nmachines:\n  - id: a\n    address: 10.0.0.1\n", "inv.yaml:2: defaults: "},
			} {
				inv, _, err := parse("inv.yaml", []byte(c.inventory), noEnv)
				switch {
				case tt.want == "" && err != nil:
					t.Errorf("port %s in the %s: %v, want it accepted", tt.port, c.where, err)
				case tt.want == "" && inv.byID["a"].m.addr.Port() != parsePort(t, tt.port):
					t.Errorf("port %s in the %s: machine a is at %s", tt.port, c.where, inv.byID["a"].m.addr)
				case tt.want != "" && (err == nil || err.Error() != c.wantAt+tt.want):
					t.Errorf("port %s in the %s: error %v, want %q", tt.port, c.where, err, c.wantAt+tt.want)
				}
			}
		})
	}
}

func parsePort(t *testing.T, s string) uint16 {
	t.Helper()
	n, err := strconv.ParseUint(s, 10, 16)
	if err != nil {
		t.Fatal(err)
	}
	return uint16(n)
}

// A secret file may hold up to maxSecretSize bytes: one of exactly that
// size is read whole, one byte more is refused with an error naming the
// file and the limit (a path such as /dev/zero given by mistake must not
// exhaust memory).
func TestSecretFileSizeLimit(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	atLimit := filepath.Join(dir, "at-limit")
	pastLimit := filepath.Join(dir, "past-limit")
	writeFile(t, atLimit, strings.Repeat("p", maxSecretSize-1)+"\n")
	writeFile(t, pastLimit, strings.Repeat("p", maxSecretSize)+"\n")

	inv, _, err := parse("inv.yaml", []byte("machines:\n  - id: a\n    address: 10.0.0.1\n    ssh_password_file: "+atLimit+"\n"), noEnv)
	if err != nil {
		t.Fatalf("a password file of %d bytes: %v", maxSecretSize, err)
	}
	if got := len(inv.byID["a"].password.Reveal()); got != maxSecretSize-1 {
		t.Errorf("a password file of %d bytes gave a password of %d bytes, want %d (all but the newline)", maxSecretSize, got, maxSecretSize-1)
	}

	_, _, err = parse("inv.yaml", []byte("machines:\n  - id: a\n    address: 10.0.0.1\n    ssh_password_file: "+pastLimit+"\n"), noEnv)
	want := fmt.Sprintf(`inv.yaml:4: machine "a": ssh_password_file: %s is larger than %d bytes`, pastLimit, maxSecretSize)
	if err == nil || err.Error() != want {
		t.Errorf("a password file of %d bytes: %v, want %q", maxSecretSize+1, err, want)
	}
}

// A YAML syntax error is reported at its line, whether the file ends with
// a newline or not, and never past the file's last line.
func TestSyntaxErrorLine(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct{ name, inventory, want string }{
		{"no newline at the end", "machines:\n  - id: a\n    address: [10.0.0.1", "inv.yaml:3: did not find expected ',' or ']'"},
		{"newline at the end", "machines:\n  - id: a\n    address: [10.0.0.1\n", "inv.yaml:3: did not find expected ',' or ']'"},
		{"parser problem on the last line", "machines:\n- id: a\n x: 1", "inv.yaml:3: did not find expected key"},
		{"scanner problem", "machines:\n\t- id: a\n", "inv.yaml:2: found character that cannot start any token"},
		{"first line", "machines: [", "inv.yaml:1: did not find expected node content"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, _, err := parse("inv.yaml", []byte(tt.inventory), noEnv)
			if err == nil || err.Error() != tt.want {
				t.Errorf("parse(%q) error = %v, want %q", tt.inventory, err, tt.want)
			}
		})
	}
}

func TestMissingInventory(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "nope.yaml")
	_, err := New(Config{Inventory: path})
	if !errors.Is(err, os.ErrNotExist) || !strings.Contains(err.Error(), path) {
		t.Errorf("New of a missing file: %v, want ErrNotExist naming the path", err)
	}
}

func TestInventoryDetails(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	_, keyPEM := newKey(t)
	writeFile(t, filepath.Join(dir, "pw"), "s3cret\r\n")
	writeFile(t, filepath.Join(dir, "key"), string(keyPEM))
	inv, _, err := parse("inv.yaml", []byte(fmt.Sprintf(`
defaults:
  port: 2222
  ssh_user: ops
  reboot_command: reboot now
machines:
  - id: 007              # a number in YAML, a string to us
    address: fe80::1%%eth0
  - id: b
    address: 10.0.0.2
    port: 22
    ssh_user: admin
    ssh_password_file: %s
    ssh_key_file: %s
    reboot_command: ipmitool power cycle
    location:            # null: no location
    trust_on_first_use: true
  - id: c
    address: 10.0.0.3
    ssh_password_env: PW
`, filepath.Join(dir, "pw"), filepath.Join(dir, "key"))), envMap(map[string]string{"PW": "env pw\n"}))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := ids(inv.list), []string{"007", "b", "c"}; !slices.Equal(got, want) {
		t.Errorf("ids = %v, want %v", got, want)
	}
	a, b, c := inv.byID["007"], inv.byID["b"], inv.byID["c"]
	if a.m.addr.String() != "[fe80::1%eth0]:2222" || a.user != "ops" || a.rebootCommand != "reboot now" || !a.password.Empty() || a.signer != nil {
		t.Errorf("machine 007 = addr %s, user %q, reboot %q, password %v, key %v", a.m.addr, a.user, a.rebootCommand, !a.password.Empty(), a.signer != nil)
	}
	if b.m.addr.String() != "10.0.0.2:22" || b.user != "admin" || b.rebootCommand != "ipmitool power cycle" || b.password.Reveal() != "s3cret" || b.signer == nil {
		t.Errorf("machine b = addr %s, user %q, reboot %q, key %v", b.m.addr, b.user, b.rebootCommand, b.signer != nil)
	}
	if a.trustOnFirstUse || !b.trustOnFirstUse || c.trustOnFirstUse {
		t.Errorf("trust_on_first_use: 007 %v, b %v, c %v; want only b", a.trustOnFirstUse, b.trustOnFirstUse, c.trustOnFirstUse)
	}
	// A variable's value is taken as it is; only a file's line end is cut.
	if c.password.Reveal() != "env pw\n" {
		t.Error("machine c's password from the environment was changed")
	}
}

// trust_on_first_use in the defaults holds for every machine that does not
// say otherwise.
func TestTrustOnFirstUseOverride(t *testing.T) {
	t.Parallel()
	inv, _, err := parse("inv.yaml", []byte(`defaults:
  trust_on_first_use: true
machines:
  - {id: a, address: 10.0.0.1}
  - {id: b, address: 10.0.0.2, trust_on_first_use: false}
`), noEnv)
	if err != nil {
		t.Fatal(err)
	}
	if a, b := inv.byID["a"].trustOnFirstUse, inv.byID["b"].trustOnFirstUse; !a || b {
		t.Errorf("trust_on_first_use: a %v, b %v; want a true from the defaults, b false as it says", a, b)
	}
}

// YAML anchors and aliases stand for the value they name, so a value can
// be written once and used again.
func TestAliases(t *testing.T) {
	t.Parallel()
	inv, _, err := parse("inv.yaml", []byte(`machines:
  - id: a
    address: &ip 10.0.0.1
    ssh_user: &user admin
  - id: b
    address: *ip
    port: 2200
    ssh_user: *user
  - &c {id: c, address: 10.0.0.3}
`), noEnv)
	if err != nil {
		t.Fatal(err)
	}
	b := inv.byID["b"]
	if b.m.addr.String() != "10.0.0.1:2200" || b.user != "admin" {
		t.Errorf("machine b = addr %s, user %q; want 10.0.0.1:2200 and admin, through the aliases", b.m.addr, b.user)
	}
	if got, want := ids(inv.list), []string{"a", "b", "c"}; !slices.Equal(got, want) {
		t.Errorf("ids = %v, want %v", got, want)
	}
}

// A field written with no value (YAML null) is left out: the default
// applies. So is a null defaults section or machines list.
func TestNullMeansDefault(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct{ name, inventory, wantAddr, wantUser string }{
		{"null fields", `defaults:
  ssh_user: ops
  port:
machines:
  - id: a
    address: 10.0.0.1
    port: ~
    ssh_user:
    reboot_command: null
    trust_on_first_use:
`, "10.0.0.1:22", "ops"},
		{"null defaults", "defaults:\nmachines:\n  - {id: a, address: 10.0.0.1}\n", "10.0.0.1:22", ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			inv, _, err := parse("inv.yaml", []byte(tt.inventory), noEnv)
			if err != nil {
				t.Fatal(err)
			}
			a := inv.byID["a"]
			if a.m.addr.String() != tt.wantAddr || a.user != tt.wantUser || a.rebootCommand != defaultRebootCommand || a.trustOnFirstUse {
				t.Errorf("machine a = addr %s, user %q, reboot %q, trust on first use %v; want %s, %q and the defaults",
					a.m.addr, a.user, a.rebootCommand, a.trustOnFirstUse, tt.wantAddr, tt.wantUser)
			}
		})
	}
	inv, _, err := parse("inv.yaml", []byte("machines:\n"), noEnv)
	if err != nil || len(inv.list) != 0 {
		t.Errorf("parse(machines: null) = %v, %v; want an inventory without machines", inv, err)
	}
}
