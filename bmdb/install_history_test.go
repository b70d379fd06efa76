package bmdb_test

import (
	"context"
	"crypto/ed25519"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// startedMachine returns a new database with one machine whose agent was
// started with key.
func startedMachine(t *testing.T) (*bmdbtest.DB, uuid.UUID, ed25519.PublicKey) {
	t.Helper()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	f := fixture{t: t, db: db, s: s}
	m := bmdbtest.AddMachine(t, db, s, "p")
	key := newKey(t)
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error { return tx.SetAgentStarted(ctx, m, key) })
	return db, m, key
}

// TestInstallationHistory: every installation's course is in history
// (process Reinstall): the request with its requester, the request handed
// to the agent (once per generation, however many heartbeats carry it),
// and the agent's report (once per outcome, however often it is resent),
// a failure with the agent's error. A new request leaves the earlier
// failure in history, and every view of the request names the same
// requester (issue 13 item 16).
func TestInstallationHistory(t *testing.T) {
	t.Parallel()
	db, m, key := startedMachine(t)
	beat := func(report *bmdb.InstallationReport) bmdb.HeartbeatResult {
		t.Helper()
		res, err := db.RecordHeartbeats(t.Context(), []bmdb.Heartbeat{{MachineID: m, AgentKey: key, Installation: report}})
		if err != nil || len(res) != 1 || !res[0].Accepted {
			t.Fatalf("heartbeat: %+v, %v", res, err)
		}
		return res[0]
	}
	beat(nil)
	if _, err := db.RequestInstallation(t.Context(), m, "alice@ops", []byte("gen1")); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if r := beat(nil); r.Pending == nil || r.Pending.Generation != 1 {
			t.Fatalf("generation 1 not handed to the agent: %+v", r)
		}
	}
	failed := &bmdb.InstallationReport{Generation: 1, Error: "writing image: no space left on device", Raw: []byte("r1")}
	beat(failed)
	beat(failed) // resent: its acknowledgement was lost
	if _, err := db.RequestInstallation(t.Context(), m, "bob (web UI)", []byte("gen2")); err != nil {
		t.Fatal(err)
	}
	beat(nil)
	beat(&bmdb.InstallationReport{Generation: 2, Success: true, Raw: []byte("r2")})
	beat(nil)

	h, err := db.History(t.Context(), bmdb.HistoryFilter{MachineID: m, Process: bmdb.ProcessReinstall})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range h {
		got = append(got, string(e.Event)+": "+e.Cause)
	}
	want := []string{
		"Requested: OS installation generation 1 requested by alice@ops",
		"Installing: OS installation generation 1 (requested by alice@ops) handed to the agent with its heartbeat",
		"InstallFailed: OS installation generation 1 failed, the agent reports: writing image: no space left on device",
		"Requested: OS installation generation 2 requested by bob (web UI)",
		"Installing: OS installation generation 2 (requested by bob (web UI)) handed to the agent with its heartbeat",
		"Installed: OS installation generation 2 installed, the agent reports",
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("installation history (-want +got):\n%s", diff)
	}

	in, err := db.GetInstallation(t.Context(), m)
	if err != nil || in.RequestedBy != "bob (web UI)" || !in.Installed() {
		t.Errorf("installation %+v, %v; want generation 2 requested by bob (web UI), installed", in, err)
	}
	d, err := db.GetMachine(t.Context(), m)
	if err != nil || d.Installation == nil || d.Installation.RequestedBy != "bob (web UI)" {
		t.Errorf("machine detail's installation %+v, %v; want requested by bob (web UI)", d.Installation, err)
	}
	if n := strings.Count(strings.Join(got, "\n"), "InstallFailed"); n != 1 {
		t.Errorf("%d InstallFailed rows, want 1", n)
	}
}

// TestInstallationHandedOnceToHeartbeatsAtOnce: two heartbeats of one
// machine in flight together (an agent's retry while the first is still
// being recorded) both carry the pending request, and history records its
// handing over once.
func TestInstallationHandedOnceToHeartbeatsAtOnce(t *testing.T) {
	t.Parallel()
	db, m, key := startedMachine(t)
	if _, err := db.RequestInstallation(t.Context(), m, "alice@ops", []byte("gen1")); err != nil {
		t.Fatal(err)
	}
	// The first heartbeat is held at its Installing row, after it marked
	// the request delivered; the second starts then and waits behind it.
	gate := bmdbtest.HoldInserts(t, db, "work_history", bmdbtest.BeforeInsert, "NEW.event = 'Installing'")
	results := make(chan []bmdb.HeartbeatResult, 2)
	beat := func() {
		res, err := db.RecordHeartbeats(context.WithoutCancel(t.Context()), []bmdb.Heartbeat{{MachineID: m, AgentKey: key}})
		if err != nil {
			t.Errorf("heartbeat: %v", err)
		}
		results <- res
	}
	go beat()
	gate.WaitHeld(t)
	go beat()
	bmdbtest.WaitFor(t, 60*time.Second, "the second heartbeat waits for the first", func(ctx context.Context) (bool, error) {
		return bmdbtest.LockWaiters(ctx, db)
	})
	gate.Open(t)
	for range 2 {
		res := <-results
		if len(res) != 1 || !res[0].Accepted || res[0].Pending == nil || res[0].Pending.Generation != 1 {
			t.Errorf("heartbeat result %+v, want accepted with generation 1 pending", res)
		}
	}
	h, err := db.History(t.Context(), bmdb.HistoryFilter{MachineID: m, Process: bmdb.ProcessReinstall})
	if err != nil {
		t.Fatal(err)
	}
	var installing int
	for _, e := range h {
		if e.Event == bmdb.EventInstalling {
			installing++
		}
	}
	if installing != 1 {
		t.Errorf("%d Installing rows in history %+v, want 1", installing, h)
	}
}
