package bmdb_test

import (
	"context"
	"crypto/ed25519"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

func (f fixture) requestDecommission(id uuid.UUID) {
	f.t.Helper()
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error {
		return tx.RequestDecommission(ctx, id, "ops", "disk on fire")
	})
}

func TestDecommissionCandidates(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	f := fixture{t: t, db: db, s: bmdbtest.Session(t, db, "test", time.Minute)}
	cases := []struct {
		name     string
		provider string
		setup    func(id uuid.UUID)
		want     bool
	}{
		{"no request", "p", nil, false},
		{"requested", "p", f.requestDecommission, true},
		{"requested, other provider", "q", f.requestDecommission, false},
		{"requested, healthy agent", "p", func(id uuid.UUID) {
			f.started(id, time.Hour)
			f.heartbeat(id, time.Minute)
			f.requestDecommission(id)
		}, true},
		{"requested, agent start in progress", "p", func(id uuid.UUID) {
			f.requestDecommission(id)
			f.work(id, bmdb.ProcessAgentStart, false)
		}, false},
		{"requested, agent start of a dead session", "p", func(id uuid.UUID) {
			f.requestDecommission(id)
			f.work(id, bmdb.ProcessAgentStart, true)
		}, true},
		{"requested, provider update does not exclude", "p", func(id uuid.UUID) {
			f.requestDecommission(id)
			f.work(id, bmdb.ProcessProviderUpdate, false)
		}, true},
		{"requested, decommission backed off", "p", func(id uuid.UUID) {
			f.requestDecommission(id)
			f.backoff(id, bmdb.ProcessDecommission, time.Hour, false)
		}, false},
		{"requested, decommission quarantined", "p", func(id uuid.UUID) {
			f.requestDecommission(id)
			f.backoff(id, bmdb.ProcessDecommission, time.Hour, true)
		}, false},
		{"requested, decommission backoff over", "p", func(id uuid.UUID) {
			f.requestDecommission(id)
			f.backoff(id, bmdb.ProcessDecommission, -time.Minute, false)
		}, true},
		// The request takes over the hold of a backoff recorded before it
		// was made (migration 00020).
		{"backed off, then requested", "p", func(id uuid.UUID) {
			f.backoff(id, bmdb.ProcessDecommission, time.Hour, false)
			f.requestDecommission(id)
		}, false},
		{"requested, decommission backoff reset", "p", func(id uuid.UUID) {
			f.requestDecommission(id)
			f.backoff(id, bmdb.ProcessDecommission, time.Hour, false)
			if err := db.ResetBackoff(t.Context(), id, bmdb.ProcessDecommission, "test"); err != nil {
				t.Fatal(err)
			}
		}, true},
		{"requested, recovery quarantine does not exclude", "p", func(id uuid.UUID) {
			f.requestDecommission(id)
			f.backoff(id, bmdb.ProcessRecovery, time.Hour, true)
		}, true},
	}
	var want []uuid.UUID
	ids := map[uuid.UUID]string{}
	for _, c := range cases {
		id := bmdbtest.AddMachine(t, db, f.s, c.provider)
		ids[id] = c.name
		if c.setup != nil {
			c.setup(id)
		}
		if c.want {
			want = append(want, id)
		}
	}
	got, err := db.ListCandidates(t.Context(), bmdb.ProcessDecommission, bmdb.DecommissionCandidates("p"), 100)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range got {
		if !slices.Contains(want, id) {
			t.Errorf("%q is a decommission candidate, it should not be", ids[id])
		}
	}
	for _, id := range want {
		if !slices.Contains(got, id) {
			t.Errorf("%q is not a decommission candidate, it should be", ids[id])
		}
	}
	n, err := db.CountCandidates(t.Context(), bmdb.ProcessDecommission, bmdb.DecommissionCandidates("p"))
	if err != nil || n != int64(len(want)) {
		t.Errorf("CountCandidates() = %d, %v; want %d", n, err, len(want))
	}
	// Requested machines are nobody else's candidates.
	for _, c := range []struct {
		p  bmdb.Process
		cs bmdb.Candidates
	}{
		{bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p")},
		{bmdb.ProcessRecovery, bmdb.RecoveryCandidates("p", time.Millisecond, time.Millisecond)},
	} {
		got, err := db.ListCandidates(t.Context(), c.p, c.cs, 100)
		if err != nil {
			t.Fatal(err)
		}
		for _, id := range got {
			if strings.HasPrefix(ids[id], "requested") {
				t.Errorf("%q is a %s candidate although its decommission was requested", ids[id], c.p)
			}
		}
	}
}

// TestDecommission claims a machine with every tag for decommission and
// finishes it: the tags are gone, the machines row and the history stay,
// the record says what the machine was, and it is nobody's candidate.
func TestDecommission(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	f := fixture{t: t, db: db, s: bmdbtest.Session(t, db, "test", time.Minute)}
	id := bmdbtest.AddMachine(t, db, f.s, "p")
	other := bmdbtest.AddMachine(t, db, f.s, "p")
	key := make(ed25519.PublicKey, ed25519.PublicKeySize)
	key[0] = 7
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error { return tx.SetAgentStarted(ctx, id, key) })
	f.heartbeat(id, time.Hour)
	f.install(id, 2, 1, false)
	f.backoff(id, bmdb.ProcessRecovery, time.Hour, true)
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error {
		_, _, err := tx.RecordHostKey(ctx, id, []byte("host key"), false)
		return err
	})
	db.Exec(t, `INSERT INTO machine_hardware_report (machine_id, hardware_report_raw, cpu_threads, memory_bytes) VALUES ($1, '\x00', 8, 1024)`, id)
	providerID := bmdbtest.Scalar[string](t, db, "SELECT provider_id FROM machine_provided WHERE machine_id = $1", id)
	f.requestDecommission(id)
	if st, err := db.FleetStates(t.Context(), "p", 0, 0); err != nil || st[bmdb.StateDecommissioning] != 1 {
		t.Errorf("FleetStates() before the decommission = %v, %v; want one Decommissioning", st, err)
	}

	s := bmdbtest.Session(t, db, "decommissioner", time.Minute)
	w, err := s.Work(t.Context(), bmdb.ProcessDecommission, bmdb.DecommissionCandidates("p"))
	if err != nil {
		t.Fatal(err)
	}
	if w.MachineID != id || w.Provided.ProviderID != providerID {
		t.Fatalf("claimed %s (%s), want %s (%s)", w.MachineID, w.Provided.ProviderID, id, providerID)
	}
	var rec bmdb.DecommissionRecord
	err = w.Finish(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		var err error
		rec, err = tx.Decommission(ctx, id, true)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if rec.Provider != "p" || rec.ProviderID != providerID || rec.DecommissionedAt.IsZero() || !rec.Released {
		t.Errorf("Decommission() = %+v", rec)
	}

	for _, table := range []string{"machine_provided", "machine_agent_started", "machine_agent_heartbeat",
		"machine_hardware_report", "machine_os_installation_request", "machine_os_installation_report",
		"machine_ssh_host_key", "machine_decommission_request", "work_backoff", "work"} {
		if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM "+table+" WHERE machine_id = $1", id); n != 0 {
			t.Errorf("%s still has %d rows of the decommissioned machine", table, n)
		}
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM machine_provided WHERE machine_id = $1", other); n != 1 {
		t.Errorf("the other machine lost its Provided tag")
	}
	got, err := db.GetDecommissioned(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	if got.ProviderID != providerID || got.RequestedBy != "ops" || got.Reason != "disk on fire" || got.RequestedAt.IsZero() ||
		!got.Released || !got.DecommissionedAt.Equal(rec.DecommissionedAt) {
		t.Errorf("GetDecommissioned() = %+v", got)
	}
	if _, err := db.GetDecommissioned(t.Context(), other); !errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("GetDecommissioned(a machine in the fleet) = %v, want ErrNotFound", err)
	}
	h, err := db.History(t.Context(), bmdb.HistoryFilter{MachineID: id, Process: bmdb.ProcessDecommission})
	if err != nil {
		t.Fatal(err)
	}
	if len(h) != 3 || h[0].Event != bmdb.EventRequested || h[1].Event != bmdb.EventStarted || h[2].Event != bmdb.EventFinished {
		t.Errorf("decommission history %+v, want Requested, Started, Finished", h)
	}

	// It left every candidate query and the fleet counts.
	for _, c := range []struct {
		p  bmdb.Process
		cs bmdb.Candidates
	}{
		{bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p")},
		{bmdb.ProcessRecovery, bmdb.RecoveryCandidates("p", time.Millisecond, time.Millisecond)},
		{bmdb.ProcessDecommission, bmdb.DecommissionCandidates("p")},
	} {
		ids, err := db.ListCandidates(t.Context(), c.p, c.cs, 100)
		if err != nil {
			t.Fatal(err)
		}
		if slices.Contains(ids, id) {
			t.Errorf("the decommissioned machine is a %s candidate", c.p)
		}
	}
	st, err := db.FleetStates(t.Context(), "p", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if st[bmdb.StateDecommissioning] != 0 || st[bmdb.StateProvided] != 1 || len(st) != 1 {
		t.Errorf("FleetStates() after the decommission = %v, want only the other machine, Provided", st)
	}
	// Its agent's key is worthless now, and the agent is told to stop;
	// another key is only refused.
	res, err := db.RecordHeartbeats(t.Context(), []bmdb.Heartbeat{{MachineID: id, AgentKey: key}, {MachineID: id, AgentKey: newKey(t)}})
	if err != nil || res[0].Accepted || !res[0].Retired {
		t.Errorf("heartbeat of the decommissioned machine's agent: %+v, %v; want refused and retired", res, err)
	}
	if err == nil && (res[1].Accepted || res[1].Retired) {
		t.Errorf("heartbeat with another key: %+v; want refused, not retired", res[1])
	}
	retired, err := db.DecommissionedProviderIDs(t.Context(), "p")
	if _, ok := retired[providerID]; err != nil || !ok || len(retired) != 1 {
		t.Errorf("DecommissionedProviderIDs() = %v, %v; want %s", retired, err, providerID)
	}
	// A second decommission finds nothing to do.
	err = f.s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		_, err := tx.Decommission(ctx, id, true)
		return err
	})
	if !errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("decommissioning again: %v, want ErrNotFound", err)
	}
}

