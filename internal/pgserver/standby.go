package pgserver

import (
	"bytes"
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"
)

// promoteTimeout bounds how long Promote waits for the standby to leave
// recovery (ctx may end the wait earlier).
const promoteTimeout = 60 * time.Second

// StartStandby creates a streaming-replication standby of primary in
// cfg.Dir and starts it: the data directory is a pg_basebackup of the
// running primary, taken with -R so that the standby follows the primary
// over its unix socket from then on (hot standby: it accepts read-only
// connections). An existing cluster in cfg.Dir is reused as is.
//
// The standby reports cfg's "cluster_name" setting (default DefaultStandbyName) as
// its application_name to the primary, so the primary can name it in
// synchronous_standby_names for synchronous replication. cfg.User and
// cfg.BinDir default to the primary's; a different User is rejected, since
// the backup carries the primary's roles. Settings of the primary are not
// copied (they are command-line options): a standby meant to be promoted
// should not get the primary's synchronous_standby_names, or its commits
// would wait for a standby it does not have; for the same reason a
// synchronous_standby_names the primary got from ALTER SYSTEM (see
// SetSynchronousStandby) is removed from the standby's copy of
// postgresql.auto.conf.
func StartStandby(ctx context.Context, primary *Server, cfg Config) (*Server, error) {
	if cfg.User == "" {
		cfg.User = primary.user
	}
	if cfg.BinDir == "" {
		cfg.BinDir = primary.binDir
	}
	dir := cfg.Dir
	if dir == "" {
		dir = "a temporary directory"
	}
	if cfg.User != primary.user {
		return nil, fmt.Errorf("starting standby in %s: user %q differs from the primary's %q", dir, cfg.User, primary.user)
	}
	if _, ok := cfg.Settings["cluster_name"]; !ok {
		settings := make(map[string]string, len(cfg.Settings)+1)
		for k, v := range cfg.Settings {
			settings[k] = v
		}
		settings["cluster_name"] = DefaultStandbyName
		cfg.Settings = settings
	}
	s, err := start(ctx, cfg, freePort, func(s *Server, ctx context.Context) error {
		return s.baseBackup(ctx, primary)
	})
	if err != nil {
		return nil, fmt.Errorf("starting standby of %s in %s: %w", primary.dir, dir, err)
	}
	return s, nil
}

// baseBackup fills the data directory with a pg_basebackup of primary
// unless it holds a cluster already (see fillDataDir).
func (s *Server) baseBackup(ctx context.Context, primary *Server) error {
	return s.fillDataDir(ctx, ".basebackup", func(ctx context.Context, scratch string) error {
		// Connect as libpq keywords rather than a URL: -R copies them into
		// primary_conninfo.
		conninfo := fmt.Sprintf("host=%s port=%d user=%s sslmode=disable", primary.sockDir, primary.port, primary.user)
		args := []string{"-D", scratch, "-d", conninfo, "-R", "-X", "stream", "-c", "fast"}
		if !s.durable {
			args = append(args, "--no-sync")
		}
		if err := s.runTool(ctx, "pg_basebackup", args...); err != nil {
			return err
		}
		return dropSyncStandbyNames(filepath.Join(scratch, "postgresql.auto.conf"))
	})
}

// runTool runs one of the PostgreSQL programs of BinDir (initdb,
// pg_basebackup; as the postgres OS user when we are root), killing the
// process group it starts if ctx ends, and returns an error that includes
// the end of its output if it fails.
func (s *Server) runTool(ctx context.Context, name string, args ...string) error {
	path := filepath.Join(s.binDir, name)
	if !isExecutable(path) {
		return fmt.Errorf("%w: no executable %s in %s", ErrNotInstalled, name, s.binDir)
	}
	cmd := exec.CommandContext(ctx, path, args...)
	cmd.Dir = s.dir
	cmd.Env = childEnv()
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Setpgid:    true,
		Pdeathsig:  syscall.SIGKILL,
		Credential: s.credential(),
	}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Run(); err != nil {
		if ctxErr := ctx.Err(); ctxErr != nil {
			return fmt.Errorf("running %s: %w", name, ctxErr)
		}
		return fmt.Errorf("running %s: %w; its output ends with:\n%s", name, err, lastLines(out.String(), tailLines))
	}
	return nil
}

// Promote turns a standby started by StartStandby into a primary with
// `pg_ctl promote` and waits until it accepts writes (at most 60 s, or
// until ctx ends). It fails if the server is stopped or not a standby.
func (s *Server) Promote(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil {
		return fmt.Errorf("promoting postgres in %s: not running", s.dir)
	}
	ctx, cancel := context.WithTimeout(ctx, promoteTimeout)
	defer cancel()
	secs := strconv.Itoa(int(promoteTimeout / time.Second))
	if err := s.runTool(ctx, "pg_ctl", "promote", "-D", s.dataDir, "-w", "-t", secs); err != nil {
		return fmt.Errorf("promoting postgres in %s: %w", s.dir, err)
	}
	s.log.Info("postgres promoted", "dir", s.dir, "port", s.port)
	return nil
}

// StopImmediate shuts postgres down the way `pg_ctl stop -m immediate`
// does (SIGQUIT to the postmaster: every backend exits at once, nothing is
// checkpointed, the next start runs crash recovery), escalating to killing
// the process group after 10 s, and waits until it has exited. It is how
// tests simulate the loss of a primary. It returns nil if postgres is
// already stopped.
func (s *Server) StopImmediate(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.proc
	if p == nil {
		return nil
	}
	s.proc = nil
	s.kill(p)
	s.log.Info("postgres stopped (immediate)", "pid", p.cmd.Process.Pid, "dir", s.dir)
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("stopping postgres in %s: %w", s.dir, err)
	}
	return nil
}

// MultiHostDSN returns a libpq/pgx keyword connection string for database
// that lists every server's unix socket in order, with
// target_session_attrs=read-write: a client tries them in turn and keeps
// the first that accepts writes, so after a standby is promoted the same
// string reaches the new primary. An empty database means "postgres".
func MultiHostDSN(database string, servers ...*Server) string {
	var hosts, ports []byte
	for i, s := range servers {
		if i > 0 {
			hosts = append(hosts, ',')
			ports = append(ports, ',')
		}
		hosts = append(hosts, s.sockDir...)
		ports = strconv.AppendInt(ports, int64(s.port), 10)
	}
	user := defaultUser
	if len(servers) > 0 {
		user = servers[0].user
	}
	return fmt.Sprintf("host=%s port=%s user=%s dbname=%s sslmode=disable target_session_attrs=read-write",
		hosts, ports, user, dbName(database))
}
