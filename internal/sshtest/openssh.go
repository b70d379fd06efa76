package sshtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/shepherd/shepherd/internal/atomicfile"
	"golang.org/x/crypto/ssh"
)

// sshdOptions are what this sshd's version needs in its configuration.
type sshdOptions struct {
	// noPenalties disables PerSourcePenalties (OpenSSH 9.8+), which would
	// otherwise block 127.0.0.1 after a few failed logins or readiness
	// probes, refusing every later connection of the test.
	noPenalties bool
}

var sshdVersionRE = regexp.MustCompile(`OpenSSH_(\d+)\.(\d+)`)

// probeSSHD asks sshd for its version (sshd -V; older versions print it in
// their usage message) to choose the options its configuration needs.
func probeSSHD(ctx context.Context, path string) (sshdOptions, error) {
	out, _ := exec.CommandContext(ctx, path, "-V").CombinedOutput() // -V exits non-zero on old versions
	m := sshdVersionRE.FindSubmatch(out)
	if m == nil {
		if _, err := os.Stat(path); err != nil {
			return sshdOptions{}, fmt.Errorf("sshtest: running %s -V: %w", path, err)
		}
		return sshdOptions{}, nil // unknown version: assume an old one
	}
	major, _ := strconv.Atoi(string(m[1]))
	minor, _ := strconv.Atoi(string(m[2]))
	return sshdOptions{noPenalties: major > 9 || major == 9 && minor >= 8}, nil
}

// sshdServer runs one sshd child process for a Host, writing its
// configuration, keys and log into the Host's directory.
type sshdServer struct {
	h       *Host
	path    string // absolute path of sshd
	opts    sshdOptions
	cfgPath string
	keyDir  string // host keys are ssh_host_<type>_key in it
	pidPath string
	akPath  string // authorized keys
	// tag, if set, marks every command of the server's sessions with
	// envMachine=tag (see Machine).
	tag     string
	logPath string
	proc    *sshdProc // running sshd, nil when stopped
}

// homeDir is the HOME of the server's sessions: empty but for what the
// test puts there.
func (s *sshdServer) homeDir() string { return filepath.Join(s.h.Dir, "home") }

func newSSHDServer(h *Host, path string, opts sshdOptions) *sshdServer {
	return &sshdServer{
		h:       h,
		path:    path,
		opts:    opts,
		cfgPath: filepath.Join(h.Dir, "sshd_config"),
		keyDir:  h.Dir,
		pidPath: filepath.Join(h.Dir, "sshd.pid"),
		akPath:  filepath.Join(h.Dir, "authorized_keys"),
		logPath: filepath.Join(h.Dir, "sshd.log"),
	}
}

// sshdProc is one started sshd process.
type sshdProc struct {
	cmd  *exec.Cmd
	done chan struct{} // closed when cmd.Wait has returned
	err  error         // cmd.Wait's result; read only after done is closed
}

// start writes the host key, authorized keys and configuration and starts
// sshd, choosing a free port if the Host has none yet.
func (s *sshdServer) start(ctx context.Context) error {
	if s.proc != nil {
		return errors.New("sshd is already running")
	}
	if err := os.MkdirAll(s.homeDir(), 0o700); err != nil {
		return err
	}
	for i := range s.h.HostKeys {
		key, err := s.h.hostKeyPEM(i)
		if err != nil {
			return err
		}
		// sshd refuses host keys that others can read.
		if err := atomicfile.Write(s.keyPath(i), key, 0o600); err != nil {
			return err
		}
	}
	var ak []byte
	for _, k := range s.h.authorizedKeys {
		ak = append(ak, ssh.MarshalAuthorizedKey(k)...)
	}
	if err := atomicfile.Write(s.akPath, ak, 0o600); err != nil {
		return err
	}
	_, err := onFreePort(s.h.Addr, func(addr netip.AddrPort) error {
		if s.h.Addr != addr { // a restart on the same port changes nothing that others read
			s.h.Addr = addr
		}
		return s.startOnce(ctx)
	})
	return err
}

