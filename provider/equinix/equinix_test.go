package equinix_test

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"log/slog"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/provider"
	"github.com/shepherd/shepherd/provider/equinix"
	"github.com/shepherd/shepherd/provider/equinix/fakemetal"
	"github.com/shepherd/shepherd/provider/equinix/metal"
	"github.com/shepherd/shepherd/provider/providertest"
)

func TestMain(m *testing.M) { bmdbtest.Main(m) }

const (
	token   = "metal-token-5ecret-do-not-log"
	project = "proj-a"
)

// syncBuffer collects log output from many goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// fixture is a fake Metal API over real HTTP and a provider using it.
type fixture struct {
	fake *fakemetal.Server
	srv  *httptest.Server
	p    *equinix.Provider
	key  ssh.PublicKey // the provider's SSH key
	logs *syncBuffer
	fc   fixtureConfig
}

type fixtureConfig struct {
	reservations int
	fake         fakemetal.Config
	client       metal.Config
	provider     equinix.Config
}

func newFixture(t *testing.T, fc fixtureConfig) *fixture {
	t.Helper()
	fc.fake.Token = token
	fake, err := fakemetal.New(fc.fake)
	if err != nil {
		t.Fatal(err)
	}
	fake.AddProject(project)
	fake.AddReservations(project, "c3.small.x86", "fr2", "fr", fc.reservations)
	srv := httptest.NewServer(fake)
	t.Cleanup(srv.Close)
	f := &fixture{fake: fake, srv: srv, logs: &syncBuffer{}, fc: fc}
	f.p, f.key = f.newProvider(t, fc.client)
	return f
}

