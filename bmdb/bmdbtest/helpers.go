package bmdbtest

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/internal/eventually"
)

// Session starts a session for component with lease (0 = default) and
// closes it when the test ends.
func Session(t testing.TB, db *DB, component string, lease time.Duration) *bmdb.Session {
	t.Helper()
	s, err := db.StartSession(t.Context(), bmdb.SessionConfig{Component: component, Lease: lease})
	if err != nil {
		t.Fatalf("bmdbtest: starting session: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Close(context.Background()); err != nil && !s.Lost() {
			t.Errorf("bmdbtest: closing session: %v", err)
		}
	})
	return s
}

var providerSeq atomic.Int64

// AddMachine adds a machine of provider through the BMDB API and returns its id.
func AddMachine(t testing.TB, db *DB, s *bmdb.Session, provider string) uuid.UUID {
	t.Helper()
	var id uuid.UUID
	err := s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		var err error
		id, err = tx.AddMachine(ctx, bmdb.Provided{
			Provider:   provider,
			ProviderID: fmt.Sprintf("test-%d", providerSeq.Add(1)),
			Status:     bmdb.ProviderStatusRunning,
		})
		return err
	})
	if err != nil {
		t.Fatalf("bmdbtest: adding machine: %v", err)
	}
	return id
}

// Fleet describes a fleet of one provider to build in bulk, for tests and
// benchmarks at the scale of a real fleet. Machine counts are disjoint.
type Fleet struct {
	Provider string
	// Healthy machines have AgentStarted (a day ago) and a fresh heartbeat.
	Healthy int
	// Stale machines are healthy ones whose last heartbeat is a day old.
	Stale int
	// Installed machines are healthy ones whose installation succeeded.
	Installed int
	// AwaitingAgent machines are provided only.
	AwaitingAgent int
	// NeverHeartbeat machines got AgentStarted a day ago and never a heartbeat.
	NeverHeartbeat int
	// AgentStartHeld of the AwaitingAgent machines failed agent start and
	// back off for an hour; RecoveryHeld of the Stale ones failed recovery
	// and back off for an hour.
	AgentStartHeld, RecoveryHeld int
	// Decommissioning of the Healthy machines have a decommission request,
	// made a second apart; DecommissionHeld of them, the oldest requests,
	// failed decommission and back off for an hour.
	Decommissioning, DecommissionHeld int
}

// BuildFleet adds the fleet f with a few set-based statements (adding
// 100,000 machines one by one would take minutes) and runs ANALYZE so the
// planner sees it. The tags are written through the same tables and triggers
// as the API writes them; only the times are set directly.
func BuildFleet(ctx context.Context, pool *pgxpool.Pool, f Fleet) error {
	type step struct {
		n   int
		sql string
	}
	steps := []step{
		{f.Healthy + f.Stale + f.Installed + f.AwaitingAgent + f.NeverHeartbeat, `
			WITH m AS (
				INSERT INTO machines (machine_id) SELECT gen_random_uuid() FROM generate_series(1, $1)
				RETURNING machine_id
			)
			INSERT INTO machine_provided (machine_id, provider, provider_id, provider_status, provider_status_at)
			SELECT machine_id, $2, 'fleet-' || machine_id::text, 'Running', now() FROM m`},
		// Everything but AwaitingAgent gets an agent, started a day ago.
		{f.Healthy + f.Stale + f.Installed + f.NeverHeartbeat, `
			INSERT INTO machine_agent_started (machine_id, agent_started_at, agent_public_key)
			SELECT machine_id, now() - interval '1 day', decode(repeat('ab', 32), 'hex')
			FROM machine_provided WHERE provider = $2 AND agent_phase = 'AwaitingAgent'
			LIMIT $1`},
		// The trigger started their phase now; it began with the agent.
		{f.Healthy + f.Stale + f.Installed + f.NeverHeartbeat, `
			UPDATE machine_provided SET agent_phase_since = now() - interval '1 day'
			WHERE provider = $2 AND agent_phase = 'AwaitingFirstHeartbeat' AND $1::integer > 0`},
		{f.Healthy + f.Stale + f.Installed, `
			INSERT INTO machine_agent_heartbeat (machine_id, agent_heartbeat_at)
			SELECT machine_id, now() FROM machine_provided
			WHERE provider = $2 AND agent_phase = 'AwaitingFirstHeartbeat'
			LIMIT $1`},
		{f.Stale, `
			UPDATE machine_agent_heartbeat SET agent_heartbeat_at = now() - interval '1 day'
			WHERE machine_id IN (
				SELECT h.machine_id FROM machine_agent_heartbeat h JOIN machine_provided p USING (machine_id)
				WHERE p.provider = $2 AND h.agent_heartbeat_at > now() - interval '1 hour'
				LIMIT $1)`},
		{f.Installed, `
			INSERT INTO machine_os_installation_request (machine_id, generation, os_installation_request_raw)
			SELECT h.machine_id, 1, '\x00' FROM machine_agent_heartbeat h JOIN machine_provided p USING (machine_id)
			WHERE p.provider = $2 AND h.agent_heartbeat_at > now() - interval '1 hour'
			LIMIT $1`},
		{f.Installed, `
			INSERT INTO machine_os_installation_report (machine_id, generation, success, os_installation_report_raw)
			SELECT q.machine_id, q.generation, true, '\x00'
			FROM machine_os_installation_request q JOIN machine_provided p USING (machine_id)
			WHERE p.provider = $2 AND NOT EXISTS (SELECT 1 FROM machine_os_installation_report r WHERE r.machine_id = q.machine_id)
			LIMIT $1`},
		{f.AgentStartHeld, `
			INSERT INTO work_backoff (machine_id, process, backoff_until, cause, last_interval_ms, attempts)
			SELECT machine_id, 'AgentStart', now() + interval '1 hour', 'fleet: held', 3600000, 5
			FROM machine_provided WHERE provider = $2 AND agent_phase = 'AwaitingAgent'
			LIMIT $1`},
		{f.RecoveryHeld, `
			INSERT INTO work_backoff (machine_id, process, backoff_until, cause, last_interval_ms, attempts)
			SELECT h.machine_id, 'Recovery', now() + interval '1 hour', 'fleet: held', 3600000, 5
			FROM machine_agent_heartbeat h JOIN machine_provided p USING (machine_id)
			WHERE p.provider = $2 AND h.agent_heartbeat_at < now() - interval '1 hour'
			  AND NOT EXISTS (SELECT 1 FROM machine_os_installation_request q WHERE q.machine_id = h.machine_id)
			LIMIT $1`},
		{f.Decommissioning, `
			INSERT INTO machine_decommission_request (machine_id, requested_at, requested_by, reason)
			SELECT h.machine_id, now() - interval '1 day' + interval '1 second' * row_number() OVER (), 'fleet', 'fleet: decommission'
			FROM machine_agent_heartbeat h JOIN machine_provided p USING (machine_id)
			WHERE p.provider = $2 AND h.agent_heartbeat_at > now() - interval '1 hour'
			  AND NOT EXISTS (SELECT 1 FROM machine_os_installation_request q WHERE q.machine_id = h.machine_id)
			  AND NOT EXISTS (SELECT 1 FROM machine_decommission_request d WHERE d.machine_id = h.machine_id)
			LIMIT $1`},
		{f.DecommissionHeld, `
			INSERT INTO work_backoff (machine_id, process, backoff_until, cause, last_interval_ms, attempts)
			SELECT d.machine_id, 'Decommission', now() + interval '1 hour', 'fleet: held', 3600000, 5
			FROM machine_decommission_request d JOIN machine_provided p USING (machine_id)
			WHERE p.provider = $2
			ORDER BY d.requested_at
			LIMIT $1`},
	}
	for _, st := range steps {
		if st.n == 0 {
			continue
		}
		if _, err := pool.Exec(ctx, st.sql, st.n, f.Provider); err != nil {
			return fmt.Errorf("building fleet of %s: %w", f.Provider, err)
		}
	}
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE"); err != nil {
		return fmt.Errorf("analyzing fleet: %w", err)
	}
	return nil
}

