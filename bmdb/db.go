package bmdb

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb/model"
	"github.com/shepherd/shepherd/internal/ratelog"
)

// Config says which database to use and how. Zero values mean defaults.
type Config struct {
	// URL is the PostgreSQL connection string (URL or key=value form); required.
	URL string
	// MaxConns bounds the connection pool; default 8 + 4 per CPU, which leaves
	// room for a few dozen workers without queueing on the pool.
	MaxConns int32
	// HeartbeatConns bounds a second pool that only RecordHeartbeats uses,
	// so that heartbeats never queue for a connection behind control-loop
	// workers (hundreds of takeovers in flight held a 100-connection pool
	// and made each heartbeat batch wait about 228 ms, longer than the
	// takeovers' own statements, and the machines late to heartbeat).
	// Default 4, the callback server's default flushers; opened lazily, so
	// a process without a callback server opens none.
	HeartbeatConns int32
	// Schema says what Open does about the schema; default SchemaMigrate.
	Schema SchemaPolicy
	// Registerer receives the BMDB client metrics; nil keeps them private.
	Registerer prometheus.Registerer
	// Logger receives session and retry events; nil discards them.
	Logger *slog.Logger
}

// SchemaPolicy says what Open does about the database schema.
type SchemaPolicy int

const (
	// SchemaMigrate applies the embedded migrations the database lacks.
	SchemaMigrate SchemaPolicy = iota
	// SchemaRequireCurrent changes nothing and fails unless the database has
	// every migration this binary knows, for processes that must not change
	// the schema of a shared database.
	SchemaRequireCurrent
	// SchemaIgnore neither migrates nor checks; `shepherd migrate` uses it.
	SchemaIgnore
)

// Validate reports the first problem with the configuration. It changes nothing.
func (c Config) Validate() error {
	if c.URL == "" {
		return errors.New("bmdb: Config.URL is required")
	}
	if c.Schema < SchemaMigrate || c.Schema > SchemaIgnore {
		return fmt.Errorf("bmdb: Config.Schema %d is not a schema policy", c.Schema)
	}
	if c.MaxConns < 0 {
		return fmt.Errorf("bmdb: Config.MaxConns must be >= 0 (0 = default), got %d", c.MaxConns)
	}
	if c.HeartbeatConns < 0 {
		return fmt.Errorf("bmdb: Config.HeartbeatConns must be >= 0 (0 = default), got %d", c.HeartbeatConns)
	}
	return nil
}

// DB is an open BMDB: a connection pool, the schema version it found, and the
// client metrics. It is safe for concurrent use.
type DB struct {
	pool *pgxpool.Pool
	q    *model.Queries
	// hbPool and hb are Config.HeartbeatConns' pool, for RecordHeartbeats.
	hbPool *pgxpool.Pool
	hb     *model.Queries
	log    *slog.Logger
	// failures bounds the lines about failures that repeat while the
	// database is unreachable (session renewals, check-ins, claims): one
	// per kind per interval, with a count.
	failures *ratelog.Logger
	metrics  *metrics
	version  int64
}

// Open connects to the database, applies the embedded migrations (unless
// cfg.Schema says otherwise) and returns the DB. Migrations are serialised between
// processes, so any number of processes may open the same database at once.
func Open(ctx context.Context, cfg Config) (*DB, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.MaxConns = cmp.Or(cfg.MaxConns, int32(8+4*runtime.GOMAXPROCS(0)))
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	reg := cfg.Registerer
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	pcfg, err := pgxpool.ParseConfig(cfg.URL)
	if err != nil {
		// The parse error may quote the URL, password included.
		return nil, errors.New("bmdb: parsing database URL: invalid connection string")
	}
	pcfg.AfterConnect = encodeUUIDsAsBytes
	hbcfg := pcfg.Copy()
	pcfg.MaxConns = cfg.MaxConns
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("bmdb: creating connection pool: %w", err)
	}
	hbcfg.MaxConns = cmp.Or(cfg.HeartbeatConns, 4)
	hbcfg.MinConns = 0
	hbPool, err := pgxpool.NewWithConfig(ctx, hbcfg)
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("bmdb: creating heartbeat connection pool: %w", err)
	}
	log = log.With("component", "bmdb")
	db := &DB{pool: pool, q: model.New(pool), hbPool: hbPool, hb: model.New(hbPool), log: log, failures: ratelog.New(log, 0)}
	if err := db.open(ctx, cfg, reg); err != nil {
		db.Close()
		return nil, err
	}
	return db, nil
}

func (db *DB) open(ctx context.Context, cfg Config, reg prometheus.Registerer) error {
	if err := db.pool.Ping(ctx); err != nil {
		return fmt.Errorf("bmdb: connecting to %s: %w", redactedTarget(db.pool), err)
	}
	var err error
	switch cfg.Schema {
	case SchemaMigrate:
		db.version, err = db.Migrate(ctx, nil)
	case SchemaRequireCurrent:
		db.version, err = db.dbVersion(ctx, true)
	case SchemaIgnore:
		db.version, err = db.dbVersion(ctx, false)
	}
	if err != nil {
		return err
	}
	db.metrics, err = newMetrics(reg)
	return err
}

// redactedTarget names the server and database of the pool without the
// password, for error messages.
func redactedTarget(pool *pgxpool.Pool) string {
	cc := pool.Config().ConnConfig
	return fmt.Sprintf("database %q on %s:%d", cc.Database, cc.Host, cc.Port)
}

// SchemaVersion is the migration version the database was at after Open.
func (db *DB) SchemaVersion() int64 { return db.version }

// Close closes every connection. Sessions must be closed first.
func (db *DB) Close() {
	db.pool.Close()
	db.hbPool.Close()
	db.failures.Flush()
}
