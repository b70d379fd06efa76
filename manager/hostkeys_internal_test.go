package manager

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/logtest"
	"github.com/shepherd/shepherd/internal/sshtest"
	"github.com/shepherd/shepherd/internal/sshx"
	"github.com/shepherd/shepherd/provider"
)

// machineAt is a provider's machine at addr.
type machineAt struct {
	id   string
	addr netip.AddrPort
}

func (m machineAt) ID() string                          { return m.id }
func (m machineAt) Addr() netip.AddrPort                { return m.addr }
func (m machineAt) Availability() provider.Availability { return provider.KnownUsed }
func (m machineAt) Failed() bool                        { return false }

// addresses is a provider whose machines are at the addresses it maps
// them to; an unknown id is not found.
type addresses struct {
	named
	at map[string]netip.AddrPort
}

func (a addresses) GetMachine(_ context.Context, id string) (provider.Machine, error) {
	addr, ok := a.at[id]
	if !ok {
		return nil, fmt.Errorf("machine %s: %w", id, provider.ErrNotFound)
	}
	return machineAt{id: id, addr: addr}, nil
}

// accessible is addresses with SSHAccess: access, or err.
type accessible struct {
	addresses
	access provider.SSHAccess
	err    error
}

func (a accessible) SSHAccess(context.Context, string) (provider.SSHAccess, error) {
	return a.access, a.err
}

// hostKey returns a fresh host key.
func hostKey(t *testing.T) ssh.PublicKey { return sshtest.NewKey(t).PublicKey() }

