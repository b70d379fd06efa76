package sim_test

import (
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/provider/sim"
)

// TestSharedKeyScale adopts 2,000 machines recorded in the BMDB and checks
// that they all heartbeat, with goroutines bounded by the fleet's worker
// pool and connection count rather than by its size. It does not run in
// parallel with other tests, so the goroutine count is this test's own.
func TestSharedKeyScale(t *testing.T) {
	const n = 2000
	e := newEnv(t, time.Second)
	f := newFleet(t, sim.Config{Machines: n, SharedAgentKey: true})

	ids := make([]string, n)
	slots := make([]string, n)
	adoptions := make([]sim.Adoption, n)
	for i := range n {
		ids[i], slots[i] = uuid.NewString(), slotID(i+1)
		adoptions[i] = sim.Adoption{ProviderID: slots[i], MachineID: ids[i]}
	}
	key, err := f.Adopt(e.endpoint, e.ca, adoptions)
	if err != nil {
		t.Fatalf("Adopt: %v", err)
	}
	if len(key) != 32 {
		t.Fatalf("Adopt returned a %d-byte key", len(key))
	}
	// One transaction of set-based statements: adding 2,000 machines one
	// by one through the API would dominate the test.
	ctx := testCtx(t)
	tx, err := e.db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	for _, q := range []struct {
		sql  string
		args []any
	}{
		{`INSERT INTO machines (machine_id) SELECT unnest($1::uuid[])`, []any{ids}},
		{`INSERT INTO machine_provided (machine_id, provider, provider_id, provider_status, provider_status_at)
		  SELECT m.id, $3, m.pid, 'Running', now() FROM unnest($1::uuid[], $2::text[]) AS m(id, pid)`, []any{ids, slots, f.Name()}},
		{`INSERT INTO machine_agent_started (machine_id, agent_started_at, agent_public_key)
		  SELECT unnest($1::uuid[]), now(), $2`, []any{ids, []byte(key)}},
	} {
		if _, err := tx.Exec(ctx, q.sql, q.args...); err != nil {
			t.Fatalf("%s: %v", q.sql, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	base := runtime.NumGoroutine()
	start := time.Now()
	run(t, f)
	peak := 0
	count := func(ctx context.Context) (int, error) {
		peak = max(peak, runtime.NumGoroutine())
		var got int
		err := e.db.Pool.QueryRow(ctx, `
			SELECT count(*) FROM machine_agent_heartbeat h JOIN machine_provided p USING (machine_id)
			WHERE p.provider = $1`, f.Name()).Scan(&got)
		return got, err
	}
	bmdbtest.WaitFor(t, 2*time.Minute, "every adopted machine heartbeats", func(ctx context.Context) (bool, error) {
		got, err := count(ctx)
		return got == n, err
	})
	t.Logf("%d machines heartbeating after %s", n, time.Since(start).Round(time.Millisecond))
	// Steady state: another full round at the server's 1 s interval.
	round := time.Now()
	bmdbtest.WaitFor(t, time.Minute, "a second round of heartbeats", func(ctx context.Context) (bool, error) {
		_, err := count(ctx)
		var old int
		if err == nil {
			err = e.db.Pool.QueryRow(ctx, `
				SELECT count(*) FROM machine_agent_heartbeat h JOIN machine_provided p USING (machine_id)
				WHERE p.provider = $1 AND h.agent_heartbeat_at < $2`, f.Name(), round).Scan(&old)
		}
		return err == nil && old == 0, err
	})
	st := f.Stats()
	t.Logf("goroutines: %d before Run, peak %d; stats %+v", base, peak, st)
	if peak >= 300 {
		t.Errorf("%d goroutines while %d agents ran, want < 300", peak, n)
	}
	if st.AgentsRunning != n || st.Used != n || st.HeartbeatsOK < 2*n {
		t.Errorf("Stats() = %+v, want %d agents and >= %d heartbeats", st, n, 2*n)
	}
	for _, id := range []string{slots[0], slots[n-1]} {
		if f.LastHeartbeat(id).IsZero() {
			t.Errorf("LastHeartbeat(%s) is zero", id)
		}
	}
}

// TestAdoptNeedsSharedKey checks that Adopt refuses per-key fleets and bad
// input, adopting nothing.
func TestAdoptNeedsSharedKey(t *testing.T) {
	t.Parallel()
	f := newFleet(t, sim.Config{Machines: 2})
	if _, err := f.Adopt("127.0.0.1:7443", nil, []sim.Adoption{{slotID(1), uuid.NewString()}}); err == nil {
		t.Error("Adopt without SharedAgentKey succeeded")
	}
	s := newFleet(t, sim.Config{Machines: 2, SharedAgentKey: true})
	for name, tc := range map[string]struct {
		endpoint string
		m        sim.Adoption
	}{
		"unknown slot":    {"127.0.0.1:7443", sim.Adoption{"sim-000009", uuid.NewString()}},
		"machine id":      {"127.0.0.1:7443", sim.Adoption{slotID(1), "x"}},
		"bad endpoint":    {"127.0.0.1", sim.Adoption{slotID(1), uuid.NewString()}},
		"endpoint port 0": {"127.0.0.1:0", sim.Adoption{slotID(1), uuid.NewString()}},
	} {
		if _, err := s.Adopt(tc.endpoint, nil, []sim.Adoption{{slotID(2), uuid.NewString()}, tc.m}); err == nil {
			t.Errorf("%s: Adopt succeeded", name)
		}
	}
	if st := s.Stats(); st.Used != 0 || st.AgentsRunning != 0 {
		t.Errorf("Stats() = %+v after failed adoptions, want nothing used", st)
	}
}
