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

// withMigrations runs fn with a goose provider over the embedded migrations.
func (db *DB) withMigrations(fn func(p *goose.Provider) error) error {
	fsys, err := fs.Sub(migrationFiles, "migrations")
	if err != nil {
		return err
	}
	// The advisory lock only serialises processes migrating at the same time;
	// correctness of the migrations themselves does not depend on it.
	locker, err := lock.NewPostgresSessionLocker()
	if err != nil {
		return fmt.Errorf("bmdb: creating migration lock: %w", err)
	}
	sqlDB := stdlib.OpenDBFromPool(db.pool)
	defer sqlDB.Close()
	p, err := goose.NewProvider(goose.DialectPostgres, sqlDB, fsys, goose.WithSessionLocker(locker))
	if err != nil {
		return fmt.Errorf("bmdb: loading migrations: %w", err)
	}
	return fn(p)
}

// Migrate applies every embedded migration the database lacks, one at a
// time, calls progress (if not nil) after each, and returns the resulting
// schema version.
func (db *DB) Migrate(ctx context.Context, progress func(MigrationState, time.Duration)) (int64, error) {
	var v int64
	err := db.withMigrations(func(p *goose.Provider) error {
		for {
			r, err := p.UpByOne(ctx)
			if errors.Is(err, goose.ErrNoNextVersion) {
				break
			}
			if err != nil {
				return fmt.Errorf("bmdb: applying migrations: %w", err)
			}
			if progress != nil {
				progress(MigrationState{Version: r.Source.Version, Name: r.Source.Path, Applied: true, AppliedAt: time.Now()}, r.Duration)
			}
		}
		var err error
		v, err = schemaVersion(ctx, p)
		return err
	})
	return v, err
}

// MigrationStatus lists the embedded migrations and which ones the database has.
func (db *DB) MigrationStatus(ctx context.Context) ([]MigrationState, error) {
	var out []MigrationState
	err := db.withMigrations(func(p *goose.Provider) error {
		st, err := p.Status(ctx)
		if err != nil {
			return fmt.Errorf("bmdb: reading migration status: %w", err)
		}
		for _, s := range st {
			out = append(out, MigrationState{
				Version:   s.Source.Version,
				Name:      s.Source.Path,
				Applied:   s.State == goose.StateApplied,
				AppliedAt: s.AppliedAt,
			})
		}
		return nil
	})
	return out, err
}

// dbVersion returns the database's schema version. With requireCurrent it
// fails if the database lacks migrations this binary needs.
func (db *DB) dbVersion(ctx context.Context, requireCurrent bool) (int64, error) {
	var v int64
	err := db.withMigrations(func(p *goose.Provider) error {
		var err error
		if v, err = schemaVersion(ctx, p); err != nil {
			return err
		}
		sources := p.ListSources()
		if want := sources[len(sources)-1].Version; requireCurrent && v < want {
			return fmt.Errorf("bmdb: database schema is at version %d, this binary needs %d; run `shepherd migrate up`", v, want)
		}
		return nil
	})
	return v, err
}

func schemaVersion(ctx context.Context, p *goose.Provider) (int64, error) {
	v, err := p.GetDBVersion(ctx)
	if err != nil {
		return 0, fmt.Errorf("bmdb: reading schema version: %w", err)
	}
	return v, nil
}
