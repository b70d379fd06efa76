package static

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/internal/sshx"
	"github.com/shepherd/shepherd/provider"
)

// fakeHostKeys is a provider.HostKeyChecker that knows key for every
// machine and records what it is asked.
type fakeHostKeys struct {
	key ssh.PublicKey // nil: none recorded
	err error         // what KnownHostKey fails with, if not nil

	mu    sync.Mutex
	asked []string // "known ID" and "mismatch ID"
}

// errExplained marks the errors fakeHostKeys explained.
var errExplained = errors.New("explained by the host key checker")

func (f *fakeHostKeys) KnownHostKey(_ context.Context, providerID string) (ssh.PublicKey, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.asked = append(f.asked, "known "+providerID)
	return f.key, f.err
}

func (f *fakeHostKeys) HostKeyMismatch(_ context.Context, providerID string, err error) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.asked = append(f.asked, "mismatch "+providerID)
	return fmt.Errorf("%w: %w", errExplained, err)
}

func (f *fakeHostKeys) questions() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.asked)
}

// rebootFixture is a provider whose machines all point at one test SSH
// server, which accepts the provider's key for user "shepherd".
type rebootFixture struct {
	p      *Provider
	srv    *sshServer
	client ssh.Signer
}

// newRebootFixture writes the machines (YAML list entries, with ADDR and
// PORT standing for the server's, and HOSTKEY for its host key) and creates
// the provider with env (whose SSHSigner and SSHUser it fills in if unset).
func newRebootFixture(t *testing.T, machines string, env provider.Env) rebootFixture {
	t.Helper()
	client, _ := newKey(t)
	if env.SSHSigner == nil {
		env.SSHSigner = client
	}
	env.SSHUser = "shepherd"
	srv := newSSHServer(t, serverAuth{keys: []ssh.PublicKey{env.SSHSigner.PublicKey()}})
	path := filepath.Join(t.TempDir(), "inventory.yaml")
	writeFile(t, path, "machines:\n"+strings.NewReplacer(
		"ADDR", srv.addr.Addr().String(),
		"PORT", fmt.Sprint(srv.addr.Port()),
		"HOSTKEY", authorizedKey(srv.hostKey),
	).Replace(machines))
	p, err := New(Config{Inventory: path, SSHTimeout: 10 * time.Second, Env: env})
	if err != nil {
		t.Fatal(err)
	}
	return rebootFixture{p: p, srv: srv, client: client}
}

func TestReboot(t *testing.T) {
	t.Parallel()
	wrongHost, _ := newKey(t)
	f := newRebootFixture(t, fmt.Sprintf(`
  - {id: default, address: ADDR, port: PORT, host_key: HOSTKEY}
  - {id: custom, address: ADDR, port: PORT, host_key: HOSTKEY, reboot_command: "ipmitool power cycle", ssh_user: admin}
  - {id: drop, address: ADDR, port: PORT, host_key: HOSTKEY, reboot_command: %s}
  - {id: fail, address: ADDR, port: PORT, host_key: HOSTKEY, reboot_command: %s}
  - {id: wrong-key, address: ADDR, port: PORT, host_key: %q}
`, cmdDrop, cmdFail, authorizedKey(wrongHost.PublicKey())), provider.Env{})

	if err := f.p.RebootMachine(t.Context(), "default"); err != nil {
		t.Errorf("RebootMachine(default): %v", err)
	}
	if got, want := f.srv.received(), []run{{"shepherd", "systemctl reboot"}}; !slices.Equal(got, want) {
		t.Errorf("the server ran %v, want %v", got, want)
	}
	// The server accepts the key for any user: ssh_user is what is sent.
	if err := f.p.RebootMachine(t.Context(), "custom"); err != nil {
		t.Errorf("RebootMachine(custom): %v", err)
	}
	if got, want := f.srv.received()[1:], []run{{"admin", "ipmitool power cycle"}}; !slices.Equal(got, want) {
		t.Errorf("the server ran %v, want %v", got, want)
	}

	// A reboot cuts the connection before the command exits: success.
	if err := f.p.RebootMachine(t.Context(), "drop"); err != nil {
		t.Errorf("RebootMachine with the connection cut during the command: %v, want success", err)
	}

	err := f.p.RebootMachine(t.Context(), "fail")
	if err == nil || !strings.Contains(err.Error(), "exit status 1") || !strings.Contains(err.Error(), "reboot: permission denied") {
		t.Errorf("RebootMachine with a command exiting 1: %v, want an error with its status and stderr", err)
	}
	if errors.Is(err, provider.ErrNotReached) {
		t.Errorf("RebootMachine with a command exiting 1: %v wraps ErrNotReached, but the command ran on the machine", err)
	}

	before := len(f.srv.received())
	err = f.p.RebootMachine(t.Context(), "wrong-key")
	if !errors.Is(err, sshx.ErrHostKeyMismatch) {
		t.Errorf("RebootMachine with a wrong pinned host key: %v, want ErrHostKeyMismatch", err)
	}
	if got := f.srv.received(); len(got) != before {
		t.Errorf("with a wrong host key the server still ran %v", got[before:])
	}

	if err := f.p.RebootMachine(t.Context(), "nope"); !errors.Is(err, provider.ErrNotFound) {
		t.Errorf("RebootMachine(nope): %v, want ErrNotFound", err)
	}
	if err := f.p.ReinstallMachine(t.Context(), "default"); !errors.Is(err, provider.ErrUnsupported) {
		t.Errorf("ReinstallMachine: %v, want ErrUnsupported", err)
	}
}

