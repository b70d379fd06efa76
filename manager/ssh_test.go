package manager_test

import (
	"cmp"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/crypto/ssh"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/sshtest"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/provider"
	"github.com/shepherd/shepherd/provider/static"
)

// fakeAgent is the "agent binary" the SSH tests upload: it reads the
// TakeoverInit and prints the answer the test wrote for the machine next
// to its state directory (its arguments are: takeover --state-dir DIR). It
// starts no daemon, so the tests leave nothing running on the hosts.
const fakeAgent = "#!/bin/sh\ncat >/dev/null\nexec cat \"$(dirname \"$3\")/response\"\n"

// agentEndpoint is the callback server the tests' TakeoverInits name; no
// agent ever connects to it.
const agentEndpoint = "127.0.0.1:1"

// sshFixture is a static inventory of machines behind real SSH servers
// (sshtest), recorded in the BMDB by a provisioner pass, with the
// initializer's key and the fake agent ready.
type sshFixture struct {
	t      *testing.T
	db     *bmdbtest.DB
	key    ssh.Signer
	p      *static.Provider
	agents string // the agent directory of machine X is agents/X
	agent  string // the fake agent binary
	// agentDir is the initializer's AgentDir; "" means agents/{provider_id}.
	agentDir string
	machines map[string]uuid.UUID
}

// newSSHFixture writes inventory (the YAML of the machines list, and an
// optional defaults section before it) and records its machines. HOST_i,
// PORT_i and KEY_i_j in it stand for host i's address, port and host key j
// (0 ed25519, 1 ECDSA, 2 RSA with AllHostKeyTypes).
func newSSHFixture(t *testing.T, hosts []*sshtest.Host, key ssh.Signer, inventory string) *sshFixture {
	t.Helper()
	db := bmdbtest.New(t)
	dir := t.TempDir()
	var repl []string
	for i, h := range hosts {
		repl = append(repl, fmt.Sprintf("HOST_%d", i), h.Addr.Addr().String(), fmt.Sprintf("PORT_%d", i), fmt.Sprint(h.Addr.Port()))
		for j, k := range h.HostKeys {
			repl = append(repl, fmt.Sprintf("KEY_%d_%d", i, j), fmt.Sprintf("%q", strings.TrimSpace(string(ssh.MarshalAuthorizedKey(k)))))
		}
	}
	inv := filepath.Join(dir, "inventory.yaml")
	if err := os.WriteFile(inv, []byte(strings.NewReplacer(repl...).Replace(inventory)), 0o600); err != nil {
		t.Fatal(err)
	}
	f := &sshFixture{t: t, db: db, key: key, agents: filepath.Join(dir, "agents"), agent: filepath.Join(dir, "fake-agent"), machines: map[string]uuid.UUID{}}
	if err := os.WriteFile(f.agent, []byte(fakeAgent), 0o755); err != nil {
		t.Fatal(err)
	}
	var err error
	f.p, err = static.New(static.Config{
		Name: "lab", Inventory: inv, ReloadInterval: time.Hour, SSHTimeout: 30 * time.Second,
		Env: provider.Env{Registerer: prometheus.NewRegistry(), HostKeys: &manager.HostKeys{DB: db.DB, Provider: "lab"}, SSHSigner: key, SSHUser: hosts[0].User},
	})
	if err != nil {
		t.Fatal(err)
	}
	pr, err := manager.NewProvisioner(manager.ProvisionerConfig{}, db.DB, f.p, prometheus.NewRegistry(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pr.Pass(t.Context(), bmdbtest.Session(t, db, "provisioner", time.Minute)); err != nil {
		t.Fatal(err)
	}
	ms, err := f.p.ListMachines(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range ms {
		id, err := db.MachineByProviderID(t.Context(), "lab", m.ID())
		if err != nil {
			t.Fatal(err)
		}
		f.machines[m.ID()] = id
		f.writeResponse(m.ID())
	}
	return f
}

// writeResponse writes the fake agent's answer for machine pid: a success
// echoing the TakeoverInit the initializer sends, with a fresh key.
func (f *sshFixture) writeResponse(pid string) {
	f.t.Helper()
	pub, _, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		f.t.Fatal(err)
	}
	resp, err := proto.Marshal(&agentv1.TakeoverResponse{Result: &agentv1.TakeoverResponse_Success{Success: &agentv1.TakeoverSuccess{
		InitMessage: &agentv1.TakeoverInit{MachineId: f.machines[pid].String(), ServerEndpoint: agentEndpoint},
		PublicKey:   pub,
	}}})
	if err != nil {
		f.t.Fatal(err)
	}
	dir := filepath.Join(f.agents, pid)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		f.t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "response"), resp, 0o644); err != nil {
		f.t.Fatal(err)
	}
}

