package static

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/provider"
)

const (
	metricMachines     = "shepherd_static_inventory_machines"
	metricValid        = "shepherd_static_inventory_valid"
	metricReloadErrors = "shepherd_static_inventory_reload_errors_total"
)

func TestReload(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "inventory.yaml")
	writeFile(t, path, `machines:
  - id: a
    address: 10.0.0.1
  - id: b
    address: 10.0.0.2
`)
	reg := prometheus.NewRegistry()
	var logs syncBuffer
	p, err := New(Config{Inventory: path, ReloadInterval: 10 * time.Millisecond,
		Env: provider.Env{Registerer: reg, Logger: bufferLogger(&logs)}})
	if err != nil {
		t.Fatal(err)
	}
	listed := func() []string {
		ms, err := p.ListMachines(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		return ids(ms)
	}
	gauges := func() (machines, valid, errs float64) {
		return metricValue(t, reg, metricMachines), metricValue(t, reg, metricValid), metricValue(t, reg, metricReloadErrors)
	}
	if m, v, e := gauges(); m != 2 || v != 1 || e != 0 {
		t.Errorf("after New: machines %v, valid %v, reload errors %v; want 2, 1, 0", m, v, e)
	}
	runProvider(t, p)

	// A broken file is counted once and changes nothing.
	writeFile(t, path, `machines:
  - id: a
    address: 10.0.0.1
  - id: b
    adress: 10.0.0.2
`)
	waitFor(t, 10*time.Second, "the reload error is counted", func() bool { return metricValue(t, reg, metricReloadErrors) == 1 })
	if got := listed(); !slices.Equal(got, []string{"a", "b"}) {
		t.Errorf("with a broken file ListMachines = %v, want the last good [a b]", got)
	}
	if m, v, _ := gauges(); m != 2 || v != 0 {
		t.Errorf("with a broken file: machines %v, valid %v; want 2, 0", m, v)
	}
	if !strings.Contains(logs.String(), path+`:5: machine \"b\": unknown field \"adress\"`) {
		t.Errorf("the log does not name FILE:LINE of the problem:\n%s", logs.String())
	}

	// A good file replaces the inventory: b leaves, c arrives.
	writeFile(t, path, `machines:
  - id: c
    address: 10.0.0.3
  - id: a
    address: 10.0.0.1
`)
	waitFor(t, 10*time.Second, "ListMachines shows the new file", func() bool { return slices.Equal(listed(), []string{"a", "c"}) })
	if m, v, e := gauges(); m != 2 || v != 1 || e != 1 {
		t.Errorf("after a good file: machines %v, valid %v, reload errors %v; want 2, 1, 1", m, v, e)
	}

	// A file that disappears is an error too; the inventory stays.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the missing file is counted", func() bool { return metricValue(t, reg, metricReloadErrors) == 2 })
	if got := listed(); !slices.Equal(got, []string{"a", "c"}) {
		t.Errorf("with the file gone ListMachines = %v, want [a c]", got)
	}
	writeFile(t, path, "machines: []\n")
	waitFor(t, 10*time.Second, "an empty list is in force", func() bool { return len(listed()) == 0 })
	if m, v, e := gauges(); m != 0 || v != 1 || e != 2 {
		t.Errorf("after machines: []: machines %v, valid %v, reload errors %v; want 0, 1, 2", m, v, e)
	}
}

func TestReloadNow(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "inventory.yaml")
	pwFile := filepath.Join(dir, "pw")
	writeFile(t, pwFile, "old\n")
	writeFile(t, path, "machines:\n  - id: a\n    address: 10.0.0.1\n    ssh_password_file: "+pwFile+"\n")
	reg := prometheus.NewRegistry()
	p, err := New(Config{Inventory: path, Env: provider.Env{Registerer: reg}})
	if err != nil {
		t.Fatal(err)
	}
	// A rotated secret is picked up by Reload though the inventory is unchanged.
	writeFile(t, pwFile, "new\n")
	if err := p.Reload(); err != nil {
		t.Fatal(err)
	}
	if got := p.inv.Load().byID["a"].password.reveal(); got != "new" {
		t.Errorf("after Reload the password is %q, want the rotated one", got)
	}
	// A secret that is gone makes Reload fail and keeps the inventory.
	if err := os.Remove(pwFile); err != nil {
		t.Fatal(err)
	}
	err = p.Reload()
	if err == nil || !strings.HasPrefix(err.Error(), path+`:4: machine "a": ssh_password_file: open `) {
		t.Errorf("Reload with the password file gone: %v", err)
	}
	if got := p.inv.Load().byID["a"].password.reveal(); got != "new" {
		t.Errorf("after a failed Reload the password is %q, want the last good one", got)
	}
	if v, e := metricValue(t, reg, metricValid), metricValue(t, reg, metricReloadErrors); v != 0 || e != 1 {
		t.Errorf("after a failed Reload: valid %v, reload errors %v; want 0, 1", v, e)
	}
}

