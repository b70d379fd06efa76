// Package bmdbtest gives every test a real, freshly migrated PostgreSQL
// database.
//
// A test binary that uses it calls Main from TestMain. The first test that
// asks for a database starts one private PostgreSQL cluster for the whole
// binary (initdb into a temporary directory, unix socket only, as the
// postgres OS user when running as root), migrates a template database once,
// and then hands each test its own database cloned from the template and
// dropped when the test ends. Main stops the cluster after the tests.
//
// With SHEPHERD_TEST_DATABASE_URL set, the harness uses that server instead
// (the role needs CREATEDB): it creates the template and the per-test
// databases there and drops them again.
//
// If no PostgreSQL server is installed, tests fail with the command that
// installs it. They do not skip.
package bmdbtest

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/internal/pgserver"
	"github.com/shepherd/shepherd/internal/tcpproxy"
)

// EnvDatabaseURL names the environment variable that points the harness at
// an external PostgreSQL server instead of a private cluster.
const EnvDatabaseURL = "SHEPHERD_TEST_DATABASE_URL"

// cluster is the per-binary state of the harness. It is process-wide by
// nature: one PostgreSQL cluster serves every test of the binary.
type cluster struct {
	once    sync.Once
	err     error
	server  *pgserver.Server // nil when using an external server
	admin   *pgxpool.Pool    // connection to the maintenance database
	baseURL *url.URL         // URL whose path is replaced per database
	tmpl    string           // template database name
	create  sync.Mutex       // CREATE DATABASE ... TEMPLATE one at a time
	seq     atomic.Int64
}

var (
	mainCalled atomic.Bool
	shared     cluster
)

// Main runs the package's tests and then stops the private cluster (or drops
// the template on an external server). Call it from TestMain:
//
//	func TestMain(m *testing.M) { bmdbtest.Main(m) }
//
// It also fails the run if goroutines are left behind after the tests (a
// session not closed, a pool not closed), as goleak sees them. cleanups run
// after the tests, before the process exits.
func Main(m *testing.M, cleanups ...func()) {
	mainCalled.Store(true)
	ignore := goleak.IgnoreCurrent()
	code := m.Run()
	for _, c := range cleanups {
		c()
	}
	if err := shared.shutdown(); err != nil {
		fmt.Fprintln(os.Stderr, "bmdbtest:", err)
		if code == 0 {
			code = 1
		}
	}
	if code == 0 {
		if err := goleak.Find(ignore); err != nil {
			fmt.Fprintln(os.Stderr, "bmdbtest: goroutines left behind after the tests:", err)
			code = 1
		}
	}
	os.Exit(code)
}

func (c *cluster) start() error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	adminURL := os.Getenv(EnvDatabaseURL)
	if adminURL == "" {
		// TCP too, so that tests can put a misbehaving proxy between
		// Shepherd and the database (NewBehindProxy).
		srv, err := pgserver.Start(ctx, pgserver.Config{TCP: true})
		if err != nil {
			if errors.Is(err, pgserver.ErrNotInstalled) {
				return fmt.Errorf("the BMDB tests need a PostgreSQL server (or %s pointing at one): %w", EnvDatabaseURL, err)
			}
			return err
		}
		c.server = srv
		adminURL = srv.URL("postgres")
	}
	u, err := url.Parse(adminURL)
	if err != nil || u.Scheme == "" {
		return fmt.Errorf("%s must be a postgres:// URL", EnvDatabaseURL)
	}
	c.baseURL = u
	c.admin, err = pgxpool.New(ctx, adminURL)
	if err != nil {
		return fmt.Errorf("connecting to the test server: %w", err)
	}
	c.tmpl = fmt.Sprintf("shepherd_template_%d_%d", os.Getpid(), time.Now().UnixNano()%1e6)
	if _, err := c.admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{c.tmpl}.Sanitize()); err != nil {
		return fmt.Errorf("creating template database: %w", err)
	}
	db, err := bmdb.Open(ctx, bmdb.Config{URL: c.url(c.tmpl), MaxConns: 2})
	if err != nil {
		return fmt.Errorf("migrating template database: %w", err)
	}
	db.Close()
	return nil
}