// startOnce validates the configuration for the Host's address and starts
// sshd on it, waiting until it completes an SSH handshake.
func (s *sshdServer) startOnce(ctx context.Context) error {
	if err := s.writeConfig(); err != nil {
		return err
	}
	if err := s.validate(ctx); err != nil {
		return err
	}
	logf, err := os.OpenFile(s.logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("opening sshd log: %w", err)
	}
	defer logf.Close() // the child has its own copy once started
	logStart, err := logf.Seek(0, io.SeekEnd)
	if err != nil {
		return fmt.Errorf("finding the end of the sshd log: %w", err)
	}
	if _, err := fmt.Fprintf(logf, "--- sshtest: starting %s on %s at %s ---\n", s.path, s.h.Addr, time.Now().Format(time.RFC3339Nano)); err != nil {
		return fmt.Errorf("writing sshd log: %w", err)
	}

	// -D keeps sshd in the foreground as our child; -e logs to stderr. sshd
	// re-executes argv[0] for every connection and on SIGHUP, so it must be
	// an absolute path.
	cmd := exec.Command(s.path, "-D", "-e", "-f", s.cfgPath)
	// A file, not a pipe: sshd's per-connection processes inherit stderr
	// and may outlive the listener, and a pipe would make Wait wait for them.
	cmd.Stdout, cmd.Stderr = logf, logf
	// Pdeathsig kills sshd if the test process dies without cleaning up. It
	// survives sshd's re-exec on SIGHUP. (It fires when the OS thread that
	// started sshd exits, which the Go runtime does only for threads locked
	// by goroutines that exit; tests do not do that.)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", s.path, err)
	}
	p := &sshdProc{cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	if err := waitReady(ctx, s.h.Addr, s.h.HostKey, p.done); err != nil {
		_ = p.terminate()
		_ = s.killLeftovers()
		if errors.Is(err, errServerExited) {
			err = fmt.Errorf("sshd exited before accepting connections (%v)", p.err)
		}
		if s.logSince(logStart, "Address already in use") {
			err = fmt.Errorf("%w: %w", errAddrInUse, err)
		}
		return fmt.Errorf("%w\n%s", err, logTail(s.logPath))
	}
	s.proc = p
	return nil
}

// keyPath is the file of host key i, named as ssh-keygen -A names them.
func (s *sshdServer) keyPath(i int) string {
	kind := map[string]string{ssh.KeyAlgoED25519: "ed25519", ssh.KeyAlgoECDSA256: "ecdsa", ssh.KeyAlgoRSA: "rsa"}[s.h.HostKeys[i].Type()]
	return filepath.Join(s.keyDir, "ssh_host_"+kind+"_key")
}

// logSince reports whether the log, from offset on, contains text.
func (s *sshdServer) logSince(offset int64, text string) bool {
	data, err := os.ReadFile(s.logPath)
	if err != nil || int64(len(data)) < offset {
		return false
	}
	return strings.Contains(string(data[offset:]), text)
}

