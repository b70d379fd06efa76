package pgserver

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	osexec "os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// requirePostgres fails the test, saying how to install it, when no
// PostgreSQL server is installed.
func requirePostgres(t *testing.T) {
	t.Helper()
	if _, err := FindBinDir(); err != nil {
		t.Fatalf("these tests need a PostgreSQL server: %v", err)
	}
}

// clusterParent returns a fresh directory that the postgres OS user can
// traverse (t.TempDir is mode 0700 and so unusable when running as root).
func clusterParent(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "shepherd-pg-test-")
	if err != nil {
		t.Fatal(err)
	}
	// MkdirTemp makes it 0700; the postgres user (when we are root) must be
	// able to traverse it.
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := os.RemoveAll(dir); err != nil {
			t.Error(err)
		}
	})
	return dir
}

func startServer(t *testing.T, cfg Config) *Server {
	t.Helper()
	s, err := Start(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Error(err)
		}
	})
	return s
}

func connect(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), url)
	if err != nil {
		t.Fatalf("connecting to %s: %v", url, err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

func execSQL(t *testing.T, url, sql string) {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), url)
	if err != nil {
		t.Fatalf("connecting to %s: %v", url, err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(t.Context(), sql); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func queryInt(t *testing.T, url, sql string) int {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), url)
	if err != nil {
		t.Fatalf("connecting to %s: %v", url, err)
	}
	defer conn.Close(context.Background())
	var n int
	if err := conn.QueryRow(t.Context(), sql).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// processesUsing returns the pids of processes whose command line mentions
// dataDir or whose working directory is (or was) inside it. Postgres
// backends rewrite their command line but keep the data directory as cwd.
func processesUsing(t *testing.T, dataDir string) []int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatalf("reading /proc: %v", err)
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == os.Getpid() {
			continue
		}
		cmdline, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		cwd, _ := os.Readlink(filepath.Join("/proc", e.Name(), "cwd"))
		if strings.Contains(string(cmdline), dataDir) || strings.HasPrefix(cwd, dataDir) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// requireNoProcesses polls (with a deadline) until no process uses dataDir.
func requireNoProcesses(t *testing.T, dataDir string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		pids := processesUsing(t, dataDir)
		if len(pids) == 0 {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("processes still using %s: %v", dataDir, pids)
		case <-tick.C:
		}
	}
}

func TestLifecycle(t *testing.T) {
	t.Parallel()
	requirePostgres(t)
	s, err := Start(t.Context(), Config{TCP: true})
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			_ = s.Close()
		}
	})

	dir := filepath.Dir(s.DataDir())
	if !strings.HasPrefix(filepath.Base(dir), "shepherd-pg-") {
		t.Errorf("temp dir %s lacks the shepherd-pg- prefix", dir)
	}
	if s.User() != "shepherd" || s.Port() == 0 || s.BinDir() == "" || s.SocketDir() == "" {
		t.Errorf("unexpected accessors: user=%q port=%d bindir=%q sockdir=%q", s.User(), s.Port(), s.BinDir(), s.SocketDir())
	}
	wantURL := "postgres://shepherd@/postgres?host=" + strings.ReplaceAll(s.SocketDir(), "/", "%2F") + "&port=" + strconv.Itoa(s.Port()) + "&sslmode=disable"
	if got := s.URL("postgres"); got != wantURL {
		t.Errorf("URL = %s, want %s", got, wantURL)
	}
	if got, want := s.TCPURL("app"), "postgres://shepherd@127.0.0.1:"+strconv.Itoa(s.Port())+"/app?sslmode=disable"; got != want {
		t.Errorf("TCPURL = %s, want %s", got, want)
	}

	for name, url := range map[string]string{"socket": s.URL("postgres"), "tcp": s.TCPURL("postgres")} {
		conn := connect(t, url)
		var user, version string
		if err := conn.QueryRow(t.Context(), "SELECT current_user, version()").Scan(&user, &version); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if user != "shepherd" {
			t.Errorf("%s: current_user = %q, want shepherd", name, user)
		}
		if !strings.HasPrefix(version, "PostgreSQL ") {
			t.Errorf("%s: version() = %q, want a PostgreSQL server", name, version)
		}
		_ = conn.Close(t.Context())
	}

	var settings = map[string]string{}
	conn := connect(t, s.URL(""))
	rows, err := conn.Query(t.Context(), "SELECT name, setting FROM pg_settings WHERE name IN ('fsync', 'synchronous_commit', 'full_page_writes', 'max_connections', 'listen_addresses')")
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var name, value string
		if err := rows.Scan(&name, &value); err != nil {
			t.Fatal(err)
		}
		settings[name] = value
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	_ = conn.Close(t.Context())
	for name, want := range map[string]string{"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off", "max_connections": "200", "listen_addresses": "127.0.0.1"} {
		if settings[name] != want {
			t.Errorf("setting %s = %q, want %q", name, settings[name], want)
		}
	}

	execSQL(t, s.URL(""), "CREATE TABLE survivor (n int); INSERT INTO survivor VALUES (42)")

	if err := s.Stop(t.Context()); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if err := s.Stop(t.Context()); err != nil {
		t.Fatalf("second Stop: %v", err)
	}
	requireNoProcesses(t, s.DataDir())

	port, sock := s.Port(), s.SocketDir()
	if err := s.Start(t.Context()); err != nil {
		t.Fatalf("restart: %v", err)
	}
	if s.Port() != port || s.SocketDir() != sock {
		t.Errorf("restart moved the server: port %d->%d, socket %s->%s", port, s.Port(), sock, s.SocketDir())
	}
	if err := s.Start(t.Context()); err == nil {
		t.Error("Start on a running server succeeded")
	}
	if n := queryInt(t, s.URL(""), "SELECT n FROM survivor"); n != 42 {
		t.Errorf("after restart: n = %d, want 42", n)
	}

	closed = true
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if _, err := os.Stat(dir); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("temp dir %s still there after Close (stat: %v)", dir, err)
	}
	requireNoProcesses(t, s.DataDir())
	if err := s.Start(t.Context()); err == nil {
		t.Error("Start after Close succeeded")
	}
}

