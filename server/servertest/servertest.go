// Package servertest runs a real callback server on loopback for tests of
// the server and of its clients (agents, simulated fleets).
package servertest

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/server"
)

// stopBound is how long stop waits for Run to return: far beyond the
// server's own shutdown bounds, so that only a hang reaches it.
const stopBound = time.Minute

// Start runs a callback server for the test on 127.0.0.1 with a random port
// and, unless cfg names certificate files, a development CA in a temporary
// directory. It stops the server when the test ends and fails the test if
// Run failed. It returns the server and its host:port.
func Start(t testing.TB, db *bmdb.DB, cfg server.Config) (*server.Server, string) {
	t.Helper()
	srv, addr, stop := Run(t, db, cfg)
	t.Cleanup(func() {
		if err := stop(); err != nil {
			t.Errorf("callback server: %v", err)
		}
	})
	return srv, addr
}

// Run starts a server as Start does, for a test that stops it itself and
// checks how: stop ends it and returns Run's error, or an error if Run has
// not returned within a minute. Calling stop again returns the same. The
// server is also stopped when the test ends.
func Run(t testing.TB, db *bmdb.DB, cfg server.Config) (srv *server.Server, addr string, stop func() error) {
	t.Helper()
	cfg.Listen = "127.0.0.1:0"
	if cfg.CertFile == "" && cfg.DataDir == "" {
		cfg.DataDir = t.TempDir()
	}
	srv, err := server.New(cfg, db)
	if err != nil {
		t.Fatal(err)
	}
	a, err := srv.Listen()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	stop = sync.OnceValue(func() error {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				return fmt.Errorf("Run: %w", err)
			}
			return nil
		case <-time.After(stopBound):
			return errors.New("the server did not stop within a minute")
		}
	})
	t.Cleanup(func() { _ = stop() })
	return srv, a.String(), stop
}
