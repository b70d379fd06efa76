package server_test

import (
	"context"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/server"
)

// Told to stop, the server takes no more connections but lets a heartbeat
// in flight finish, then Run returns nil. A clean run, start to stop, logs
// no warning or error.
func TestStopLetsHeartbeatsInFlightFinish(t *testing.T) {
	t.Parallel()
	var logs syncBuffer
	db := bmdbtest.New(t)
	srv, err := server.New(server.Config{Listen: "127.0.0.1:0", DataDir: t.TempDir(), Logger: slog.New(slog.NewTextHandler(&logs, nil))}, db.DB)
	if err != nil {
		t.Fatal(err)
	}
	addr, err := srv.Listen()
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	t.Cleanup(stop)
	done := make(chan error, 1)
	go func() { done <- srv.Run(ctx) }()
	e := &env{t: t, db: db, s: bmdbtest.Session(t, db, "test", time.Minute), srv: srv, endpoint: addr.String()}
	id, key := e.machine()
	c := e.client(id, key)
	if _, err := e.heartbeat(c, &agentv1.HeartbeatRequest{MachineId: id.String()}); err != nil {
		t.Fatal(err)
	}

	release := blockWrites(t, db)
	answer := make(chan error, 1)
	go func() {
		_, err := e.heartbeat(c, &agentv1.HeartbeatRequest{MachineId: id.String()})
		answer <- err
	}()
	waitForWrites(t, db, 1, answer)
	stop()
	bmdbtest.WaitFor(t, 10*time.Second, "the server stops taking connections", func(context.Context) (bool, error) {
		c, err := net.DialTimeout("tcp", e.endpoint, time.Second)
		if err == nil {
			c.Close()
		}
		return err != nil, nil
	})
	release()
	if err := <-answer; err != nil {
		t.Errorf("heartbeat in flight when the server was told to stop: %v", err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return within 30 s of the stop")
	}
	if !strings.Contains(logs.String(), `msg="callback server stopped"`) {
		t.Errorf("no line saying the server stopped in:\n%s", logs.String())
	}
	for l := range strings.Lines(logs.String()) {
		if strings.Contains(l, "level=WARN") || strings.Contains(l, "level=ERROR") {
			t.Errorf("a clean run logged: %s", l)
		}
	}
}