// newProvider starts another provider on the fixture's fake account, as
// another process would: a client of its own (configured as cc, with the
// fixture's defaults for what cc leaves zero) and an SSH key of its own.
func (f *fixture) newProvider(t *testing.T, cc metal.Config) (*equinix.Provider, ssh.PublicKey) {
	t.Helper()
	log := slog.New(slog.NewTextHandler(f.logs, &slog.HandlerOptions{Level: slog.LevelDebug}))
	cc.BaseURL, cc.Token, cc.Logger = f.srv.URL+"/metal/v1", token, log
	if cc.RequestsPerSecond == 0 {
		cc.RequestsPerSecond, cc.Burst = 200, 50
	}
	client, err := metal.New(cc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(client.CloseIdleConnections)
	signer := newSigner(t)
	pc := f.fc.provider
	pc.Project, pc.Client, pc.OperatingSystem, pc.SSHKey, pc.Logger = project, client, "ubuntu_22_04", signer.PublicKey(), log
	pc.StatePollInterval = cmpOr(pc.StatePollInterval, 20*time.Millisecond)
	pc.RebootSettle = cmpOr(pc.RebootSettle, time.Second)
	p, err := equinix.New(t.Context(), pc)
	if err != nil {
		t.Fatal(err)
	}
	return p, signer.PublicKey()
}

// newSigner returns a new SSH key, as a process makes in its data
// directory.
func newSigner(t *testing.T) ssh.Signer {
	t.Helper()
	_, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	signer, err := ssh.NewSignerFromKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return signer
}

func cmpOr(a, b time.Duration) time.Duration {
	if a != 0 {
		return a
	}
	return b
}

func TestContract(t *testing.T) {
	t.Parallel()
	var fakes sync.Map // *equinix.Provider → *fakemetal.Server
	providertest.Run(t, providertest.Harness{
		New: func(t *testing.T) provider.Provider {
			f := newFixture(t, fixtureConfig{reservations: 3, fake: fakemetal.Config{ProvisionDelay: 10 * time.Millisecond, RebootDelay: 50 * time.Millisecond}})
			// A foreign device: listed, never ours.
			f.fake.AddDevice(project, fakemetal.DeviceSpec{Hostname: "someone-elses", State: "active"})
			fakes.Store(f.p, f.fake)
			return f.p
		},
		CanReboot: true,
		AfterReboot: func(t *testing.T, p provider.Provider, id string) {
			// The API accepted exactly one reboot, and the provider returned
			// only once the device was active again.
			v, _ := fakes.Load(p)
			fake := v.(*fakemetal.Server)
			if n := fake.Reboots(id); n != 1 {
				t.Errorf("the API accepted %d reboots of %s, want 1", n, id)
			}
			for _, d := range fake.Devices(project) {
				if d.ID == id && d.State != "active" {
					t.Errorf("device %s is %q after RebootMachine returned, want active", id, d.State)
				}
			}
		},
	})
}

// TestSSHKeysOfSeveralProcesses starts providers with different SSH keys
// (processes with data directories of their own) on one project: each
// key is registered once and stays, none overwrites another, and a device
// any of them creates trusts every one of them, so that whichever process's
// initializer claims it can take it over.
func TestSSHKeysOfSeveralProcesses(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureConfig{reservations: 2, fake: fakemetal.Config{ProvisionDelay: time.Millisecond}})
	f.fake.AddSSHKey(project, "someone's laptop", someoneElsesKey(t))
	b, bKey := f.newProvider(t, metal.Config{})
	f.newProvider(t, metal.Config{}) // a third process, a third key
	// A restart of the first process (the same key) registers nothing new.
	restarted, err := equinix.New(t.Context(), equinix.Config{Project: project, Client: mustClient(t, f), OperatingSystem: "ubuntu_22_04", SSHKey: f.key})
	if err != nil {
		t.Fatal(err)
	}

	authorized := func(k ssh.PublicKey) string { return strings.TrimSpace(string(ssh.MarshalAuthorizedKey(k))) }
	byKey := map[string][]string{} // authorized key → ids of project keys holding it
	var ids []string
	for _, k := range f.fake.SSHKeys(project) {
		byKey[strings.TrimSpace(k.Key)] = append(byKey[strings.TrimSpace(k.Key)], k.ID)
		ids = append(ids, k.ID)
	}
	// Three keys of ours, and someone else's.
	if len(ids) != 4 {
		t.Errorf("the project has %d SSH keys after three keys were registered and one restarted, want 4 (with someone else's): %+v", len(ids), f.fake.SSHKeys(project))
	}
	for name, k := range map[string]ssh.PublicKey{"first": f.key, "second": bKey} {
		if n := len(byKey[authorized(k)]); n != 1 {
			t.Errorf("the %s process's key is in the project %d times, want once", name, n)
		}
	}

	capacity := func() provider.Machine {
		t.Helper()
		ms, err := restarted.ListMachines(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range ms {
			if m.Availability() == provider.KnownUnused {
				return m
			}
		}
		t.Fatal("no capacity left")
		return nil
	}
	for name, p := range map[string]*equinix.Provider{"first": f.p, "second": b} {
		m, err := p.CreateMachine(t.Context(), provider.CreateRequest{From: capacity(), Session: uuid.New()})
		if err != nil {
			t.Fatal(err)
		}
		d, _ := f.fake.Device(m.ID())
		trusted := map[string]bool{}
		for _, id := range d.SSHKeyIDs {
			for k, kids := range byKey {
				if slices.Contains(kids, id) {
					trusted[k] = true
				}
			}
		}
		for owner, k := range map[string]ssh.PublicKey{"first": f.key, "second": bKey} {
			if !trusted[authorized(k)] {
				t.Errorf("the device the %s process created does not trust the %s process's key (keys %v)", name, owner, d.SSHKeyIDs)
			}
		}
		if trusted[someoneElsesKey(t)] {
			t.Errorf("the device the %s process created trusts a project key that is not Shepherd's", name)
		}
	}
}

// someoneElsesKey is a fixed authorized key that no provider in the tests
// uses.
func someoneElsesKey(t *testing.T) string {
	t.Helper()
	pub, _, err := ed25519.GenerateKey(bytes.NewReader(make([]byte, 64)))
	if err != nil {
		t.Fatal(err)
	}
	k, err := ssh.NewPublicKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(ssh.MarshalAuthorizedKey(k)))
}

// mustClient is a client of the fixture's account with the fixture's
// defaults.
func mustClient(t *testing.T, f *fixture) *metal.Client {
	t.Helper()
	c, err := metal.New(metal.Config{BaseURL: f.srv.URL + "/metal/v1", Token: token, RequestsPerSecond: 200, Burst: 50})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.CloseIdleConnections)
	return c
}

