package server

import (
	"context"
	"crypto/ed25519"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/eventually"
)

// A batch holds at most MaxBatch heartbeats: ten queued heartbeats with a
// limit of four are written in three transactions of 4, 4 and 2.
func TestBatchHoldsAtMostMaxBatch(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	const maxBatch, n = 4, 10
	var hbs []bmdb.Heartbeat
	for range n {
		id := bmdbtest.AddMachine(t, db, s, "p")
		pub, _, err := ed25519.GenerateKey(nil)
		if err != nil {
			t.Fatal(err)
		}
		err = s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error { return tx.SetAgentStarted(ctx, id, pub) })
		if err != nil {
			t.Fatal(err)
		}
		hbs = append(hbs, bmdb.Heartbeat{MachineID: id, AgentKey: pub})
	}
	reg := prometheus.NewRegistry()
	m, err := newMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	b := newBatcher(db.DB, maxBatch, 1, 10*time.Second, m, func() { t.Error("a batch failed") })
	type answer struct {
		res bmdb.HeartbeatResult
		err error
	}
	answers := make(chan answer, n)
	for _, hb := range hbs {
		go func() {
			res, err := b.submit(t.Context(), hb, true, false)
			answers <- answer{res, err}
		}()
	}
	// All are queued before the flusher starts, so it could take them all.
	eventually.Holds(t, 10*time.Second, "every heartbeat is queued", func(context.Context) (bool, error) {
		return len(b.verified) == n, nil
	})
	ctx, stop := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() {
		defer close(done)
		b.run(ctx)
	}()
	for range n {
		if a := <-answers; a.err != nil || !a.res.Accepted {
			t.Errorf("heartbeat: %+v, %v; want accepted", a.res, a.err)
		}
	}
	stop()
	<-done

	// A transaction writes its heartbeats at one database time.
	rows, err := db.Pool.Query(t.Context(), `SELECT count(*) FROM machine_agent_heartbeat GROUP BY agent_heartbeat_at ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	var sizes []int
	for rows.Next() {
		var k int
		if err := rows.Scan(&k); err != nil {
			t.Fatal(err)
		}
		sizes = append(sizes, k)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if want := []int{2, 4, 4}; !slices.Equal(sizes, want) {
		t.Errorf("heartbeats per transaction %v, want %v", sizes, want)
	}
	if count, sum := histogram(t, reg, "shepherd_server_heartbeat_batch_size"); count != 3 || sum != n {
		t.Errorf("batch size histogram: %d batches of %v heartbeats, want 3 of %d", count, sum, n)
	}
}

// histogram returns the sample count and sum of the histogram name.
func histogram(t *testing.T, reg *prometheus.Registry, name string) (uint64, float64) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			h := mf.GetMetric()[0].GetHistogram()
			return h.GetSampleCount(), h.GetSampleSum()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0, 0
}