// startInitializer runs the initializer until the test ends. Failed agent
// starts back off for an hour, so that each machine is tried once unless
// the test resets it.
func (f *sshFixture) startInitializer() { f.startInitializerWithTimeout(time.Minute) }

// startInitializerWithTimeout is startInitializer with the exec timeout.
func (f *sshFixture) startInitializerWithTimeout(exec time.Duration) {
	f.t.Helper()
	in, err := manager.NewInitializer(manager.InitializerConfig{
		Loop:           manager.LoopConfig{IdleSleep: 50 * time.Millisecond, Lease: 15 * time.Second},
		ConnectTimeout: 20 * time.Second, ExecTimeout: exec,
		SSHKey: f.key, AgentPath: f.agent, AgentDir: cmp.Or(f.agentDir, filepath.Join(f.agents, "{provider_id}")),
		ServerEndpoint: agentEndpoint, Backoff: bmdb.BackoffPolicy{Initial: time.Hour},
	}, f.db.DB, f.p, prometheus.NewRegistry(), nil)
	if err != nil {
		f.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- in.Run(ctx) }()
	f.t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			f.t.Errorf("initializer: %v", err)
		}
	})
}

// takeover waits until machine pid's agent start has an outcome since
// history row after: started, or failed with cause.
func (f *sshFixture) takeover(pid string, after int64) (started bool, cause string) {
	f.t.Helper()
	id := f.machines[pid]
	bmdbtest.WaitFor(f.t, 2*time.Minute, "agent start of "+pid, func(ctx context.Context) (bool, error) {
		h, err := f.db.History(ctx, bmdb.HistoryFilter{MachineID: id, Process: bmdb.ProcessAgentStart, AfterID: after})
		if err != nil {
			return false, err
		}
		for _, e := range h {
			switch e.Event {
			case bmdb.EventFinished:
				started = true
				return true, nil
			case bmdb.EventFailed:
				cause = e.Cause
				return true, nil
			}
		}
		return false, nil
	})
	return started, cause
}

// lastHistoryID is the newest history row of the fixture's database.
func (f *sshFixture) lastHistoryID() int64 {
	return bmdbtest.Scalar[int64](f.t, f.db, "SELECT COALESCE(max(history_id), 0) FROM work_history")
}

// recordedHostKey returns the host key the BMDB holds for pid.
func (f *sshFixture) recordedHostKey(pid string) (ssh.PublicKey, bool) {
	f.t.Helper()
	raw, pinned, err := f.db.HostKey(f.t.Context(), f.machines[pid])
	if err != nil {
		f.t.Fatalf("host key of %s: %v", pid, err)
	}
	k, err := ssh.ParsePublicKey(raw)
	if err != nil {
		f.t.Fatal(err)
	}
	return k, pinned
}

func keysEqual(a, b ssh.PublicKey) bool { return string(a.Marshal()) == string(b.Marshal()) }

// forEachSSHKind runs f as a parallel subtest per kind of SSH server.
func forEachSSHKind(t *testing.T, f func(t *testing.T, kind sshtest.Kind)) {
	for _, kind := range sshtest.Kinds(t) {
		t.Run(string(kind), func(t *testing.T) {
			t.Parallel()
			f(t, kind)
		})
	}
}