// TestSweepDecommissioned: a heartbeat written after the decommission (it
// raced with it) is swept; machines decommissioned long ago are not looked
// at, and the fleet is left alone.
func TestSweepDecommissioned(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	f := fixture{t: t, db: db, s: bmdbtest.Session(t, db, "test", time.Minute)}
	id := bmdbtest.AddMachine(t, db, f.s, "p")
	old := bmdbtest.AddMachine(t, db, f.s, "p")
	live := bmdbtest.AddMachine(t, db, f.s, "p")
	f.started(live, time.Hour)
	f.heartbeat(live, 0)
	for _, m := range []uuid.UUID{id, old} {
		f.tx(func(ctx context.Context, tx *bmdb.Tx) error {
			_, err := tx.Decommission(ctx, m, false)
			return err
		})
		// What a heartbeat batch that authenticated before the
		// decommission can still write after it: a hardware report. A
		// heartbeat it cannot: a heartbeat needs its AgentStarted.
		if _, err := db.Pool.Exec(t.Context(), "INSERT INTO machine_agent_heartbeat (machine_id, agent_heartbeat_at) VALUES ($1, now())", m); err == nil {
			t.Error("a heartbeat row was written for a decommissioned machine")
		}
		db.Exec(t, `INSERT INTO machine_hardware_report (machine_id, hardware_report_raw) VALUES ($1, '\x00')`, m)
	}
	db.Exec(t, "UPDATE machines SET decommissioned_at = now() - interval '1 day' WHERE machine_id = $1", old)
	n, err := db.SweepDecommissioned(t.Context(), time.Hour)
	if err != nil || n != 1 {
		t.Fatalf("SweepDecommissioned() = %d, %v; want the stray row of the recent decommission", n, err)
	}
	if c := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM machine_agent_heartbeat WHERE machine_id = $1", live); c != 1 {
		t.Error("the sweep took the heartbeat of a machine in the fleet")
	}
	if _, err := db.SweepDecommissioned(t.Context(), 0); err == nil {
		t.Error("SweepDecommissioned(0) succeeded, want an error")
	}
}