// AddFleet is BuildFleet for tests.
func AddFleet(t testing.TB, db *DB, f Fleet) {
	t.Helper()
	if err := BuildFleet(t.Context(), db.Pool, f); err != nil {
		t.Fatal(err)
	}
}

// WaitFor polls cond until it reports true, and fails the test with what and
// the last error if timeout passes first.
func WaitFor(t testing.TB, timeout time.Duration, what string, cond func(context.Context) (bool, error)) {
	t.Helper()
	eventually.Holds(t, timeout, what, cond)
}

// OverlappingClaims checks, in the database, that the history of every
// machine is a sequence of claims that never overlap: each Started of a
// machine-exclusive process follows the end of the previous claim, and each
// end (Finished, Failed, Canceled, Expired) ends the claim the last Started
// made, under the same session. History is written in the same transaction
// as every transition, and a claim only sees a machine free after the
// previous end committed, so history order is claim order. It returns a
// description of each violation (at most 20).
func OverlappingClaims(t testing.TB, db *DB) []string {
	t.Helper()
	out, err := OverlappingClaimsIn(t.Context(), db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// OverlappingClaimsIn is OverlappingClaims for any BMDB pool, for harnesses
// that run their own PostgreSQL (the chaos soak).
func OverlappingClaimsIn(ctx context.Context, pool *pgxpool.Pool) ([]string, error) {
	rows, err := pool.Query(ctx, `
		WITH claims AS (
			SELECT machine_id, history_id, event, session_id,
			       lag(event) OVER w AS prev_event,
			       lag(session_id) OVER w AS prev_session
			FROM work_history
			WHERE event IN ('Started', 'Finished', 'Failed', 'Canceled', 'Expired')
			  AND process IN (SELECT process FROM processes WHERE machine_exclusive)
			WINDOW w AS (PARTITION BY machine_id ORDER BY history_id)
		)
		SELECT machine_id, history_id, event, coalesce(prev_event, '')
		FROM claims
		WHERE (event = 'Started' AND prev_event = 'Started')
		   OR (event <> 'Started' AND (prev_event IS DISTINCT FROM 'Started' OR prev_session IS DISTINCT FROM session_id))
		LIMIT 20`)
	if err != nil {
		return nil, fmt.Errorf("querying work history for overlapping claims: %w", err)
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var m uuid.UUID
		var id int64
		var ev, prev string
		if err := rows.Scan(&m, &id, &ev, &prev); err != nil {
			return nil, fmt.Errorf("reading overlapping claims: %w", err)
		}
		out = append(out, fmt.Sprintf("machine %s: history %d %s after %q", m, id, ev, prev))
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("reading overlapping claims: %w", err)
	}
	return out, nil
}

// History returns machine's history as "Process Event cause" lines, oldest
// first, for tests to compare whole.
func History(t testing.TB, db *DB, machine uuid.UUID) []string {
	t.Helper()
	events, err := db.History(t.Context(), bmdb.HistoryFilter{MachineID: machine})
	if err != nil {
		t.Fatalf("bmdbtest: reading history: %v", err)
	}
	lines := []string{}
	for _, e := range events {
		lines = append(lines, strings.TrimSpace(string(e.Process)+" "+string(e.Event)+" "+e.Cause))
	}
	return lines
}
