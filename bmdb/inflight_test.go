package bmdb_test

import (
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// TestClaimedMachinesLeaveAgentStartHead: the machines a fleet's workers
// hold for agent start are not read by every next claim (issue 17 item 5).
// The candidate index hands out the longest waiting machine first, and a
// claim does not move a machine's phase, so the machines in flight stayed
// at the head of the range and every claim stepped over all of them: with
// 500 takeovers in parallel about 1.3 ms of PostgreSQL CPU per claim, the
// largest cost of taking over 10,000 machines. A claim now moves its
// machine to the end of the range (where a machine given back unfinished
// waits behind those that waited longer), so what a claim reads does not
// grow with the work in flight.
func TestClaimedMachinesLeaveAgentStartHead(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	const inFlight, free = 500, 4500
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "p", AwaitingAgent: inFlight + free})
	// The fleet's machines became candidates a millisecond apart, so that
	// the order of the range is the order they waited in.
	db.Exec(t, `UPDATE machine_provided p SET agent_phase_since = now() - interval '1 hour' + x.n * interval '1 millisecond'
		FROM (SELECT machine_id, row_number() OVER (ORDER BY machine_id) AS n FROM machine_provided) x
		WHERE x.machine_id = p.machine_id`)
	cands := bmdb.AgentStartCandidates("p")
	s := bmdbtest.Session(t, db, "test", time.Minute)
	held := make(map[uuid.UUID]*bmdb.Work, inFlight)
	var first *bmdb.Work
	for range inFlight {
		w, err := s.Work(t.Context(), bmdb.ProcessAgentStart, cands)
		if err != nil {
			t.Fatalf("claim %d: %v", len(held)+1, err)
		}
		if held[w.MachineID] != nil {
			t.Fatalf("machine %s claimed twice", w.MachineID)
		}
		held[w.MachineID] = w
		if first == nil {
			first = w
		}
	}
	db.Exec(t, "ANALYZE")

	// A claim reads a handful of candidates from the index: the first is
	// free. Stepping over the machines in flight, it read each of them, and
	// probed the work table and the sessions for each.
	for _, generic := range []bool{false, true} {
		plan, err := db.ExplainAnalyzeClaim(t.Context(), s, bmdb.ProcessAgentStart, cands, generic)
		if err != nil {
			t.Fatal(err)
		}
		if n := indexRows(t, plan, "machine_provided_awaiting_agent"); n > 70 {
			t.Errorf("a claim (generic plan: %v) with %d machines in flight read %d candidates:\n%s", generic, inFlight, n, plan)
		}
	}
	plans, err := db.ExplainAnalyzeCandidates(t.Context(), bmdb.ProcessAgentStart, cands)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range plans {
		if p.Statement != "list" {
			continue
		}
		if n := indexRows(t, p.Plan, "machine_provided_awaiting_agent"); n > 70 {
			t.Errorf("listing the first candidate with %d machines in flight read %d candidates:\n%s", inFlight, n, p.Plan)
		}
	}

	// A machine given back unfinished is a candidate again, behind the
	// machines that waited longer.
	if err := first.Cancel(t.Context()); err != nil {
		t.Fatal(err)
	}
	list, err := db.ListCandidates(t.Context(), bmdb.ProcessAgentStart, cands, free+10)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != free+1 || list[free] != first.MachineID {
		t.Fatalf("after the cancel: %d candidates, want the %d never claimed and then the canceled machine %s last", len(list), free, first.MachineID)
	}
	for i, id := range list[:free] {
		if held[id] != nil {
			t.Fatalf("candidate %d is %s, held before, ahead of machines never claimed", i+1, id)
		}
	}
}

var indexScanLine = regexp.MustCompile(`(?:Index (?:Only )?Scan using|Bitmap Index Scan on) (\S+) .*actual time=\S+ rows=(\d+) loops=(\d+)`)

// indexRows is how many index entries of index an EXPLAIN ANALYZE plan's
// scans returned, over all their loops. A plan that reads the index by
// bitmap counts as reading all it returned too.
func indexRows(t *testing.T, plan, index string) int {
	t.Helper()
	found, n := false, 0
	for _, line := range strings.Split(plan, "\n") {
		m := indexScanLine.FindStringSubmatch(line)
		if m == nil || m[1] != index {
			continue
		}
		rows, _ := strconv.Atoi(m[2])
		loops, _ := strconv.Atoi(m[3])
		found, n = true, n+rows*loops
	}
	if !found {
		t.Fatalf("the plan reads no index %s:\n%s", index, plan)
	}
	return n
}