// TestDecommissionCandidatePlanAtScale: the decommission candidate query
// reads the open requests, not the fleet.
func TestDecommissionCandidatePlanAtScale(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "p", Healthy: 99_000, AwaitingAgent: 1000})
	// Requests spread over the fleet, and what else a running fleet has:
	// work in flight, old backoffs, a lot of history.
	db.Exec(t, `INSERT INTO machine_decommission_request (machine_id)
		SELECT machine_id FROM machine_provided ORDER BY md5(machine_id::text) LIMIT 30`)
	holder := bmdbtest.Session(t, db, "holder", time.Minute)
	db.Exec(t, `INSERT INTO work (machine_id, process, machine_exclusive, session_id)
		SELECT machine_id, 'Recovery', true, $1 FROM machine_provided
		WHERE machine_id NOT IN (SELECT machine_id FROM machine_decommission_request)
		ORDER BY machine_id DESC LIMIT 500`, holder.ID())
	db.Exec(t, `INSERT INTO work_backoff (machine_id, process, backoff_until, cause, last_interval_ms, attempts)
		SELECT machine_id, 'Decommission', now() - interval '1 hour', 'old', 60000, 1 FROM machine_provided LIMIT 20000`)
	db.Exec(t, `INSERT INTO work_history (machine_id, process, event, session_id)
		SELECT machine_id, 'AgentStart', 'Finished', NULL FROM machine_provided`)
	db.Exec(t, "ANALYZE")
	n, err := db.CountCandidates(t.Context(), bmdb.ProcessDecommission, bmdb.DecommissionCandidates("p"))
	if err != nil || n != 30 {
		t.Fatalf("CountCandidates() = %d, %v; want 30", n, err)
	}
	plans, err := db.ExplainCandidates(t.Context(), bmdb.ProcessDecommission, bmdb.DecommissionCandidates("p"))
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range plans {
		if bad := fullScans(p.Plan); len(bad) > 0 {
			t.Errorf("%s statement: full scans of per-machine tables %q in plan:\n%s", p.Statement, bad, p.Plan)
		}
	}
}
