package pgserver

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/internal/localport"
)

const (
	// killGrace is how long an immediate shutdown (SIGQUIT) may take before
	// the whole process group is killed.
	killGrace = 10 * time.Second
	// tailLines is how many log lines errors include.
	tailLines = 20
	// maxLogSize is the size above which postgres.log is truncated when
	// postgres starts, so a long-lived dev directory does not grow forever.
	maxLogSize = 16 << 20
	// maxSocketPath is the longest unix socket path postgres accepts
	// (sizeof(sun_path) minus the terminating NUL).
	maxSocketPath = 107
)

// errAddrInUse marks a startup failure caused by the port being taken, the
// one failure Start retries (with a new port) when Config.Port is 0.
var errAddrInUse = errors.New("port already in use")

// osUser is the unprivileged OS user postgres runs as when we are root.
type osUser struct {
	name   string
	uid    uint32
	gid    uint32
	groups []uint32 // supplementary groups
}

// lookupPostgresUser finds the "postgres" OS user that runs the server when
// the calling process is root (PostgreSQL refuses to run as root).
func lookupPostgresUser() (*osUser, error) {
	u, err := user.Lookup("postgres")
	if err != nil {
		var unknown user.UnknownUserError
		if errors.As(err, &unknown) {
			return nil, errors.New(`running as root, but PostgreSQL refuses to run as root and there is no "postgres" OS user to run it as; create one with: useradd --system postgres`)
		}
		return nil, fmt.Errorf("looking up the postgres OS user: %w", err)
	}
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("postgres OS user has non-numeric uid %q", u.Uid)
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("postgres OS user has non-numeric gid %q", u.Gid)
	}
	ou := &osUser{name: u.Username, uid: uint32(uid), gid: uint32(gid)}
	if ids, err := u.GroupIds(); err == nil {
		for _, id := range ids {
			if g, err := strconv.ParseUint(id, 10, 32); err == nil && uint32(g) != ou.gid {
				ou.groups = append(ou.groups, uint32(g))
			}
		}
	}
	return ou, nil
}

// canSearch reports whether u may traverse the directory described by fi,
// following the kernel's owner/group/other permission rules (ACLs are not
// considered).
func (u *osUser) canSearch(fi fs.FileInfo) bool {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return true
	}
	perm := fi.Mode().Perm()
	switch {
	case st.Uid == u.uid:
		return perm&0o100 != 0
	case st.Gid == u.gid || slices.Contains(u.groups, st.Gid):
		return perm&0o010 != 0
	default:
		return perm&0o001 != 0
	}
}

// credential returns the credential child processes run with: nil (the
// current user) unless we are root.
func (s *Server) credential() *syscall.Credential {
	if s.owner == nil {
		return nil
	}
	return &syscall.Credential{Uid: s.owner.uid, Gid: s.owner.gid, Groups: s.owner.groups}
}

// prepareDir creates (or adopts) the cluster directory and the socket
// directory, and when running as root makes them usable by the postgres
// user.
func (s *Server) prepareDir(dir string) error {
	if dir == "" {
		parent := os.TempDir()
		if s.owner != nil {
			if err := s.checkTraversable(parent); err != nil {
				return fmt.Errorf("%w (or point TMPDIR at a directory it can enter)", err)
			}
		}
		d, err := os.MkdirTemp(parent, "shepherd-pg-")
		if err != nil {
			return err
		}
		s.dir, s.tempDir = d, true
	} else {
		abs, err := filepath.Abs(dir)
		if err != nil {
			return err
		}
		if err := os.MkdirAll(filepath.Dir(abs), 0o755); err != nil {
			return err
		}
		if s.owner != nil {
			if err := s.checkTraversable(filepath.Dir(abs)); err != nil {
				return err
			}
		}
		if err := os.Mkdir(abs, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
		s.dir = abs
	}
	s.dataDir = filepath.Join(s.dir, "data")
	s.sockDir = filepath.Join(s.dir, "sock")
	s.logPath = filepath.Join(s.dir, "postgres.log")

	if err := os.Mkdir(s.sockDir, 0o700); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	if err := os.Chmod(s.sockDir, 0o700); err != nil {
		return err
	}
	if s.owner != nil {
		if err := chownTree(s.dir, s.owner.uid, s.owner.gid); err != nil {
			return fmt.Errorf("handing %s to the %q OS user: %w", s.dir, s.owner.name, err)
		}
	}
	return nil
}

// checkTraversable returns an error if the postgres user cannot reach dir
// because dir or one of its parents lacks search permission for it.
func (s *Server) checkTraversable(dir string) error {
	resolved, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return err
	}
	for p := resolved; ; p = filepath.Dir(p) {
		fi, err := os.Stat(p)
		if err != nil {
			return err
		}
		if !s.owner.canSearch(fi) {
			st, _ := fi.Sys().(*syscall.Stat_t)
			var uid, gid uint32
			if st != nil {
				uid, gid = st.Uid, st.Gid
			}
			return fmt.Errorf("postgres runs as OS user %q, which cannot enter %s (mode %#o, uid %d, gid %d); every parent directory of the cluster directory must be traversable by that user: choose a directory it can reach or run: chmod o+x %s",
				s.owner.name, p, fi.Mode().Perm(), uid, gid, p)
		}
		if p == filepath.Dir(p) {
			return nil
		}
	}
}

