package bmdb_test

import (
	"context"
	"crypto/ed25519"
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// fixture builds machine states tag by tag, through the API where the API
// produces the state and with raw SQL where only time would (a heartbeat an
// hour old).
type fixture struct {
	t  *testing.T
	db *bmdbtest.DB
	s  *bmdb.Session
}

func (f fixture) tx(fn func(ctx context.Context, tx *bmdb.Tx) error) {
	f.t.Helper()
	if err := f.s.Transact(f.t.Context(), fn); err != nil {
		f.t.Fatal(err)
	}
}

func (f fixture) started(id uuid.UUID, ago time.Duration) {
	f.t.Helper()
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error {
		return tx.SetAgentStarted(ctx, id, make(ed25519.PublicKey, ed25519.PublicKeySize))
	})
	// The agent phase changed when AgentStarted was set, so it moves back too.
	f.db.Exec(f.t, "UPDATE machine_agent_started SET agent_started_at = now() - $2::interval WHERE machine_id = $1", id, ago)
	f.db.Exec(f.t, "UPDATE machine_provided SET agent_phase_since = now() - $2::interval WHERE machine_id = $1", id, ago)
}

func (f fixture) status(id uuid.UUID, st bmdb.ProviderStatus) {
	f.t.Helper()
	f.db.Exec(f.t, "UPDATE machine_provided SET provider_status = $2 WHERE machine_id = $1", id, string(st))
}

func (f fixture) heartbeat(id uuid.UUID, ago time.Duration) {
	f.t.Helper()
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error { return tx.RecordHeartbeat(ctx, id) })
	f.db.Exec(f.t, "UPDATE machine_agent_heartbeat SET agent_heartbeat_at = now() - $2::interval WHERE machine_id = $1", id, ago)
}

// installed requests generation(s) and reports on one of them.
func (f fixture) install(id uuid.UUID, requests int, reportGen int64, success bool) {
	f.t.Helper()
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error {
		for range requests {
			if _, err := tx.RequestInstallation(ctx, id, "test", []byte("request")); err != nil {
				return err
			}
		}
		r := bmdb.InstallationReport{Generation: reportGen, Success: success, Raw: []byte("report")}
		if !success {
			r.Error = "writing image: no space left on device"
		}
		return tx.ReportInstallation(ctx, id, r)
	})
}

func (f fixture) backoff(id uuid.UUID, p bmdb.Process, until time.Duration, quarantined bool) {
	f.t.Helper()
	f.db.Exec(f.t, `INSERT INTO work_backoff (machine_id, process, backoff_until, cause, last_interval_ms, attempts, quarantined_at)
		VALUES ($1, $2, now() + $3::interval, 'test', 60000, 3, CASE WHEN $4 THEN now() END)`, id, string(p), until, quarantined)
}

// work makes a session of its own hold process on the machine; dead
// sessions have their deadline moved into the past.
func (f fixture) work(id uuid.UUID, p bmdb.Process, dead bool) {
	f.t.Helper()
	holder := bmdbtest.Session(f.t, f.db, "holder", time.Minute)
	f.db.Exec(f.t, `INSERT INTO work (machine_id, process, machine_exclusive, session_id)
		SELECT $1, process, machine_exclusive, $3 FROM processes WHERE process = $2`, id, string(p), holder.ID())
	if dead {
		f.db.Exec(f.t, "UPDATE sessions SET deadline = now() - interval '1 second' WHERE session_id = $1", holder.ID())
	}
}

