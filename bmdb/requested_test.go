package bmdb_test

import (
	"strings"
	"testing"
	"time"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// TestRequestsWriteHistory: an operator's decommission and installation
// requests are in the machine's audit trail; a repeated decommission
// request changes nothing, history included.
func TestRequestsWriteHistory(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	m := bmdbtest.AddMachine(t, db, s, "p")
	gen, err := db.RequestInstallation(t.Context(), m, "test", []byte("request"))
	if err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := db.RequestDecommission(t.Context(), m, "alice", "disk failed"); err != nil {
			t.Fatal(err)
		}
	}
	h, err := db.History(t.Context(), bmdb.HistoryFilter{MachineID: m})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, e := range h {
		if e.Event == bmdb.EventRequested {
			got = append(got, string(e.Process)+": "+e.Cause)
		}
	}
	want := []string{
		"Reinstall: OS installation generation 1 requested by test",
		"Decommission: decommission requested by alice: disk failed",
	}
	if gen != 1 || strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("Requested history rows (generation %d):\n%s\nwant:\n%s", gen, strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