func TestRebootAsksHostKeyChecker(t *testing.T) {
	t.Parallel()
	other, _ := newKey(t)
	for _, tt := range []struct {
		name    string
		known   func(f rebootFixture) ssh.PublicKey
		wantErr error
		asked   []string
	}{
		{"recorded key", func(f rebootFixture) ssh.PublicKey { return f.srv.hostKey }, nil, []string{"known rack1/node 7"}},
		{"nothing recorded: first use", func(rebootFixture) ssh.PublicKey { return nil }, nil, []string{"known rack1/node 7"}},
		{"another key recorded", func(rebootFixture) ssh.PublicKey { return other.PublicKey() }, errExplained, []string{"known rack1/node 7", "mismatch rack1/node 7"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			hk := &fakeHostKeys{}
			f := newRebootFixture(t, "  - {id: rack1/node 7, address: ADDR, port: PORT}\n", provider.Env{HostKeys: hk})
			hk.key = tt.known(f)
			err := f.p.RebootMachine(t.Context(), "rack1/node 7")
			if !errors.Is(err, tt.wantErr) || (err == nil) != (tt.wantErr == nil) {
				t.Errorf("RebootMachine: %v, want %v", err, tt.wantErr)
			}
			if tt.wantErr != nil && !errors.Is(err, sshx.ErrHostKeyMismatch) {
				t.Errorf("RebootMachine: %v, want it to wrap ErrHostKeyMismatch", err)
			}
			if got := hk.questions(); !slices.Equal(got, tt.asked) {
				t.Errorf("the host key checker was asked %v, want %v", got, tt.asked)
			}
			if ran := len(f.srv.received()) > 0; ran != (tt.wantErr == nil) {
				t.Errorf("the server ran %v", f.srv.received())
			}
		})
	}
}

func TestRebootRefusesUnverifiableHostKey(t *testing.T) {
	t.Parallel()
	f := newRebootFixture(t, "  - {id: a, address: ADDR, port: PORT}\n", provider.Env{})
	err := f.p.RebootMachine(t.Context(), "a")
	if err == nil || !strings.Contains(err.Error(), "the host key cannot be verified") {
		t.Errorf("RebootMachine with no pin and no checker: %v, want a refusal", err)
	}
	if got := f.srv.received(); len(got) != 0 {
		t.Errorf("the server ran %v", got)
	}
}

// A command the machine started but that runs past SSHTimeout is a reboot
// issued (systemctl reboot can block while the machine shuts down), and
// RebootMachine returns at SSHTimeout.
func TestRebootTimeout(t *testing.T) {
	t.Parallel()
	f := newRebootFixture(t, "  - {id: a, address: ADDR, port: PORT, host_key: HOSTKEY, reboot_command: "+cmdHang+"}\n", provider.Env{})
	f.p.cfg.SSHTimeout = 2 * time.Second
	if err := f.p.RebootMachine(t.Context(), "a"); err != nil {
		t.Errorf("RebootMachine with a command that runs past SSHTimeout: %v, want the reboot counted as issued", err)
	}
	if got := f.srv.received(); len(got) != 1 || got[0].cmd != cmdHang {
		t.Errorf("the server ran %v, want the hanging command", got)
	}
}

