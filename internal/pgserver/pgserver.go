// Package pgserver runs a private PostgreSQL cluster from the PostgreSQL
// server binaries installed on the machine (initdb and postgres).
//
// It exists so that tests, benchmarks and the zero-setup `shepherd dev`
// command can get a real PostgreSQL without any manual setup: Start creates
// (or reuses) a data directory, starts postgres as a child process that
// listens on a private unix socket (and optionally on 127.0.0.1), and waits
// until it accepts connections.
//
// PostgreSQL refuses to run as root. When the calling process is root,
// initdb and postgres are run as the "postgres" OS user and the cluster
// directory is chowned to that user. That user must be able to traverse
// every parent directory of Config.Dir (and of os.TempDir() when Dir is
// empty); Start checks this and explains how to fix it. Note that
// directories made by testing.T.TempDir are mode 0700 and owned by root, so
// they cannot hold a cluster when tests run as root.
package pgserver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// ErrNotInstalled is wrapped by the error FindBinDir (and Start) return when
// no PostgreSQL server installation can be found, so callers such as
// `shepherd dev` can recognise the situation and print install instructions.
var ErrNotInstalled = errors.New("PostgreSQL server not found")

const (
	// defaultUser is the superuser created by initdb when Config.User is "".
	defaultUser = "shepherd"
	// defaultLibRoot is where Debian/Ubuntu packages install server binaries.
	defaultLibRoot = "/usr/lib/postgresql"
	// readyTimeout bounds how long Start waits for postgres to accept
	// connections (ctx may end the wait earlier).
	readyTimeout = 60 * time.Second
	// pollInterval is the readiness poll tick.
	pollInterval = 25 * time.Millisecond
	// closeTimeout bounds the fast shutdown attempted by Close before it
	// escalates to an immediate shutdown.
	closeTimeout = 30 * time.Second
	// portAttempts is how often Start tries a new port when Port is 0 and the
	// picked port turned out to be taken by another process.
	portAttempts = 5
)

// Config says where and how to run the cluster. Zero values mean defaults,
// so Config{} gives a throw-away, non-durable cluster reachable over a unix
// socket, which is what tests want.
type Config struct {
	// Dir is the parent directory for data/ (the PostgreSQL data directory),
	// sock/ (the unix socket directory) and postgres.log. An existing
	// cluster in Dir is reused, which is what `shepherd dev` relies on. ""
	// means a fresh directory under os.TempDir() that Close removes. When
	// running as root, every parent of Dir must be traversable by the
	// "postgres" OS user.
	Dir string
	// Port is the TCP port and also names the unix socket (.s.PGSQL.Port).
	// 0 picks a free port on 127.0.0.1 (and retries with another one if it
	// is taken before postgres binds it).
	Port int
	// TCP makes postgres also listen on 127.0.0.1:Port. By default it
	// listens on the unix socket only.
	TCP bool
	// Durable keeps PostgreSQL's crash-safety settings. When false (the
	// default, meant for tests and benchmarks of our own code) fsync,
	// synchronous_commit and full_page_writes are turned off and initdb
	// runs with --no-sync.
	Durable bool
	// Settings are extra postgresql.conf settings, passed to postgres as
	// -c name=value after (and so overriding) the package defaults. The
	// settings this package manages itself (port, listen_addresses,
	// unix_socket_directories, data_directory, logging_collector) are
	// rejected by Validate.
	Settings map[string]string
	// BinDir is the directory holding initdb and postgres. "" means
	// FindBinDir().
	BinDir string
	// User is the database superuser created by initdb and used in URLs.
	// "" means "shepherd". When reusing a Dir it must match the user the
	// cluster was created with.
	User string
	// Logger receives lifecycle messages. nil discards them.
	Logger *slog.Logger
}

// isReservedSetting reports whether name is managed by this package;
// overriding it would break the URLs, the socket location or the log
// capture.
func isReservedSetting(name string) bool {
	switch strings.ToLower(name) {
	case "data_directory", "listen_addresses", "logging_collector", "port", "unix_socket_directories":
		return true
	}
	return false
}

