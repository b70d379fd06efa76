package bmdb_test

import (
	"context"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

var buffersLine = regexp.MustCompile(`Buffers: shared(?: hit=(\d+))?(?: read=(\d+))?`)

// planBuffers is the number of shared buffers the root of an EXPLAIN
// (ANALYZE, BUFFERS) plan touched: its first Buffers line.
func planBuffers(t *testing.T, plan string) int {
	t.Helper()
	m := buffersLine.FindStringSubmatch(plan)
	if m == nil {
		t.Fatalf("no Buffers line in plan:\n%s", plan)
	}
	hit, _ := strconv.Atoi(m[1])
	read, _ := strconv.Atoi(m[2])
	return hit + read
}

// TestBackedOffMachinesLeaveCandidateRange: machines that wait in backoff
// (or quarantine) are not scanned by the candidate statements (issue 10
// item 20: 50,000 AwaitingAgent machines with all but 10 backed off cost
// 200,000 buffer hits per claim). The statements' buffer counts must not
// grow with the number of held machines, and a machine whose hold ends is a
// candidate again.
func TestBackedOffMachinesLeaveCandidateRange(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	const held = 5000
	// A few machines whose agent never sent a heartbeat failed recovery
	// too: they are held, and silent.
	const heldNeverHeartbeat = 20
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "p", Healthy: 60_000, AwaitingAgent: held + 10, Stale: held + 10,
		NeverHeartbeat: heldNeverHeartbeat, AgentStartHeld: held, RecoveryHeld: held, Decommissioning: held + 10, DecommissionHeld: held})
	db.Exec(t, `INSERT INTO work_backoff (machine_id, process, backoff_until, cause, last_interval_ms, attempts)
		SELECT machine_id, 'Recovery', now() + interval '1 hour', 'test: held', 3600000, 5
		FROM machine_provided WHERE provider = 'p' AND agent_phase = 'AwaitingFirstHeartbeat'`)
	// Quarantines are held too, for good.
	db.Exec(t, `UPDATE work_backoff SET quarantined_at = now() WHERE machine_id IN (
		SELECT machine_id FROM work_backoff ORDER BY machine_id LIMIT 500)`)
	db.Exec(t, "ANALYZE")

	cases := []struct {
		process bmdb.Process
		cands   bmdb.Candidates
	}{
		{bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p")},
		{bmdb.ProcessRecovery, bmdb.RecoveryCandidates("p", 0, 0)},
		// A provider that refuses to release machines backs off every
		// decommission (migration 00020).
		{bmdb.ProcessDecommission, bmdb.DecommissionCandidates("p")},
	}
	for _, c := range cases {
		if n, err := db.CountCandidates(t.Context(), c.process, c.cands); err != nil || n != 10 {
			t.Fatalf("%s: %d candidates (%v), want the 10 that are not held", c.cands, n, err)
		}
		plans, err := db.ExplainAnalyzeCandidates(t.Context(), c.process, c.cands)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range plans {
			// A handful of index pages and the 10 candidates' rows; the
			// held machines would cost thousands.
			if b := planBuffers(t, p.Plan); b > 400 {
				t.Errorf("%s, %s statement touched %d buffers with %d machines held:\n%s", c.cands, p.Statement, b, held, p.Plan)
			}
		}
	}

	// The matching count (the breaker's "silent") still counts held
	// machines: they are silent, whatever backoff they wait in.
	if n, err := db.CountMatching(t.Context(), bmdb.RecoveryCandidates("p", 0, 0)); err != nil || n != held+10+heldNeverHeartbeat {
		t.Errorf("silent machines by tags: %d (%v), want %d", n, err, held+10+heldNeverHeartbeat)
	}
	// It reads the held machines' entries of machine_provided_recovery_held
	// and their rows, the few recent unwatched heartbeats, and the start of
	// each held machine that never sent a heartbeat (about 300 buffers), not
	// each held machine's heartbeat: asked whether each heartbeat is old,
	// the count probed machine_agent_heartbeat once per held machine (4
	// buffers each) or read it whole (1,200 buffers here), and it read
	// machine_agent_started whole to check the start of the machines that
	// never sent one (issue 17 item 4).
	plan, err := db.ExplainAnalyzeMatching(t.Context(), bmdb.RecoveryCandidates("p", 0, 0))
	if err != nil {
		t.Fatal(err)
	}
	if b := planBuffers(t, plan); b > 500 {
		t.Errorf("the matching count touched %d buffers with %d machines held:\n%s", b, held, plan)
	}

	// A hold that ends makes the machine a candidate again, without
	// anything else changing: three backoffs end in a moment.
	db.Exec(t, `UPDATE work_backoff SET backoff_until = now() + interval '300 milliseconds'
		WHERE quarantined_at IS NULL AND machine_id IN (
			SELECT machine_id FROM work_backoff WHERE process = 'AgentStart' AND quarantined_at IS NULL LIMIT 3)`)
	db.Exec(t, `UPDATE work_backoff SET backoff_until = now() + interval '300 milliseconds'
		WHERE quarantined_at IS NULL AND machine_id IN (
			SELECT machine_id FROM work_backoff WHERE process = 'Recovery' AND quarantined_at IS NULL LIMIT 3)`)
	db.Exec(t, `UPDATE work_backoff SET backoff_until = now() + interval '300 milliseconds'
		WHERE quarantined_at IS NULL AND machine_id IN (
			SELECT machine_id FROM work_backoff WHERE process = 'Decommission' AND quarantined_at IS NULL LIMIT 3)`)
	for _, c := range cases {
		bmdbtest.WaitFor(t, 10*time.Second, c.cands.String()+": 13 candidates once three holds end", func(ctx context.Context) (bool, error) {
			n, err := db.CountCandidates(ctx, c.process, c.cands)
			l, lerr := db.ListCandidates(ctx, c.process, c.cands, 100)
			return n == 13 && len(l) == 13, errorsJoin(err, lerr)
		})
	}
	// Claiming takes all of them, and only them.
	s := bmdbtest.Session(t, db, "test", time.Minute)
	for _, c := range cases {
		for i := range 14 {
			w, err := s.Work(t.Context(), c.process, c.cands)
			if i == 13 {
				if err != bmdb.ErrNothingToDo {
					t.Errorf("%s: claim %d: %v, want nothing to do", c.cands, i+1, err)
				}
				break
			}
			if err != nil {
				t.Fatalf("%s: claim %d: %v", c.cands, i+1, err)
			}
			_ = w
		}
	}
}

func errorsJoin(errs ...error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}
