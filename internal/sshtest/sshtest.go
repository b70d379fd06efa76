// Package sshtest runs SSH servers on loopback for end-to-end tests. Each
// server stands in for one machine: tests of Shepherd's initializer SSH into
// it, upload the agent with SFTP, run it (it starts a detached daemon) and
// later "reboot" the machine's SSH server with Restart or ChangeHostKey.
//
// The real OpenSSH server is used when it is installed, because the
// initializer must work against it (its SFTP rename semantics, its session
// handling, its logs). The in-process github.com/gliderlabs/ssh server is the
// fallback when it is not. CI sets SHEPHERD_REQUIRE_SSHD=1 so that a missing
// sshd fails the tests instead of silently testing only the fallback.
//
// Differences between the kinds that tests may notice:
//   - Commands run in the login user's home directory under OpenSSH and in
//     Host.Dir under Gliderlabs; relative SFTP paths resolve the same way.
//     Use absolute paths.
//   - OpenSSH gives commands a minimal environment (PATH, HOME, USER, SSH_*)
//     whose HOME is the host's own, Host.Dir/home (empty), so the startup
//     files of the machine running the tests reach no command; Gliderlabs
//     gives them the test process's environment.
//   - OpenSSH runs commands with the user's login shell (Debian's bash reads
//     $HOME/.bashrc even though it is not interactive); Gliderlabs uses
//     /bin/sh.
//   - An SFTP rename (SSH_FXP_RENAME) onto an existing file fails under
//     OpenSSH (it links, then unlinks) but replaces the file under Gliderlabs
//     (pkg/sftp calls rename(2)). Use the posix-rename@openssh.com extension
//     (sftp.Client.PosixRename) to replace a file on both.
//   - Gliderlabs allocates no pty and runs no shell: a session must carry a
//     command. A command killed by signal N exits with status 128+N instead
//     of sending an exit-signal.
//   - Gliderlabs accepts only the user running the test (Host.User); OpenSSH
//     accepts any local user with a working shell, since every user's
//     authorized keys come from the same file.
//   - With Config.Password, Gliderlabs accepts exactly that password; OpenSSH
//     checks passwords against the system's user database, which a test
//     cannot set, so it refuses them all. Both log every password offered
//     (Host.PasswordAttempts counts them), which is what tests of "was a
//     secret sent to this server?" look at.
//
// Machine is an OpenSSH Host standing in for a whole machine whose power a
// test cuts and restores, directly or through a simulated BMC's hook: power
// off kills its sshd and everything its sessions started, power on starts
// sshd again with the same address and host keys.
//
// Proxy puts a TCP forwarder in front of any server (an SSH Host, or
// PostgreSQL) that a test can make go silent, as a machine does that resets
// without closing its connections.
package sshtest

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/internal/localport"
)

// Kind is which SSH server a Host runs.
type Kind string

const (
	// OpenSSH is the system's sshd, run as a child process per Host.
	OpenSSH Kind = "openssh"
	// Gliderlabs is an in-process github.com/gliderlabs/ssh server.
	Gliderlabs Kind = "gliderlabs"
)

// EnvRequireSSHD names the environment variable that, set to "1", makes a
// missing OpenSSH server fail the test instead of falling back to
// Gliderlabs. CI sets it so the real server is never silently skipped.
const EnvRequireSSHD = "SHEPHERD_REQUIRE_SSHD"

const (
	// defaultSSHD is where Debian and most distributions install sshd; it is
	// often not on PATH for non-root users.
	defaultSSHD = "/usr/sbin/sshd"
	// startTimeout bounds how long a server may take to accept an SSH
	// handshake after it is started.
	startTimeout = 10 * time.Second
	// stopTimeout is how long sshd may take to exit after SIGTERM before it
	// is killed.
	stopTimeout = 10 * time.Second
	// portAttempts is how many free ports Start tries before giving up,
	// because another process may take the port between our probe and
	// sshd's bind.
	portAttempts = 5
	// logTailLines is how many lines of a server's log failures include.
	logTailLines = 40
	// pollInterval is how often readiness and exit are polled.
	pollInterval = 20 * time.Millisecond
)