// Validate reports whether c can be used by Start, so that configuration
// mistakes are reported before anything is created on disk.
func (c Config) Validate() error {
	if c.Port < 0 || c.Port > 65535 {
		return fmt.Errorf("invalid port %d: must be between 0 and 65535", c.Port)
	}
	if c.User != "" && !isIdentifier(c.User) {
		return fmt.Errorf("invalid user name %q: use letters, digits and underscores, not starting with a digit", c.User)
	}
	if len(c.User) > 63 {
		return fmt.Errorf("invalid user name %q: longer than 63 bytes", c.User)
	}
	for name, value := range c.Settings {
		if !isSettingName(name) {
			return fmt.Errorf("invalid setting name %q", name)
		}
		if isReservedSetting(name) {
			return fmt.Errorf("setting %q is managed by pgserver and cannot be overridden", name)
		}
		if strings.ContainsAny(value, "\x00\n\r") {
			return fmt.Errorf("invalid value for setting %q: contains a NUL or newline", name)
		}
	}
	if strings.ContainsRune(c.Dir, 0) || strings.ContainsRune(c.BinDir, 0) {
		return errors.New("invalid directory name: contains a NUL byte")
	}
	return nil
}

// isIdentifier reports whether s is a plain SQL identifier, which keeps
// the user name safe in URLs and command lines without quoting rules.
func isIdentifier(s string) bool {
	if s == "" {
		return false
	}
	for i, r := range s {
		switch {
		case r == '_', r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z':
		case r >= '0' && r <= '9' && i > 0:
		default:
			return false
		}
	}
	return true
}

// isSettingName reports whether s looks like a GUC name, including
// extension settings such as "auto_explain.log_min_duration".
func isSettingName(s string) bool {
	if s == "" || s[0] == '.' || s[len(s)-1] == '.' {
		return false
	}
	for _, part := range strings.Split(s, ".") {
		if !isIdentifier(part) {
			return false
		}
	}
	return true
}

// FindBinDir locates the directory holding PostgreSQL's initdb and postgres
// so callers need no configuration on a machine with PostgreSQL installed.
// It first looks for initdb on PATH (resolving symlinks; its directory must
// also contain postgres), then for the highest version under
// /usr/lib/postgresql/*/bin. If nothing is found the error wraps
// ErrNotInstalled and says how to install the server.
func FindBinDir() (string, error) {
	return findBinDir(os.Getenv("PATH"), defaultLibRoot)
}

// findBinDir is FindBinDir with the search locations as parameters so tests
// can point it at empty or fake directories.
func findBinDir(pathEnv, libRoot string) (string, error) {
	for _, dir := range filepath.SplitList(pathEnv) {
		if dir == "" || !filepath.IsAbs(dir) {
			// Like exec.LookPath, never pick up binaries relative to the
			// working directory.
			continue
		}
		initdb := filepath.Join(dir, "initdb")
		if !isExecutable(initdb) {
			continue
		}
		resolved, err := filepath.EvalSymlinks(initdb)
		if err != nil {
			continue
		}
		binDir := filepath.Dir(resolved)
		if isExecutable(filepath.Join(binDir, "postgres")) {
			return binDir, nil
		}
	}

	matches, _ := filepath.Glob(filepath.Join(libRoot, "*", "bin"))
	var best string
	var bestVersion []int
	for _, binDir := range matches {
		if !isExecutable(filepath.Join(binDir, "initdb")) || !isExecutable(filepath.Join(binDir, "postgres")) {
			continue
		}
		v, ok := parseVersion(filepath.Base(filepath.Dir(binDir)))
		if !ok {
			continue
		}
		if best == "" || slices.Compare(v, bestVersion) > 0 {
			best, bestVersion = binDir, v
		}
	}
	if best != "" {
		return best, nil
	}

	sudo := "sudo "
	if os.Geteuid() == 0 {
		sudo = ""
	}
	return "", fmt.Errorf("%w (looked for initdb on PATH and in %s); install it with: %sapt-get install -y postgresql",
		ErrNotInstalled, filepath.Join(libRoot, "*", "bin"), sudo)
}

