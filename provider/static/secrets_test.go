package static

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/provider"
)

// TestSecretsNeverLeak loads inventories with known secrets, makes every
// kind of error happen, and looks for the secrets in the errors, the log
// and the metrics. It uses the real environment (t.Setenv), so it does not
// run in parallel.
func TestSecretsNeverLeak(t *testing.T) {
	const (
		pwFromFile = "pw-from-file-S3CR3T-1f3a"
		pwFromEnv  = "pw-from-env-S3CR3T-9c2e"
		pwInline   = "pw-inline-S3CR3T-77b0"
		notAKey    = "not-a-key-S3CR3T-5d41"
	)
	_, keyPEM := newKey(t)
	// The key's body, without the armor lines that every key shares.
	keyLines := strings.Split(strings.TrimSpace(string(keyPEM)), "\n")
	keyBody := keyLines[1 : len(keyLines)-1]
	secrets := append([]string{pwFromFile, pwFromEnv, pwInline, notAKey}, keyBody...)

	dir := t.TempDir()
	writeFile(t, filepath.Join(dir, "pw"), pwFromFile+"\n")
	writeFile(t, filepath.Join(dir, "key"), string(keyPEM))
	t.Setenv("STATIC_TEST_PW", pwFromEnv)
	t.Setenv("STATIC_TEST_KEY", string(keyPEM))
	t.Setenv("STATIC_TEST_NOT_A_KEY", notAKey)

	// The server knows none of the credentials, so every reboot fails at
	// authentication, or before with a wrong host key.
	other, _ := newKey(t)
	srv := newSSHServer(t, serverAuth{user: "admin", password: "something else"})
	good := fmt.Sprintf(`machines:
  - {id: pw-file, address: %[1]s, port: %[2]d, host_key: %[3]q, ssh_password_file: %[4]s}
  - {id: pw-env, address: %[1]s, port: %[2]d, host_key: %[3]q, ssh_password_env: STATIC_TEST_PW}
  - {id: key-file, address: %[1]s, port: %[2]d, host_key: %[3]q, ssh_key_file: %[5]s}
  - {id: key-env, address: %[1]s, port: %[2]d, host_key: %[3]q, ssh_key_env: STATIC_TEST_KEY}
  - {id: wrong-host, address: %[1]s, port: %[2]d, host_key: %[6]q, ssh_password_env: STATIC_TEST_PW}
`, srv.addr.Addr(), srv.addr.Port(), authorizedKey(srv.hostKey), filepath.Join(dir, "pw"), filepath.Join(dir, "key"),
		authorizedKey(other.PublicKey()))
	path := filepath.Join(dir, "inventory.yaml")
	writeFile(t, path, good)

	var logs syncBuffer
	reg := prometheus.NewRegistry()
	p, err := New(Config{Inventory: path, Env: provider.Env{Logger: bufferLogger(&logs), Registerer: reg, SSHUser: "admin"}})
	if err != nil {
		t.Fatal(err)
	}
	var seen []string // everything a secret must not be in
	for _, id := range []string{"pw-file", "pw-env", "key-file", "key-env", "wrong-host"} {
		err := p.RebootMachine(t.Context(), id)
		if err == nil {
			t.Errorf("RebootMachine(%s) succeeded against a server that knows none of the credentials", id)
		}
		seen = append(seen, fmt.Sprint(err))
		acc, err := p.SSHAccess(t.Context(), id)
		seen = append(seen, fmt.Sprintf("%v %+v %#v", acc, acc, err))
	}
	ms, _ := p.ListMachines(t.Context())
	seen = append(seen, fmt.Sprintf("%v %+v %#v", ms, ms, ms))

	for _, broken := range []string{
		"machines:\n  - {id: a, address: 10.0.0.1, password: " + pwInline + "}\n",
		"machines:\n  - {id: a, address: 10.0.0.1, ssh_password: " + pwInline + "}\n",
		"machines:\n  - {id: a, address: 10.0.0.1, passwd: " + pwInline + "}\n",
		"machines:\n  - {id: a, address: 10.0.0.1, secret: " + pwInline + "}\n",
		"machines:\n  - {id: a, address: 10.0.0.1, ssh_user: {password: " + pwInline + "}}\n",
		"machines:\n  - {id: a, address: 10.0.0.1, ssh_password: \"" + pwInline + "\n",
		"machines:\n  - id: a\n    address: 10.0.0.1\n    ssh_password: " + pwInline + ": x\n",
		"machines:\n  - {id: a, address: 10.0.0.1, ssh_key: \"" + strings.Join(keyBody, "\\n") + "\"}\n",
		"machines:\n  - {id: a, address: 10.0.0.1, ssh_key_env: STATIC_TEST_NOT_A_KEY}\n",
		"machines:\n  - {id: a, address: 10.0.0.1, ssh_key_file: " + filepath.Join(dir, "pw") + "}\n",
		"machines:\n  - {id: a, address: 10.0.0.1, ssh_password_file: " + filepath.Join(dir, "pw") + ", ssh_password_env: STATIC_TEST_PW}\n",
		good + "  - {id: pw-file, address: 10.0.0.1, ssh_password_file: " + filepath.Join(dir, "pw") + "}\n",
	} {
		writeFile(t, path, broken)
		err := p.Reload()
		if err == nil {
			t.Errorf("Reload of a broken inventory succeeded:\n%s", broken)
		}
		seen = append(seen, fmt.Sprint(err))
	}

	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	seen = append(seen, logs.String(), fmt.Sprint(mfs))

	all := strings.Join(seen, "\n")
	for _, s := range secrets {
		if strings.Contains(all, s) {
			t.Errorf("secret %q leaked into the errors, logs or metrics:\n%s", s, all)
		}
	}
	if t.Failed() {
		t.Logf("errors, logs and metrics checked:\n%s", all)
	}
}