// Config describes the servers to start.
type Config struct {
	// AuthorizedKeys are the client keys that may log in, as the user running
	// the test (Host.User; root in CI). Empty means nobody can log in.
	AuthorizedKeys []ssh.PublicKey
	// Kind is the server to run. "" means OpenSSH if /usr/sbin/sshd (or sshd
	// on PATH) exists, else Gliderlabs; with SHEPHERD_REQUIRE_SSHD=1 a
	// missing sshd fails the test instead.
	Kind Kind
	// AllHostKeyTypes gives each server an ed25519, an ECDSA (P-256) and an
	// RSA host key, as a stock sshd has (ssh-keygen -A), instead of only an
	// ed25519 one. Such a server presents whichever key the client prefers,
	// so clients that do not restrict their host key algorithms to the key
	// they expect see another one. Host.HostKey stays the ed25519 key;
	// Host.HostKeys lists all three.
	AllHostKeyTypes bool
	// Password, if not empty, makes the servers accept password logins as
	// Host.User and refuse keys (AuthorizedKeys must be empty). See the
	// package doc: OpenSSH checks the system's password instead, so there
	// every login fails, but Host.PasswordAttempts still counts them.
	Password string
}

// Validate names the bad field and value. It changes nothing.
func (c Config) Validate() error {
	switch c.Kind {
	case "", OpenSSH, Gliderlabs:
	default:
		return fmt.Errorf("sshtest: Kind must be %q, %q or empty, got %q", OpenSSH, Gliderlabs, c.Kind)
	}
	for i, k := range c.AuthorizedKeys {
		if k == nil {
			return fmt.Errorf("sshtest: AuthorizedKeys[%d] is nil", i)
		}
	}
	if c.Password != "" && len(c.AuthorizedKeys) > 0 {
		return errors.New("sshtest: a server takes Password or AuthorizedKeys, not both")
	}
	return nil
}

// Host is one running SSH server on 127.0.0.1.
//
// A Host's methods and fields must not be used concurrently with Restart or
// ChangeHostKey on the same Host, which replace its server and HostKey.
type Host struct {
	Kind    Kind
	Addr    netip.AddrPort // 127.0.0.1:port
	HostKey ssh.PublicKey  // current ed25519 host key
	// HostKeys are all current host keys: HostKey, then (with
	// Config.AllHostKeyTypes) the ECDSA and the RSA key.
	HostKeys []ssh.PublicKey
	Dir      string // scratch directory of this host (config, keys, logs); owned by the test
	User     string // user to log in as: the user running the test

	hostKeys       []crypto.Signer // private halves of HostKeys, in the same order
	allKeyTypes    bool
	authorizedKeys []ssh.PublicKey
	password       string
	sshd           *sshdServer // when Kind is OpenSSH
	gl             *glServer   // when Kind is Gliderlabs
}

