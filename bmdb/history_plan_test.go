package bmdb_test

import (
	"testing"
	"time"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// TestHistoryFiltersReadBoundedBuffers: a history listing filtered by a
// time range or by a rare process reads about the rows it returns, not the
// whole history. The time range is served by the BRIN index work_history_at
// (migration 00021), which reads whole block ranges (128 pages) at the two
// ends of the range; the process by the btree work_history_process_at.
func TestHistoryFiltersReadBoundedBuffers(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	// 200,000 rows, one a second for 55 hours, appended in time order as
	// history is: about 2,700 heap pages. One row in a thousand is a
	// Decommission, scattered over all of them.
	const rows = 200_000
	base := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	db.Exec(t, `INSERT INTO machines (machine_id) SELECT gen_random_uuid() FROM generate_series(1, 1000)`)
	db.Exec(t, `INSERT INTO work_history (machine_id, process, event, at, session_id)
		SELECT m.machine_id, CASE WHEN i % 1000 = 7 THEN 'Decommission' ELSE 'AgentStart' END, 'Finished',
		       $1::timestamptz + i * interval '1 second', gen_random_uuid()
		FROM generate_series(0, $2::integer - 1) i
		JOIN (SELECT row_number() OVER (ORDER BY machine_id) - 1 AS n, machine_id FROM machines) m ON m.n = i % 1000
		ORDER BY i`, base, rows)
	db.Exec(t, "VACUUM ANALYZE work_history")

	mid := base.Add(rows / 2 * time.Second)
	last := base.Add(rows * time.Second)
	cases := []struct {
		name  string
		f     bmdb.HistoryFilter
		count int
	}{
		{"ten minutes in the middle", bmdb.HistoryFilter{Since: mid, Until: mid.Add(10 * time.Minute)}, 600},
		{"ten minutes in the middle, newest first", bmdb.HistoryFilter{Since: mid, Until: mid.Add(10 * time.Minute), NewestFirst: true}, 600},
		{"the last ten minutes, newest first", bmdb.HistoryFilter{Since: last.Add(-10 * time.Minute), NewestFirst: true}, 600},
		{"a rare process", bmdb.HistoryFilter{Process: bmdb.ProcessDecommission}, rows / 1000},
		{"a rare process in a time range", bmdb.HistoryFilter{Process: bmdb.ProcessDecommission, Since: mid, Until: mid.Add(time.Hour)}, 4},
	}
	for _, c := range cases {
		events, err := db.History(t.Context(), c.f)
		if err != nil {
			t.Fatal(err)
		}
		if len(events) != c.count {
			t.Errorf("%s: %d events, want %d", c.name, len(events), c.count)
		}
		plan, err := db.ExplainAnalyzeHistory(t.Context(), c.f)
		if err != nil {
			t.Fatal(err)
		}
		// The rows' pages (8 for ten minutes, 200 for the process), two
		// block ranges of 128 pages and a few index pages. The whole
		// history is 2,700 pages.
		if b := planBuffers(t, plan); b > 600 {
			t.Errorf("%s: the listing touched %d buffers of a %d-row history:\n%s", c.name, b, rows, plan)
		}
	}
}

// TestHistoryAppendsLeaveTimeIndexAlone checks that the history rows a
// fresh database's first claims write land in an unsummarized range of
// work_history_at (migration 00021), so that appending them writes nothing
// to the index: brin_summarize_range finds the range still to summarize.
// A summarized range would have its summary moved by each row, a WAL
// record per row that the commits wait for.
func TestHistoryAppendsLeaveTimeIndexAlone(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	bmdbtest.AddMachine(t, db, s, "p")
	claimAndFinish(t, s)
	if n := bmdbtest.Scalar[int64](t, db, `SELECT brin_summarize_range('work_history_at', 0)`); n != 1 {
		t.Errorf("brin_summarize_range summarized %d ranges, want 1: the range the history was appended to was summarized already", n)
	}
}