// TestHostKeyOfEachType takes over machines behind servers that, like a
// stock sshd, hold ed25519, ECDSA and RSA host keys: a key of each type
// pinned in the inventory, or recorded in the BMDB, must be the one the
// server is asked for, and a first use records the ed25519 key. Then the
// static provider reboots each machine, checking the same keys.
func TestHostKeyOfEachType(t *testing.T) {
	t.Parallel()
	forEachSSHKind(t, func(t *testing.T, kind sshtest.Kind) {
		key := sshtest.NewKey(t)
		hosts := sshtest.Start(t, 3, sshtest.Config{Kind: kind, AllHostKeyTypes: true, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})
		types := []string{"ed25519", "ecdsa", "rsa"}
		var inv strings.Builder
		inv.WriteString("defaults:\n  reboot_command: \"true\"\nmachines:\n")
		for i, typ := range types {
			fmt.Fprintf(&inv, "  - {id: pinned-%s, address: HOST_%d, port: PORT_%d, host_key: KEY_%d_%d}\n", typ, i, i, i, i)
			fmt.Fprintf(&inv, "  - {id: recorded-%s, address: HOST_%d, port: PORT_%d}\n", typ, i, i)
		}
		inv.WriteString("  - {id: first-use, address: HOST_0, port: PORT_0}\n")
		f := newSSHFixture(t, hosts, key, inv.String())
		for i, typ := range types {
			if _, _, err := f.db.RecordHostKey(t.Context(), f.machines["recorded-"+typ], hosts[i].HostKeys[i].Marshal(), false); err != nil {
				t.Fatal(err)
			}
		}
		f.startInitializer()
		for i, typ := range types {
			for _, pid := range []string{"pinned-" + typ, "recorded-" + typ} {
				if started, cause := f.takeover(pid, 0); !started {
					t.Errorf("%s: agent start failed: %s", pid, cause)
					continue
				}
				if got, _ := f.recordedHostKey(pid); !keysEqual(got, hosts[i].HostKeys[i]) {
					t.Errorf("%s: the BMDB holds %s %s, want the %s key", pid, got.Type(), ssh.FingerprintSHA256(got), typ)
				}
			}
		}
		if started, cause := f.takeover("first-use", 0); !started {
			t.Errorf("first-use: agent start failed: %s", cause)
		} else if got, pinned := f.recordedHostKey("first-use"); pinned || !keysEqual(got, hosts[0].HostKey) {
			t.Errorf("first use recorded %s %s (pinned %v), want the ed25519 key", got.Type(), ssh.FingerprintSHA256(got), pinned)
		}
		for _, typ := range types {
			for _, pid := range []string{"pinned-" + typ, "recorded-" + typ} {
				if err := f.p.RebootMachine(t.Context(), pid); err != nil {
					t.Errorf("rebooting %s: %v", pid, err)
				}
			}
		}
	})
}

// TestSecretsOnlyToVerifiedHosts: an inventory password goes only to a
// server whose host key is pinned or recorded. The servers accept passwords
// only, and count the passwords they are offered.
func TestSecretsOnlyToVerifiedHosts(t *testing.T) {
	t.Parallel()
	forEachSSHKind(t, func(t *testing.T, kind sshtest.Kind) {
		hosts := sshtest.Start(t, 3, sshtest.Config{Kind: kind, Password: testPassword})
		f := newSSHFixture(t, hosts, sshtest.NewKey(t), fmt.Sprintf(`defaults:
  reboot_command: "true"
machines:
  - {id: unverified, address: HOST_0, port: PORT_0, ssh_password_file: %[1]s}
  - {id: pinned, address: HOST_1, port: PORT_1, ssh_password_file: %[1]s, host_key: KEY_1_0}
  - {id: recorded, address: HOST_2, port: PORT_2, ssh_password_file: %[1]s}
`, passwordFile(t)))
		if _, _, err := f.db.RecordHostKey(t.Context(), f.machines["recorded"], hosts[2].HostKey.Marshal(), false); err != nil {
			t.Fatal(err)
		}
		f.startInitializer()
		for i, pid := range []string{"unverified", "pinned", "recorded"} {
			started, cause := f.takeover(pid, 0)
			sent := hosts[i].PasswordAttempts() > 0
			switch {
			case pid == "unverified":
				if sent {
					t.Errorf("%s: the password was sent to a host whose key nobody verified", pid)
				}
				if started || !strings.Contains(cause, "host_key") || !strings.Contains(cause, "trust_on_first_use") {
					t.Errorf("%s: started %v, cause %q; want a failure that says to pin host_key or set trust_on_first_use", pid, started, cause)
				}
			case !sent:
				t.Errorf("%s: the password was not offered (cause %q)", pid, cause)
			case kind == sshtest.Gliderlabs && !started:
				// OpenSSH checks the system's password, which the test
				// cannot set; Gliderlabs lets the right one in.
				t.Errorf("%s: agent start failed: %s", pid, cause)
			}
			if strings.Contains(cause, testPassword) {
				t.Errorf("%s: the cause holds the password: %q", pid, cause)
			}
		}
		// Nor does a reboot of the machine whose key is still not known
		// send it.
		err := f.p.RebootMachine(t.Context(), "unverified")
		if err == nil || !strings.Contains(err.Error(), "trust_on_first_use") {
			t.Errorf("rebooting the unverified machine: %v, want a refusal naming trust_on_first_use", err)
		}
		if n := hosts[0].PasswordAttempts(); n > 0 {
			t.Errorf("the unverified machine was offered the password %d times", n)
		}
	})
}