// TestFaultyProvisioning provisions 200 reservations with the real
// provisioner while a fifth of the API's answers are faults (SPEC §8 R4).
func TestFaultyProvisioning(t *testing.T) {
	t.Parallel()
	const n = 200
	f := newFixture(t, fixtureConfig{
		reservations: n,
		fake: fakemetal.Config{
			ProvisionDelay: 10 * time.Millisecond,
			Budget:         100, Burst: 20,
		},
		client: metal.Config{RequestsPerSecond: 80, Burst: 20, CallTimeout: 500 * time.Millisecond, RetryDeadline: time.Minute},
	})
	f.fake.AddDevice(project, fakemetal.DeviceSpec{Hostname: "foreign-1", State: "active"})
	f.fake.SetFaults(fakemetal.Faults{Rate: 0.2, TooManyRequests: 1, ServerError: 1, Timeout: 1, LostCreate: 1,
		RetryAfter: time.Second, Slow: 2 * time.Second})

	db := bmdbtest.New(t)
	pr, err := manager.NewProvisioner(manager.ProvisionerConfig{ChunkSize: 50, CreateLimit: manager.Limit{Every: time.Millisecond, Burst: 50}}, db.DB, f.p, prometheus.NewRegistry(), slog.New(slog.NewTextHandler(f.logs, nil)))
	if err != nil {
		t.Fatal(err)
	}
	s := bmdbtest.Session(t, db, "provisioner", time.Minute)
	var passErrs []string
	bmdbtest.WaitFor(t, 5*time.Minute, "every reservation provisioned", func(ctx context.Context) (bool, error) {
		if _, err := pr.Pass(ctx, s); err != nil {
			passErrs = append(passErrs, err.Error())
		}
		refs, err := db.ListProvided(ctx, "equinix")
		return len(refs) == n, err
	})
	f.fake.SetFaults(fakemetal.Faults{})

	// Every reservation has exactly one device, every device of ours is in
	// the BMDB exactly once, and the foreign device is not.
	devices := map[string]string{} // reservation → device
	ours := map[string]bool{}
	for _, d := range f.fake.Devices(project) {
		if d.Hostname == "foreign-1" {
			continue
		}
		if prev, dup := devices[d.ReservationID]; dup {
			t.Errorf("reservation %s has two devices: %s and %s", d.ReservationID, prev, d.ID)
		}
		devices[d.ReservationID] = d.ID
		ours[d.ID] = true
	}
	if len(devices) != n {
		t.Errorf("%d reservations have a device, want %d", len(devices), n)
	}
	for _, r := range f.fake.Reservations(project) {
		if r.DeviceID == "" {
			t.Errorf("reservation %s was left without a device", r.ID)
		}
	}
	refs, err := db.ListProvided(t.Context(), "equinix")
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, r := range refs {
		if seen[r.ProviderID] {
			t.Errorf("device %s is in the BMDB twice", r.ProviderID)
		}
		seen[r.ProviderID] = true
		if !ours[r.ProviderID] {
			t.Errorf("the BMDB has %s, which is no device of ours at the provider", r.ProviderID)
		}
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM machine_provided WHERE provider = 'equinix'"); n != int64(len(refs)) {
		t.Errorf("machine_provided has %d rows, ListProvided %d", n, len(refs))
	}

	// The fake saw the configured budget kept and every Retry-After honoured.
	if v := f.fake.Check(); len(v) > 0 {
		t.Errorf("the client misbehaved towards the API (%d violations), first: %s", len(v), v[0])
	}
	faults := map[string]int{}
	for _, r := range f.fake.Requests() {
		faults[r.Fault]++
	}
	t.Logf("requests by fault: %v; failed passes: %d", faults, len(passErrs))
	for _, kind := range []string{"429", "5xx", "timeout", "lost-create"} {
		if faults[kind] == 0 {
			t.Errorf("no %s fault was injected: the run did not test it", kind)
		}
	}
	// The token never reaches logs or errors.
	if strings.Contains(f.logs.String(), token) || strings.Contains(strings.Join(passErrs, "\n"), token) {
		t.Error("the API token appears in the logs or errors")
	}
}