// parseVersion parses a version directory name such as "15" or "9.6".
func parseVersion(s string) ([]int, bool) {
	var v []int
	for _, part := range strings.Split(s, ".") {
		n, err := strconv.Atoi(part)
		if err != nil || n < 0 {
			return nil, false
		}
		v = append(v, n)
	}
	return v, true
}

// isExecutable reports whether path is a regular file (after following
// symlinks) with an execute bit set.
func isExecutable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0
}

// Server is a running (or stopped) private PostgreSQL cluster created by
// Start. Its methods are safe for concurrent use. Call Close when done.
type Server struct {
	log      *slog.Logger
	user     string
	binDir   string
	dir      string // absolute cluster directory (Config.Dir or a temp dir)
	tempDir  bool   // dir was created by Start and is removed by Close
	dataDir  string
	sockDir  string
	logPath  string
	tcp      bool
	durable  bool
	settings map[string]string
	owner    *osUser // user postgres runs as when we are root; nil otherwise

	// port is fixed once the first start succeeded.
	port int

	mu     sync.Mutex // serialises Start, Stop and Close
	proc   *process   // the running postmaster; nil when stopped
	closed bool
}

// Start initialises a cluster in cfg.Dir unless one exists already, starts
// postgres and waits until it accepts connections (at most 60 s, or until
// ctx ends). The returned Server must be closed with Close.
func Start(ctx context.Context, cfg Config) (*Server, error) {
	s, err := start(ctx, cfg, freePort, (*Server).initCluster)
	if err != nil {
		dir := cfg.Dir
		if dir == "" {
			dir = "a temporary directory"
		}
		return nil, fmt.Errorf("starting postgres in %s: %w", dir, err)
	}
	return s, nil
}

// start is Start without the error prefix; pickPort chooses the port when
// cfg.Port is 0 (a parameter so tests can simulate losing the port race),
// and initData fills the data directory unless it holds a cluster already
// (initdb for a primary, pg_basebackup for a standby).
func start(ctx context.Context, cfg Config, pickPort func() (int, error), initData func(*Server, context.Context) error) (_ *Server, err error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	s := &Server{
		log:      cfg.Logger,
		user:     cfg.User,
		binDir:   cfg.BinDir,
		tcp:      cfg.TCP,
		durable:  cfg.Durable,
		settings: maps.Clone(cfg.Settings), // the caller may reuse its map
		port:     cfg.Port,
	}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	if s.user == "" {
		s.user = defaultUser
	}
	if s.binDir == "" {
		if s.binDir, err = FindBinDir(); err != nil {
			return nil, err
		}
	}
	if s.binDir, err = filepath.Abs(s.binDir); err != nil {
		return nil, err
	}
	for _, name := range []string{"initdb", "postgres"} {
		if !isExecutable(filepath.Join(s.binDir, name)) {
			return nil, fmt.Errorf("%w: no executable %s in %s", ErrNotInstalled, name, s.binDir)
		}
	}
	if os.Geteuid() == 0 {
		if s.owner, err = lookupPostgresUser(); err != nil {
			return nil, err
		}
	}

	defer func() {
		if err != nil && s.tempDir {
			_ = os.RemoveAll(s.dir)
		}
	}()
	if err := s.prepareDir(cfg.Dir); err != nil {
		return nil, err
	}

	if err := initData(s, ctx); err != nil {
		return nil, err
	}

	autoPort := s.port == 0
	for attempt := 1; ; attempt++ {
		if autoPort {
			if s.port, err = pickPort(); err != nil {
				return nil, err
			}
		}
		if err := s.checkSocketPath(); err != nil {
			return nil, err
		}
		p, err := s.launch(ctx)
		if err == nil {
			s.proc = p
			return s, nil
		}
		if !autoPort || attempt >= portAttempts || !errors.Is(err, errAddrInUse) {
			return nil, err
		}
		s.log.Debug("port taken, retrying with another one", "port", s.port, "attempt", attempt)
	}
}

