package bmdbtest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// GatePoint is where an InsertGate holds the statements it catches.
type GatePoint int

const (
	// BeforeInsert holds a statement at its insert: after it took its
	// snapshot and read what it read, before it writes the row.
	BeforeInsert GatePoint = iota
	// AtCommit holds a transaction at its COMMIT, after every statement ran
	// (a deferred constraint trigger).
	AtCommit
)

// InsertGate holds every statement that inserts a matching row into a
// table of the test's database, at its GatePoint, until the test opens the
// gate: a trigger waits for an advisory lock the gate holds. Tests use it to
// put a claim, an end or a Close at an exact point without any clock.
type InsertGate struct {
	db      *DB
	conn    *pgxpool.Conn
	table   string
	trigger string
	key     int64
	open    bool
}

// HoldInserts closes a gate on inserts into table at point; when, if not
// empty, is an SQL condition on NEW that limits the rows held. The gate is
// opened and removed when the test ends, or earlier with Open and Remove.
func HoldInserts(t testing.TB, db *DB, table string, point GatePoint, when string) *InsertGate {
	t.Helper()
	g := &InsertGate{db: db, table: table, trigger: fmt.Sprintf("gate_%s_%d", table, point), key: 4200 + int64(point)}
	// The function waits for the lock and lets go of it at once: the row
	// passes as soon as the test opens the gate.
	db.Exec(t, fmt.Sprintf(`CREATE OR REPLACE FUNCTION %[1]s() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_advisory_lock(%[2]d); PERFORM pg_advisory_unlock(%[2]d); RETURN %[3]s; END $$`,
		g.trigger, g.key, map[GatePoint]string{BeforeInsert: "NEW", AtCommit: "NULL"}[point]))
	cond := ""
	if when != "" {
		cond = "WHEN (" + when + ")"
	}
	switch point {
	case BeforeInsert:
		db.Exec(t, fmt.Sprintf("CREATE TRIGGER %[1]s BEFORE INSERT ON %[2]s FOR EACH ROW %[3]s EXECUTE FUNCTION %[1]s()", g.trigger, table, cond))
	case AtCommit:
		db.Exec(t, fmt.Sprintf(`CREATE CONSTRAINT TRIGGER %[1]s AFTER INSERT ON %[2]s DEFERRABLE INITIALLY DEFERRED
			FOR EACH ROW %[3]s EXECUTE FUNCTION %[1]s()`, g.trigger, table, cond))
	default:
		t.Fatalf("bmdbtest: unknown gate point %d", point)
	}
	conn, err := db.Pool.Acquire(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	g.conn = conn
	if _, err := conn.Exec(t.Context(), "SELECT pg_advisory_lock($1)", g.key); err != nil {
		conn.Release()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		g.Open(t)
		g.conn.Release()
	})
	return g
}

// WaitHeld waits until a statement of the test's database is held at the
// gate.
func (g *InsertGate) WaitHeld(t testing.TB) {
	t.Helper()
	WaitFor(t, 60*time.Second, "a statement waits at the gate on "+g.table, func(ctx context.Context) (bool, error) {
		// Advisory locks are per database: other tests' gates, in their own
		// databases on the same cluster, must not count.
		var held bool
		err := g.db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks
			WHERE locktype = 'advisory' AND NOT granted AND objid = $1
			  AND database = (SELECT oid FROM pg_database WHERE datname = current_database()))`, g.key).Scan(&held)
		return held, err
	})
}

// Open lets every held statement, and all later ones, pass. It is
// idempotent.
func (g *InsertGate) Open(t testing.TB) {
	t.Helper()
	if g.open {
		return
	}
	g.open = true
	// The test's context may be done in a cleanup; the lock must go anyway.
	if _, err := g.conn.Exec(context.WithoutCancel(t.Context()), "SELECT pg_advisory_unlock($1)", g.key); err != nil {
		t.Fatal(err)
	}
}

// Remove opens the gate and drops its trigger, so that the table's inserts
// no longer go through it.
func (g *InsertGate) Remove(t testing.TB) {
	t.Helper()
	g.Open(t)
	g.db.Exec(t, fmt.Sprintf("DROP TRIGGER %s ON %s", g.trigger, g.table))
}

// LockWaiters reports whether a session of the test's database waits for a
// lock other than an advisory one (a row or transaction lock): a statement
// blocked behind another transaction.
func LockWaiters(ctx context.Context, db *DB) (bool, error) {
	var waiting bool
	err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks l JOIN pg_stat_activity a USING (pid)
		WHERE NOT l.granted AND l.locktype <> 'advisory' AND a.datname = current_database())`).Scan(&waiting)
	return waiting, err
}