// chownTree gives every file below (and including) root to uid:gid,
// without following symlinks.
func chownTree(root string, uid, gid uint32) error {
	return filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Uid == uid && st.Gid == gid {
			return nil
		}
		return os.Lchown(path, int(uid), int(gid))
	})
}

// initCluster runs initdb unless the data directory already holds a
// cluster (see fillDataDir).
func (s *Server) initCluster(ctx context.Context) error {
	return s.fillDataDir(ctx, ".initdb", func(ctx context.Context, scratch string) error {
		args := []string{"-D", scratch, "--auth=trust", "-U", s.user, "-E", "UTF8", "--locale=C"}
		if !s.durable {
			args = append(args, "--no-sync")
		}
		return s.runTool(ctx, "initdb", args...)
	})
}

// fillDataDir fills the data directory with fill unless it holds a
// cluster already. fill writes into a scratch directory (the data
// directory's name plus suffix) that is renamed into place only on
// success, so an interrupted initdb or pg_basebackup never leaves a
// half-made cluster that would later be mistaken for a real one.
func (s *Server) fillDataDir(ctx context.Context, suffix string, fill func(ctx context.Context, scratch string) error) error {
	if _, err := os.Stat(filepath.Join(s.dataDir, "PG_VERSION")); err == nil {
		s.log.Debug("reusing existing cluster", "data", s.dataDir)
		return nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("checking %s: %w", s.dataDir, err)
	}
	if entries, err := os.ReadDir(s.dataDir); err == nil {
		if len(entries) > 0 {
			return fmt.Errorf("%s exists but is not a PostgreSQL data directory (no PG_VERSION); move it away or use another directory", s.dataDir)
		}
		if err := os.Remove(s.dataDir); err != nil {
			return err
		}
	}
	scratch := s.dataDir + suffix
	if err := os.RemoveAll(scratch); err != nil {
		return fmt.Errorf("removing an old %s: %w", scratch, err)
	}
	began := time.Now()
	if err := fill(ctx, scratch); err != nil {
		_ = os.RemoveAll(scratch)
		return err
	}
	s.log.Debug("data directory made", "data", s.dataDir, "duration", time.Since(began))
	if err := os.Rename(scratch, s.dataDir); err != nil {
		_ = os.RemoveAll(scratch)
		return fmt.Errorf("moving %s into place: %w", scratch, err)
	}
	return nil
}

// childEnv is the environment for initdb and postgres: ours without libpq
// (PG*) variables, which could redirect them, and with the C locale so log
// messages are predictable.
func childEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "PG") || strings.HasPrefix(kv, "LC_") || strings.HasPrefix(kv, "LANG=") || strings.HasPrefix(kv, "LANGUAGE=") {
			continue
		}
		env = append(env, kv)
	}
	return append(env, "LC_ALL=C", "LANG=C")
}

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	// Not from the ephemeral range: a restart binds the same port again
	// (see package localport).
	return localport.Free(27000, 32767)
}

// checkSocketPath rejects socket paths that postgres would refuse, with an
// error that names the actual problem.
func (s *Server) checkSocketPath() error {
	p := filepath.Join(s.sockDir, ".s.PGSQL."+strconv.Itoa(s.port))
	if len(p) > maxSocketPath {
		return fmt.Errorf("unix socket path %s is too long (%d bytes, at most %d): use a shorter directory", p, len(p), maxSocketPath)
	}
	return nil
}