func TestReuseDir(t *testing.T) {
	t.Parallel()
	requirePostgres(t)
	dir := filepath.Join(clusterParent(t), "dev")
	cfg := Config{Dir: dir, User: "dev", Settings: map[string]string{"work_mem": "8MB"}}

	s1, err := Start(t.Context(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	execSQL(t, s1.URL(""), "CREATE TABLE kept (n int); INSERT INTO kept VALUES (7)")
	if n := queryInt(t, s1.URL(""), "SELECT pg_size_bytes(current_setting('work_mem'))::int"); n != 8<<20 {
		t.Errorf("work_mem = %d bytes, want 8MB", n)
	}

	// A second server on the same directory must be refused while the
	// first one runs.
	if s, err := Start(t.Context(), cfg); err == nil {
		_ = s.Close()
		t.Error("second Start on a running Dir succeeded")
	} else if !strings.Contains(err.Error(), "already running") {
		t.Errorf("second Start on a running Dir: %v, want an 'already running' error", err)
	}

	if err := s1.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "data", "PG_VERSION")); err != nil {
		t.Fatalf("Close removed a caller-provided Dir: %v", err)
	}
	requireNoProcesses(t, s1.DataDir())

	s2 := startServer(t, cfg)
	if n := queryInt(t, s2.URL(""), "SELECT n FROM kept"); n != 7 {
		t.Errorf("after reuse: n = %d, want 7", n)
	}
	if s2.TCPURL("") != "" {
		t.Errorf("TCPURL without TCP = %q, want empty", s2.TCPURL(""))
	}
	if _, err := os.Stat(filepath.Join(dir, "postgres.log")); err != nil {
		t.Errorf("no postgres.log: %v", err)
	}
}

// helperDirEnv makes the test binary act as a program that starts a
// server and then gets killed (see TestCrashedParentLeavesNoPostgres).
const helperDirEnv = "PGSERVER_TEST_HELPER_DIR"

func TestHelperServer(t *testing.T) {
	dir := os.Getenv(helperDirEnv)
	if dir == "" {
		return // only a helper process of TestCrashedParentLeavesNoPostgres
	}
	s, err := Start(t.Context(), Config{Dir: dir})
	if err != nil {
		fmt.Println("ERROR", err)
		t.Fatal(err)
	}
	fmt.Println("READY", s.DataDir())
	// Block until the parent kills us (or closes stdin).
	_, _ = io.Copy(io.Discard, os.Stdin)
	_ = s.Close()
}