// TestTrustOnFirstUseOptIn: with trust_on_first_use the inventory's
// password goes to a server whose key is not known yet, and the key is
// recorded once the takeover succeeded.
func TestTrustOnFirstUseOptIn(t *testing.T) {
	t.Parallel()
	forEachSSHKind(t, func(t *testing.T, kind sshtest.Kind) {
		hosts := sshtest.Start(t, 2, sshtest.Config{Kind: kind, Password: testPassword})
		f := newSSHFixture(t, hosts, sshtest.NewKey(t), fmt.Sprintf(`defaults:
  trust_on_first_use: true
machines:
  - {id: by-default, address: HOST_0, port: PORT_0, ssh_password_file: %[1]s}
  - {id: opted-out, address: HOST_1, port: PORT_1, ssh_password_file: %[1]s, trust_on_first_use: false}
`, passwordFile(t)))
		f.startInitializer()
		started, cause := f.takeover("by-default", 0)
		if hosts[0].PasswordAttempts() == 0 {
			t.Errorf("by-default: the password was not offered (cause %q)", cause)
		}
		if kind == sshtest.Gliderlabs {
			if !started {
				t.Errorf("by-default: agent start failed: %s", cause)
			} else if got, _ := f.recordedHostKey("by-default"); !keysEqual(got, hosts[0].HostKey) {
				t.Errorf("by-default: recorded %s, want the server's key", ssh.FingerprintSHA256(got))
			}
		}
		if started, cause := f.takeover("opted-out", 0); started || hosts[1].PasswordAttempts() > 0 || !strings.Contains(cause, "trust_on_first_use") {
			t.Errorf("opted-out: started %v, %d passwords offered, cause %q; want none offered", started, hosts[1].PasswordAttempts(), cause)
		}
	})
}

// testPassword is the password of the password-only test servers.
const testPassword = "inventory-S3CR3T"