func TestCandidateQueries(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	f := fixture{t: t, db: db, s: bmdbtest.Session(t, db, "test", time.Minute)}
	const (
		hour = time.Hour
		min  = time.Minute
	)
	cases := []struct {
		name       string
		provider   string
		setup      func(id uuid.UUID)
		agentStart bool // want it among AgentStart candidates
		recovery   bool // want it among Recovery candidates
	}{
		{"provided only", "p", nil, true, false},
		{"other provider", "q", nil, false, false},
		{"agent start backed off", "p", func(id uuid.UUID) { f.backoff(id, bmdb.ProcessAgentStart, hour, false) }, false, false},
		{"agent start backoff expired", "p", func(id uuid.UUID) { f.backoff(id, bmdb.ProcessAgentStart, -min, false) }, true, false},
		{"agent start quarantined", "p", func(id uuid.UUID) { f.backoff(id, bmdb.ProcessAgentStart, -min, true) }, false, false},
		{"recovery backoff does not stop agent start", "p", func(id uuid.UUID) { f.backoff(id, bmdb.ProcessRecovery, hour, true) }, true, false},
		{"agent start held by live session", "p", func(id uuid.UUID) { f.work(id, bmdb.ProcessAgentStart, false) }, false, false},
		{"agent start held by dead session", "p", func(id uuid.UUID) { f.work(id, bmdb.ProcessAgentStart, true) }, true, false},
		{"decommission work excludes agent start", "p", func(id uuid.UUID) { f.work(id, bmdb.ProcessDecommission, false) }, false, false},
		{"provider update does not exclude agent start", "p", func(id uuid.UUID) { f.work(id, bmdb.ProcessProviderUpdate, false) }, true, false},
		{"still provisioning at the provider", "p", func(id uuid.UUID) { f.status(id, bmdb.ProviderStatusProvisioning) }, false, false},
		{"provisioning failed", "p", func(id uuid.UUID) { f.status(id, bmdb.ProviderStatusProvisioningFailedPermanent) }, false, false},
		{"stopped at the provider", "p", func(id uuid.UUID) { f.status(id, bmdb.ProviderStatusStopped) }, false, false},
		{"missing at the provider", "p", func(id uuid.UUID) { f.status(id, bmdb.ProviderStatusMissing) }, false, false},
		{"provider status unknown", "p", func(id uuid.UUID) { f.status(id, bmdb.ProviderStatusUnknown) }, true, false},
		// Issue 10 item 22: an installation does not end the watch; an
		// installed machine whose agent was cleared is taken over again.
		{"installed, never started", "p", func(id uuid.UUID) { f.install(id, 1, 1, true) }, true, false},
		{"decommission requested", "p", func(id uuid.UUID) {
			f.tx(func(ctx context.Context, tx *bmdb.Tx) error { return tx.RequestDecommission(ctx, id, "test", "gone") })
		}, false, false},
		{"started recently, no heartbeat yet", "p", func(id uuid.UUID) { f.started(id, min) }, false, false},
		{"started long ago, heartbeat never came", "p", func(id uuid.UUID) { f.started(id, hour) }, false, true},
		{"heartbeat fresh", "p", func(id uuid.UUID) { f.started(id, hour); f.heartbeat(id, min) }, false, false},
		{"heartbeat stale", "p", func(id uuid.UUID) { f.started(id, hour); f.heartbeat(id, hour) }, false, true},
		{"stale, other provider", "q", func(id uuid.UUID) { f.started(id, hour); f.heartbeat(id, hour) }, false, false},
		{"stale, recovery backed off", "p", func(id uuid.UUID) {
			f.started(id, hour)
			f.heartbeat(id, hour)
			f.backoff(id, bmdb.ProcessRecovery, hour, false)
		}, false, false},
		{"stale, recovery backoff expired", "p", func(id uuid.UUID) {
			f.started(id, hour)
			f.heartbeat(id, hour)
			f.backoff(id, bmdb.ProcessRecovery, -min, false)
		}, false, true},
		{"stale, recovery quarantined", "p", func(id uuid.UUID) {
			f.started(id, hour)
			f.heartbeat(id, hour)
			f.backoff(id, bmdb.ProcessRecovery, -min, true)
		}, false, false},
		{"never came, recovery quarantined", "p", func(id uuid.UUID) {
			f.started(id, hour)
			f.backoff(id, bmdb.ProcessRecovery, -min, true)
		}, false, false},
		{"stale, installed", "p", func(id uuid.UUID) { f.started(id, hour); f.heartbeat(id, hour); f.install(id, 1, 1, true) }, false, true},
		{"never came, installed", "p", func(id uuid.UUID) { f.started(id, hour); f.install(id, 1, 1, true) }, false, true},
		{"fresh, installed", "p", func(id uuid.UUID) { f.started(id, hour); f.heartbeat(id, min); f.install(id, 1, 1, true) }, false, false},
		{"stale, install failed", "p", func(id uuid.UUID) { f.started(id, hour); f.heartbeat(id, hour); f.install(id, 1, 1, false) }, false, true},
		{"stale, installed an older generation", "p", func(id uuid.UUID) {
			f.started(id, hour)
			f.heartbeat(id, hour)
			f.install(id, 2, 1, true)
		}, false, true},
		{"stale, recovery held by live session", "p", func(id uuid.UUID) {
			f.started(id, hour)
			f.heartbeat(id, hour)
			f.work(id, bmdb.ProcessRecovery, false)
		}, false, false},
		{"stale, recovery held by dead session", "p", func(id uuid.UUID) {
			f.started(id, hour)
			f.heartbeat(id, hour)
			f.work(id, bmdb.ProcessRecovery, true)
		}, false, true},
		{"stale, reinstall held by live session", "p", func(id uuid.UUID) {
			f.started(id, hour)
			f.heartbeat(id, hour)
			f.work(id, bmdb.ProcessReinstall, false)
		}, false, false},
		{"stale, provider update held by live session", "p", func(id uuid.UUID) {
			f.started(id, hour)
			f.heartbeat(id, hour)
			f.work(id, bmdb.ProcessProviderUpdate, false)
		}, false, true},
		{"stale, decommission requested", "p", func(id uuid.UUID) {
			f.started(id, hour)
			f.heartbeat(id, hour)
			f.tx(func(ctx context.Context, tx *bmdb.Tx) error { return tx.RequestDecommission(ctx, id, "test", "gone") })
		}, false, false},
		{"recovered (agent cleared)", "p", func(id uuid.UUID) {
			f.started(id, hour)
			f.heartbeat(id, hour)
			f.tx(func(ctx context.Context, tx *bmdb.Tx) error { return tx.ClearAgent(ctx, id) })
		}, true, false},
	}
	var wantAgentStart, wantRecovery []uuid.UUID
	names := map[uuid.UUID]string{}
	for _, c := range cases {
		id := bmdbtest.AddMachine(t, db, f.s, c.provider)
		names[id] = c.name
		if c.setup != nil {
			c.setup(id)
		}
		if c.agentStart {
			wantAgentStart = append(wantAgentStart, id)
		}
		if c.recovery {
			wantRecovery = append(wantRecovery, id)
		}
	}

	check := func(process bmdb.Process, cands bmdb.Candidates, want []uuid.UUID) {
		t.Helper()
		got, err := db.ListCandidates(t.Context(), process, cands, 1000)
		if err != nil {
			t.Fatal(err)
		}
		byName := func(ids []uuid.UUID) []string {
			var out []string
			for _, id := range ids {
				out = append(out, names[id])
			}
			slices.Sort(out)
			return out
		}
		if diff := cmp.Diff(byName(want), byName(got)); diff != "" {
			t.Errorf("%s candidates (-want +got):\n%s", process, diff)
		}
		n, err := db.CountCandidates(t.Context(), process, cands)
		if err != nil {
			t.Fatal(err)
		}
		if n != int64(len(got)) {
			t.Errorf("Count%sCandidates = %d, list has %d", process, n, len(got))
		}
	}
	check(bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"), wantAgentStart)
	check(bmdb.ProcessRecovery, bmdb.RecoveryCandidates("p", 30*time.Minute, 10*time.Minute), wantRecovery)

	// The thresholds are parameters: with a first-heartbeat timeout of two
	// hours, a machine started an hour ago is not silent yet.
	var wantLonger []uuid.UUID
	for _, id := range wantRecovery {
		if n := names[id]; n != "started long ago, heartbeat never came" && n != "never came, installed" {
			wantLonger = append(wantLonger, id)
		}
	}
	check(bmdb.ProcessRecovery, bmdb.RecoveryCandidates("p", 2*time.Hour, 10*time.Minute), wantLonger)

	// The stored phase the partial indexes read must equal the phase computed
	// from the tags, for every machine the table built.
	if n := bmdbtest.Scalar[int64](t, db, `SELECT count(*) FROM machine_provided
		WHERE agent_phase IS DISTINCT FROM machine_agent_phase(machine_id)`); n != 0 {
		t.Errorf("%d machines have a stored agent_phase that differs from their tags", n)
	}
	if n := bmdbtest.Scalar[int64](t, db, `SELECT count(*) FROM machine_agent_heartbeat
		JOIN machine_provided p USING (machine_id)
		WHERE watched IS DISTINCT FROM (machine_agent_phase(machine_id) = 'Heartbeating' AND p.recovery_held_until IS NULL)`); n != 0 {
		t.Errorf("%d heartbeats have a watched flag that differs from their tags", n)
	}

	// Claiming takes exactly the listed machines, once each, and expires the
	// dead session's work on the way.
	var claimed []uuid.UUID
	for {
		w, err := f.s.Work(t.Context(), bmdb.ProcessRecovery, bmdb.RecoveryCandidates("p", 0, 0))
		if err != nil {
			if err != bmdb.ErrNothingToDo {
				t.Fatalf("Work: %v", err)
			}
			break
		}
		claimed = append(claimed, w.MachineID)
	}
	slices.SortFunc(claimed, func(a, b uuid.UUID) int { return slices.Compare(a[:], b[:]) })
	slices.SortFunc(wantRecovery, func(a, b uuid.UUID) int { return slices.Compare(a[:], b[:]) })
	if diff := cmp.Diff(wantRecovery, claimed); diff != "" {
		t.Errorf("claimed recovery candidates (-want +got):\n%s", diff)
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work_history WHERE event = 'Expired'"); n != 1 {
		t.Errorf("%d Expired history rows, want 1 (the dead session's recovery work)", n)
	}
}

// TestRecoveryMatchingCount: the circuit breaker's count of silent agents
// (CountMatching of the recovery definition) counts exactly the silent
// machines of the provider by their tags, whatever work, backoff or
// quarantine they are in, and no machine whose agent heartbeats, held or
// not (issue 17 item 4: held machines are judged by whether their heartbeat
// is recent, not by probing whether it is old).
func TestRecoveryMatchingCount(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	f := fixture{t: t, db: db, s: bmdbtest.Session(t, db, "test", time.Minute)}
	const (
		hour = time.Hour
		min  = time.Minute
	)
	// holdEnded moves a recovery hold's end into the past, as time does:
	// the machine stays held (its heartbeat unwatched) until the backoff
	// row goes.
	holdEnded := func(id uuid.UUID) {
		f.db.Exec(f.t, "UPDATE machine_provided SET recovery_held_until = now() - interval '1 minute' WHERE machine_id = $1", id)
	}
	// stale: an agent started and last heard from three hours ago.
	stale := func(id uuid.UUID) {
		f.started(id, 3*hour)
		f.heartbeat(id, 3*hour)
	}
	cases := []struct {
		name     string
		provider string
		setup    func(id uuid.UUID)
		// silent: counted with the default timeouts (first heartbeat 30
		// min, heartbeat 10 min); silentLong: with both at two hours.
		silent, silentLong bool
	}{
		{"provided only", "p", nil, false, false},
		{"started recently, no heartbeat yet", "p", func(id uuid.UUID) { f.started(id, min) }, false, false},
		{"started long ago, heartbeat never came", "p", func(id uuid.UUID) { f.started(id, 3*hour) }, true, true},
		{"started an hour ago, heartbeat never came", "p", func(id uuid.UUID) { f.started(id, hour) }, true, false},
		{"healthy", "p", func(id uuid.UUID) { f.started(id, 3*hour); f.heartbeat(id, min) }, false, false},
		{"stale for an hour", "p", func(id uuid.UUID) { f.started(id, 3*hour); f.heartbeat(id, hour) }, true, false},
		{"stale for three hours", "p", stale, true, true},
		{"stale, other provider", "q", stale, false, false},
		{"stale, lost by the provider", "p", func(id uuid.UUID) {
			stale(id)
			f.status(id, bmdb.ProviderStatusMissing)
		}, false, false},
		{"stale, recovered by a live session", "p", func(id uuid.UUID) {
			stale(id)
			f.work(id, bmdb.ProcessRecovery, false)
		}, true, true},
		{"stale, decommission requested", "p", func(id uuid.UUID) {
			stale(id)
			f.tx(func(ctx context.Context, tx *bmdb.Tx) error { return tx.RequestDecommission(ctx, id, "test", "gone") })
		}, true, true},
		// Held by a recovery backoff or quarantine.
		{"stale for an hour, backed off", "p", func(id uuid.UUID) {
			f.started(id, 3*hour)
			f.heartbeat(id, hour)
			f.backoff(id, bmdb.ProcessRecovery, hour, false)
		}, true, false},
		{"stale for three hours, backed off", "p", func(id uuid.UUID) {
			stale(id)
			f.backoff(id, bmdb.ProcessRecovery, hour, false)
		}, true, true},
		{"backed off, heartbeating again", "p", func(id uuid.UUID) {
			stale(id)
			f.backoff(id, bmdb.ProcessRecovery, hour, false)
			f.heartbeat(id, min)
		}, false, false},
		{"stale, quarantined", "p", func(id uuid.UUID) {
			stale(id)
			f.backoff(id, bmdb.ProcessRecovery, hour, true)
		}, true, true},
		{"quarantined, heartbeating again", "p", func(id uuid.UUID) {
			stale(id)
			f.backoff(id, bmdb.ProcessRecovery, hour, true)
			f.heartbeat(id, min)
		}, false, false},
		{"stale, backoff ended", "p", func(id uuid.UUID) {
			stale(id)
			f.backoff(id, bmdb.ProcessRecovery, hour, false)
			holdEnded(id)
		}, true, true},
		{"backoff ended, heartbeating again", "p", func(id uuid.UUID) {
			stale(id)
			f.backoff(id, bmdb.ProcessRecovery, hour, false)
			holdEnded(id)
			f.heartbeat(id, min)
		}, false, false},
		{"stale, backed off, recovered by a live session", "p", func(id uuid.UUID) {
			stale(id)
			f.backoff(id, bmdb.ProcessRecovery, hour, false)
			f.work(id, bmdb.ProcessRecovery, false)
		}, true, true},
		{"stale, backed off, other provider", "q", func(id uuid.UUID) {
			stale(id)
			f.backoff(id, bmdb.ProcessRecovery, hour, false)
		}, false, false},
		{"stale, backed off, stopped by the provider", "p", func(id uuid.UUID) {
			stale(id)
			f.backoff(id, bmdb.ProcessRecovery, hour, false)
			f.status(id, bmdb.ProviderStatusStopped)
		}, false, false},
		{"heartbeat never came, backed off", "p", func(id uuid.UUID) {
			f.started(id, 3*hour)
			f.backoff(id, bmdb.ProcessRecovery, hour, false)
		}, true, true},
		{"started recently, backed off", "p", func(id uuid.UUID) {
			f.started(id, min)
			f.backoff(id, bmdb.ProcessRecovery, hour, false)
		}, false, false},
		{"agent start backed off", "p", func(id uuid.UUID) { f.backoff(id, bmdb.ProcessAgentStart, hour, false) }, false, false},
	}
	var want, wantLong int64
	for _, c := range cases {
		id := bmdbtest.AddMachine(t, db, f.s, c.provider)
		if c.setup != nil {
			c.setup(id)
		}
		if c.silent {
			want++
		}
		if c.silentLong {
			wantLong++
		}
	}
	// The count relies on the watched flag the triggers keep: a held
	// machine's heartbeat is not watched.
	if n := bmdbtest.Scalar[int64](t, db, `SELECT count(*) FROM machine_agent_heartbeat
		JOIN machine_provided p USING (machine_id)
		WHERE watched IS DISTINCT FROM (machine_agent_phase(machine_id) = 'Heartbeating' AND p.recovery_held_until IS NULL)`); n != 0 {
		t.Errorf("%d heartbeats have a watched flag that differs from their tags", n)
	}
	for _, c := range []struct {
		cands bmdb.Candidates
		want  int64
	}{
		{bmdb.RecoveryCandidates("p", 0, 0), want},
		{bmdb.RecoveryCandidates("p", 2*hour, 2*hour), wantLong},
	} {
		if n, err := db.CountMatching(t.Context(), c.cands); err != nil || n != c.want {
			t.Errorf("%s: %d silent machines by tags (%v), want %d", c.cands, n, err, c.want)
		}
	}
}
