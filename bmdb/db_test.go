package bmdb_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

func TestOpenMigratesConcurrently(t *testing.T) {
	t.Parallel()
	url := bmdbtest.NewEmptyDatabase(t)

	// An empty database is refused when migrations are skipped.
	_, err := bmdb.Open(t.Context(), bmdb.Config{URL: url, Schema: bmdb.SchemaRequireCurrent})
	if err == nil || !strings.Contains(err.Error(), "shepherd migrate up") {
		t.Fatalf("Open without migrations on an empty database: %v, want advice to migrate", err)
	}

	// Several processes starting at once all migrate the same database.
	var g errgroup.Group
	versions := make([]int64, 4)
	for i := range versions {
		g.Go(func() error {
			db, err := bmdb.Open(t.Context(), bmdb.Config{URL: url})
			if err != nil {
				return err
			}
			defer db.Close()
			versions[i] = db.SchemaVersion()
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatalf("concurrent Open: %v", err)
	}
	for _, v := range versions {
		if v != versions[0] || v < 1 {
			t.Fatalf("schema versions %v, want the same positive version everywhere", versions)
		}
	}
	db, err := bmdb.Open(t.Context(), bmdb.Config{URL: url, Schema: bmdb.SchemaRequireCurrent})
	if err != nil {
		t.Fatalf("Open without migrations on a migrated database: %v", err)
	}
	defer db.Close()
	st, err := db.MigrationStatus(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if len(st) == 0 || st[len(st)-1].Version != versions[0] {
		t.Fatalf("migration status %+v, want the last at version %d", st, versions[0])
	}
	for _, m := range st {
		if !m.Applied || m.AppliedAt.IsZero() {
			t.Errorf("migration %d (%s) not applied", m.Version, m.Name)
		}
	}
}

func TestOpenRejectsBadConfig(t *testing.T) {
	t.Parallel()
	for name, cfg := range map[string]bmdb.Config{
		"no url":            {},
		"negative conns":    {URL: "postgres://x@localhost/db", MaxConns: -1},
		"negative hb conns": {URL: "postgres://x@localhost/db", HeartbeatConns: -1},
		"garbage url":       {URL: "postgres://user:s3cret@[::1"},
		"unreachable host":  {URL: "postgres://user:s3cret@127.0.0.1:1/db?connect_timeout=2"},
	} {
		_, err := bmdb.Open(t.Context(), cfg)
		if err == nil {
			t.Errorf("%s: Open succeeded", name)
			continue
		}
		if strings.Contains(err.Error(), "s3cret") {
			t.Errorf("%s: error leaks the password: %v", name, err)
		}
	}
}

func TestMetricsRegistry(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	db := bmdbtest.NewWithConfig(t, bmdb.Config{Registerer: reg})
	// A second DB on the same registry would double-count: refused.
	if _, err := bmdb.Open(t.Context(), bmdb.Config{URL: db.URL, Registerer: reg}); err == nil {
		t.Error("a second DB registered its metrics on the same registry")
	}
	s := bmdbtest.Session(t, db, "test", time.Minute)
	for range 3 {
		bmdbtest.AddMachine(t, db, s, "p")
	}
	for i := range 3 {
		w, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"))
		if err != nil {
			t.Fatal(err)
		}
		switch i {
		case 0:
			err = w.Finish(t.Context(), nil)
		case 1:
			_, err = w.Fail(t.Context(), bmdb.BackoffPolicy{Initial: time.Hour, MaxAttempts: 1}, "boom")
		case 2:
			err = w.Cancel(t.Context())
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	want := map[string]float64{
		`shepherd_bmdb_work_started_total{process="AgentStart"}`:                   3,
		`shepherd_bmdb_work_ended_total{process="AgentStart",result="finished"}`:   1,
		`shepherd_bmdb_work_ended_total{process="AgentStart",result="failed"}`:     1,
		`shepherd_bmdb_work_ended_total{process="AgentStart",result="canceled"}`:   1,
		`shepherd_bmdb_work_quarantined_total{process="AgentStart"}`:               1,
		`shepherd_bmdb_work_started_total{process="Recovery"}`:                     0,
		`shepherd_bmdb_sessions_started_total{component="test"}`:                   1,
		`shepherd_bmdb_sessions_open{component="test"}`:                            1,
		`shepherd_bmdb_transaction_retries_total{sqlstate="40001"}`:                0,
		`shepherd_bmdb_work_claim_conflicts_total{process="AgentStart"}`:           0,
		`shepherd_bmdb_work_ended_total{process="Decommission",result="finished"}`: 0,
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+`="`+l.GetValue()+`"`)
			}
			key := mf.GetName() + "{" + strings.Join(labels, ",") + "}"
			got[key] = m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
		if mf.GetHelp() == "" {
			t.Errorf("metric %s has no help text", mf.GetName())
		}
	}
	for k, v := range want {
		g, ok := got[k]
		if !ok {
			t.Errorf("series %s missing", k)
		} else if g != v {
			t.Errorf("%s = %v, want %v", k, g, v)
		}
	}
}

func TestHistoryQueries(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	a := bmdbtest.AddMachine(t, db, s, "p")
	b := bmdbtest.AddMachine(t, db, s, "p")
	// Each machine: AgentStart Started, Finished; then Recovery for a.
	for range 2 {
		w, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"))
		if err != nil {
			t.Fatal(err)
		}
		if err := w.Finish(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
			return tx.SetAgentStarted(ctx, w.MachineID, make([]byte, 32))
		}); err != nil {
			t.Fatal(err)
		}
	}
	db.Exec(t, "UPDATE machine_agent_started SET agent_started_at = now() - interval '2 hours' WHERE machine_id = $1", a)
	db.Exec(t, "UPDATE machine_provided SET agent_phase_since = now() - interval '2 hours' WHERE machine_id = $1", a)
	w, err := s.Work(t.Context(), bmdb.ProcessRecovery, bmdb.RecoveryCandidates("p", 0, 0))
	if err != nil || w.MachineID != a {
		t.Fatalf("Work(Recovery) = %v, %v; want machine %s", w, err, a)
	}
	if _, err := w.Fail(t.Context(), bmdb.RecoveryBackoff(), "reboot: provider said 503"); err != nil {
		t.Fatal(err)
	}
	// Backdate b's history to check time ranges.
	db.Exec(t, "UPDATE work_history SET at = at - interval '1 day' WHERE machine_id = $1", b)

	count := func(f bmdb.HistoryFilter) int {
		t.Helper()
		h, err := db.History(t.Context(), f)
		if err != nil {
			t.Fatal(err)
		}
		return len(h)
	}
	cases := []struct {
		name string
		f    bmdb.HistoryFilter
		want int
	}{
		{"all", bmdb.HistoryFilter{}, 6},
		{"machine a", bmdb.HistoryFilter{MachineID: a}, 4},
		{"machine b", bmdb.HistoryFilter{MachineID: b}, 2},
		{"recovery", bmdb.HistoryFilter{Process: bmdb.ProcessRecovery}, 2},
		{"a, agent start", bmdb.HistoryFilter{MachineID: a, Process: bmdb.ProcessAgentStart}, 2},
		{"last hour", bmdb.HistoryFilter{Since: time.Now().Add(-time.Hour)}, 4},
		{"before an hour ago", bmdb.HistoryFilter{Until: time.Now().Add(-time.Hour)}, 2},
		{"page of 5", bmdb.HistoryFilter{Limit: 5}, 5},
	}
	for _, c := range cases {
		if got := count(c.f); got != c.want {
			t.Errorf("%s: %d rows, want %d", c.name, got, c.want)
		}
	}
	if _, err := db.History(t.Context(), bmdb.HistoryFilter{Limit: -1}); err == nil {
		t.Error("negative limit accepted")
	}

	// Export pages through everything as JSON lines.
	var buf bytes.Buffer
	n, err := db.ExportHistory(t.Context(), &buf, bmdb.HistoryFilter{Limit: 2})
	if err != nil || n != 6 {
		t.Fatalf("ExportHistory() = %d, %v; want 6 rows", n, err)
	}
	sc := bufio.NewScanner(&buf)
	var lastID int64
	lines := 0
	for sc.Scan() {
		var e bmdb.HistoryEvent
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			t.Fatalf("line %d: %v: %s", lines+1, err, sc.Text())
		}
		if e.ID <= lastID {
			t.Errorf("line %d: id %d after %d", lines+1, e.ID, lastID)
		}
		lastID = e.ID
		if e.Event == bmdb.EventFailed && e.Cause != "reboot: provider said 503" {
			t.Errorf("Failed row lost its cause: %+v", e)
		}
		if e.SessionID == nil || *e.SessionID != s.ID() {
			t.Errorf("row %d does not name the session", e.ID)
		}
		lines++
	}
	if lines != 6 {
		t.Errorf("%d lines exported, want 6", lines)
	}
	_, err = db.ExportHistory(t.Context(), failingWriter{}, bmdb.HistoryFilter{})
	if err == nil {
		t.Error("ExportHistory ignored a write error")
	}
}

type failingWriter struct{}

func (failingWriter) Write([]byte) (int, error) { return 0, errors.New("disk full") }

// TestOpenEncodesUUIDsAsBytes: both of Open's pools encode uuid.UUID
// parameters as bytes (uuidencode.go), the heartbeat pool included.
func TestOpenEncodesUUIDsAsBytes(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	ok, err := db.EncodesUUIDsAsBytes(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if !ok {
		t.Error("a pool's connections encode uuid.UUID through its database/sql string")
	}
}
