package static

import (
	"bytes"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/shepherd/shepherd/ladder"
	"github.com/shepherd/shepherd/provider"
)

// fuzzSecret is what every secret file and variable holds in FuzzParse.
const fuzzSecret = "FUZZ-S3CR3T-value"

// problemLine is the form of each line of a parse error.
var problemLine = regexp.MustCompile(`^F:[1-9][0-9]*: .|^F: [0-9]+ more problems$`)

// FuzzParse feeds the inventory parser arbitrary files: it must not panic,
// must return an inventory or an error made of FILE:LINE lines, must never
// put a secret it read in the error, and what it accepts must be valid.
func FuzzParse(f *testing.F) {
	f.Add([]byte("machines: []\n"))
	f.Add([]byte(`defaults:
  port: 2222
  ssh_user: root
  reboot_command: systemctl reboot
machines:
  - id: rack1-node7
    address: 10.0.0.7
    port: 22
    location: fra1/rack1
    ssh_user: admin
    ssh_password_file: /pw
    ssh_key_env: KEY
    host_key: "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIEmFdmJ5VsJOYqPAoNXWh7M0kd5x4v1vFqQ4sEJ0eM9l"
  - {id: "n 2", address: "2001:db8::2", ssh_password_env: PW}
  - id: n2
    address: fe80::1%eth0
`))
	f.Add([]byte("machines:\n  - id: a\n    address: [1\n"))
	f.Add([]byte("machines:\n  - &x {id: a, address: 10.0.0.1}\n  - *x\n"))
	f.Add([]byte("machines:\n  - id: a\n    password: x\n    ssh_key: y\n"))
	f.Add([]byte("a: &a [*a]\n"))
	f.Add([]byte(`defaults:
  recovery_rungs: [agent, reboot]
machines:
  - {id: a, address: 10.0.0.1, recovery_rungs: [power, agent], bmc: {driver: ipmi, address: 10.1.0.1, username: u, password_env: PW}}
  - {id: b, address: 10.0.0.2, recovery_rungs: [reinstall]}
  - {id: c, address: 10.0.0.3, recovery_rungs: [power]}
`))
	f.Fuzz(func(t *testing.T, data []byte) {
		env := func(string) (string, bool) { return fuzzSecret, true }
		read := func(string) ([]byte, fileID, error) { return []byte(fuzzSecret + "\n"), fileID{}, nil }
		inv, _, err := parseWith("F", data, env, read, nil)
		if (inv == nil) == (err == nil) {
			t.Fatalf("parse returned %v and %v", inv, err)
		}
		if err != nil {
			for _, line := range strings.Split(err.Error(), "\n") {
				if !problemLine.MatchString(line) {
					t.Errorf("error line %q is not FILE:LINE: problem", line)
				}
			}
			if !bytes.Contains(data, []byte(fuzzSecret)) && strings.Contains(err.Error(), fuzzSecret) {
				t.Errorf("the error contains the secret: %v", err)
			}
			return
		}
		got := ids(inv.list)
		if !slices.IsSorted(got) || len(slices.Compact(slices.Clone(got))) != len(got) || len(inv.byID) != len(got) {
			t.Errorf("ids %v are not sorted and unique", got)
		}
		for _, m := range inv.list {
			if !provider.ValidID(m.id) || !m.addr.IsValid() || m.addr.Port() == 0 {
				t.Errorf("accepted machine %q at %s", m.id, m.addr)
			}
			e := inv.byID[m.id]
			if e.rebootCommand == "" {
				t.Errorf("machine %q has no reboot command", m.id)
			}
			if e.rungs != nil {
				if ordered, err := checkRungs(e.rungs); err != nil || !slices.Equal(ordered, e.rungs) || slices.Contains(e.rungs, ladder.Power) && e.bmc == nil {
					t.Errorf("machine %q has the recovery ladder %v (BMC %v)", m.id, e.rungs, e.bmc)
				}
			}
		}
	})
}
