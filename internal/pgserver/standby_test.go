package pgserver

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/internal/eventually"
)

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
	eventually.Holds(t, 30*time.Second, "standby is the primary's synchronous standby", func(ctx context.Context) (bool, error) {
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
	eventually.Holds(t, 30*time.Second, "row replicated", func(ctx context.Context) (bool, error) {
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

// TestSyncPairFailoverAndResync starts a synchronous pair, writes through
// the multi-host TCP URL, loses the primary and promotes the standby, then
// gives the promoted server a new standby and makes it synchronous again:
// a commit then waits for that standby (it is seen waiting on SyncRep while
// the standby is down) until synchronous replication is turned off.
func TestSyncPairFailoverAndResync(t *testing.T) {
	requirePostgres(t)
	parent := clusterParent(t)
	primary, standby, err := StartSyncPair(t.Context(), parent)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []*Server{standby, primary} {
		t.Cleanup(func() {
			if err := s.Close(); err != nil {
				t.Error(err)
			}
		})
	}
	// Both are reachable over TCP, the standby read-only.
	if got := queryInt(t, primary.TCPURL(""), "SELECT pg_is_in_recovery()::int"); got != 0 {
		t.Fatal("primary over TCP: in recovery")
	}
	if got := queryInt(t, standby.TCPURL(""), "SELECT pg_is_in_recovery()::int"); got != 1 {
		t.Fatal("standby over TCP: not in recovery")
	}
	if got := queryInt(t, primary.URL(""), "SELECT count(*) FROM pg_stat_replication WHERE application_name = 'standby' AND sync_state = 'sync'"); got != 1 {
		t.Fatalf("StartSyncPair returned with %d synchronous standbys, want 1", got)
	}
	url := MultiHostURL("", primary, standby)
	want := fmt.Sprintf("@127.0.0.1:%d,127.0.0.1:%d/postgres?", primary.Port(), standby.Port())
	if !strings.Contains(url, want) || !strings.Contains(url, "target_session_attrs=read-write") {
		t.Fatalf("MultiHostURL = %q, want it to contain %q and target_session_attrs=read-write", url, want)
	}
	if got := queryInt(t, url, "SELECT current_setting('port')::int"); got != primary.Port() {
		t.Fatalf("MultiHostURL reached port %d before the failover, want the primary's %d", got, primary.Port())
	}
	execSQL(t, url, "CREATE TABLE acked (n int PRIMARY KEY); INSERT INTO acked VALUES (1)")

	if err := primary.StopImmediate(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := standby.Promote(t.Context()); err != nil {
		t.Fatal(err)
	}
	if got := queryInt(t, url, "SELECT current_setting('port')::int"); got != standby.Port() {
		t.Fatalf("MultiHostURL reached port %d after the failover, want the promoted standby's %d", got, standby.Port())
	}
	// The promoted standby did not inherit synchronous replication: its
	// commits do not wait for a standby it does not have.
	if got := queryInt(t, url, "SELECT (current_setting('synchronous_standby_names') = '')::int"); got != 1 {
		t.Fatal("the promoted standby has synchronous_standby_names set")
	}
	execSQL(t, url, "INSERT INTO acked VALUES (2)")

	// Resynchronise. Setting the name first puts it into the
	// postgresql.auto.conf that pg_basebackup copies: the new standby
	// must not inherit it either.
	if err := standby.SetSynchronousStandby(t.Context(), DefaultStandbyName); err != nil {
		t.Fatal(err)
	}
	standby2, err := StartStandby(t.Context(), standby, Config{Dir: filepath.Join(parent, "standby2"), TCP: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := standby2.Close(); err != nil {
			t.Error(err)
		}
	})
	if err := standby.WaitSynchronous(t.Context(), DefaultStandbyName); err != nil {
		t.Fatal(err)
	}
	if got := queryInt(t, standby2.URL(""), "SELECT (current_setting('synchronous_standby_names') = '')::int"); got != 1 {
		t.Fatal("the new standby inherited synchronous_standby_names from its primary")
	}
	url3 := MultiHostURL("", primary, standby, standby2)
	execSQL(t, url3, "INSERT INTO acked VALUES (3)")
	eventually.Holds(t, 30*time.Second, "row 3 on the new standby", func(ctx context.Context) (bool, error) {
		conn, err := pgx.Connect(ctx, standby2.URL(""))
		if err != nil {
			return false, err
		}
		defer conn.Close(context.WithoutCancel(ctx))
		var n int
		err = conn.QueryRow(ctx, "SELECT count(*) FROM acked").Scan(&n)
		return n == 3, err
	})

	// Synchronous indeed: without the standby a commit waits.
	if err := standby2.Stop(t.Context()); err != nil {
		t.Fatal(err)
	}
	committed := make(chan error, 1)
	go func() {
		conn, err := pgx.Connect(t.Context(), url3)
		if err != nil {
			committed <- err
			return
		}
		defer conn.Close(context.Background())
		_, err = conn.Exec(t.Context(), "INSERT INTO acked VALUES (4)")
		committed <- err
	}()
	eventually.Holds(t, 30*time.Second, "a commit waits for the stopped synchronous standby", func(ctx context.Context) (bool, error) {
		select {
		case err := <-committed:
			t.Fatalf("the commit returned without its synchronous standby: %v", err)
		default:
		}
		conn, err := pgx.Connect(ctx, standby.URL(""))
		if err != nil {
			return false, err
		}
		defer conn.Close(context.WithoutCancel(ctx))
		var n int
		err = conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'").Scan(&n)
		return n == 1, err
	})
	// "" turns synchronous replication off and releases the waiting commit.
	if err := standby.SetSynchronousStandby(t.Context(), ""); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-committed:
		if err != nil {
			t.Fatalf("the waiting commit failed: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the waiting commit was not released when synchronous replication was turned off")
	}
	if got := queryInt(t, url3, "SELECT count(*) FROM acked"); got != 4 {
		t.Fatalf("%d rows after the resync, want 4", got)
	}
	if got := MultiHostURL("", startServer(t, Config{})); got != "" {
		t.Errorf("MultiHostURL of a server without TCP = %q, want \"\"", got)
	}
}

// TestSetSynchronousStandbyRejectsCommandLine: a synchronous_standby_names
// given on the command line overrides ALTER SYSTEM, so setting it is
// refused rather than silently ineffective.
func TestSetSynchronousStandbyRejectsCommandLine(t *testing.T) {
	requirePostgres(t)
	s := startServer(t, Config{Settings: map[string]string{"synchronous_standby_names": ""}})
	if err := s.SetSynchronousStandby(t.Context(), "x"); err == nil || !strings.Contains(err.Error(), "Config.Settings") {
		t.Fatalf("SetSynchronousStandby with the setting on the command line: %v", err)
	}
}

func TestDropSyncStandbyNames(t *testing.T) {
	path := filepath.Join(t.TempDir(), "postgresql.auto.conf")
	in := "# Do not edit this file manually!\nsynchronous_standby_names = 'standby'\nprimary_conninfo = 'host=/x port=1'\n  SYNCHRONOUS_STANDBY_NAMES='a'\n"
	if err := os.WriteFile(path, []byte(in), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := dropSyncStandbyNames(path); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if want := "# Do not edit this file manually!\nprimary_conninfo = 'host=/x port=1'\n"; string(got) != want {
		t.Errorf("after dropSyncStandbyNames:\n%s\nwant:\n%s", got, want)
	}
	if err := dropSyncStandbyNames(filepath.Join(t.TempDir(), "missing")); err != nil {
		t.Errorf("a missing file: %v", err)
	}
}
