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
	if got := p.inv.Load().byID["a"].password.Reveal(); got != "new" {
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
	if got := p.inv.Load().byID["a"].password.Reveal(); got != "new" {
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
	password := func() string { return p.inv.Load().byID["a"].password.Reveal() }

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

// A reload logs how the set of machines changed: how many there are, and
// how many arrived and left.
func TestReloadLogsMachinesAddedAndRemoved(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "inventory.yaml")
	writeFile(t, path, "machines:\n  - {id: a, address: 10.0.0.1}\n  - {id: b, address: 10.0.0.2}\n")
	var logs syncBuffer
	p, err := New(Config{Inventory: path, Env: provider.Env{Logger: bufferLogger(&logs)}})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(logs.String(), "inventory reloaded") {
		t.Errorf("New logged a reload:\n%s", logs.String())
	}
	// b leaves; c and d arrive; a stays.
	writeFile(t, path, "machines:\n  - {id: a, address: 10.0.0.1}\n  - {id: c, address: 10.0.0.3}\n  - {id: d, address: 10.0.0.4}\n")
	if err := p.Reload(); err != nil {
		t.Fatal(err)
	}
	if want := "inventory reloaded"; !strings.Contains(logs.String(), `msg="`+want+`"`) ||
		!strings.Contains(logs.String(), "machines=3 added=2 removed=1") {
		t.Errorf("the log does not say that 3 machines are in force, 2 added and 1 removed:\n%s", logs.String())
	}
}

// An unchanged inventory whose secret files are unchanged is not read
// again, however often Run polls; a secret file that breaks it is reported
// once, not at every poll.
func TestPollIgnoresUnchangedSecrets(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "inventory.yaml")
	pwFile, keyFile := filepath.Join(dir, "pw"), filepath.Join(dir, "key")
	_, key := newKey(t)
	writeFile(t, pwFile, "pw\n")
	writeFile(t, keyFile, string(key))
	writeFile(t, path, "machines:\n  - {id: a, address: 10.0.0.1, ssh_password_file: "+pwFile+", ssh_key_file: "+keyFile+"}\n")
	reg := prometheus.NewRegistry()
	var logs syncBuffer
	p, err := New(Config{Inventory: path, Env: provider.Env{Registerer: reg, Logger: bufferLogger(&logs)}})
	if err != nil {
		t.Fatal(err)
	}
	before := logs.String()
	for range 3 {
		p.poll()
	}
	if after := logs.String(); after != before {
		t.Errorf("polls of unchanged files logged:\n%s", strings.TrimPrefix(after, before))
	}

	writeFile(t, keyFile, "not a key\n")
	for range 3 {
		p.poll()
	}
	if e := metricValue(t, reg, metricReloadErrors); e != 1 {
		t.Errorf("reload errors after three polls of a broken key file = %v, want 1", e)
	}
	if n := strings.Count(logs.String(), "inventory is broken"); n != 1 {
		t.Errorf("the broken key file was logged %d times, want once:\n%s", n, logs.String())
	}
}

// Run tells a changed inventory by its size and modification time, so it
// does not read the file every ReloadInterval. An edit that keeps both is
// seen by Reload (SIGHUP), which reads the file whatever changed.
func TestPollTrustsSizeAndModTime(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "inventory.yaml")
	writeFile(t, path, "machines:\n  - {id: a, address: 10.0.0.1}\n")
	p, err := New(Config{Inventory: path})
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte("machines:\n  - {id: b, address: 10.0.0.1}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Chtimes(path, fi.ModTime(), fi.ModTime()); err != nil {
		t.Fatal(err)
	}
	listed := func() []string {
		ms, _ := p.ListMachines(t.Context())
		return ids(ms)
	}
	p.poll()
	if got := listed(); !slices.Equal(got, []string{"a"}) {
		t.Errorf("after a poll of a file with its size and modification time unchanged, ListMachines = %v, want [a]", got)
	}
	if err := p.Reload(); err != nil {
		t.Fatal(err)
	}
	if got := listed(); !slices.Equal(got, []string{"b"}) {
		t.Errorf("after Reload ListMachines = %v, want [b]", got)
	}
}

// A file that can be found but not read (here a directory in its place) is
// reported once, however often Run polls, and the last good inventory
// stays in force until a good file is back.
func TestPollUnreadableInventory(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "inventory.yaml")
	writeFile(t, path, "machines:\n  - {id: a, address: 10.0.0.1}\n")
	reg := prometheus.NewRegistry()
	var logs syncBuffer
	p, err := New(Config{Inventory: path, Env: provider.Env{Registerer: reg, Logger: bufferLogger(&logs)}})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(path, 0o700); err != nil {
		t.Fatal(err)
	}
	for range 3 {
		p.poll()
	}
	if v, e := metricValue(t, reg, metricValid), metricValue(t, reg, metricReloadErrors); v != 0 || e != 1 {
		t.Errorf("after three polls of an unreadable inventory: valid %v, reload errors %v; want 0, 1", v, e)
	}
	if want := "reading inventory: read " + path + ": is a directory"; strings.Count(logs.String(), want) != 1 {
		t.Errorf("the log does not say once that %q:\n%s", want, logs.String())
	}
	if ms, _ := p.ListMachines(t.Context()); !slices.Equal(ids(ms), []string{"a"}) {
		t.Errorf("with the inventory unreadable ListMachines = %v, want the last good [a]", ids(ms))
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	writeFile(t, path, "machines:\n  - {id: b, address: 10.0.0.2}\n")
	p.poll()
	if ms, _ := p.ListMachines(t.Context()); !slices.Equal(ids(ms), []string{"b"}) {
		t.Errorf("with a good file back ListMachines = %v, want [b]", ids(ms))
	}

	// New refuses an unreadable inventory outright.
	if _, err := New(Config{Inventory: t.TempDir()}); err == nil || !strings.Contains(err.Error(), "reading inventory: read ") {
		t.Errorf("New of a directory: %v, want an error reading the inventory", err)
	}
}

// A provider whose metrics cannot all be registered fails to start and
// leaves the registerer as it found it, so that it can be created again
// once the clash is gone.
func TestMetricsClashLeavesRegistererUntouched(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "inventory.yaml")
	writeFile(t, path, "machines: []\n")
	reg := prometheus.NewRegistry()
	// Another provider's series "valid" clashes with the second of the
	// provider's series, not the first.
	other, err := newMetrics(prometheus.NewRegistry(), "static")
	if err != nil {
		t.Fatal(err)
	}
	blocker := other.valid
	reg.MustRegister(blocker)
	if _, err := New(Config{Inventory: path, Env: provider.Env{Registerer: reg}}); err == nil || !strings.Contains(err.Error(), "registering metrics") {
		t.Fatalf("New with a clashing series registered: %v, want an error registering metrics", err)
	}
	reg.Unregister(blocker)
	if _, err := New(Config{Inventory: path, Env: provider.Env{Registerer: reg}}); err != nil {
		t.Errorf("New after the clash is gone: %v", err)
	}
}
