// Package servertest runs a real callback server on loopback for tests of
// the server and of its clients (agents, simulated fleets).
package servertest

import (
	"context"
	"testing"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/server"
)

// Start runs a callback server for the test on 127.0.0.1 with a random port
// and, unless cfg names certificate files, a development CA in a temporary
// directory. It stops the server when the test ends and fails the test if
// Run failed. It returns the server and its host:port.
func Start(t testing.TB, db *bmdb.DB, cfg server.Config) (*server.Server, string) {
	t.Helper()
	cfg.Listen = "127.0.0.1:0"
	if cfg.CertFile == "" && cfg.DataDir == "" {
		cfg.DataDir = t.TempDir()
	}
	srv, err := server.New(cfg, db)
	if err != nil {
		t.Fatal(err)
	}
	addr, err := srv.Listen()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("callback server: %v", err)
		}
	})
	return srv, addr.String()
}