// TestAdoptionAfterCrash: a device created at the provider whose BMDB insert
// never happened (the process died in between) is adopted by the next
// pass; a foreign device is left alone.
func TestAdoptionAfterCrash(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureConfig{reservations: 3, fake: fakemetal.Config{ProvisionDelay: 10 * time.Millisecond}})
	foreign := f.fake.AddDevice(project, fakemetal.DeviceSpec{Hostname: "db-primary", State: "active"})
	ms, err := f.p.ListMachines(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	var capacity provider.Machine
	for _, m := range ms {
		if m.Availability() == provider.KnownUnused {
			capacity = m
			break
		}
	}
	// The "crash": created at the provider, never recorded.
	orphan, err := f.p.CreateMachine(t.Context(), provider.CreateRequest{From: capacity, Session: uuid.New()})
	if err != nil {
		t.Fatal(err)
	}
	db := bmdbtest.New(t)
	pr, err := manager.NewProvisioner(manager.ProvisionerConfig{MaxMachines: 1}, db.DB, f.p, prometheus.NewRegistry(), nil)
	if err != nil {
		t.Fatal(err)
	}
	s := bmdbtest.Session(t, db, "provisioner", time.Minute)
	r, err := pr.Pass(t.Context(), s)
	if err != nil {
		t.Fatal(err)
	}
	if r.Adopted != 1 || r.Created != 0 || r.Foreign != 1 {
		t.Errorf("pass after the crash: %+v, want the orphan adopted, nothing created (MaxMachines 1), the foreign device counted", r)
	}
	if _, err := db.MachineByProviderID(t.Context(), "equinix", orphan.ID()); err != nil {
		t.Errorf("the orphan %s is not in the BMDB: %v", orphan.ID(), err)
	}
	if _, err := db.MachineByProviderID(t.Context(), "equinix", foreign); !errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("the foreign device: %v, want it left out of the BMDB", err)
	}
	for _, d := range f.fake.Devices(project) {
		if d.ID == foreign && d.State != "active" {
			t.Errorf("the foreign device changed: %+v", d)
		}
	}
}

// TestRebootWaitsForActive: RebootMachine returns once the device is active
// again, not before.
func TestRebootWaitsForActive(t *testing.T) {
	t.Parallel()
	f := newFixture(t, fixtureConfig{reservations: 1, fake: fakemetal.Config{ProvisionDelay: time.Millisecond, RebootDelay: 300 * time.Millisecond}})
	ms, err := f.p.ListMachines(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	m, err := f.p.CreateMachine(t.Context(), provider.CreateRequest{From: ms[0], Session: uuid.New()})
	if err != nil {
		t.Fatal(err)
	}
	bmdbtest.WaitFor(t, 10*time.Second, "device active", func(ctx context.Context) (bool, error) {
		got, err := f.p.GetMachine(ctx, m.ID())
		return err == nil && got.(provider.Described).Status() == provider.StatusRunning && got.Addr().IsValid(), err
	})
	start := time.Now()
	if err := f.p.RebootMachine(t.Context(), m.ID()); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took < 300*time.Millisecond {
		t.Errorf("RebootMachine returned after %s, before the device could be active again (300ms)", took)
	}
	if n := f.fake.Reboots(m.ID()); n != 1 {
		t.Errorf("the API accepted %d reboots, want 1", n)
	}
	for _, d := range f.fake.Devices(project) {
		if d.ID == m.ID() && d.State != "active" {
			t.Errorf("device state %q after RebootMachine returned, want active", d.State)
		}
	}
	// Not ours: refused without touching the API's device.
	foreign := f.fake.AddDevice(project, fakemetal.DeviceSpec{Hostname: "web-1", State: "active"})
	if err := f.p.RebootMachine(t.Context(), foreign); err == nil {
		t.Error("RebootMachine of a foreign device succeeded")
	}
	if n := f.fake.Reboots(foreign); n != 0 {
		t.Errorf("the foreign device was rebooted %d times", n)
	}
}

func TestParseConfig(t *testing.T) {
	t.Parallel()
	env := func(k string) string {
		if k == "METAL_TOKEN" {
			return token
		}
		return ""
	}
	good := "project: p\noperating_system: ubuntu_22_04\ntoken_env: METAL_TOKEN\n"
	fc, err := equinix.ParseConfig([]byte(good), env)
	if err != nil {
		t.Fatal(err)
	}
	if fc.Client.Token != token || fc.Provider.Project != "p" {
		t.Errorf("parsed %+v", fc.Provider)
	}
	for _, tt := range []struct{ name, yaml, want string }{
		{"no token", "project: p\noperating_system: x\n", "token_file or token_env is required"},
		{"empty env", "project: p\noperating_system: x\ntoken_env: NOPE\n", "NOPE is empty or unset"},
		{"both", "project: p\noperating_system: x\ntoken_env: A\ntoken_file: /x\n", "exclusive"},
		{"no project", "operating_system: x\ntoken_env: METAL_TOKEN\n", "project is required"},
		{"no os", "project: p\ntoken_env: METAL_TOKEN\n", "operating_system is required"},
		{"unknown key", good + "tokn: x\n", "tokn"},
		{"token inline is unknown", good + "token: " + token + "\n", "field token not found"},
	} {
		_, err := equinix.ParseConfig([]byte(tt.yaml), env)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: %v, want %q", tt.name, err, tt.want)
		}
		if err != nil && strings.Contains(err.Error(), token) {
			t.Errorf("%s: the error shows the token", tt.name)
		}
	}
}

