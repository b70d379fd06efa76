package bmdb_test

import (
	"context"
	"errors"
	"testing"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

func TestSmoke(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	if db.SchemaVersion() < 1 {
		t.Fatalf("SchemaVersion() = %d", db.SchemaVersion())
	}
	s := bmdbtest.Session(t, db, "test", 0)
	id := bmdbtest.AddMachine(t, db, s, "p")
	w, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"))
	if err != nil {
		t.Fatal(err)
	}
	if w.MachineID != id {
		t.Fatalf("claimed %s, want %s", w.MachineID, id)
	}
	if _, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p")); !errors.Is(err, bmdb.ErrNothingToDo) {
		t.Fatalf("second Work: %v", err)
	}
	if err := w.Finish(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		return tx.SetAgentStarted(ctx, id, make([]byte, 32))
	}); err != nil {
		t.Fatal(err)
	}
	h, err := db.History(t.Context(), bmdb.HistoryFilter{MachineID: id})
	if err != nil {
		t.Fatal(err)
	}
	if len(h) != 2 || h[0].Event != bmdb.EventStarted || h[1].Event != bmdb.EventFinished {
		t.Fatalf("history = %+v", h)
	}
	pm, err := db.GetProvided(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	if pm.AgentPhase != bmdb.AgentPhaseAwaitingFirstHeartbeat {
		t.Fatalf("phase %s", pm.AgentPhase)
	}
}
