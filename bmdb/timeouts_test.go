package bmdb_test

import (
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