// passwordFile writes testPassword into a secret file and returns its path.
func passwordFile(t *testing.T) string {
	t.Helper()
	pw := filepath.Join(t.TempDir(), "pw")
	if err := os.WriteFile(pw, []byte(testPassword+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return pw
}

// TestHostKeyMismatchNamesTheWayOut changes a machine's host key after its
// key was recorded: the agent start fails with a cause that names both
// fingerprints and the command that accepts the new key.
func TestHostKeyMismatchNamesTheWayOut(t *testing.T) {
	t.Parallel()
	forEachSSHKind(t, func(t *testing.T, kind sshtest.Kind) {
		key := sshtest.NewKey(t)
		hosts := sshtest.Start(t, 2, sshtest.Config{Kind: kind, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})
		f := newSSHFixture(t, hosts, key, `machines:
  - {id: recorded, address: HOST_0, port: PORT_0}
  - {id: pinned, address: HOST_1, port: PORT_1, host_key: KEY_1_0}
`)
		old := []ssh.PublicKey{hosts[0].HostKey, hosts[1].HostKey}
		if _, _, err := f.db.RecordHostKey(t.Context(), f.machines["recorded"], old[0].Marshal(), false); err != nil {
			t.Fatal(err)
		}
		offered := []ssh.PublicKey{hosts[0].ChangeHostKey(t), hosts[1].ChangeHostKey(t)}
		f.startInitializer()

		started, cause := f.takeover("recorded", 0)
		want := fmt.Sprintf("shepherd machine host-key accept %s --fingerprint %s", f.machines["recorded"], ssh.FingerprintSHA256(offered[0]))
		if started || !strings.Contains(cause, ssh.FingerprintSHA256(old[0])) || !strings.Contains(cause, want) {
			t.Errorf("recorded: started %v, cause %q; want both fingerprints and %q", started, cause, want)
		}
		started, cause = f.takeover("pinned", 0)
		if started || !strings.Contains(cause, ssh.FingerprintSHA256(old[1])) || !strings.Contains(cause, ssh.FingerprintSHA256(offered[1])) ||
			!strings.Contains(cause, "host_key") || strings.Contains(cause, "host-key accept") {
			t.Errorf("pinned: started %v, cause %q; want both fingerprints and the inventory's host_key, not the accept command", started, cause)
		}
		if d, err := f.db.GetMachine(t.Context(), f.machines["pinned"]); err != nil || d.OfferedHostKey != nil {
			t.Errorf("pinned: the BMDB keeps an offered key %x (%v): a pin is changed at the provider", d.OfferedHostKey, err)
		}
	})
}

// TestAcceptedHostKeyIsTakenOverAtOnce accepts the key a reinstalled
// machine presented: the agent start, backed off for an hour by the
// mismatch, takes the machine over at once with the accepted key.
func TestAcceptedHostKeyIsTakenOverAtOnce(t *testing.T) {
	t.Parallel()
	forEachSSHKind(t, func(t *testing.T, kind sshtest.Kind) {
		key := sshtest.NewKey(t)
		h := sshtest.Start(t, 1, sshtest.Config{Kind: kind, AllHostKeyTypes: true, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})[0]
		f := newSSHFixture(t, []*sshtest.Host{h}, key, "machines:\n  - {id: m, address: HOST_0, port: PORT_0}\n")
		id := f.machines["m"]
		// The RSA key was recorded; the machine was reinstalled with keys
		// of every type.
		if _, _, err := f.db.RecordHostKey(t.Context(), id, h.HostKeys[2].Marshal(), false); err != nil {
			t.Fatal(err)
		}
		h.ChangeHostKey(t)
		f.startInitializer()
		if started, cause := f.takeover("m", 0); started || !strings.Contains(cause, ssh.FingerprintSHA256(h.HostKeys[2])) {
			t.Fatalf("started %v, cause %q; want a mismatch naming the RSA key presented now", started, cause)
		}
		after := f.lastHistoryID()
		if _, err := f.db.AcceptHostKey(t.Context(), id, ssh.FingerprintSHA256(h.HostKeys[2]), "test", ""); err != nil {
			t.Fatal(err)
		}
		if started, cause := f.takeover("m", after); !started {
			t.Fatalf("after the accept the agent start failed: %s", cause)
		}
		if got, pinned := f.recordedHostKey("m"); pinned || !keysEqual(got, h.HostKeys[2]) {
			t.Errorf("recorded %s (pinned %v), want the accepted RSA key", sshDescribe(got), pinned)
		}
	})
}

func sshDescribe(k ssh.PublicKey) string { return k.Type() + " " + ssh.FingerprintSHA256(k) }

// TestTakeoverEndsWhenMachineGoesSilent: a machine that stops answering
// while the agent runs (a proxy goes silent once the agent started) fails
// the takeover at the exec timeout, instead of holding the worker and the
// machine's lock for ever.
func TestTakeoverEndsWhenMachineGoesSilent(t *testing.T) {
	t.Parallel()
	forEachSSHKind(t, func(t *testing.T, kind sshtest.Kind) {
		key := sshtest.NewKey(t)
		h := sshtest.Start(t, 1, sshtest.Config{Kind: kind, AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})[0]
		proxy := sshtest.StartProxy(t, h.Addr.String())
		f := newSSHFixture(t, []*sshtest.Host{h}, key, fmt.Sprintf("machines:\n  - {id: m, address: %s, port: %d}\n", proxy.Addr.Addr(), proxy.Addr.Port()))
		marker := filepath.Join(f.agents, "m", "started")
		// This agent starts, says so, and runs until its output goes
		// nowhere.
		agent := "#!/bin/sh\n" + sshtest.UntilSilenced(marker) + "\n"
		if err := os.WriteFile(f.agent, []byte(agent), 0o755); err != nil {
			t.Fatal(err)
		}
		// The exec timeout must outlast the upload and the agent's start on
		// a loaded machine; the test waits it out once, after the silence.
		f.startInitializerWithTimeout(10 * time.Second)
		bmdbtest.WaitFor(t, time.Minute, "the agent started", func(context.Context) (bool, error) {
			_, err := os.Stat(marker)
			return err == nil, nil
		})
		proxy.Silence()
		if started, cause := f.takeover("m", 0); started || !strings.Contains(cause, "exec timeout") {
			t.Errorf("started %v, cause %q; want the exec timeout", started, cause)
		}
	})
}
