package pgserver

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// waitFor polls cond every 20 ms until it reports true, failing the test
// with what and the last error once timeout has passed.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func(ctx context.Context) (bool, error)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), timeout)
	defer cancel()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		ok, err := cond(ctx)
		if ok {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s: still false after %s (last error: %v)", what, timeout, err)
		case <-tick.C:
		}
	}
}

// TestStandbyFailover starts a primary with a synchronous standby, checks
// that a committed row is on the standby as soon as the commit returns,
// then loses the primary, promotes the standby and writes through a
// multi-host connection string that named the primary first.
func TestStandbyFailover(t *testing.T) {
	requirePostgres(t)
	parent := clusterParent(t)
	primary := startServer(t, Config{
		Dir: filepath.Join(parent, "primary"),
		Settings: map[string]string{
			"synchronous_commit":        "on",
			"synchronous_standby_names": "standby",
		},
	})
	standby, err := StartStandby(t.Context(), primary, Config{Dir: filepath.Join(parent, "standby")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := standby.Close(); err != nil {
			t.Error(err)
		}
	})
	if got := queryInt(t, standby.URL(""), "SELECT pg_is_in_recovery()::int"); got != 1 {
		t.Fatalf("standby: pg_is_in_recovery = %d, want 1", got)
	}
	waitFor(t, 30*time.Second, "standby is the primary's synchronous standby", func(ctx context.Context) (bool, error) {
		conn, err := pgx.Connect(ctx, primary.URL(""))
		if err != nil {
			return false, err
		}
		defer conn.Close(context.WithoutCancel(ctx))
		var n int
		err = conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_replication WHERE application_name = 'standby' AND sync_state = 'sync'").Scan(&n)
		return n == 1, err
	})

	// With synchronous_commit=on the commit returns only once the standby
	// has flushed it; remote_apply would be needed to also see it there at
	// once, so poll for visibility, but the row must survive the failover.
	execSQL(t, primary.URL(""), "CREATE TABLE acked (n int PRIMARY KEY); INSERT INTO acked VALUES (1)")
	waitFor(t, 30*time.Second, "row replicated", func(ctx context.Context) (bool, error) {
		conn, err := pgx.Connect(ctx, standby.URL(""))
		if err != nil {
			return false, err
		}
		defer conn.Close(context.WithoutCancel(ctx))
		var n int
		err = conn.QueryRow(ctx, "SELECT count(*) FROM acked").Scan(&n)
		return n == 1, err
	})

	dsn := MultiHostDSN("", primary, standby)
	if want := "target_session_attrs=read-write"; !strings.Contains(dsn, want) {
		t.Fatalf("MultiHostDSN = %q, want it to contain %q", dsn, want)
	}
	if got := queryInt(t, dsn, "SELECT current_setting('port')::int"); got != primary.Port() {
		t.Fatalf("multi-host DSN reached port %d before the failover, want the primary", got)
	}
	if got := queryInt(t, dsn, "SELECT pg_is_in_recovery()::int"); got != 0 {
		t.Fatal("multi-host DSN reached a server in recovery")
	}

	if err := primary.StopImmediate(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := standby.Promote(t.Context()); err != nil {
		t.Fatal(err)
	}
	if got := queryInt(t, dsn, "SELECT pg_is_in_recovery()::int"); got != 0 {
		t.Fatal("after the promotion the multi-host DSN reached a server in recovery")
	}
	execSQL(t, dsn, "INSERT INTO acked VALUES (2)")
	if got := queryInt(t, standby.URL(""), "SELECT count(*) FROM acked"); got != 2 {
		t.Fatalf("promoted standby has %d rows, want 2", got)
	}
	// Promoting a server that is no longer a standby fails.
	if err := standby.Promote(t.Context()); err == nil {
		t.Fatal("promoting a primary succeeded")
	}
	if err := primary.StopImmediate(t.Context()); err != nil {
		t.Fatalf("StopImmediate of a stopped server: %v", err)
	}
}