// postgresArgs is the postgres command line; all settings are passed with
// -c so postgresql.conf in the data directory is never edited.
func (s *Server) postgresArgs() []string {
	args := []string{"-D", s.dataDir, "-k", s.sockDir, "-p", strconv.Itoa(s.port)}
	set := func(name, value string) { args = append(args, "-c", name+"="+value) }
	listen := ""
	if s.tcp {
		listen = "127.0.0.1"
	}
	set("listen_addresses", listen)
	set("logging_collector", "off")
	set("log_min_messages", "warning")
	set("max_connections", "200")
	set("shared_buffers", "128MB")
	if !s.durable {
		set("fsync", "off")
		set("synchronous_commit", "off")
		set("full_page_writes", "off")
	}
	names := make([]string, 0, len(s.settings))
	for name := range s.settings {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		set(name, s.settings[name])
	}
	return args
}

// process is one run of the postmaster.
type process struct {
	cmd       *exec.Cmd
	logOffset int64         // size of postgres.log before this run
	done      chan struct{} // closed once the postmaster has been reaped
	err       error         // cmd.Wait's result; read only after done is closed
}

// launch starts the postmaster and waits until it accepts connections. On
// failure no process is left behind.
func (s *Server) launch(ctx context.Context) (*process, error) {
	if pid, ok := runningPostmaster(s.dataDir); ok {
		return nil, fmt.Errorf("postgres is already running for %s (pid %d); stop it first or use another directory", s.dataDir, pid)
	}

	logf, err := os.OpenFile(s.logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	defer logf.Close() // the child has its own copy
	fi, err := logf.Stat()
	if err != nil {
		return nil, err
	}
	offset := fi.Size()
	if offset > maxLogSize {
		if err := logf.Truncate(0); err != nil {
			return nil, err
		}
		offset = 0
	}
	if s.owner != nil {
		if err := logf.Chown(int(s.owner.uid), int(s.owner.gid)); err != nil {
			return nil, err
		}
	}

	cmd := exec.Command(filepath.Join(s.binDir, "postgres"), s.postgresArgs()...)
	cmd.Dir = s.dir
	cmd.Env = childEnv()
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.SysProcAttr = &syscall.SysProcAttr{
		// Own process group: a terminal's Ctrl-C must not reach postgres
		// directly; Stop shuts it down in order.
		Setpgid: true,
		// Immediate shutdown if we die without stopping it (e.g. a crashed
		// test binary). Go delivers this when the forking OS thread exits,
		// which for ordinary goroutines means when the process exits.
		Pdeathsig:  syscall.SIGQUIT,
		Credential: s.credential(),
	}
	began := time.Now()
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	p := &process{cmd: cmd, logOffset: offset, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()

	if err := s.waitReady(ctx, p); err != nil {
		s.kill(p)
		return nil, err
	}
	s.log.Info("postgres started", "pid", cmd.Process.Pid, "dir", s.dir, "port", s.port, "tcp", s.tcp, "duration", time.Since(began))
	return p, nil
}

// waitReady polls until postgres accepts a connection over the unix
// socket, postgres exits, the readiness deadline passes or ctx ends.
func (s *Server) waitReady(ctx context.Context, p *process) error {
	ctx, cancel := context.WithTimeout(ctx, readyTimeout)
	defer cancel()
	cfg, err := pgx.ParseConfig(s.URL("postgres"))
	if err != nil {
		return err
	}
	cfg.ConnectTimeout = 5 * time.Second
	tick := time.NewTicker(pollInterval)
	defer tick.Stop()
	for {
		lastErr := ping(ctx, cfg)
		if lastErr == nil {
			return nil
		}
		select {
		case <-p.done:
			return s.exitError(p, "postgres exited during startup")
		case <-ctx.Done():
			return fmt.Errorf("waiting for postgres to accept connections: %w (last attempt: %v); last lines of %s:\n%s",
				ctx.Err(), lastErr, s.logPath, s.logTail(p))
		case <-tick.C:
		}
	}
}

// ping connects once and checks that the server answers queries.
func ping(ctx context.Context, cfg *pgx.ConnConfig) error {
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	return conn.Ping(ctx)
}

// exitError describes a postmaster that exited when it should not have,
// including the end of its log; it wraps errAddrInUse when the log says
// the port was taken.
func (s *Server) exitError(p *process, what string) error {
	text := logSince(s.logPath, p.logOffset)
	status := "exit status 0"
	if p.err != nil {
		status = p.err.Error()
	}
	err := fmt.Errorf("%s (%s); last lines of %s:\n%s", what, status, s.logPath, lastLines(text, tailLines))
	if strings.Contains(text, "Address already in use") || strings.Contains(text, "could not create any TCP/IP sockets") {
		return fmt.Errorf("%w (%d): %w", errAddrInUse, s.port, err)
	}
	return err
}

// logTail returns the last lines this run of postgres wrote to its log.
func (s *Server) logTail(p *process) string {
	return lastLines(logSince(s.logPath, p.logOffset), tailLines)
}

// stopProcess performs the shutdown described at Server.Stop.
func (s *Server) stopProcess(ctx context.Context, p *process) error {
	select {
	case <-p.done:
		return s.exitError(p, "postgres had exited unexpectedly")
	default:
	}
	if err := p.cmd.Process.Signal(os.Interrupt); err != nil && !errors.Is(err, os.ErrProcessDone) {
		s.log.Warn("could not signal postgres; killing it", "pid", p.cmd.Process.Pid, "err", err)
		s.kill(p)
		return nil
	}
	select {
	case <-p.done:
		if p.err != nil {
			return s.exitError(p, "postgres failed to shut down cleanly")
		}
		s.log.Info("postgres stopped", "pid", p.cmd.Process.Pid, "dir", s.dir)
		return nil
	case <-ctx.Done():
	}
	s.log.Warn("fast shutdown did not finish in time; forcing an immediate shutdown", "pid", p.cmd.Process.Pid, "dir", s.dir)
	s.kill(p)
	return nil
}

// kill performs an immediate shutdown (SIGQUIT), kills the whole process
// group if that does not finish within killGrace, and waits until the
// postmaster has been reaped.
func (s *Server) kill(p *process) {
	_ = p.cmd.Process.Signal(syscall.SIGQUIT)
	t := time.NewTimer(killGrace)
	defer t.Stop()
	select {
	case <-p.done:
		return
	case <-t.C:
	}
	// The postmaster has not been reaped yet, so its pid still names its
	// process group, which also holds all its children.
	_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
	<-p.done
}

// runningPostmaster reports the pid of a live postmaster that owns
// dataDir, according to dataDir/postmaster.pid. A stale file left by a
// killed run is not reported: postgres itself deals with that.
func runningPostmaster(dataDir string) (int, bool) {
	b, err := os.ReadFile(filepath.Join(dataDir, "postmaster.pid"))
	if err != nil {
		return 0, false
	}
	first, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(first))
	if err != nil || pid <= 0 {
		return 0, false
	}
	if err := syscall.Kill(pid, 0); err != nil && !errors.Is(err, syscall.EPERM) {
		return 0, false
	}
	procDir := "/proc/" + strconv.Itoa(pid)
	if comm, err := os.ReadFile(procDir + "/comm"); err == nil && strings.TrimSpace(string(comm)) != "postgres" {
		return 0, false // the pid was reused by another program
	}
	// A postmaster runs in its data directory; if we may look, make sure
	// this one is not serving some other cluster that got the same pid.
	if cwd, err := os.Stat(procDir + "/cwd"); err == nil {
		if data, err := os.Stat(dataDir); err == nil && !os.SameFile(cwd, data) {
			return 0, false
		}
	}
	return pid, true
}

// logSince returns what was appended to the log at path after offset
// (at most the last 64 KiB of it).
func logSince(path string, offset int64) string {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Sprintf("(cannot read log: %v)", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return fmt.Sprintf("(cannot read log: %v)", err)
	}
	start := max(offset, fi.Size()-64<<10, 0)
	if start > fi.Size() {
		start = 0 // truncated meanwhile
	}
	b, err := io.ReadAll(io.NewSectionReader(f, start, fi.Size()-start))
	if err != nil {
		return fmt.Sprintf("(cannot read log: %v)", err)
	}
	return string(b)
}

// lastLines returns the last n lines of text.
func lastLines(text string, n int) string {
	lines := strings.Split(strings.TrimRight(text, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