func TestCrashedParentLeavesNoPostgres(t *testing.T) {
	t.Parallel()
	requirePostgres(t)
	dir := filepath.Join(clusterParent(t), "crash")
	ctx, cancel := context.WithTimeout(t.Context(), 90*time.Second)
	defer cancel()
	cmd := osexec.CommandContext(ctx, os.Args[0], "-test.run=^TestHelperServer$")
	cmd.Env = append(os.Environ(), helperDirEnv+"="+dir)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	defer stdin.Close()
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var dataDir string
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		if d, ok := strings.CutPrefix(sc.Text(), "READY "); ok {
			dataDir = d
			break
		}
		t.Log("helper:", sc.Text())
	}
	if dataDir == "" {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		t.Fatal("helper did not start a server")
	}
	if len(processesUsing(t, dataDir)) == 0 {
		t.Fatal("helper's postgres is not running")
	}

	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, stdout)
	_ = cmd.Wait()
	requireNoProcesses(t, dataDir)

	// The directory is still usable after the crash.
	s := startServer(t, Config{Dir: dir})
	if n := queryInt(t, s.URL(""), "SELECT 1"); n != 1 {
		t.Errorf("SELECT 1 = %d", n)
	}
}

func TestPortInUseReportsLog(t *testing.T) {
	t.Parallel()
	requirePostgres(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	port := l.Addr().(*net.TCPAddr).Port

	s, err := Start(t.Context(), Config{Port: port, TCP: true})
	if err == nil {
		_ = s.Close()
		t.Fatal("Start on a taken port succeeded")
	}
	t.Logf("error (expected): %v", err)
	msg := err.Error()
	if !strings.HasPrefix(msg, "starting postgres in ") || !strings.Contains(msg, "Address already in use") {
		t.Errorf("error does not carry the postgres log: %v", err)
	}
	if !errors.Is(err, errAddrInUse) {
		t.Errorf("error does not wrap errAddrInUse: %v", err)
	}
}

func TestAutoPortRetriesWhenTaken(t *testing.T) {
	t.Parallel()
	requirePostgres(t)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	taken := l.Addr().(*net.TCPAddr).Port

	// The first pick loses the race to another process; Start must move on.
	calls := 0
	pick := func() (int, error) {
		calls++
		if calls == 1 {
			return taken, nil
		}
		return freePort()
	}
	s, err := start(t.Context(), Config{TCP: true}, pick, (*Server).initCluster)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := s.Close(); err != nil {
			t.Error(err)
		}
	}()
	if calls != 2 || s.Port() == taken {
		t.Errorf("picked %d ports, using %d (taken: %d); want a retry with a new port", calls, s.Port(), taken)
	}
	if n := queryInt(t, s.TCPURL(""), "SELECT 1"); n != 1 {
		t.Errorf("SELECT 1 = %d", n)
	}
}

func TestCanceledContext(t *testing.T) {
	t.Parallel()
	requirePostgres(t)
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	dir := filepath.Join(clusterParent(t), "canceled")
	_, err := Start(ctx, Config{Dir: dir})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("Start with a canceled context: %v, want context.Canceled", err)
	}
	requireNoProcesses(t, dir)
	// Nothing half-initialised is left that a later Start would trust.
	if _, err := os.Stat(filepath.Join(dir, "data", "PG_VERSION")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("PG_VERSION exists after a canceled initdb (stat: %v)", err)
	}
	s := startServer(t, Config{Dir: dir})
	if n := queryInt(t, s.URL(""), "SELECT 1"); n != 1 {
		t.Errorf("SELECT 1 = %d", n)
	}
}