// A machine that does not confirm the command within SSHTimeout did not
// reboot for sure: that is a failure.
func TestRebootNotStartedFails(t *testing.T) {
	t.Parallel()
	f := newRebootFixture(t, "  - {id: a, address: ADDR, port: PORT, host_key: HOSTKEY}\n", provider.Env{})
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := f.p.RebootMachine(ctx, "a"); err == nil {
		t.Error("RebootMachine with its context done succeeded")
	}
	if got := f.srv.received(); len(got) != 0 {
		t.Errorf("the server ran %v", got)
	}
}

func TestRebootNeedsUserAndCredentials(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "inventory.yaml")
	host, _ := newKey(t)
	writeFile(t, path, fmt.Sprintf("machines:\n  - {id: a, address: 127.0.0.1, host_key: %q}\n", authorizedKey(host.PublicKey())))
	p, err := New(Config{Inventory: path})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.RebootMachine(t.Context(), "a"); err == nil || !strings.Contains(err.Error(), "no SSH user") {
		t.Errorf("RebootMachine without a user: %v", err)
	}
	p.cfg.Env.SSHUser = "root"
	if err := p.RebootMachine(t.Context(), "a"); err == nil || !strings.Contains(err.Error(), "no SSH credentials") {
		t.Errorf("RebootMachine without credentials: %v", err)
	}
}

// The machine's own password and key are used next to Shepherd's key.
func TestRebootWithMachineCredentials(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	shepherdKey, _ := newKey(t)
	machineKey, machineKeyPEM := newKey(t)
	writeFile(t, filepath.Join(dir, "pw"), "open sesame\n")
	writeFile(t, filepath.Join(dir, "key"), string(machineKeyPEM))

	// This server knows the password only; Shepherd's key is rejected.
	pwSrv := newSSHServer(t, serverAuth{user: "admin", password: "open sesame"})
	// This one knows the machine's key only.
	keySrv := newSSHServer(t, serverAuth{keys: []ssh.PublicKey{machineKey.PublicKey()}})
	path := filepath.Join(dir, "inventory.yaml")
	writeFile(t, path, fmt.Sprintf(`machines:
  - {id: pw, address: %s, port: %d, host_key: %q, ssh_user: admin, ssh_password_file: %s}
  - {id: key, address: %s, port: %d, host_key: %q, ssh_key_file: %s}
`, pwSrv.addr.Addr(), pwSrv.addr.Port(), authorizedKey(pwSrv.hostKey), filepath.Join(dir, "pw"),
		keySrv.addr.Addr(), keySrv.addr.Port(), authorizedKey(keySrv.hostKey), filepath.Join(dir, "key")))
	p, err := New(Config{Inventory: path, Env: provider.Env{SSHSigner: shepherdKey, SSHUser: "root"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		id  string
		srv *sshServer
	}{{"pw", pwSrv}, {"key", keySrv}} {
		if err := p.RebootMachine(t.Context(), tc.id); err != nil {
			t.Errorf("RebootMachine(%s): %v", tc.id, err)
		}
		if got := tc.srv.received(); len(got) != 1 || got[0].cmd != "systemctl reboot" {
			t.Errorf("server of %s ran %v", tc.id, got)
		}
	}

	// What SSHAccess hands the initializer works on its own.
	acc, err := p.SSHAccess(t.Context(), "pw")
	if err != nil {
		t.Fatal(err)
	}
	c, err := sshx.Dial(t.Context(), sshx.Target{Addr: pwSrv.addr.String(), User: acc.User, SecretAuth: acc.Auth, HostKey: acc.HostKey})
	if err != nil {
		t.Fatalf("dialing with SSHAccess(pw): %v", err)
	}
	if _, err := sshx.Run(t.Context(), c, "true", nil, 1024); err != nil {
		t.Errorf("running a command with SSHAccess(pw): %v", err)
	}
	c.Close()
}

// A reboot that fails before the machine confirmed it started the command
// did nothing to the machine: its error wraps provider.ErrNotReached (so
// the circuit breaker does not count it) and says what stood in the way.
func TestRebootNotReached(t *testing.T) {
	t.Parallel()
	errBMDB := errors.New("the BMDB is down")
	for _, tt := range []struct {
		name     string
		machine  string
		auth     serverAuth // besides Shepherd's key
		hostKeys *fakeHostKeys
		wantErr  error
	}{
		{"host key checker fails", "{id: a, address: ADDR, port: PORT}", serverAuth{}, &fakeHostKeys{err: errBMDB}, errBMDB},
		{"session refused", "{id: a, address: ADDR, port: PORT, host_key: HOSTKEY}", serverAuth{refuseSessions: true}, nil, sshx.ErrNotStarted},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			env := provider.Env{}
			if tt.hostKeys != nil {
				env.HostKeys = tt.hostKeys
			}
			client, _ := newKey(t)
			env.SSHSigner, env.SSHUser = client, "shepherd"
			auth := tt.auth
			auth.keys = []ssh.PublicKey{client.PublicKey()}
			srv := newSSHServer(t, auth)
			p := newProviderFor(t, srv, "machines:\n  - "+tt.machine+"\n", env, noEnv)
			err := p.RebootMachine(t.Context(), "a")
			if !errors.Is(err, tt.wantErr) || !errors.Is(err, provider.ErrNotReached) {
				t.Errorf("RebootMachine: %v, want an error wrapping %v and ErrNotReached", err, tt.wantErr)
			}
			if got := srv.received(); len(got) != 0 {
				t.Errorf("the server ran %v", got)
			}
		})
	}
}

