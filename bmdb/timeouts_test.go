package bmdb_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// TestSilenceTimeouts: without a recoverer the defaults are in force and
// said to be; a recoverer's record replaces them, the last writer winning;
// nonsense is refused.
func TestSilenceTimeouts(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	ctx := t.Context()
	got, err := db.SilenceTimeouts(ctx)
	if err != nil || got != bmdb.DefaultSilenceTimeouts() || !strings.Contains(got.Describe(), "defaults") {
		t.Fatalf("no recoverer ran: %+v (%q), %v; want the defaults", got, got.Describe(), err)
	}
	if err := db.RecordSilenceTimeouts(ctx, "p", "recoverer on a (pid 1)", time.Minute, 2*time.Minute); err != nil {
		t.Fatal(err)
	}
	if err := db.RecordSilenceTimeouts(ctx, "q", "recoverer on b (pid 2)", 0, 3*time.Minute); err != nil {
		t.Fatal(err)
	}
	got, err = db.SilenceTimeouts(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !got.Recorded || got.FirstHeartbeat != bmdb.DefaultFirstHeartbeatTimeout || got.Heartbeat != 3*time.Minute ||
		got.Provider != "q" || got.WrittenBy != "recoverer on b (pid 2)" || got.WrittenAt.IsZero() {
		t.Errorf("after two recoverers: %+v, want the last one's (first heartbeat timeout: the default)", got)
	}
	if d := got.Describe(); !strings.Contains(d, "heartbeat timeout 3m0s") || !strings.Contains(d, "recorded by the recoverer of provider q") {
		t.Errorf("Describe() = %q", d)
	}
	for _, bad := range [][2]time.Duration{{-time.Second, time.Minute}, {time.Minute, time.Microsecond}} {
		if err := db.RecordSilenceTimeouts(ctx, "p", "x", bad[0], bad[1]); err == nil {
			t.Errorf("RecordSilenceTimeouts(%v) accepted", bad)
		}
	}
}

// TestHistoryNewestFirst: NewestFirst pages back from the newest event by
// BeforeID; without it BeforeID gives the events just before, oldest first.
func TestHistoryNewestFirst(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", 0)
	m := bmdbtest.AddMachine(t, db, s, "p")
	db.Exec(t, `INSERT INTO work_history (machine_id, process, event, cause)
		SELECT $1, 'Recovery', 'Failed', 'event ' || g FROM generate_series(1, 25) g`, m)
	all, err := db.History(t.Context(), bmdb.HistoryFilter{MachineID: m})
	if err != nil || len(all) < 25 {
		t.Fatalf("history: %d events, %v", len(all), err)
	}
	n := len(all)
	page, err := db.History(t.Context(), bmdb.HistoryFilter{MachineID: m, NewestFirst: true, Limit: 10})
	if err != nil || len(page) != 10 || page[0].ID != all[n-1].ID || page[9].ID != all[n-10].ID {
		t.Fatalf("newest page: %v, %v", page, err)
	}
	page, err = db.History(t.Context(), bmdb.HistoryFilter{MachineID: m, NewestFirst: true, Limit: 10, BeforeID: page[9].ID})
	if err != nil || len(page) != 10 || page[0].ID != all[n-11].ID {
		t.Fatalf("second page: %v, %v", page, err)
	}
	page, err = db.History(t.Context(), bmdb.HistoryFilter{MachineID: m, Limit: 3, BeforeID: all[5].ID})
	if err != nil || len(page) != 3 || page[0].ID != all[2].ID || page[2].ID != all[4].ID {
		t.Fatalf("the 3 before %d, oldest first: %v, %v", all[5].ID, page, err)
	}
	if _, err := db.History(t.Context(), bmdb.HistoryFilter{MachineID: m, BeforeID: -1}); err == nil {
		t.Error("a negative cursor was accepted")
	}
}

// TestFactStatesNeedFacts: no machine without facts beyond its Provided
// tag is in a state of FactStates, whatever its provider status and agent
// phase, so lists of those states may read the machines with facts only.
func TestFactStatesNeedFacts(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	rows, err := db.Pool.Query(t.Context(), `
		SELECT DISTINCT machine_state(st, ph, false, false, false, false, false, false, false, false, false)
		FROM unnest(ARRAY['Missing', 'Provisioning', 'ProvisioningFailedPermanent', 'Running', 'Stopped', 'Unknown']) st,
		     unnest(ARRAY['AwaitingAgent', 'AwaitingFirstHeartbeat', 'Heartbeating']) ph`)
	if err != nil {
		t.Fatal(err)
	}
	var plain []string
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		plain = append(plain, s)
		if slices.Contains(bmdb.FactStates, bmdb.MachineState(s)) {
			t.Errorf("a machine without facts can be %s, which lists read from the machines with facts only", s)
		}
	}
	if rows.Err() != nil || len(plain) < 4 {
		t.Fatalf("states without facts: %v, %v", plain, rows.Err())
	}
	// Every state is one or the other.
	for _, s := range bmdb.MachineStates() {
		if s != bmdb.StateDecommissioned && !slices.Contains(plain, string(s)) && !slices.Contains(bmdb.FactStates, s) {
			t.Errorf("state %s is neither reachable without facts nor among FactStates", s)
		}
	}
}