// writeConfig writes sshd_config for the Host's current address.
func (s *sshdServer) writeConfig() error {
	keys := make([]string, len(s.h.HostKeys))
	for i := range keys {
		k, err := configArg(s.keyPath(i))
		if err != nil {
			return err
		}
		keys[i] = k
	}
	pid, err := configArg(s.pidPath)
	if err != nil {
		return err
	}
	// sshd expands %-tokens (%h, %u) in AuthorizedKeysFile; %% is a literal %.
	ak, err := configArg(strings.ReplaceAll(s.akPath, "%", "%%"))
	if err != nil {
		return err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "# Written by sshtest for one test host; sshd runs as: %s -D -e -f %s\n", s.path, s.cfgPath)
	fmt.Fprintf(&b, "Port %d\n", s.h.Addr.Port())
	fmt.Fprintf(&b, "ListenAddress %s\n", s.h.Addr)
	for _, k := range keys {
		fmt.Fprintf(&b, "HostKey %s\n", k)
	}
	fmt.Fprintf(&b, "PidFile %s\n", pid)
	fmt.Fprintf(&b, "AuthorizedKeysFile %s\n", ak)
	if s.h.password != "" {
		// Passwords only: sshd checks them against the system's user
		// database and logs each attempt.
		b.WriteString("PermitRootLogin yes\nPubkeyAuthentication no\nPasswordAuthentication yes\nPermitEmptyPasswords no\n")
	} else {
		b.WriteString("PermitRootLogin prohibit-password\nPubkeyAuthentication yes\nPasswordAuthentication no\n")
	}
	b.WriteString(`KbdInteractiveAuthentication no
# Without PAM, sshd itself refuses accounts whose password field starts with
# "!" (locked), even for key logins.
UsePAM no
# The files live in the test's temporary directory, whatever its ownership.
StrictModes no
Subsystem sftp internal-sftp
PrintMotd no
# Accept no environment from clients (no real variable is named "none").
AcceptEnv none
# Many machines' worth of concurrent, unauthenticated connections must not
# be dropped by sshd's default 10:30:100.
MaxStartups 200
MaxSessions 100
LogLevel VERBOSE
`)
	// The sessions' home is the host's own, so that the startup files of
	// the machine running the tests (bash reads ~/.bashrc for a command
	// from sshd; a pyenv there wrote "cannot rehash" to stderr when several
	// sessions started at once) reach no command. sshd uses only the first
	// SetEnv line, so every variable is on it.
	home, err := configArg("HOME=" + s.homeDir())
	if err != nil {
		return err
	}
	b.WriteString("SetEnv " + home)
	if s.tag != "" {
		// Marks every process of this machine's sessions (sshtest.Machine).
		fmt.Fprintf(&b, " %s=%s", envMachine, s.tag)
	}
	b.WriteString("\n")
	if s.opts.noPenalties {
		b.WriteString("# Failed logins in tests must not get 127.0.0.1 blocked.\nPerSourcePenalties no\n")
	}
	return atomicfile.Write(s.cfgPath, []byte(b.String()), 0o600)
}

// configArg quotes s as one sshd_config argument. sshd splits arguments at
// spaces, treats an unquoted '#' as the start of a comment and, within
// double quotes, turns \" and \\ into " and \.
func configArg(s string) (string, error) {
	if strings.ContainsAny(s, "\n\r\x00") {
		return "", fmt.Errorf("path %q contains a line break or NUL, which sshd_config cannot express", s)
	}
	return `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(s) + `"`, nil
}

// privsepRE matches sshd's complaint that the privilege separation
// directory (/run/sshd on Debian, elsewhere on other systems) is missing;
// it lives on a tmpfs that containers often start without.
var privsepRE = regexp.MustCompile(`Missing privilege separation directory: (\S+)`)

// validate runs sshd -t, which reports configuration and host key errors
// clearly instead of in the log of a process that exited. When sshd (run as
// root) misses its privilege separation directory, validate creates it.
func (s *sshdServer) validate(ctx context.Context) error {
	for created := false; ; created = true {
		out, err := exec.CommandContext(ctx, s.path, "-t", "-f", s.cfgPath).CombinedOutput()
		if err == nil {
			return nil
		}
		if m := privsepRE.FindSubmatch(out); m != nil && !created {
			if err := os.MkdirAll(string(m[1]), 0o755); err != nil {
				return fmt.Errorf("creating sshd's privilege separation directory: %w", err)
			}
			continue
		}
		return fmt.Errorf("%s -t -f %s rejected the configuration: %w\n%s", s.path, s.cfgPath, err, strings.TrimSpace(string(out)))
	}
}

// stop stops sshd for good, reporting an abnormal exit that happened while
// the test ran.
func (s *sshdServer) stop() error {
	p := s.proc
	if p == nil {
		return nil
	}
	var early error
	select {
	case <-p.done:
		// sshd exits 0 on SIGTERM, so a test that shut it down on purpose
		// with `kill $(cat PIDFILE)` is no error.
		if p.err != nil {
			early = fmt.Errorf("sshd exited while the test ran: %w\n%s", p.err, logTail(s.logPath))
		}
	default:
	}
	return errors.Join(early, s.halt())
}