// NewKey returns a fresh ed25519 SSH key, for a test's client (put its
// public half in Config.AuthorizedKeys) or wherever a test needs a key.
func NewKey(t testing.TB) ssh.Signer {
	t.Helper()
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	s, err := ssh.NewSignerFromKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// FindSSHD returns the absolute path of the OpenSSH server: /usr/sbin/sshd
// if it exists, else sshd on PATH. sshd must be started by absolute path,
// because it re-executes argv[0] for every connection and on SIGHUP.
func FindSSHD() (string, error) { return findSSHD(defaultSSHD, exec.LookPath) }

// findSSHD is FindSSHD with the default path and the PATH lookup as
// parameters, for tests.
func findSSHD(defaultPath string, lookPath func(string) (string, error)) (string, error) {
	if fi, err := os.Stat(defaultPath); err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0 {
		return defaultPath, nil
	}
	p, err := lookPath("sshd")
	if err != nil {
		return "", fmt.Errorf("no OpenSSH server: %s is not an executable file and sshd is not on PATH (install openssh-server)", defaultPath)
	}
	abs, err := filepath.Abs(p)
	if err != nil {
		return "", fmt.Errorf("making sshd path %q absolute: %w", p, err)
	}
	return abs, nil
}

// sshdRequired reports whether SHEPHERD_REQUIRE_SSHD=1.
func sshdRequired() bool { return os.Getenv(EnvRequireSSHD) == "1" }

// Kinds returns the kinds of server that can run here, for tests that run
// once per kind: OpenSSH and Gliderlabs when sshd is installed, otherwise
// only Gliderlabs. With SHEPHERD_REQUIRE_SSHD=1 a missing sshd fails the
// test.
func Kinds(t testing.TB) []Kind {
	t.Helper()
	kinds, err := availableKinds(FindSSHD, sshdRequired())
	if err != nil {
		t.Fatal(err)
	}
	return kinds
}

// availableKinds is Kinds with the sshd lookup and SHEPHERD_REQUIRE_SSHD as
// parameters, for tests.
func availableKinds(find func() (string, error), required bool) ([]Kind, error) {
	if _, err := find(); err != nil {
		if required {
			return nil, fmt.Errorf("sshtest: %s=1 but %w", EnvRequireSSHD, err)
		}
		return []Kind{Gliderlabs}, nil
	}
	return []Kind{OpenSSH, Gliderlabs}, nil
}

// resolveKind turns Config.Kind into the kind to run and, for OpenSSH, the
// path of sshd, given the sshd lookup and SHEPHERD_REQUIRE_SSHD.
func resolveKind(k Kind, find func() (string, error), required bool) (Kind, string, error) {
	if k == Gliderlabs {
		return Gliderlabs, "", nil
	}
	p, err := find()
	switch {
	case err == nil:
		return OpenSSH, p, nil
	case k == OpenSSH:
		return "", "", fmt.Errorf("sshtest: Kind %q requested but %w", OpenSSH, err)
	case required:
		return "", "", fmt.Errorf("sshtest: %s=1 but %w", EnvRequireSSHD, err)
	default:
		return Gliderlabs, "", nil
	}
}

// Start starts n servers, each on its own free port with its own ed25519
// host key, and stops them when the test ends (t.Cleanup). It fails the test
// (t.Fatal) if a server does not come up, with the server's log in the
// message. The servers start concurrently.
func Start(t testing.TB, n int, cfg Config) []*Host {
	t.Helper()
	if n < 1 {
		t.Fatalf("sshtest: Start needs n >= 1, got %d", n)
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	kind, sshdPath, err := resolveKind(cfg.Kind, FindSSHD, sshdRequired())
	if err != nil {
		t.Fatal(err)
	}
	u, err := user.Current()
	if err != nil {
		t.Fatalf("sshtest: looking up the current user, who logs in to the servers: %v", err)
	}
	var opts sshdOptions
	if kind == OpenSSH {
		if opts, err = probeSSHD(t.Context(), sshdPath); err != nil {
			t.Fatal(err)
		}
	}
	hosts := make([]*Host, n)
	for i := range hosts {
		// t.TempDir registers its removal now, before our cleanup below, so
		// it runs after the server is stopped (cleanups run last-in first-out).
		dir, err := filepath.Abs(t.TempDir())
		if err != nil {
			t.Fatalf("sshtest: making the host directory absolute: %v", err)
		}
		hosts[i] = &Host{Kind: kind, Dir: dir, User: u.Username, authorizedKeys: cfg.AuthorizedKeys,
			allKeyTypes: cfg.AllHostKeyTypes, password: cfg.Password}
		if kind == OpenSSH {
			hosts[i].sshd = newSSHDServer(hosts[i], sshdPath, opts)
		} else {
			hosts[i].gl = newGLServer(hosts[i])
		}
	}
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, h := range hosts {
		wg.Go(func() {
			if err := h.newHostKey(); err != nil {
				errs[i] = err
				return
			}
			if err := h.start(t.Context()); err != nil {
				errs[i] = fmt.Errorf("sshtest: starting %s server %d of %d: %w", kind, i+1, n, err)
			}
		})
	}
	wg.Wait()
	for _, h := range hosts {
		t.Cleanup(func() {
			if err := h.stop(); err != nil {
				t.Errorf("sshtest: stopping %s server on %s: %v", h.Kind, h.Addr, err)
			}
		})
	}
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	return hosts
}

// Restart stops and starts the server on the same port with the same host
// key (a "reboot" of the machine's SSH server). For OpenSSH it starts a new
// sshd process. Established connections survive, as they do when a real
// sshd restarts: under OpenSSH they are served by their own processes, under
// Gliderlabs only the listener is replaced.
func (h *Host) Restart(t testing.TB) {
	t.Helper()
	if err := h.restart(t.Context()); err != nil {
		t.Fatalf("sshtest: restarting %s server on %s: %v", h.Kind, h.Addr, err)
	}
}

// ChangeHostKey generates new host keys (of every type the Host has),
// restarts the server with them and returns the new ed25519 key (a
// reinstalled machine).
func (h *Host) ChangeHostKey(t testing.TB) ssh.PublicKey {
	t.Helper()
	if err := h.newHostKey(); err != nil {
		t.Fatal(err)
	}
	if err := h.restart(t.Context()); err != nil {
		t.Fatalf("sshtest: restarting %s server on %s with a new host key: %v", h.Kind, h.Addr, err)
	}
	return h.HostKey
}

// HostKeySet is a Host's host keys, private halves included: Keys takes
// them, SetHostKeys gives them back (a host key rotation undone).
type HostKeySet struct {
	signers []crypto.Signer
	pubs    []ssh.PublicKey
}

// Keys returns the Host's current host keys.
func (h *Host) Keys() HostKeySet { return HostKeySet{h.hostKeys, h.HostKeys} }

// SetHostKeys restarts the server with keys (from Keys) as its host keys.
func (h *Host) SetHostKeys(t testing.TB, keys HostKeySet) {
	t.Helper()
	if len(keys.signers) == 0 {
		t.Fatal("sshtest: SetHostKeys: no keys (use a HostKeySet from Keys)")
	}
	h.hostKeys, h.HostKeys, h.HostKey = keys.signers, keys.pubs, keys.pubs[0]
	if err := h.restart(t.Context()); err != nil {
		t.Fatalf("sshtest: restarting %s server on %s with other host keys: %v", h.Kind, h.Addr, err)
	}
}

// PIDFile is the path of sshd's pid file (OpenSSH only; "" for Gliderlabs),
// so a test's "reboot command" run through SSH can restart sshd itself with
// `kill -HUP $(cat PIDFILE)`. sshd re-executes itself with the same pid and
// configuration, so the Host keeps working and is still stopped at cleanup.
func (h *Host) PIDFile() string {
	if h.sshd == nil {
		return ""
	}
	return h.sshd.pidPath
}

// LogPath is the path of the server's log in Dir: sshd's stderr for
// OpenSSH, connections and commands for Gliderlabs.
func (h *Host) LogPath() string {
	if h.sshd != nil {
		return h.sshd.logPath
	}
	return h.gl.logPath
}

// String returns the kind and address, for messages.
func (h *Host) String() string { return fmt.Sprintf("%s@%s", h.Kind, h.Addr) }

// rsaHostKeyBits is the size of RSA host keys: ssh-keygen's default is
// 3072, but 2048 is as good for a test and generates much faster.
const rsaHostKeyBits = 2048

// newHostKey generates the Host's host keys (ed25519, and with
// AllHostKeyTypes ECDSA P-256 and RSA); the server uses them from its next
// start.
func (h *Host) newHostKey() error {
	_, ed, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return fmt.Errorf("sshtest: generating ed25519 host key: %w", err)
	}
	keys := []crypto.Signer{ed}
	if h.allKeyTypes {
		ec, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return fmt.Errorf("sshtest: generating ECDSA host key: %w", err)
		}
		rk, err := rsa.GenerateKey(rand.Reader, rsaHostKeyBits)
		if err != nil {
			return fmt.Errorf("sshtest: generating RSA host key: %w", err)
		}
		keys = append(keys, ec, rk)
	}
	pubs := make([]ssh.PublicKey, len(keys))
	for i, k := range keys {
		if pubs[i], err = ssh.NewPublicKey(k.Public()); err != nil {
			return fmt.Errorf("sshtest: host key %d: %w", i, err)
		}
	}
	h.hostKeys, h.HostKeys, h.HostKey = keys, pubs, pubs[0]
	return nil
}

