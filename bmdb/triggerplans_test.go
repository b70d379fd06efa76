package bmdb_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// TestPhaseTriggersUseIndexesAfterGrowth: the phase trigger's statements
// find a machine's rows by key even on a connection that planned them
// while the tables were nearly empty. PL/pgSQL keeps a statement's plan for
// the life of the connection, and a plan made for a table of a page or two
// reads it whole: in a fresh BMDB taking over a fleet in bulk (P4's
// 10,000-machine line) the watched-flag update scanned machine_agent_heartbeat
// whole, about 100 buffers and 0.4 ms, twice per machine, until
// autovacuum's next ANALYZE.
func TestPhaseTriggersUseIndexesAfterGrowth(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "p", AwaitingAgent: 20, Healthy: 2})
	conn, err := pgx.Connect(t.Context(), db.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.WithoutCancel(t.Context()))
	rows, err := conn.Query(t.Context(), `SELECT machine_id::text FROM machine_provided WHERE agent_phase = 'AwaitingAgent' ORDER BY machine_id`)
	if err != nil {
		t.Fatal(err)
	}
	waiting, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(waiting) != 20 {
		t.Fatalf("%d machines awaiting an agent (%v), want 20", len(waiting), err)
	}
	const start = `INSERT INTO machine_agent_started (machine_id, agent_started_at, agent_public_key)
		VALUES ($1, now(), decode(repeat('ab', 32), 'hex'))`
	// Enough starts on this connection for its plans to settle.
	for _, id := range waiting[:10] {
		if _, err := conn.Exec(t.Context(), start, id); err != nil {
			t.Fatal(err)
		}
	}
	// The fleet grows behind the connection's back, faster than autovacuum
	// analyzes it.
	db.Exec(t, `WITH m AS (INSERT INTO machines (machine_id) SELECT gen_random_uuid() FROM generate_series(1, 5000) RETURNING machine_id)
		INSERT INTO machine_provided (machine_id, provider, provider_id, provider_status, provider_status_at)
		SELECT machine_id, 'q', 'q-' || machine_id::text, 'Running', now() FROM m`)
	db.Exec(t, `INSERT INTO machine_agent_started (machine_id, agent_started_at, agent_public_key)
		SELECT machine_id, now(), decode(repeat('ab', 32), 'hex') FROM machine_provided WHERE provider = 'q'`)
	db.Exec(t, `INSERT INTO machine_agent_heartbeat (machine_id, agent_heartbeat_at)
		SELECT machine_id, now() FROM machine_provided WHERE provider = 'q'`)

	for _, step := range []struct{ what, sql, id string }{
		{"an agent start", start, waiting[10]},
		{"a first heartbeat", `INSERT INTO machine_agent_heartbeat (machine_id, agent_heartbeat_at) VALUES ($1, now())`, waiting[0]},
	} {
		tx, err := conn.Begin(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		// The backend's counts not yet reported, which no report empties
		// within a transaction: read before and after the step.
		seqScans := func() int64 {
			var n int64
			if err := tx.QueryRow(t.Context(), `SELECT COALESCE(sum(seq_scan), 0) FROM pg_stat_xact_user_tables
				WHERE relname IN ('machine_agent_heartbeat', 'machine_agent_started', 'machine_provided')`).Scan(&n); err != nil {
				t.Fatal(err)
			}
			return n
		}
		before := seqScans()
		if _, err := tx.Exec(t.Context(), step.sql, step.id); err != nil {
			t.Fatal(err)
		}
		scans := seqScans() - before
		if err := tx.Rollback(t.Context()); err != nil {
			t.Fatal(err)
		}
		if scans != 0 {
			t.Errorf("%s on a connection whose plans predate the fleet read %d per-machine tables whole", step.what, scans)
		}
	}
}

// TestHotPathChecksCarryNoSettings: the triggers that run on every claim
// and finish carry no function settings, which PostgreSQL saves, sets and
// restores at each call (migration 00028: 40-120 µs of PostgreSQL CPU per
// P2 cycle for enable_seqscan on the machine check alone).
func TestHotPathChecksCarryNoSettings(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	rows, err := db.Pool.Query(t.Context(), `SELECT DISTINCT p.proname || ' ' || array_to_string(p.proconfig, ',')
		FROM pg_trigger g
		JOIN pg_proc p ON p.oid = g.tgfoid
		WHERE g.tgrelid IN ('work'::regclass, 'work_history'::regclass) AND p.proconfig IS NOT NULL`)
	if err != nil {
		t.Fatal(err)
	}
	withSettings, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if len(withSettings) > 0 {
		t.Errorf("triggers on work and work_history call functions with settings: %q", withSettings)
	}
}