// URL returns a libpq/pgx connection URL for database that connects over
// the unix socket as the superuser (trust authentication, no password).
// An empty database means "postgres", which always exists.
func (s *Server) URL(database string) string {
	q := url.Values{}
	q.Set("host", s.sockDir)
	q.Set("port", strconv.Itoa(s.port))
	q.Set("sslmode", "disable")
	u := url.URL{
		Scheme:   "postgres",
		User:     url.User(s.user),
		Path:     "/" + dbName(database),
		RawQuery: q.Encode(),
	}
	return u.String()
}

// TCPURL returns a connection URL for database over 127.0.0.1:Port, for
// clients that cannot use unix sockets. It returns "" unless Config.TCP
// was set. An empty database means "postgres".
func (s *Server) TCPURL(database string) string {
	if !s.tcp {
		return ""
	}
	u := url.URL{
		Scheme:   "postgres",
		User:     url.User(s.user),
		Host:     "127.0.0.1:" + strconv.Itoa(s.port),
		Path:     "/" + dbName(database),
		RawQuery: "sslmode=disable",
	}
	return u.String()
}

func dbName(database string) string {
	if database == "" {
		return "postgres"
	}
	return database
}

// SocketDir returns the directory holding the unix socket (libpq's host).
func (s *Server) SocketDir() string { return s.sockDir }

// Port returns the port postgres uses; it stays the same across Stop and
// Start.
func (s *Server) Port() int { return s.port }

// User returns the database superuser name.
func (s *Server) User() string { return s.user }

// BinDir returns the directory of the PostgreSQL binaries in use, so that
// callers can run other tools of the same version (pg_dump, psql, ...).
func (s *Server) BinDir() string { return s.binDir }

// DataDir returns the PostgreSQL data directory (Dir/data).
func (s *Server) DataDir() string { return s.dataDir }

// Stop shuts postgres down with a fast shutdown (SIGINT to the postmaster:
// open transactions are rolled back) and waits for it to exit. If ctx ends
// first it escalates to an immediate shutdown (SIGQUIT; the next start runs
// crash recovery) and finally kills the process group. Stop returns nil if
// postgres is already stopped; it reports an error if postgres had exited
// on its own since it was started.
func (s *Server) Stop(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stopLocked(ctx)
}

func (s *Server) stopLocked(ctx context.Context) error {
	p := s.proc
	if p == nil {
		return nil
	}
	s.proc = nil
	if err := s.stopProcess(ctx, p); err != nil {
		return fmt.Errorf("stopping postgres in %s: %w", s.dir, err)
	}
	return nil
}

// Start starts postgres again after Stop, with the same data directory,
// port and socket, and waits until it accepts connections. It lets tests
// exercise reconnect logic by restarting PostgreSQL in the middle of a run.
func (s *Server) Start(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("starting postgres in %s: server is closed", s.dir)
	}
	if s.proc != nil {
		return fmt.Errorf("starting postgres in %s: already running (pid %d)", s.dir, s.proc.cmd.Process.Pid)
	}
	p, err := s.launch(ctx)
	if err != nil {
		return fmt.Errorf("starting postgres in %s: %w", s.dir, err)
	}
	s.proc = p
	return nil
}

// Close stops postgres (fast shutdown, escalating after 30 s) and, if
// Config.Dir was "", removes the temporary directory. Close is idempotent;
// the Server cannot be started again afterwards.
func (s *Server) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil
	}
	s.closed = true
	ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
	defer cancel()
	err := s.stopLocked(ctx)
	if s.tempDir {
		if rerr := os.RemoveAll(s.dir); rerr != nil {
			err = errors.Join(err, fmt.Errorf("removing %s: %w", s.dir, rerr))
		}
	}
	return err
}