// signers returns the signers of the current host keys.
func (h *Host) signers() ([]ssh.Signer, error) {
	out := make([]ssh.Signer, len(h.hostKeys))
	for i, k := range h.hostKeys {
		s, err := ssh.NewSignerFromKey(k)
		if err != nil {
			return nil, fmt.Errorf("making host key signer: %w", err)
		}
		out[i] = s
	}
	return out, nil
}

// hostKeyPEM returns host key i in OpenSSH's private key format, the one
// sshd reads.
func (h *Host) hostKeyPEM(i int) ([]byte, error) {
	block, err := ssh.MarshalPrivateKey(h.hostKeys[i], "sshtest host key")
	if err != nil {
		return nil, fmt.Errorf("encoding host key: %w", err)
	}
	return pem.EncodeToMemory(block), nil
}

// PasswordAttempts counts the password logins the server has seen, good or
// bad, from its log: a test asks it whether a client sent a password.
//
// sshd writes "Failed password" from the connection's monitor process, which
// may still be writing when the client has already seen the refusal; so the
// count waits (up to stopTimeout) until sshd holds no connection still being
// authenticated, and then reads the log.
func (h *Host) PasswordAttempts() int {
	if h.sshd != nil {
		h.sshd.settle()
	}
	data, err := os.ReadFile(h.LogPath())
	if err != nil {
		return 0
	}
	// sshd logs "Failed password for USER from ..." and "Accepted password
	// for ..."; glServer.password logs the same words.
	return strings.Count(string(data), " password for ")
}

func (h *Host) start(ctx context.Context) error {
	if h.sshd != nil {
		return h.sshd.start(ctx)
	}
	return h.gl.start(ctx)
}

func (h *Host) stop() error {
	if h.sshd != nil {
		return h.sshd.stop()
	}
	return h.gl.stop()
}

