package main

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/provider/sim"
	"github.com/shepherd/shepherd/web"
)

// TestSilenceJudgedByTheRecoverersTimeouts: a recoverer running with a
// heartbeat timeout of 2 minutes records it in the BMDB, and the CLI and
// the web UI then call a machine whose last heartbeat is 3 minutes old
// Silent, as the recoverer does; before any recoverer ran they judge by
// the defaults (10 minutes: Healthy) and say so.
func TestSilenceJudgedByTheRecoverersTimeouts(t *testing.T) {
	db := bmdbtest.New(t)
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "p", Healthy: 1})
	id := bmdbtest.Scalar[uuid.UUID](t, db, "SELECT machine_id FROM machine_provided")
	db.Exec(t, "UPDATE machine_agent_heartbeat SET agent_heartbeat_at = now() - interval '3 minutes'")

	ui, err := web.New(web.Config{Refresh: -1}, db.DB)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ui.Close)
	page := func(path string) string {
		t.Helper()
		rec := httptest.NewRecorder()
		ui.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
		body, _ := io.ReadAll(rec.Result().Body)
		if rec.Code != http.StatusOK {
			t.Fatalf("GET %s = %d:\n%s", path, rec.Code, body)
		}
		return string(body)
	}
	check := func(wantState, wantSource string) {
		t.Helper()
		out, err := run(t, "machine", "show", id.String(), "--database-url", db.URL)
		if err != nil || !strings.Contains(out, "State:") || !strings.Contains(out, wantSource) {
			t.Fatalf("machine show: %v\n%s", err, out)
		}
		if !strings.Contains(strings.Join(strings.Fields(out), " "), "State: "+wantState+" ") {
			t.Errorf("machine show says another state than %s:\n%s", wantState, out)
		}
		out, err = run(t, "machine", "list", "--state", wantState, "--database-url", db.URL)
		if err != nil || !strings.Contains(out, id.String()) || !strings.Contains(out, wantSource) {
			t.Errorf("machine list --state %s does not list %s: %v\n%s", wantState, id, err, out)
		}
		if body := page("/machines/" + id.String()); !strings.Contains(body, `id="machine-state">`+wantState+`<`) || !strings.Contains(body, wantSource) {
			t.Errorf("the machine page does not call the machine %s (by %q):\n%s", wantState, wantSource, body)
		}
		if body := page("/machines?state=" + wantState); !strings.Contains(body, id.String()) {
			t.Errorf("the web list of %s machines lacks %s:\n%s", wantState, id, body)
		}
		if body := page("/"); !strings.Contains(body, `data-provider="p" data-state="`+wantState+`"><a href="/machines?provider=p&amp;state=`+wantState+`">1</a>`) {
			t.Errorf("the overview does not count the machine as %s:\n%s", wantState, body)
		}
	}
	// No recoverer ever ran: the defaults, said to be defaults.
	check(string(bmdb.StateHealthy), "defaults: no recoverer has recorded")

	// The agent's key is shown one way by the CLI (table and JSON) and the
	// machine page, as the initializer logs it.
	key := bmdb.AgentKeyText(bmdbtest.Scalar[[]byte](t, db, "SELECT agent_public_key FROM machine_agent_started WHERE machine_id = $1", id))
	if len(key) != 44 {
		t.Fatalf("agent key text %q, want 44 characters of base64", key)
	}
	for _, args := range [][]string{{}, {"-o", "json"}} {
		out, err := run(t, append([]string{"machine", "show", id.String(), "--database-url", db.URL}, args...)...)
		if err != nil || !strings.Contains(out, key) {
			t.Errorf("machine show %v lacks the agent key %s: %v\n%s", args, key, err, out)
		}
	}
	if body := page("/machines/" + id.String()); !strings.Contains(body, key) {
		t.Errorf("the machine page lacks the agent key %s", key)
	}

	// A recoverer with a 2-minute heartbeat timeout, for another provider
	// (so that it leaves the machine alone: the timeouts are the fleet's).
	fleet, err := sim.New(sim.Config{Name: "r", Machines: 1})
	if err != nil {
		t.Fatal(err)
	}
	rc, err := manager.NewRecoverer(manager.RecovererConfig{HeartbeatTimeout: 2 * time.Minute, FirstHeartbeatTimeout: 5 * time.Minute},
		db.DB, fleet, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- rc.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("recoverer: %v", err)
		}
	})
	bmdbtest.WaitFor(t, 30*time.Second, "the recoverer records its timeouts", func(ctx context.Context) (bool, error) {
		to, err := db.SilenceTimeouts(ctx)
		return to.Recorded, err
	})
	check(string(bmdb.StateSilent), "heartbeat timeout 2m0s (recorded by the recoverer of provider r")
}
