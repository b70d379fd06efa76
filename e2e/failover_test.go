package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/metricstest"
	"github.com/shepherd/shepherd/internal/pgserver"
)

// sessionComponents are the components of `shepherd run --components all`
// that hold a BMDB session, sorted.
var sessionComponents = []string{"decommissioner", "initializer", "janitor", "provisioner", "recoverer", "server", "updater"}

// failoverSnapshot is what the primary had committed when it was lost.
type failoverSnapshot struct {
	history    []int64                 // work_history ids
	heartbeats map[uuid.UUID]time.Time // each machine's last heartbeat
	sessions   map[uuid.UUID]string    // live sessions: id -> component
	work       []heldWork              // work in flight
}

type heldWork struct {
	machine uuid.UUID
	process string
	session uuid.UUID
}

// TestFailover runs `shepherd run --components all` on a simulated fleet
// against a primary with a synchronous standby, through a keyword
// connection string naming both (host=a,b port=p1,p2
// target_session_attrs=read-write; bmdb's TestFailover tests the URL
// form). Once the fleet is Healthy it loses the primary (immediate stop),
// keeps the database away until every component has lost its session, and
// promotes the standby. The same process must carry on by itself: it does
// not exit, every component opens a new session on the promoted server,
// work of the lost sessions expires, the fleet is Healthy again (fresh
// heartbeats) within a bound, and everything the primary had committed is
// on the promoted server.
func TestFailover(t *testing.T) {
	t.Parallel()
	const (
		machines         = 20
		heartbeatTimeout = 5 * time.Second
		recoveryBound    = 30 * time.Second
	)
	parent, err := os.MkdirTemp("", "shepherd-e2e-failover-")
	if err != nil {
		t.Fatal(err)
	}
	// The postgres OS user (when we are root) must traverse it.
	if err := os.Chmod(parent, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(parent) })
	primary, standby, err := pgserver.StartSyncPair(t.Context(), parent)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []*pgserver.Server{primary, standby} {
		t.Cleanup(func() {
			if err := s.Close(); err != nil {
				t.Error(err)
			}
		})
	}
	createDatabase(t, primary.TCPURL(""), "shepherd")
	dsn := fmt.Sprintf("host=127.0.0.1,127.0.0.1 port=%d,%d user=%s dbname=shepherd sslmode=disable target_session_attrs=read-write connect_timeout=5",
		primary.Port(), standby.Port(), primary.User())

	// The test's own view, through the same connection string.
	db, err := bmdb.Open(t.Context(), bmdb.Config{URL: dsn})
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(t.Context(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		pool.Close()
		db.Close()
	})
	tdb := &bmdbtest.DB{DB: db, URL: dsn, Pool: pool}

	dir := t.TempDir()
	simConfig, stand := filepath.Join(dir, "sim.yaml"), filepath.Join(dir, "agent-stand-in")
	for name, data := range map[string]string{simConfig: fmt.Sprintf("machines: %d\n", machines), stand: "simulated machines do not run it"} {
		if err := os.WriteFile(name, []byte(data), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	metricsAddr := fmt.Sprintf("127.0.0.1:%d", freePort(t))
	p := startShepherd(t, "run", "--components", "all", "--database-url", dsn, "--data-dir", filepath.Join(dir, "data"),
		"--provider", "sim", "--provider-config", simConfig, "--agent", stand,
		"--server-listen", fmt.Sprintf("127.0.0.1:%d", freePort(t)), "--metrics-listen", metricsAddr,
		"--heartbeat-interval", "1s", "--heartbeat-timeout", heartbeatTimeout.String(), "--first-heartbeat-timeout", "1m",
		"--provisioner-period", "500ms", "--janitor-period", "500ms", "--updater-changing-period", "500ms", "--updater-stable-period", "2s",
		"--log-level", "warn")
	running := func() {
		t.Helper()
		p.exitedEarly(t)
	}
	healthy := func(what string, timeout time.Duration) {
		t.Helper()
		bmdbtest.WaitFor(t, timeout, what, func(ctx context.Context) (bool, error) {
			running()
			st, err := tdb.FleetStates(ctx, "sim", time.Minute, heartbeatTimeout)
			if err != nil {
				return false, err
			}
			return st[bmdb.StateHealthy] == machines, fmt.Errorf("states %v", st)
		})
	}
	healthy("every machine Healthy", time.Minute)
	bmdbtest.WaitFor(t, time.Minute, "a live session of every component", func(ctx context.Context) (bool, error) {
		running()
		var n int
		err := pool.QueryRow(ctx, "SELECT count(DISTINCT component) FROM sessions WHERE closed_at IS NULL AND deadline > now() AND component = ANY($1)",
			sessionComponents).Scan(&n)
		return n == len(sessionComponents), err
	})

	// Work in flight when the primary is lost, held by a session of the
	// test's own with a short lease (the fleet's own work is done by now):
	// after the failover the janitor must expire it. No component works on
	// machines of provider "held".
	holder, err := db.StartSession(t.Context(), bmdb.SessionConfig{Component: "test-holder", Lease: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = holder.Close(context.Background()) })
	err = holder.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		_, err := tx.AddMachine(ctx, bmdb.Provided{Provider: "held", ProviderID: "held-1", Status: bmdb.ProviderStatusRunning})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := holder.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("held")); err != nil {
		t.Fatalf("claiming the held machine: %v", err)
	}

	// What the primary committed, read from it just before it is lost:
	// all of it must survive the failover.
	snap := snapshot(t, primary.TCPURL("shepherd"))
	if err := primary.StopImmediate(t.Context()); err != nil {
		t.Fatal(err)
	}
	stoppedAt := time.Now()
	if len(snap.heartbeats) != machines {
		t.Fatalf("%d machines had heartbeats on the primary, want %d", len(snap.heartbeats), machines)
	}
	// What was in flight when the primary was lost, read from the standby
	// once it has replayed everything it received (with synchronous
	// replication, everything the primary acknowledged).
	bmdbtest.WaitFor(t, 30*time.Second, "the standby replayed all it received", func(ctx context.Context) (bool, error) {
		c, err := pgx.Connect(ctx, standby.TCPURL("shepherd"))
		if err != nil {
			return false, err
		}
		defer c.Close(context.WithoutCancel(ctx))
		var done bool
		err = c.QueryRow(ctx, "SELECT pg_last_wal_receive_lsn() = pg_last_wal_replay_lsn()").Scan(&done)
		return done, err
	})
	atStop := snapshot(t, standby.TCPURL("shepherd"))
	for id, c := range atStop.sessions {
		snap.sessions[id] = c
	}
	snap.work = atStop.work
	if len(snap.work) == 0 {
		t.Fatal("no work in flight when the primary was lost; the test proves nothing about its expiry")
	}
	t.Logf("primary's snapshot: %d history rows, %d heartbeats; at the stop: %d live sessions, %d work items in flight",
		len(snap.history), len(snap.heartbeats), len(snap.sessions), len(snap.work))

	// Keep the database away until every component noticed that its
	// session is lost (a lease, 10 s): then it must make a new one.
	bmdbtest.WaitFor(t, time.Minute, "every component lost its session", func(ctx context.Context) (bool, error) {
		running()
		for _, c := range sessionComponents {
			n, err := metricstest.Scrape(ctx, metricsAddr, `shepherd_bmdb_sessions_lost_total{component="`+c+`"}`)
			if err != nil || n < 1 {
				return false, fmt.Errorf("%s: %v sessions lost (%v)", c, n, err)
			}
		}
		return true, nil
	})
	if err := standby.Promote(t.Context()); err != nil {
		t.Fatal(err)
	}
	promotedAt := time.Now()

	old := make([]uuid.UUID, 0, len(snap.sessions))
	for id := range snap.sessions {
		old = append(old, id)
	}
	bmdbtest.WaitFor(t, recoveryBound, "a new session of every component on the promoted server", func(ctx context.Context) (bool, error) {
		running()
		var got []string
		rows, err := pool.Query(ctx, `SELECT DISTINCT component FROM sessions
			WHERE closed_at IS NULL AND deadline > now() AND NOT session_id = ANY($1) ORDER BY 1`, old)
		if err != nil {
			return false, err
		}
		if got, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
			return false, err
		}
		return slices.Equal(got, sessionComponents), fmt.Errorf("components with a new session: %v", got)
	})
	sessionsBack := time.Since(promotedAt)
	healthy("every machine Healthy again after the failover", recoveryBound)
	healthyBack := time.Since(promotedAt)

	// From here on, check the promoted server directly.
	conn, err := pgx.Connect(t.Context(), standby.TCPURL("shepherd"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var inRecovery bool
	if err := conn.QueryRow(t.Context(), "SELECT pg_is_in_recovery()").Scan(&inRecovery); err != nil || inRecovery {
		t.Fatalf("promoted standby: in recovery = %v, %v", inRecovery, err)
	}
	count := func(what, sql string, args ...any) int {
		t.Helper()
		var n int
		if err := conn.QueryRow(t.Context(), sql, args...).Scan(&n); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		return n
	}
	// Synchronous replication: nothing the primary committed is lost.
	if n := count("history", `SELECT count(*) FROM unnest($1::bigint[]) AS id
		WHERE NOT EXISTS (SELECT FROM work_history h WHERE h.history_id = id)`, snap.history); n != 0 {
		t.Errorf("%d of %d work_history rows committed on the primary are missing after the failover", n, len(snap.history))
	}
	ids := make([]uuid.UUID, 0, len(snap.heartbeats))
	ats := make([]time.Time, 0, len(snap.heartbeats))
	for id, at := range snap.heartbeats {
		ids = append(ids, id)
		ats = append(ats, at)
	}
	if n := count("heartbeats", `SELECT count(*) FROM unnest($1::uuid[], $2::timestamptz[]) AS s(id, at)
		WHERE NOT EXISTS (SELECT FROM machine_agent_heartbeat h WHERE h.machine_id = s.id AND h.agent_heartbeat_at >= s.at)`, ids, ats); n != 0 {
		t.Errorf("%d of %d machines' last heartbeat went back in time in the failover", n, len(ids))
	}
	if n := count("old sessions", `SELECT count(*) FROM unnest($1::uuid[]) AS id
		WHERE NOT EXISTS (SELECT FROM sessions s WHERE s.session_id = id)`, old); n != 0 {
		t.Errorf("%d of %d sessions live on the primary are missing after the failover", n, len(old))
	}
	if n := count("old sessions alive", "SELECT count(*) FROM sessions WHERE session_id = ANY($1) AND closed_at IS NULL AND deadline > now()", old); n != 0 {
		t.Errorf("%d sessions of before the failover are still alive", n)
	}
	// Nothing stays held by a lost session: its work expired (the janitor,
	// history Expired) and its leases passed on.
	bmdbtest.WaitFor(t, recoveryBound, "work and leases of the lost sessions released", func(ctx context.Context) (bool, error) {
		running()
		var held int
		err := conn.QueryRow(ctx, `SELECT (SELECT count(*) FROM work WHERE session_id = ANY($1))
			+ (SELECT count(*) FROM provider_state WHERE lease_session_id = ANY($1) OR update_lease_session_id = ANY($1))`, old).Scan(&held)
		if err != nil {
			return false, err
		}
		return held == 0, fmt.Errorf("%d work items and leases held by lost sessions", held)
	})
	for _, w := range snap.work {
		if n := count("expired work", `SELECT count(*) FROM work_history
			WHERE machine_id = $1 AND process = $2 AND session_id = $3 AND event = 'Expired'`, w.machine, w.process, w.session); n != 1 {
			t.Errorf("%s of %s, held by lost session %s: %d Expired history rows, want 1", w.process, w.machine, w.session, n)
		}
	}
	running()
	t.Logf("outage (stop to promotion) %s; new sessions %s and fleet Healthy %s after the promotion",
		promotedAt.Sub(stoppedAt).Round(time.Millisecond), sessionsBack.Round(time.Millisecond), healthyBack.Round(time.Millisecond))
}

// createDatabase creates database name through url.
func createDatabase(t *testing.T, url, name string) {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(t.Context(), "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatal(err)
	}
}

// snapshot reads the facts the BMDB at url has committed.
func snapshot(t *testing.T, url string) failoverSnapshot {
	t.Helper()
	conn, err := pgx.Connect(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	// One snapshot of the database for all four.
	tx, err := conn.BeginTx(t.Context(), pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	snap := failoverSnapshot{heartbeats: map[uuid.UUID]time.Time{}, sessions: map[uuid.UUID]string{}}
	rows, err := tx.Query(t.Context(), "SELECT history_id FROM work_history")
	if err == nil {
		snap.history, err = pgx.CollectRows(rows, pgx.RowTo[int64])
	}
	if err != nil {
		t.Fatalf("reading history: %v", err)
	}
	var id uuid.UUID
	var at time.Time
	_, err = pgx.ForEachRow(mustQuery(t, tx, "SELECT machine_id, agent_heartbeat_at FROM machine_agent_heartbeat"), []any{&id, &at}, func() error {
		snap.heartbeats[id] = at
		return nil
	})
	if err != nil {
		t.Fatalf("reading heartbeats: %v", err)
	}
	var component string
	_, err = pgx.ForEachRow(mustQuery(t, tx, "SELECT session_id, component FROM sessions WHERE closed_at IS NULL AND deadline > now()"), []any{&id, &component}, func() error {
		snap.sessions[id] = component
		return nil
	})
	if err != nil {
		t.Fatalf("reading sessions: %v", err)
	}
	var w heldWork
	_, err = pgx.ForEachRow(mustQuery(t, tx, "SELECT machine_id, process, session_id FROM work"), []any{&w.machine, &w.process, &w.session}, func() error {
		snap.work = append(snap.work, w)
		return nil
	})
	if err != nil {
		t.Fatalf("reading work: %v", err)
	}
	return snap
}

func mustQuery(t *testing.T, tx pgx.Tx, sql string) pgx.Rows {
	t.Helper()
	rows, err := tx.Query(t.Context(), sql)
	if err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return rows
}