// restart stops the server and starts it again with the current host key on
// the same port.
func (h *Host) restart(ctx context.Context) error {
	if h.sshd != nil {
		if err := h.sshd.halt(); err != nil {
			return err
		}
		return h.sshd.start(ctx)
	}
	return h.gl.restart(ctx)
}

// errProbed ends a readiness probe's handshake once the server has proved it
// holds the expected host key; authentication is not needed to know the
// server is up, and skipping it keeps failed logins out of the server's log.
var errProbed = errors.New("sshtest: host key verified")

// probe reports whether an SSH server holding hostKey completes a key
// exchange on addr.
func probe(ctx context.Context, addr netip.AddrPort, hostKey ssh.PublicKey) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	var d net.Dialer
	conn, err := d.DialContext(ctx, "tcp", addr.String())
	if err != nil {
		return fmt.Errorf("connecting: %w", err)
	}
	defer conn.Close()
	deadline, _ := ctx.Deadline()
	if err := conn.SetDeadline(deadline); err != nil {
		return fmt.Errorf("setting handshake deadline: %w", err)
	}
	_, _, _, err = ssh.NewClientConn(conn, addr.String(), &ssh.ClientConfig{
		User: "sshtest-probe",
		// A server with several host keys presents the one the client
		// prefers: ask for the kind expected.
		HostKeyAlgorithms: []string{hostKey.Type()},
		HostKeyCallback: func(_ string, _ net.Addr, key ssh.PublicKey) error {
			if !keysEqual(key, hostKey) {
				return fmt.Errorf("server presented host key %s, want %s", ssh.FingerprintSHA256(key), ssh.FingerprintSHA256(hostKey))
			}
			return errProbed
		},
	})
	if errors.Is(err, errProbed) {
		return nil
	}
	if err == nil {
		return errors.New("server accepted a login without credentials")
	}
	return fmt.Errorf("handshake: %w", err)
}

// waitReady polls until probe succeeds, exited is closed (the server died)
// or startTimeout passes.
func waitReady(ctx context.Context, addr netip.AddrPort, hostKey ssh.PublicKey, exited <-chan struct{}) error {
	ctx, cancel := context.WithTimeout(ctx, startTimeout)
	defer cancel()
	tick := time.NewTicker(pollInterval)
	defer tick.Stop()
	for {
		err := probe(ctx, addr, hostKey)
		if err == nil {
			return nil
		}
		select {
		case <-exited:
			return errServerExited
		case <-ctx.Done():
			return fmt.Errorf("no SSH handshake on %s within %s (last attempt: %w)", addr, startTimeout, err)
		case <-tick.C:
		}
	}
}

// errServerExited means the server process ended while we waited for it to
// accept connections.
var errServerExited = errors.New("server exited before accepting connections")

// keysEqual reports whether a and b are the same public key.
func keysEqual(a, b ssh.PublicKey) bool {
	if a == nil || b == nil {
		return false
	}
	return string(a.Marshal()) == string(b.Marshal())
}

// freePort returns a port that was free on 127.0.0.1 a moment ago. Another
// process may take it before sshd binds it, so callers retry on
// "Address already in use".
func freePort() (uint16, error) {
	port, err := localport.Free(20000, 26999)
	return uint16(port), err
}

// errAddrInUse marks a server start that failed because its port was taken,
// the one failure onFreePort retries with another port.
var errAddrInUse = errors.New("port already in use")

// onFreePort starts a server with start on addr or, when addr has no port
// yet, on a free port, choosing another while start reports errAddrInUse
// (another test bound the port first), up to portAttempts times. It returns
// the address start last tried.
func onFreePort(addr netip.AddrPort, start func(netip.AddrPort) error) (netip.AddrPort, error) {
	choosePort := addr.Port() == 0
	for attempt := 1; ; attempt++ {
		if choosePort {
			port, err := freePort()
			if err != nil {
				return addr, err
			}
			addr = netip.AddrPortFrom(loopback, port)
		}
		err := start(addr)
		if choosePort && errors.Is(err, errAddrInUse) && attempt < portAttempts {
			continue
		}
		return addr, err
	}
}

// loopback is the address every server listens on.
var loopback = netip.AddrFrom4([4]byte{127, 0, 0, 1})

// logTail returns the last logTailLines lines of the log at path, for error
// messages.
func logTail(path string) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("(reading log %s: %v)", path, err)
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > logTailLines {
		lines = lines[len(lines)-logTailLines:]
	}
	return fmt.Sprintf("last lines of %s:\n\t%s", path, strings.Join(lines, "\n\t"))
}
