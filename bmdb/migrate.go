package bmdb

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"time"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// MigrationState is one migration and whether the database has it.
type MigrationState struct {
	Version   int64
	Name      string
	Applied   bool
	AppliedAt time.Time // zero unless Applied
}

func (db *DB) migrations() (*goose.Provider, func() error, error) {
	fsys, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		return nil, nil, err
	}
	// The advisory lock only serialises processes migrating at the same time;
	// correctness of the migrations themselves does not depend on it.
	locker, err := lock.NewPostgresSessionLocker()
	if err != nil {
		return nil, nil, fmt.Errorf("bmdb: creating migration lock: %w", err)
	}
	sqlDB := stdlib.OpenDBFromPool(db.pool)
	p, err := goose.NewProvider(goose.DialectPostgres, sqlDB, fsys, goose.WithSessionLocker(locker))
	if err != nil {
		sqlDB.Close()
		return nil, nil, fmt.Errorf("bmdb: loading migrations: %w", err)
	}
	return p, sqlDB.Close, nil
}

// Migrate applies every embedded migration the database lacks, one at a
// time, calls progress (if not nil) after each, and returns the resulting
// schema version.
func (db *DB) Migrate(ctx context.Context, progress func(MigrationState, time.Duration)) (int64, error) {
	p, closeDB, err := db.migrations()
	if err != nil {
		return 0, err
	}
	defer closeDB()
	for {
		r, err := p.UpByOne(ctx)
		if errors.Is(err, goose.ErrNoNextVersion) {
			break
		}
		if err != nil {
			return 0, fmt.Errorf("bmdb: applying migrations: %w", err)
		}
		if progress != nil {
			progress(MigrationState{Version: r.Source.Version, Name: r.Source.Path, Applied: true, AppliedAt: time.Now()}, r.Duration)
		}
	}
	v, err := p.GetDBVersion(ctx)
	if err != nil {
		return 0, fmt.Errorf("bmdb: reading schema version: %w", err)
	}
	return v, nil
}

// dbVersion returns the database's schema version (0 if it has none).
func (db *DB) dbVersion(ctx context.Context) (int64, error) {
	p, closeDB, err := db.migrations()
	if err != nil {
		return 0, err
	}
	defer closeDB()
	v, err := p.GetDBVersion(ctx)
	if err != nil {
		return 0, fmt.Errorf("bmdb: reading schema version: %w", err)
	}
	return v, nil
}

// MigrationStatus lists the embedded migrations and which ones the database has.
func (db *DB) MigrationStatus(ctx context.Context) ([]MigrationState, error) {
	p, closeDB, err := db.migrations()
	if err != nil {
		return nil, err
	}
	defer closeDB()
	st, err := p.Status(ctx)
	if err != nil {
		return nil, fmt.Errorf("bmdb: reading migration status: %w", err)
	}
	out := make([]MigrationState, 0, len(st))
	for _, s := range st {
		out = append(out, MigrationState{
			Version:   s.Source.Version,
			Name:      s.Source.Path,
			Applied:   s.State == goose.StateApplied,
			AppliedAt: s.AppliedAt,
		})
	}
	return out, nil
}

// checkSchema returns the database's schema version and fails if it lacks
// migrations this binary needs.
func (db *DB) checkSchema(ctx context.Context) (int64, error) {
	p, closeDB, err := db.migrations()
	if err != nil {
		return 0, err
	}
	defer closeDB()
	v, err := p.GetDBVersion(ctx)
	if err != nil {
		return 0, fmt.Errorf("bmdb: reading schema version: %w", err)
	}
	sources := p.ListSources()
	want := sources[len(sources)-1].Version
	if v < want {
		return 0, fmt.Errorf("bmdb: database schema is at version %d, this binary needs %d; run `shepherd migrate up`", v, want)
	}
	return v, nil
}