// A file rewritten with the same contents is not parsed (or counted) again,
// and an unchanged file is not even read.
func TestPollSkipsUnchanged(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "inventory.yaml")
	writeFile(t, path, "machines: []\n")
	reg := prometheus.NewRegistry()
	p, err := New(Config{Inventory: path, Env: provider.Env{Registerer: reg}})
	if err != nil {
		t.Fatal(err)
	}
	touch := func(ago time.Duration) {
		t.Helper()
		at := time.Now().Add(-ago)
		if err := os.Chtimes(path, at, at); err != nil {
			t.Fatal(err)
		}
	}
	const broken = "machines:\n  - id: a\n"
	writeFile(t, path, broken)
	touch(time.Hour)
	p.poll()
	if e := metricValue(t, reg, metricReloadErrors); e != 1 {
		t.Fatalf("reload errors after a broken file = %v, want 1", e)
	}
	writeFile(t, path, broken)
	touch(time.Minute) // surely another mtime than the first write's
	p.poll()
	p.poll()
	if e := metricValue(t, reg, metricReloadErrors); e != 1 {
		t.Errorf("reload errors after rewriting the same broken file = %v, want still 1", e)
	}
	writeFile(t, path, "machines: []\n")
	touch(0)
	p.poll()
	if v, e := metricValue(t, reg, metricValid), metricValue(t, reg, metricReloadErrors); v != 1 || e != 1 {
		t.Errorf("after a good file: valid %v, reload errors %v; want 1, 1", v, e)
	}
}

// TestPollPicksUpRotatedSecrets rotates the secret files an unchanged
// inventory names, the ways operators and tools do it: renamed over the old
// file, rewritten in place with the same size, removed and put back. Each
// time Run reads the inventory and its secrets again by itself.
func TestPollPicksUpRotatedSecrets(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "inventory.yaml")
	pwFile, keyFile := filepath.Join(dir, "pw"), filepath.Join(dir, "key")
	_, key1 := newKey(t)
	signer2, key2 := newKey(t)
	writeFile(t, pwFile, "pw-1-S3CR3T\n")
	writeFile(t, keyFile, string(key1))
	writeFile(t, path, "machines:\n  - {id: a, address: 10.0.0.1, ssh_password_file: "+pwFile+"}\n  - {id: b, address: 10.0.0.2, ssh_key_file: "+keyFile+"}\n")
	reg := prometheus.NewRegistry()
	var logs syncBuffer
	p, err := New(Config{Inventory: path, ReloadInterval: 10 * time.Millisecond, Env: provider.Env{Registerer: reg, Logger: bufferLogger(&logs)}})
	if err != nil {
		t.Fatal(err)
	}
	runProvider(t, p)
	password := func() string { return p.inv.Load().byID["a"].password.reveal() }

	// Renamed over the old file (a new inode, the same size).
	writeFile(t, pwFile, "pw-2-S3CR3T\n")
	waitFor(t, 10*time.Second, "the password renamed over the old file is in force", func() bool { return password() == "pw-2-S3CR3T" })

	// Rewritten in place with the same size (a new modification time).
	if err := os.WriteFile(pwFile, []byte("pw-3-S3CR3T\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	later := time.Now().Add(time.Minute)
	if err := os.Chtimes(pwFile, later, later); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the password rewritten in place is in force", func() bool { return password() == "pw-3-S3CR3T" })

	// A rotated key.
	writeFile(t, keyFile, string(key2))
	waitFor(t, 10*time.Second, "the rotated key is in force", func() bool {
		return string(p.inv.Load().byID["b"].signer.PublicKey().Marshal()) == string(signer2.PublicKey().Marshal())
	})

	// Removed: the inventory is broken, once, and the last good one stays;
	// put back, it is read again.
	if err := os.Remove(pwFile); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 10*time.Second, "the missing secret file is counted", func() bool { return metricValue(t, reg, metricReloadErrors) == 1 })
	if password() != "pw-3-S3CR3T" {
		t.Errorf("with the secret file gone the password is %q, want the last good one", password())
	}
	writeFile(t, pwFile, "pw-4-S3CR3T\n")
	waitFor(t, 10*time.Second, "the secret file put back is in force", func() bool { return password() == "pw-4-S3CR3T" })
	if e := metricValue(t, reg, metricReloadErrors); e != 1 {
		t.Errorf("reload errors = %v, want 1", e)
	}
	for _, secret := range []string{"pw-1-S3CR3T", "pw-2-S3CR3T", "pw-3-S3CR3T", "pw-4-S3CR3T"} {
		if strings.Contains(logs.String(), secret) {
			t.Errorf("the log holds the password %q:\n%s", secret, logs.String())
		}
	}
	if !strings.Contains(logs.String(), "secret_file="+pwFile) {
		t.Errorf("the log does not say which secret file changed:\n%s", logs.String())
	}
}