func TestRestartWithCanceledContext(t *testing.T) {
	t.Parallel()
	requirePostgres(t)
	s := startServer(t, Config{})
	if err := s.Stop(t.Context()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := s.Start(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("Start with a canceled context: %v, want context.Canceled", err)
	}
	requireNoProcesses(t, s.DataDir())
	if err := s.Start(t.Context()); err != nil {
		t.Fatal(err)
	}
	if n := queryInt(t, s.URL(""), "SELECT 1"); n != 1 {
		t.Errorf("SELECT 1 = %d", n)
	}
}

func TestUntraversableDir(t *testing.T) {
	t.Parallel()
	requirePostgres(t)
	// t.TempDir is 0700 and owned by whoever runs the test. As root, the
	// cluster runs as the postgres user, who cannot enter it: Start must say
	// so. Otherwise the cluster runs as the owner, and Start succeeds.
	s, err := Start(t.Context(), Config{Dir: filepath.Join(t.TempDir(), "pg")})
	if os.Geteuid() != 0 {
		if err != nil {
			t.Fatalf("Start in a directory of the current user: %v", err)
		}
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
		return
	}
	if err == nil {
		s.Close()
		t.Fatal("Start inside a 0700 root directory succeeded, want a traversal error")
	}
	if !strings.Contains(err.Error(), "traversable") {
		t.Fatalf("Start inside a 0700 root dir: %v, want a traversal error", err)
	}
	t.Logf("error (expected): %v", err)
}

func TestFindBinDir(t *testing.T) {
	t.Parallel()
	t.Run("installed", func(t *testing.T) {
		requirePostgres(t)
		dir, err := FindBinDir()
		if err != nil {
			t.Fatal(err)
		}
		for _, name := range []string{"initdb", "postgres"} {
			if !isExecutable(filepath.Join(dir, name)) {
				t.Errorf("%s has no executable %s", dir, name)
			}
		}
	})

	t.Run("missing", func(t *testing.T) {
		empty := t.TempDir()
		_, err := findBinDir(empty, empty)
		if !errors.Is(err, ErrNotInstalled) {
			t.Fatalf("err = %v, want ErrNotInstalled", err)
		}
		if !strings.Contains(err.Error(), "apt-get install") {
			t.Errorf("error does not say how to install: %v", err)
		}
	})

	fakeInstall := func(t *testing.T, dir string, names ...string) {
		t.Helper()
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		for _, name := range names {
			if err := os.WriteFile(filepath.Join(dir, name), []byte("#!/bin/sh\n"), 0o755); err != nil {
				t.Fatal(err)
			}
		}
	}

	t.Run("highest version", func(t *testing.T) {
		lib := t.TempDir()
		fakeInstall(t, filepath.Join(lib, "9.6", "bin"), "initdb", "postgres")
		fakeInstall(t, filepath.Join(lib, "16", "bin"), "initdb", "postgres")
		fakeInstall(t, filepath.Join(lib, "10", "bin"), "initdb", "postgres")
		fakeInstall(t, filepath.Join(lib, "17", "bin"), "initdb") // incomplete
		got, err := findBinDir(t.TempDir(), lib)
		if err != nil {
			t.Fatal(err)
		}
		if want := filepath.Join(lib, "16", "bin"); got != want {
			t.Errorf("findBinDir = %s, want %s", got, want)
		}
	})

	t.Run("path symlink", func(t *testing.T) {
		root := t.TempDir()
		realBin := filepath.Join(root, "pg", "bin")
		fakeInstall(t, realBin, "initdb", "postgres")
		pathDir := filepath.Join(root, "path")
		fakeInstall(t, pathDir)
		if err := os.Symlink(filepath.Join(realBin, "initdb"), filepath.Join(pathDir, "initdb")); err != nil {
			t.Fatal(err)
		}
		// A PATH entry with initdb but no postgres beside it is skipped.
		lonely := filepath.Join(root, "lonely")
		fakeInstall(t, lonely, "initdb")
		got, err := findBinDir(strings.Join([]string{"relative", lonely, pathDir}, string(os.PathListSeparator)), t.TempDir())
		if err != nil {
			t.Fatal(err)
		}
		if got != realBin {
			t.Errorf("findBinDir = %s, want %s", got, realBin)
		}
	})
}

func TestValidate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		cfg  Config
		ok   bool
	}{
		{"zero", Config{}, true},
		{"full", Config{Port: 5432, User: "app_1", Settings: map[string]string{"work_mem": "4MB", "auto_explain.log_min_duration": "0"}}, true},
		{"negative port", Config{Port: -1}, false},
		{"huge port", Config{Port: 70000}, false},
		{"bad user", Config{User: "a b"}, false},
		{"digit user", Config{User: "1x"}, false},
		{"bad setting name", Config{Settings: map[string]string{"a=b": "c"}}, false},
		{"reserved setting", Config{Settings: map[string]string{"Port": "1"}}, false},
		{"newline value", Config{Settings: map[string]string{"work_mem": "1\n2"}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.cfg.Validate(); (err == nil) != tc.ok {
				t.Errorf("Validate() = %v, want ok=%v", err, tc.ok)
			}
		})
	}
}