// TestHostKeyTrust: the key in force is the provider's pin, else the key
// the BMDB recorded, else none (first use); a pin the BMDB does not hold
// yet, as pinned, is recorded at the takeover; a key learnt on first use is
// recorded then, unless another was recorded meanwhile.
func TestHostKeyTrust(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "setup", time.Minute)
	ctx := t.Context()
	a, b := hostKey(t), hostKey(t)
	record := func(id uuid.UUID, k ssh.PublicKey, pinned bool) {
		t.Helper()
		if _, _, err := db.RecordHostKey(ctx, id, k.Marshal(), pinned); err != nil {
			t.Fatal(err)
		}
	}
	fresh := bmdbtest.AddMachine(t, db, s, "lab")
	firstUse := bmdbtest.AddMachine(t, db, s, "lab")
	record(firstUse, a, false)
	pinned := bmdbtest.AddMachine(t, db, s, "lab")
	record(pinned, a, true)
	unreadable := bmdbtest.AddMachine(t, db, s, "lab")
	db.Exec(t, "INSERT INTO machine_ssh_host_key (machine_id, host_key, pinned) VALUES ($1, '\\x0001', false)", unreadable)

	for _, tt := range []struct {
		name        string
		machine     uuid.UUID
		pin         ssh.PublicKey
		wantInForce ssh.PublicKey
		wantRecord  bool
	}{
		{"nothing known", fresh, nil, nil, false},
		{"pinned, not recorded", fresh, a, a, true},
		{"recorded on first use", firstUse, nil, a, false},
		{"recorded on first use, now pinned", firstUse, a, a, true},
		{"recorded on first use, another pinned", firstUse, b, b, true},
		{"recorded as pinned", pinned, a, a, false},
		{"recorded as pinned, another pinned now", pinned, b, b, true},
		{"recorded as pinned, no pin now", pinned, nil, a, false},
	} {
		h, err := loadHostKeyTrust(ctx, db.DB, tt.machine, tt.pin)
		if err != nil {
			t.Errorf("%s: %v", tt.name, err)
			continue
		}
		if !sameKey(h.inForce, tt.wantInForce) || h.record != tt.wantRecord {
			t.Errorf("%s: in force %v, record %v; want %v, %v", tt.name, describe(h.inForce), h.record, describe(tt.wantInForce), tt.wantRecord)
		}
	}
	if _, err := loadHostKeyTrust(ctx, db.DB, unreadable, nil); err == nil || !strings.Contains(err.Error(), "the host key recorded for machine "+unreadable.String()+" is unreadable") {
		t.Errorf("an unreadable recorded key: %v", err)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := loadHostKeyTrust(cctx, db.DB, fresh, nil); err == nil {
		t.Error("loading the trust with a cancelled context succeeded")
	}

	// save records what the takeover learnt, in the takeover's transaction.
	save := func(h *hostKeyTrust) error {
		return s.Transact(ctx, func(ctx context.Context, tx *bmdb.Tx) error { return h.save(ctx, tx) })
	}
	recorded := func(id uuid.UUID) (ssh.PublicKey, bool) {
		raw, p, err := db.HostKey(ctx, id)
		if errors.Is(err, bmdb.ErrNotFound) {
			return nil, false
		} else if err != nil {
			t.Fatal(err)
		}
		k, err := ssh.ParsePublicKey(raw)
		if err != nil {
			t.Fatal(err)
		}
		return k, p
	}
	m1 := bmdbtest.AddMachine(t, db, s, "lab")
	h, err := loadHostKeyTrust(ctx, db.DB, m1, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := save(h); err != nil {
		t.Errorf("saving a trust that learnt nothing: %v", err)
	}
	if k, _ := recorded(m1); k != nil {
		t.Errorf("a takeover that learnt nothing recorded %s", describe(k))
	}
	var target sshx.Target
	h.apply(&target)
	if target.HostKey != nil || target.FirstUse(a) != nil {
		t.Fatalf("first use: host key %v, or the key is refused", describe(target.HostKey))
	}
	if err := save(h); err != nil {
		t.Fatal(err)
	}
	if k, p := recorded(m1); !sameKey(k, a) || p {
		t.Errorf("after a first use: recorded %s (pinned %v), want %s not pinned", describe(k), p, describe(a))
	}

	m2 := bmdbtest.AddMachine(t, db, s, "lab")
	if h, err = loadHostKeyTrust(ctx, db.DB, m2, b); err != nil {
		t.Fatal(err)
	}
	if err := save(h); err != nil {
		t.Fatal(err)
	}
	if k, p := recorded(m2); !sameKey(k, b) || !p {
		t.Errorf("after a takeover with a pin: recorded %s (pinned %v), want the pin %s", describe(k), p, describe(b))
	}

	// A first use races with another process that recorded another key.
	m3 := bmdbtest.AddMachine(t, db, s, "lab")
	if h, err = loadHostKeyTrust(ctx, db.DB, m3, nil); err != nil {
		t.Fatal(err)
	}
	h.apply(&target)
	_ = target.FirstUse(a)
	record(m3, b, false)
	var mm *sshx.HostKeyMismatchError
	if err := save(h); !errors.As(err, &mm) || !sameKey(mm.Want, b) || !sameKey(mm.Got, a) ||
		!strings.Contains(err.Error(), "another process recorded a host key for machine "+m3.String()+" meanwhile") {
		t.Errorf("saving after another key was recorded: %v, want a mismatch naming both keys", err)
	}
	m4 := bmdbtest.AddMachine(t, db, s, "lab")
	if h, err = loadHostKeyTrust(ctx, db.DB, m4, nil); err != nil {
		t.Fatal(err)
	}
	h.apply(&target)
	_ = target.FirstUse(a)
	db.Exec(t, "INSERT INTO machine_ssh_host_key (machine_id, host_key, pinned) VALUES ($1, '\\x0001', false)", m4)
	if err := save(h); !errors.Is(err, sshx.ErrHostKeyMismatch) || !strings.Contains(err.Error(), "the key recorded meanwhile is unreadable") {
		t.Errorf("saving after an unreadable key was recorded: %v", err)
	}
}

func sameKey(a, b ssh.PublicKey) bool {
	if a == nil || b == nil {
		return a == nil && b == nil
	}
	return string(a.Marshal()) == string(b.Marshal())
}

func describe(k ssh.PublicKey) string {
	if k == nil {
		return "none"
	}
	return sshx.Describe(k)
}

// TestExplainMismatch: a host key mismatch names the way out: a new pin at
// the provider, or accepting the key the machine presented, which the BMDB
// keeps for that; other errors pass unchanged.
func TestExplainMismatch(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "setup", time.Minute)
	ctx := t.Context()
	old, presented := hostKey(t), hostKey(t)
	id := bmdbtest.AddMachine(t, db, s, "lab")
	if _, _, err := db.RecordHostKey(ctx, id, old.Marshal(), false); err != nil {
		t.Fatal(err)
	}
	other := errors.New("connection refused")
	if err := explainMismatch(ctx, db.DB, id, false, other); err != other {
		t.Errorf("another error became %v", err)
	}
	mismatch := &sshx.HostKeyMismatchError{Want: old, Got: presented}
	err := explainMismatch(ctx, db.DB, id, true, mismatch)
	if !errors.Is(err, sshx.ErrHostKeyMismatch) || !strings.Contains(err.Error(), "the key is pinned by the provider") {
		t.Errorf("a mismatch with a pin: %v", err)
	}
	if d, err := db.GetMachine(ctx, id); err != nil || d.OfferedHostKey != nil {
		t.Errorf("a mismatch with a pin kept the presented key %x (%v)", d.OfferedHostKey, err)
	}
	err = explainMismatch(ctx, db.DB, id, false, &sshx.HostKeyMismatchError{Want: old})
	if !errors.Is(err, sshx.ErrHostKeyMismatch) || !strings.Contains(err.Error(), "could not be learnt") {
		t.Errorf("a mismatch without the presented key: %v", err)
	}
	err = explainMismatch(ctx, db.DB, id, false, mismatch)
	if want := bmdb.AcceptHostKeyCommand(id, ssh.FingerprintSHA256(presented)); !errors.Is(err, sshx.ErrHostKeyMismatch) || !strings.Contains(err.Error(), want) {
		t.Errorf("a mismatch of a recorded key: %v, want it to name %q", err, want)
	}
	if d, err := db.GetMachine(ctx, id); err != nil || string(d.OfferedHostKey) != string(presented.Marshal()) {
		t.Errorf("the presented key was not kept for accepting: %x (%v)", d.OfferedHostKey, err)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if err := explainMismatch(cctx, db.DB, id, false, mismatch); !errors.Is(err, sshx.ErrHostKeyMismatch) || !strings.Contains(err.Error(), "keeping the presented key for accepting failed") {
		t.Errorf("a mismatch whose key cannot be kept: %v", err)
	}
	// The same, through the HostKeys a provider gets.
	h := &HostKeys{DB: db.DB, Provider: "lab"}
	if err := h.HostKeyMismatch(ctx, "unknown", mismatch); err != error(mismatch) {
		t.Errorf("HostKeyMismatch of an unknown machine: %v, want the error unchanged", err)
	}
	pid := bmdbtest.Scalar[string](t, db, "SELECT provider_id FROM machine_provided WHERE machine_id = $1", id)
	if err := h.HostKeyMismatch(ctx, pid, mismatch); err == nil || !strings.Contains(err.Error(), "host-key accept") {
		t.Errorf("HostKeyMismatch of a machine with a recorded key: %v", err)
	}
	if k, err := h.KnownHostKey(ctx, pid); err != nil || !sameKey(k, old) {
		t.Errorf("KnownHostKey() = %v, %v; want the recorded key", describe(k), err)
	}
	if _, err := h.KnownHostKey(ctx, "unknown"); err == nil || !strings.HasPrefix(err.Error(), "looking up the host key of unknown: ") {
		t.Errorf("KnownHostKey of an unknown machine: %v", err)
	}
	fresh := bmdbtest.AddMachine(t, db, s, "lab")
	fpid := bmdbtest.Scalar[string](t, db, "SELECT provider_id FROM machine_provided WHERE machine_id = $1", fresh)
	if k, err := h.KnownHostKey(ctx, fpid); err != nil || k != nil {
		t.Errorf("KnownHostKey of a machine without a key = %v, %v; want none", describe(k), err)
	}
	db.Exec(t, "INSERT INTO machine_ssh_host_key (machine_id, host_key, pinned) VALUES ($1, '\\x0001', false)", fresh)
	if _, err := h.KnownHostKey(ctx, fpid); err == nil || !strings.HasPrefix(err.Error(), "looking up the host key of "+fpid+": ") {
		t.Errorf("KnownHostKey of an unreadable key: %v", err)
	}
}

// TestMachineTarget: a machine is reached at the provider's address as the
// configured user, or as the provider says (user, dialer, pinned key);
// what the provider cannot tell fails with a cause naming it.
func TestMachineTarget(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "setup", time.Minute)
	ctx := t.Context()
	id := bmdbtest.AddMachine(t, db, s, "lab")
	key := sshtest.NewKey(t)
	pin := hostKey(t)
	at := map[string]netip.AddrPort{"m": netip.MustParseAddrPort("192.0.2.1:22"), "nowhere": {}}
	plain := addresses{named: named{name: "lab"}, at: at}
	dial := func(context.Context) (net.Conn, error) { return nil, errors.New("unused") }
	for _, tt := range []struct {
		name     string
		p        provider.Provider
		pid      string
		wantUser string
		wantDial bool
		wantPin  ssh.PublicKey
		wantErr  string
	}{
		{"plain", plain, "m", "root", false, nil, ""},
		{"unknown", plain, "gone", "", false, nil, "asking lab for machine gone: machine gone: provider: "},
		{"no address", plain, "nowhere", "", false, nil, "lab has no address for machine nowhere yet"},
		{"access without a user", accessible{addresses: plain}, "m", "root", false, nil, ""},
		{"access with a user", accessible{addresses: plain, access: provider.SSHAccess{User: "admin", HostKey: pin}}, "m", "admin", false, pin, ""},
		{"access with a dialer, no address", accessible{addresses: plain, access: provider.SSHAccess{Dial: dial}}, "nowhere", "root", true, nil, ""},
		{"access refused", accessible{addresses: plain, err: errors.New("vault sealed")}, "m", "", false, nil, "asking lab how to reach machine m: vault sealed"},
	} {
		target, trust, err := machineTarget(ctx, db.DB, tt.p, id, tt.pid, "root", key)
		if tt.wantErr != "" {
			if err == nil || !strings.HasPrefix(err.Error(), tt.wantErr) {
				t.Errorf("%s: %v, want an error starting %q", tt.name, err, tt.wantErr)
			}
			continue
		}
		if err != nil {
			t.Errorf("%s: %v", tt.name, err)
			continue
		}
		if target.User != tt.wantUser || (target.Dial != nil) != tt.wantDial || len(target.Keys) != 1 || target.Keys[0] != key ||
			target.Addr != at[tt.pid].String() || !sameKey(trust.inForce, tt.wantPin) || trust.machine != id {
			t.Errorf("%s: target %+v, trust %+v", tt.name, target, trust)
		}
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, _, err := machineTarget(cctx, db.DB, plain, id, "m", "root", key); err == nil {
		t.Error("machineTarget with a cancelled context succeeded")
	}
}

// TestStopAgentBestEffort: a machine the provider cannot release has its
// agent stopped over SSH only through a pinned or recorded host key; one
// never taken over is not tried, and one that cannot be reached is
// decommissioned all the same; each outcome is counted and logged.
func TestStopAgentBestEffort(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "setup", time.Minute)
	ctx := t.Context()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := netip.MustParseAddrPort(l.Addr().String())
	l.Close()
	p := addresses{named: named{name: "lab"}, at: map[string]netip.AddrPort{"fresh": closed, "known": closed}}
	h := logtest.New()
	reg := prometheus.NewRegistry()
	d, err := NewDecommissioner(DecommissionerConfig{AgentStop: &AgentStopConfig{SSHKey: sshtest.NewKey(t), Timeout: 30 * time.Second}}, db.DB, p, reg, h.Logger())
	if err != nil {
		t.Fatal(err)
	}
	task := func(pid string) *Task {
		id := bmdbtest.AddMachine(t, db, s, "lab")
		return &Task{Machine: bmdb.ProvidedMachine{MachineID: id, Provided: bmdb.Provided{Provider: "lab", ProviderID: pid}}, Log: h.Logger(), Session: s}
	}
	known := task("known")
	if _, _, err := db.RecordHostKey(ctx, known.Machine.MachineID, hostKey(t).Marshal(), false); err != nil {
		t.Fatal(err)
	}
	for _, tk := range []*Task{task("gone"), task("fresh"), known} {
		if finish, err := d.decommission(ctx, tk); err != nil || finish == nil {
			t.Errorf("decommissioning %s: %v; want it to go on whatever became of its agent", tk.Machine.ProviderID, err)
		}
	}
	stops := func(result string) float64 { return testutil.ToFloat64(d.stops.WithLabelValues(result)) }
	if stops("failed") != 2 || stops("unverified") != 1 || stops("stopped") != 0 {
		t.Errorf("agent stops: failed %v, unverified %v, stopped %v; want 2, 1, 0", stops("failed"), stops("unverified"), stops("stopped"))
	}
	if got := testutil.ToFloat64(d.releases.WithLabelValues("unsupported")); got != 3 {
		t.Errorf("unsupported releases %v, want 3", got)
	}
	var causes []string
	for _, r := range h.With("stopping the agent over SSH failed; it stops at its next heartbeat") {
		causes = append(causes, r.Attrs["err"].String())
	}
	if len(causes) != 1 || !strings.HasPrefix(causes[0], "connecting to "+closed.String()+": ") {
		t.Errorf("failed stops logged with %q, want one naming the address it could not connect to", causes)
	}
	if got := h.With("cannot stop the agent over SSH; it stops at its next heartbeat"); len(got) != 1 {
		t.Errorf("%d lines about the machine the provider does not know, want 1", len(got))
	}
	if got := h.With("no pinned or recorded host key; not stopping the agent over SSH"); len(got) != 1 {
		t.Errorf("%d lines about the machine without a host key, want 1", len(got))
	}
}
