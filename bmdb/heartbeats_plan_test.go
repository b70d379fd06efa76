package bmdb_test

import (
	"bytes"
	"context"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

var joinFilterLine = regexp.MustCompile(`Rows Removed by Join Filter: (\d+)`)

// TestHeartbeatStatementIsLinearInTheBatch: the statement that records a
// batch of heartbeats must not compare its rows pairwise. PostgreSQL's
// generic plan (the one a busy server's prepared statement settles on)
// knows nothing of the arrays' lengths and joins two CTEs in a nested
// loop; when the result joined the pairs authenticated to the heartbeats
// written, a batch of 744 compared 553,000 pairs, 180 of its 206 ms, and
// PostgreSQL's CPU per heartbeat at 10,000 agents was twice that at 1,000
// (P1). The batch here has every kind of heartbeat: TLS, with a hardware
// report, with an installation report, a datagram and a wrong key.
func TestHeartbeatStatementIsLinearInTheBatch(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	const machines = 600
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "p", Healthy: machines})
	var ids []uuid.UUID
	for _, s := range bmdbtest.Scalar[[]string](t, db, `SELECT array_agg(machine_id::text ORDER BY machine_id) FROM machine_agent_heartbeat`) {
		ids = append(ids, uuid.MustParse(s))
	}
	key := bytes.Repeat([]byte{0xab}, 32) // AddFleet's agent key
	var hbs []bmdb.Heartbeat
	for i, id := range ids {
		hb := bmdb.Heartbeat{MachineID: id, AgentKey: key}
		switch {
		case i < 100:
			hb.Hardware = &bmdb.HardwareReport{Raw: []byte{1}, CPUThreads: 4, MemoryBytes: 1 << 30, DiskCount: 1, DiskBytes: 1 << 40}
		case i < 120:
			hb.Installation = &bmdb.InstallationReport{Generation: 1, Success: true, Raw: []byte{1}}
		case i < 220:
			hb.Counter = int64(i)
		case i < 240:
			hb.AgentKey = bytes.Repeat([]byte{0xcd}, 32)
		}
		hbs = append(hbs, hb)
	}
	plan, err := db.ExplainAnalyzeHeartbeats(t.Context(), hbs)
	if err != nil {
		t.Fatal(err)
	}
	removed := 0
	for _, m := range joinFilterLine.FindAllStringSubmatch(plan, -1) {
		n, _ := strconv.Atoi(m[1])
		removed += n
	}
	// A few rows per heartbeat at most (the 20 installation reports meet
	// each other); pairwise would be hundreds of thousands.
	if removed > 2*len(hbs) {
		t.Errorf("the statement compared %d rows in join filters for a batch of %d:\n%s", removed, len(hbs), plan)
	}
}

// TestHeartbeatsDoNotQueueBehindWorkers: heartbeats are recorded while
// control-loop workers hold every connection of the main pool (P4 at
// 10,000 machines: 500 takeovers in flight on 100 connections made every
// heartbeat batch wait for one, and machines late to heartbeat).
func TestHeartbeatsDoNotQueueBehindWorkers(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	ids, keys := startedMachines(t, db, s, 3)
	release, err := db.HoldConnections(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	var hbs []bmdb.Heartbeat
	for i, id := range ids {
		hbs = append(hbs, bmdb.Heartbeat{MachineID: id, AgentKey: keys[i]})
	}
	res, err := db.RecordHeartbeats(ctx, hbs)
	if err != nil {
		t.Fatalf("recording heartbeats while every worker connection is taken: %v", err)
	}
	for i, r := range res {
		if !r.Accepted {
			t.Errorf("heartbeat %d: %+v, want accepted", i, r)
		}
	}
}