// url returns the connection URL of database on the test server.
func (c *cluster) url(database string) string {
	u := *c.baseURL
	u.Path = "/" + database
	return u.String()
}

func (c *cluster) shutdown() error {
	if c.admin == nil && c.server == nil {
		return nil
	}
	var errs []error
	if c.admin != nil {
		if c.server == nil && c.tmpl != "" {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			_, err := c.admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{c.tmpl}.Sanitize()+" WITH (FORCE)")
			cancel()
			errs = append(errs, err)
		}
		c.admin.Close()
	}
	if c.server != nil {
		errs = append(errs, c.server.Close())
	}
	return errors.Join(errs...)
}

func (c *cluster) ready(t testing.TB) {
	t.Helper()
	if err := c.readyErr(); err != nil {
		t.Fatal(err)
	}
}

// readyErr starts the cluster on first use and says why it cannot be used.
func (c *cluster) readyErr() error {
	if !mainCalled.Load() {
		return errors.New("bmdbtest: call bmdbtest.Main(m) from TestMain, so that the test cluster is stopped after the tests")
	}
	c.once.Do(func() { c.err = c.start() })
	if c.err != nil {
		return fmt.Errorf("bmdbtest: %w", c.err)
	}
	return nil
}

// NewDatabase creates a fresh, migrated database for the test, drops it when
// the test ends, and returns its connection URL.
func NewDatabase(t testing.TB) string {
	t.Helper()
	shared.ready(t)
	return newDatabase(t, shared.tmpl)
}

// NewEmptyDatabase is NewDatabase without the migrations, for tests of the
// migrations themselves.
func NewEmptyDatabase(t testing.TB) string {
	t.Helper()
	shared.ready(t)
	return newDatabase(t, "template0")
}

func newDatabase(t testing.TB, template string) string {
	t.Helper()
	name, err := createDatabase(template)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := dropDatabase(name); err != nil {
			t.Error(err)
		}
	})
	return shared.url(name)
}

// createDatabase creates a database cloned from template and returns its
// name.
func createDatabase(template string) (string, error) {
	name := fmt.Sprintf("%s_t%d", shared.tmpl, shared.seq.Add(1))
	shared.create.Lock()
	_, err := shared.admin.Exec(context.Background(), fmt.Sprintf("CREATE DATABASE %s TEMPLATE %s",
		pgx.Identifier{name}.Sanitize(), pgx.Identifier{template}.Sanitize()))
	shared.create.Unlock()
	if err != nil {
		return "", fmt.Errorf("bmdbtest: creating database %s: %w", name, err)
	}
	return name, nil
}

// dropDatabase drops a database createDatabase made.
func dropDatabase(name string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := shared.admin.Exec(ctx, "DROP DATABASE "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("bmdbtest: dropping database %s: %w", name, err)
	}
	return nil
}

// ExampleDatabase is NewDatabase for Example functions, which have no
// testing.TB: it creates a fresh, migrated database on the binary's test
// cluster (Main must run the tests) and returns its URL and a function
// that drops it. Where NewDatabase would fail the test, it panics, which
// fails the example.
func ExampleDatabase() (url string, drop func()) {
	if err := shared.readyErr(); err != nil {
		panic(err)
	}
	name, err := createDatabase(shared.tmpl)
	if err != nil {
		panic(err)
	}
	return shared.url(name), func() {
		if err := dropDatabase(name); err != nil {
			panic(err)
		}
	}
}

// DB is a test's own BMDB, plus a raw connection pool for setting up states
// the API does not produce directly (backdated heartbeats, large fleets).
type DB struct {
	*bmdb.DB
	// URL connects to the test's database.
	URL string
	// Pool runs raw SQL against the test's database.
	Pool *pgxpool.Pool
}

