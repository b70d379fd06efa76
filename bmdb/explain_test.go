package bmdb_test

import (
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// perMachineTables grow with the fleet: each has a row per machine (or
// several). Scanning one of them whole to find a handful of candidates is the
// bug SPEC §2.2 forbids. work (in-flight claims, bounded by the workers of
// all processes) and machine_decommission_request (open operator requests)
// stay small whatever the fleet size, and the planner may rightly read them
// whole once per query instead of probing them per candidate.
var perMachineTables = []string{
	"machines", "machine_provided", "machine_agent_started", "machine_agent_heartbeat",
	"machine_hardware_report", "machine_os_installation_request", "machine_os_installation_report",
	"machine_ssh_host_key", "work_backoff", "work_history",
}

// candidateIndexes are partial indexes that hold only candidates, so reading
// one of them without an index condition reads only candidates.
var candidateIndexes = []string{
	"machine_provided_awaiting_agent", "machine_provided_awaiting_first_heartbeat", "machine_agent_heartbeat_watched",
	// Machines held by a backoff or quarantine (migration 00014): bounded by
	// the failures in flight, not by the fleet.
	"machine_provided_recovery_held",
}

var scanLine = regexp.MustCompile(`(Seq Scan|Index Scan|Index Only Scan|Bitmap Index Scan|Bitmap Heap Scan)(?: Backward)?(?: using (\S+))? on (\S+)`)

// fullScans returns the scan nodes of plan that read a per-machine table
// without narrowing it down: sequential scans, and index scans that have no
// index condition on an index that is not a candidate index.
func fullScans(plan string) []string {
	lines := strings.Split(plan, "\n")
	var bad []string
	for i, l := range lines {
		m := scanLine.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		kind, index, table := m[1], m[2], m[3]
		if !contains(perMachineTables, table) {
			continue
		}
		if kind == "Bitmap Heap Scan" {
			continue // its Bitmap Index Scan child is checked
		}
		if kind == "Seq Scan" {
			bad = append(bad, strings.TrimSpace(l))
			continue
		}
		if contains(candidateIndexes, index) {
			continue
		}
		// Look for the node's Index Cond among its detail lines, which come
		// before the next node ("->").
		cond := false
		for _, d := range lines[i+1:] {
			if strings.Contains(d, "->") {
				break
			}
			if strings.Contains(d, "Index Cond:") {
				cond = true
				break
			}
		}
		if !cond {
			bad = append(bad, strings.TrimSpace(l))
		}
	}
	return bad
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func TestFullScanDetector(t *testing.T) {
	t.Parallel()
	plan := `Limit  (cost=0.42..8.45 rows=1 width=16)
  ->  Seq Scan on machine_provided p  (cost=0.00..2000.00 rows=100000 width=16)
  ->  Index Only Scan using machine_provided_pkey on machine_provided p2  (cost=0.42..8.44 rows=1 width=16)
  ->  Index Scan using work_pkey on work w  (cost=0.42..8.44 rows=1 width=16)
        Index Cond: (machine_id = p.machine_id)
  ->  Index Only Scan using machine_provided_awaiting_agent on machine_provided p3  (cost=0.42..8.44 rows=1 width=16)
  ->  Seq Scan on processes pr  (cost=0.00..1.05 rows=1 width=16)`
	got := fullScans(plan)
	if len(got) != 2 || !strings.Contains(got[0], "Seq Scan on machine_provided") || !strings.Contains(got[1], "machine_provided_pkey") {
		t.Fatalf("fullScans() = %q, want the seq scan and the condition-less pkey scan of machine_provided", got)
	}
}

// TestCandidatePlansAtScale builds a fleet of 100,000 machines where only a
// few are candidates and checks that no candidate statement scans a
// per-machine table to find them.
func TestCandidatePlansAtScale(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	// 100,000 machines of which only a few are candidates: 40 await their
	// agent, 5 never sent a heartbeat, 10 have gone quiet. 50 more went quiet
	// after a successful installation (their agents are gone for good), and
	// another provider has a thousand machines awaiting their agent.
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "p", Healthy: 99_895, Stale: 10, Installed: 50, AwaitingAgent: 40, NeverHeartbeat: 5})
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "other", AwaitingAgent: 1000})
	// A running fleet also has work in flight, decommission requests, old
	// backoffs and a lot of history.
	holder := bmdbtest.Session(t, db, "holder", time.Minute)
	db.Exec(t, `INSERT INTO work (machine_id, process, machine_exclusive, session_id)
		SELECT machine_id, 'AgentStart', true, $1 FROM machine_agent_heartbeat
		WHERE agent_heartbeat_at > now() - interval '1 minute' ORDER BY machine_id DESC LIMIT 500`, holder.ID())
	db.Exec(t, `INSERT INTO machine_decommission_request (machine_id)
		SELECT machine_id FROM machine_agent_heartbeat
		WHERE agent_heartbeat_at > now() - interval '1 minute' ORDER BY machine_id DESC OFFSET 500 LIMIT 200`)
	db.Exec(t, `INSERT INTO work_backoff (machine_id, process, backoff_until, cause, last_interval_ms, attempts)
		SELECT machine_id, 'Recovery', now() - interval '1 hour', 'old', 60000, 1 FROM machine_provided LIMIT 20000`)
	db.Exec(t, `INSERT INTO work_history (machine_id, process, event, session_id)
		SELECT machine_id, 'AgentStart', 'Finished', NULL FROM machine_provided`)
	db.Exec(t, "ANALYZE")

	cases := []struct {
		process bmdb.Process
		cands   bmdb.Candidates
		want    int64
	}{
		{bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"), 40},
		{bmdb.ProcessRecovery, bmdb.RecoveryCandidates("p", 30*time.Minute, 10*time.Minute), 15},
	}
	for _, c := range cases {
		n, err := db.CountCandidates(t.Context(), c.process, c.cands)
		if err != nil {
			t.Fatal(err)
		}
		if n != c.want {
			t.Errorf("%s: %d candidates, the fleet was built with %d", c.cands, n, c.want)
		}
		plans, err := db.ExplainCandidates(t.Context(), c.process, c.cands)
		if err != nil {
			t.Fatal(err)
		}
		if len(plans) != 3 {
			t.Fatalf("%s: %d plans, want list, count and claim", c.cands, len(plans))
		}
		for _, p := range plans {
			if bad := fullScans(p.Plan); len(bad) > 0 {
				t.Errorf("%s, %s statement: full scans of per-machine tables %q in plan:\n%s", c.cands, p.Statement, bad, p.Plan)
			}
			if !strings.Contains(p.Plan, "machine_provided_awaiting_") {
				t.Errorf("%s, %s statement does not use a candidate index:\n%s", c.cands, p.Statement, p.Plan)
			}
		}
	}

	// The claim works at this size too.
	s := bmdbtest.Session(t, db, "test", time.Minute)
	w, err := s.Work(t.Context(), bmdb.ProcessRecovery, bmdb.RecoveryCandidates("p", 0, 0))
	if err != nil {
		t.Fatal(err)
	}
	if w.MachineID == uuid.Nil {
		t.Fatal("claimed the nil machine")
	}
}