// A machine that accepts only its own password gets it only once its host
// key can be verified, or with trust_on_first_use: until then the reboot
// fails, saying how to allow it, and nothing reaches the machine.
func TestRebootWithholdsSecretsOnFirstUse(t *testing.T) {
	t.Parallel()
	vars := envMap(map[string]string{"PW": "open sesame"})
	srv := newSSHServer(t, serverAuth{user: "admin", password: "open sesame"})
	shepherdKey, _ := newKey(t)
	env := provider.Env{HostKeys: &fakeHostKeys{}, SSHSigner: shepherdKey, SSHUser: "admin"}

	p := newProviderFor(t, srv, "machines:\n  - {id: a, address: ADDR, port: PORT, ssh_password_env: PW}\n", env, vars)
	err := p.RebootMachine(t.Context(), "a")
	if !errors.Is(err, sshx.ErrSecretsWithheld) || !errors.Is(err, provider.ErrNotReached) ||
		!strings.Contains(err.Error(), "pin host_key in the inventory or set trust_on_first_use: true") {
		t.Errorf("RebootMachine with the password withheld: %v, want ErrSecretsWithheld, ErrNotReached and how to allow it", err)
	}
	if got := srv.received(); len(got) != 0 {
		t.Errorf("the server ran %v", got)
	}

	p = newProviderFor(t, srv, "machines:\n  - {id: a, address: ADDR, port: PORT, ssh_password_env: PW, trust_on_first_use: true}\n", env, vars)
	if err := p.RebootMachine(t.Context(), "a"); err != nil {
		t.Errorf("RebootMachine with trust_on_first_use: %v", err)
	}
	if got, want := srv.received(), []run{{"admin", "systemctl reboot"}}; !slices.Equal(got, want) {
		t.Errorf("with trust_on_first_use the server ran %v, want %v", got, want)
	}
}

// newProviderFor writes machines (with ADDR, PORT and HOSTKEY standing for
// srv's) to an inventory and creates its provider with env, reading
// environment variables with lookupEnv.
func newProviderFor(t *testing.T, srv *sshServer, machines string, env provider.Env, lookupEnv func(string) (string, bool)) *Provider {
	t.Helper()
	path := filepath.Join(t.TempDir(), "inventory.yaml")
	writeFile(t, path, strings.NewReplacer(
		"ADDR", srv.addr.Addr().String(),
		"PORT", fmt.Sprint(srv.addr.Port()),
		"HOSTKEY", authorizedKey(srv.hostKey),
	).Replace(machines))
	p, err := newProvider(Config{Inventory: path, SSHTimeout: 10 * time.Second, Env: env}, lookupEnv)
	if err != nil {
		t.Fatal(err)
	}
	return p
}
