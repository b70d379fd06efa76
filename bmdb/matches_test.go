package bmdb_test

import (
	"testing"
	"time"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// TestMatchesReadsOneMachine: the check a worker makes on the machine it
// holds (is it still a candidate?) reads that machine, not the candidate
// range, even when the planner's statistics are stale in the way a fleet
// provisioned in bulk leaves them. ANALYZE ran while the machines were
// still provisioning, so the planner took the partial candidate index for
// nearly empty and scanned it, filtering on the machine id: in P4's
// 10,000-machine line about 500 buffers and a millisecond per check, and
// the whole range for a claimed machine, which a claim moves to its end.
func TestMatchesReadsOneMachine(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "p", AwaitingAgent: 10_000})
	db.Exec(t, "UPDATE machine_provided SET provider_status = 'Provisioning'")
	db.Exec(t, "ANALYZE machine_provided")
	db.Exec(t, "UPDATE machine_provided SET provider_status = 'Running'")
	cands := bmdb.AgentStartCandidates("p")
	s := bmdbtest.Session(t, db, "test", time.Minute)
	w := claimAndCheckMatches(t, db, s, bmdb.ProcessAgentStart, cands, 20)
	db.Exec(t, "UPDATE machine_provided SET provider_status = 'Stopped' WHERE machine_id = $1", w.MachineID)
	if ok, err := db.Matches(t.Context(), cands, w.MachineID); err != nil || ok {
		t.Errorf("a stopped machine matches the agent-start definition: %v (%v), want false", ok, err)
	}
}

// TestRecoveryMatchesReadsOneMachine: the recoverer's check of the machine
// it holds reads that machine's rows, not the fleet's.
func TestRecoveryMatchesReadsOneMachine(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "p", Healthy: 10_000, Stale: 2_000, NeverHeartbeat: 2_000})
	cands := bmdb.RecoveryCandidates("p", 0, 0)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	for range 2 {
		claimAndCheckMatches(t, db, s, bmdb.ProcessRecovery, cands, 40)
	}
}

// claimAndCheckMatches claims a machine for process under s and checks that
// the Matches check of it touches at most maxBuffers buffers, with a plan
// for the values and with the generic plan, and finds it a candidate.
func claimAndCheckMatches(t *testing.T, db *bmdbtest.DB, s *bmdb.Session, process bmdb.Process, cands bmdb.Candidates, maxBuffers int) *bmdb.Work {
	t.Helper()
	w, err := s.Work(t.Context(), process, cands)
	if err != nil {
		t.Fatal(err)
	}
	for _, generic := range []bool{false, true} {
		plan, err := db.ExplainAnalyzeMatches(t.Context(), cands, w.MachineID, generic)
		if err != nil {
			t.Fatal(err)
		}
		if b := planBuffers(t, plan); b > maxBuffers {
			t.Errorf("%s: the check of one machine (generic plan: %v) touched %d buffers:\n%s", cands, generic, b, plan)
		}
	}
	if ok, err := db.Matches(t.Context(), cands, w.MachineID); err != nil || !ok {
		t.Errorf("%s: the claimed machine matches the definition: %v (%v), want true", cands, ok, err)
	}
	return w
}