// halt stops the running sshd, if any, and kills any process left over
// from it, without judging how it exited: a Restart after the test killed
// sshd (a crashed machine) is fine.
func (s *sshdServer) halt() error {
	p := s.proc
	if p == nil {
		return nil
	}
	s.proc = nil
	return errors.Join(p.terminate(), s.killLeftovers())
}

// terminate sends sshd SIGTERM and waits for it to exit, killing it after
// stopTimeout.
func (p *sshdProc) terminate() error {
	select {
	case <-p.done:
		return nil
	default:
	}
	pid := p.cmd.Process.Pid
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("sending SIGTERM to sshd (pid %d): %w", pid, err)
	}
	timer := time.NewTimer(stopTimeout)
	defer timer.Stop()
	select {
	case <-p.done:
		return nil
	case <-timer.C:
		_ = p.cmd.Process.Kill()
		<-p.done
		return fmt.Errorf("sshd (pid %d) still ran %s after SIGTERM; killed it", pid, stopTimeout)
	}
}

// killLeftovers kills sshd processes still running with this Host's
// configuration (connections that had not logged in yet, which sshd
// re-executes as `sshd ... -f CONFIG -R`) and waits until they are gone.
// Processes of logged-in sessions rename themselves ("sshd: root@notty")
// and are left alone, like the commands they run.
func (s *sshdServer) killLeftovers() error {
	deadline := time.Now().Add(stopTimeout)
	tick := time.NewTicker(pollInterval)
	defer tick.Stop()
	for {
		pids := s.leftovers()
		if len(pids) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("sshd processes %v for %s still run %s after SIGKILL", pids, s.cfgPath, stopTimeout)
		}
		for _, pid := range pids {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
		<-tick.C
	}
}

// settle waits until sshd has no connection left before authentication, so
// that what those connections log is in the log; it gives up quietly after
// stopTimeout, leaving the caller to read what is there.
//
// sshd logs a connection's authentication from the connection's monitor
// process ("sshd: USER [priv]", which no longer carries -f CONFIG), relaying
// what its unprivileged child reports; the client may have its answer before
// the line is written. The listener counts connections not yet
// authenticated in its title ("[listener] 1 of 10-100 startups"), and a
// connection leaves that count once its monitor has finished or logged the
// user in, which is the moment to read.
func (s *sshdServer) settle() {
	p := s.proc
	if p == nil {
		return
	}
	title := filepath.Join("/proc", strconv.Itoa(p.cmd.Process.Pid), "cmdline")
	deadline := time.Now().Add(stopTimeout)
	tick := time.NewTicker(pollInterval)
	defer tick.Stop()
	for time.Now().Before(deadline) {
		cmdline, err := os.ReadFile(title)
		if err != nil {
			return // sshd has exited
		}
		m := startupsRE.FindSubmatch(cmdline)
		if m == nil || string(m[1]) == "0" {
			return // no count in the title (an older sshd), or none pending
		}
		<-tick.C
	}
}

// startupsRE reads the number of unauthenticated connections from sshd's
// listener title.
var startupsRE = regexp.MustCompile(`\[listener\] (\d+) of `)

// leftovers returns the pids of live processes running sshd with this
// Host's configuration file.
func (s *sshdServer) leftovers() []int {
	exe, err := filepath.EvalSymlinks(s.path)
	if err != nil {
		exe = s.path
	}
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil // not Linux: nothing to check
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		// Zombies and exited processes have no exe link and an empty
		// cmdline, so they do not count.
		link, err := os.Readlink(filepath.Join("/proc", e.Name(), "exe"))
		if err != nil || strings.TrimSuffix(link, " (deleted)") != exe {
			continue
		}
		cmdline, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		// sshd may have replaced argv with a title like
		// "sshd: /usr/sbin/sshd -D -e -f CONFIG [listener] ...".
		args := " " + strings.ReplaceAll(string(cmdline), "\x00", " ") + " "
		if strings.Contains(args, " -f "+s.cfgPath+" ") {
			pids = append(pids, pid)
		}
	}
	return pids
}