// New opens a fresh database for the test with bmdb.Open. The DB is closed
// and the database dropped when the test ends.
func New(t testing.TB) *DB {
	t.Helper()
	return NewWithConfig(t, bmdb.Config{})
}

// NewWithConfig is New with cfg's options; cfg.URL is set by the harness.
func NewWithConfig(t testing.TB, cfg bmdb.Config) *DB {
	t.Helper()
	cfg.URL = NewDatabase(t)
	db, err := bmdb.Open(t.Context(), cfg)
	if err != nil {
		t.Fatalf("bmdbtest: opening BMDB: %v", err)
	}
	pool, err := pgxpool.New(t.Context(), cfg.URL)
	if err != nil {
		t.Fatalf("bmdbtest: connecting: %v", err)
	}
	t.Cleanup(func() {
		pool.Close()
		db.Close()
	})
	return &DB{DB: db, URL: cfg.URL, Pool: pool}
}

// NewBehindProxy is NewWithConfig, except that the BMDB reaches the database
// through a TCP proxy the test controls (black-hole it, reset it), while
// DB.Pool still connects directly. The proxy is closed when the test ends.
func NewBehindProxy(t testing.TB, cfg bmdb.Config) (*DB, *tcpproxy.Proxy) {
	t.Helper()
	direct, via, proxy := newProxiedDatabase(t)
	cfg.URL = via
	db, err := bmdb.Open(t.Context(), cfg)
	if err != nil {
		proxy.Close()
		t.Fatalf("bmdbtest: opening BMDB through the proxy: %v", err)
	}
	pool, err := pgxpool.New(t.Context(), direct)
	if err != nil {
		t.Fatalf("bmdbtest: connecting: %v", err)
	}
	t.Cleanup(func() {
		pool.Close()
		db.Close()
	})
	return &DB{DB: db, URL: direct, Pool: pool}, proxy
}

// NewProxiedDatabase creates a fresh migrated database, like NewDatabase,
// and returns its URL through a TCP proxy the test controls, for tests that
// open it themselves (a command's own start-up). The proxy is closed when
// the test ends.
func NewProxiedDatabase(t testing.TB) (string, *tcpproxy.Proxy) {
	t.Helper()
	_, via, proxy := newProxiedDatabase(t)
	return via, proxy
}

func newProxiedDatabase(t testing.TB) (direct, via string, proxy *tcpproxy.Proxy) {
	t.Helper()
	direct = NewDatabase(t)
	u, err := url.Parse(direct)
	if err != nil {
		t.Fatal(err)
	}
	target := u.Host
	if shared.server != nil {
		target = fmt.Sprintf("127.0.0.1:%d", shared.server.Port())
	}
	if target == "" {
		t.Fatalf("bmdbtest: %s connects over a unix socket; a proxy needs TCP", EnvDatabaseURL)
	}
	proxy, err = tcpproxy.Start(target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { proxy.Close() })
	v := *u
	v.Host = proxy.Addr()
	q := v.Query()
	q.Del("host")
	q.Del("port")
	v.RawQuery = q.Encode()
	return direct, v.String(), proxy
}

// Exec runs a statement on the test's database and fails the test on error.
func (d *DB) Exec(t testing.TB, sql string, args ...any) {
	t.Helper()
	if _, err := d.Pool.Exec(t.Context(), sql, args...); err != nil {
		t.Fatalf("bmdbtest: %s: %v", firstLine(sql), err)
	}
}

// Scalar runs a query returning one value and returns it.
func Scalar[T any](t testing.TB, d *DB, sql string, args ...any) T {
	t.Helper()
	var v T
	if err := d.Pool.QueryRow(t.Context(), sql, args...).Scan(&v); err != nil {
		t.Fatalf("bmdbtest: %s: %v", firstLine(sql), err)
	}
	return v
}

func firstLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		return s[:i] + " ..."
	}
	return s
}