// TestUpdaterMissing: a device deleted at the provider becomes Missing
// through the updater; a listing that lacks an implausible share of the
// devices changes nothing and says so.
func TestUpdaterMissing(t *testing.T) {
	t.Parallel()
	const n = 10
	f := newFixture(t, fixtureConfig{reservations: n, fake: fakemetal.Config{ProvisionDelay: time.Millisecond}})
	db := bmdbtest.New(t)
	reg := prometheus.NewRegistry()
	pr, err := manager.NewProvisioner(manager.ProvisionerConfig{}, db.DB, f.p, reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	up, err := manager.NewUpdater(manager.UpdaterConfig{}, db.DB, f.p, reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	s := bmdbtest.Session(t, db, "manager", time.Minute)
	if r, err := pr.Pass(t.Context(), s); err != nil || r.Created != n {
		t.Fatalf("provisioning pass: %+v, %v", r, err)
	}
	// Once the devices are active, the updater records them Running.
	bmdbtest.WaitFor(t, 10*time.Second, "every device Running in the BMDB", func(ctx context.Context) (bool, error) {
		if _, err := up.Pass(ctx, s); err != nil {
			return false, err
		}
		refs, err := db.ListProvided(ctx, "equinix")
		if err != nil || len(refs) != n {
			return false, err
		}
		for _, r := range refs {
			if r.Status != bmdb.ProviderStatusRunning {
				return false, nil
			}
		}
		return true, nil
	})
	status := func() map[string]bmdb.ProviderStatus {
		refs, err := db.ListProvided(t.Context(), "equinix")
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]bmdb.ProviderStatus{}
		for _, r := range refs {
			out[r.ProviderID] = r.Status
		}
		return out
	}
	devices := f.fake.Devices(project)

	// One device deleted in the portal: Missing after the next pass.
	if !f.fake.DeleteDevice(devices[0].ID) {
		t.Fatal("the fake did not delete the device")
	}
	r, err := up.Pass(t.Context(), s)
	if err != nil {
		t.Fatal(err)
	}
	if r.MarkedMissing != 1 || r.Suspect {
		t.Errorf("pass after deleting one device: %+v, want it marked Missing", r)
	}
	if got := status()[devices[0].ID]; got != bmdb.ProviderStatusMissing {
		t.Errorf("the deleted device has status %q, want Missing", got)
	}

	// Half of the devices vanish from one listing: implausible. Nothing
	// changes, and the result and the metric say why.
	before := status()
	for _, d := range devices[1 : n/2+1] {
		f.fake.DeleteDevice(d.ID)
	}
	r, err = up.Pass(t.Context(), s)
	if err != nil {
		t.Fatal(err)
	}
	if !r.Suspect || r.MarkedMissing != 0 {
		t.Errorf("pass with half the devices gone: %+v, want a suspect listing and nothing marked", r)
	}
	after := status()
	for id, st := range before {
		if after[id] != st {
			t.Errorf("device %s went from %q to %q on a suspect listing", id, st, after[id])
		}
	}
	if v := counterValue(t, reg, "shepherd_updater_passes_total", "result", "suspect"); v < 1 {
		t.Errorf("shepherd_updater_passes_total{result=suspect} = %v, want it counted", v)
	}
}

// counterValue returns the value of the counter family name whose label
// has value v (summed over other labels).
func counterValue(t *testing.T, reg *prometheus.Registry, name, label, v string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == label && l.GetValue() == v {
					sum += m.GetCounter().GetValue()
				}
			}
		}
	}
	return sum
}
