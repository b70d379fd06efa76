package main

import (
	"context"
	"log/slog"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/tcpproxy"
)

// behindProxy returns a fresh database's URL through a TCP proxy the test
// controls.
func behindProxy(t *testing.T) (string, *tcpproxy.Proxy) {
	t.Helper()
	return bmdbtest.NewProxiedDatabase(t)
}

// A long-running command started while its database cannot be reached
// waits for it instead of exiting, and comes up when it answers.
func TestOpenObservedWaitsForTheDatabase(t *testing.T) {
	t.Parallel()
	dbURL, proxy := behindProxy(t)
	proxy.SetMode(tcpproxy.Reset)
	var logs lockedBuffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	f := databaseFlags{url: dbURL}
	type result struct {
		schema int64
		err    error
	}
	done := make(chan result, 1)
	go func() {
		d, err := f.openObserved(t.Context(), newRegistry(), log)
		if err != nil {
			done <- result{err: err}
			return
		}
		defer d.Close()
		done <- result{schema: d.SchemaVersion()}
	}()
	bmdbtest.WaitFor(t, 30*time.Second, "a logged wait for the database", func(context.Context) (bool, error) {
		select {
		case r := <-done:
			t.Fatalf("openObserved returned while the database was unreachable: %+v", r)
		default:
		}
		return strings.Count(logs.String(), "waiting for it") >= 2, nil
	})
	proxy.SetMode(tcpproxy.Pass)
	select {
	case r := <-done:
		if r.err != nil || r.schema == 0 {
			t.Fatalf("once the database answered: schema %d, err %v", r.schema, r.err)
		}
	case <-time.After(time.Minute):
		t.Fatal("openObserved did not return within a minute of the database answering")
	}
}

// A configuration error is not waited out: the operator has to fix it.
func TestOpenObservedFailsFastOnConfiguration(t *testing.T) {
	t.Parallel()
	u, err := url.Parse(bmdbtest.NewDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/no_such_database_here"
	f := databaseFlags{url: u.String()}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	_, err = f.openObserved(ctx, newRegistry(), slog.New(slog.DiscardHandler))
	if err == nil || ctx.Err() != nil || !strings.Contains(err.Error(), "no_such_database_here") {
		t.Fatalf("opening a database that does not exist: %v (context: %v), want a prompt error naming it", err, ctx.Err())
	}
}

// Cancelling the wait (SIGTERM while the database is down) ends it with
// the last error.
func TestOpenObservedStopsWaitingOnCancel(t *testing.T) {
	t.Parallel()
	dbURL, proxy := behindProxy(t)
	proxy.SetMode(tcpproxy.Reset)
	ctx, cancel := context.WithCancel(t.Context())
	var logs lockedBuffer
	done := make(chan error, 1)
	go func() {
		_, err := (&databaseFlags{url: dbURL}).openObserved(ctx, newRegistry(), slog.New(slog.NewTextHandler(&logs, nil)))
		done <- err
	}()
	bmdbtest.WaitFor(t, 30*time.Second, "a logged wait for the database", func(context.Context) (bool, error) {
		return strings.Contains(logs.String(), "waiting for it"), nil
	})
	cancel()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "waiting for the database") {
			t.Fatalf("cancelled wait: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("openObserved kept waiting after its context ended")
	}
}
