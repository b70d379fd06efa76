package bmdb_test

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sync/errgroup"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// startedMachines adds n machines whose agents were started with fresh keys.
func startedMachines(t *testing.T, db *bmdbtest.DB, s *bmdb.Session, n int) ([]uuid.UUID, []ed25519.PublicKey) {
	t.Helper()
	ids := make([]uuid.UUID, n)
	keys := make([]ed25519.PublicKey, n)
	for i := range n {
		ids[i] = bmdbtest.AddMachine(t, db, s, "p")
		keys[i] = newKey(t)
	}
	err := s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		for i := range ids {
			if err := tx.SetAgentStarted(ctx, ids[i], keys[i]); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return ids, keys
}

// A heartbeat the database refuses (here an installation report whose error
// text PostgreSQL cannot store) must not decide the fate of the others in its
// batch: they are recorded, and only the bad one gets an error.
func TestRecordHeartbeatsIsolatesBadMember(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	ids, keys := startedMachines(t, db, s, 7)
	var batch []bmdb.Heartbeat
	for i := range ids {
		batch = append(batch, bmdb.Heartbeat{MachineID: ids[i], AgentKey: keys[i]})
	}
	// A NUL byte is valid UTF-8 (so protobuf lets it through) but not a
	// valid PostgreSQL text value; so is a character cut in half.
	batch[2].Installation = &bmdb.InstallationReport{Generation: 1, Error: "disk\x00gone", Raw: []byte{1}}
	batch[5].Installation = &bmdb.InstallationReport{Generation: 1, Error: "é"[:1], Raw: []byte{1}}
	res, err := db.RecordHeartbeats(t.Context(), batch)
	if err != nil {
		t.Fatalf("RecordHeartbeats failed the whole batch: %v", err)
	}
	for i, r := range res {
		bad := i == 2 || i == 5
		switch {
		case bad && (r.Accepted || !errors.Is(r.Err, bmdb.ErrInvalidHeartbeat)):
			t.Errorf("heartbeat %d (bad report): %+v, want rejected with ErrInvalidHeartbeat", i, r)
		case !bad && (!r.Accepted || r.Err != nil):
			t.Errorf("heartbeat %d (honest): %+v, want accepted", i, r)
		}
	}
	for i, id := range ids {
		_, err := db.GetAgentHeartbeat(t.Context(), id)
		if bad := i == 2 || i == 5; bad != errors.Is(err, bmdb.ErrNotFound) {
			t.Errorf("heartbeat row of machine %d: err %v (bad member: %v)", i, err, bad)
		}
	}
}

// The hardware report is stored exactly when the heartbeat it came with is
// accepted, also while the initializer's AgentStarted commits concurrently
// (the report and the heartbeat must see one snapshot).
func TestHeartbeatReportStoredIffAccepted(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	const n = 150
	ids := make([]uuid.UUID, n)
	keys := make([]ed25519.PublicKey, n)
	for i := range ids {
		ids[i] = bmdbtest.AddMachine(t, db, s, "p")
		keys[i] = newKey(t)
	}
	var mu sync.Mutex
	accepted := map[uuid.UUID]bool{}
	g, ctx := errgroup.WithContext(t.Context())
	for i := range ids {
		// The agent sends its report until its heartbeat is accepted,
		// racing the takeover's commit of its key.
		g.Go(func() error {
			for {
				res, err := db.RecordHeartbeats(ctx, []bmdb.Heartbeat{{MachineID: ids[i], AgentKey: keys[i],
					Hardware: &bmdb.HardwareReport{Raw: []byte("hw"), CPUThreads: 4}}})
				if err != nil {
					return err
				}
				if res[0].Accepted {
					mu.Lock()
					accepted[ids[i]] = res[0].HardwareRecorded
					mu.Unlock()
					return nil
				}
			}
		})
		g.Go(func() error {
			return s.Transact(ctx, func(ctx context.Context, tx *bmdb.Tx) error { return tx.SetAgentStarted(ctx, ids[i], keys[i]) })
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		if !accepted[id] {
			t.Errorf("machine %s: heartbeat accepted but the result says the report was not recorded", id)
		}
		if _, err := db.GetHardwareReport(t.Context(), id); err != nil {
			t.Errorf("machine %s: heartbeat accepted, hardware report: %v", id, err)
		}
	}
}

// A heartbeat that raced a recovery must not leave a heartbeat row behind
// once the recovery removed the agent's tags: the next takeover would start
// out Heartbeating with a stale time and be rebooted at once.
func TestHeartbeatRacingRecoveryLeavesNoHeartbeat(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	ids, keys := startedMachines(t, db, s, 1)
	id, key := ids[0], keys[0]
	if res, err := db.RecordHeartbeats(t.Context(), []bmdb.Heartbeat{{MachineID: id, AgentKey: key}}); err != nil || !res[0].Accepted {
		t.Fatalf("first heartbeat: %+v, %v", res, err)
	}

	// The recovery's Finish has removed the tags but not yet committed.
	tx, err := db.Pool.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.WithoutCancel(t.Context()))
	if _, err := tx.Exec(t.Context(), `DELETE FROM machine_agent_heartbeat WHERE machine_id = $1`, id); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(t.Context(), `DELETE FROM machine_agent_started WHERE machine_id = $1`, id); err != nil {
		t.Fatal(err)
	}
	beat := make(chan error, 1)
	go func() {
		_, err := db.RecordHeartbeats(context.WithoutCancel(t.Context()), []bmdb.Heartbeat{{MachineID: id, AgentKey: key}})
		beat <- err
	}()
	// Wait until the heartbeat waits for the recovery's row locks.
	bmdbtest.WaitFor(t, 30*time.Second, "heartbeat blocked on the recovery's locks", func(ctx context.Context) (bool, error) {
		var n int
		err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&n)
		return n > 0, err
	})
	if err := tx.Commit(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := <-beat; err != nil {
		t.Fatalf("heartbeat after the race: %v", err)
	}
	n := bmdbtest.Scalar[int](t, db, `SELECT count(*) FROM machine_agent_heartbeat h
		WHERE NOT EXISTS (SELECT 1 FROM machine_agent_started s WHERE s.machine_id = h.machine_id)`)
	if n != 0 {
		t.Errorf("%d heartbeat rows without AgentStarted after a heartbeat raced a recovery", n)
	}
}

// Batches that share machines, sent in opposite orders at the same time,
// must lock rows in one order: no deadlock (and so no retry) ever.
func TestHeartbeatBatchesLockInOneOrder(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	db := bmdbtest.NewWithConfig(t, bmdb.Config{Registerer: reg})
	s := bmdbtest.Session(t, db, "test", time.Minute)
	_ = s
	// A fleet large enough that the planner looks machines up one by one,
	// in the order of the batch, as in production.
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "p", Healthy: 5000})
	key := ed25519.PublicKey(bytes.Repeat([]byte{0xab}, ed25519.PublicKeySize)) // BuildFleet's agent key
	rows, err := db.Pool.Query(t.Context(), `SELECT machine_id FROM machine_provided ORDER BY random() LIMIT 300`)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	if err != nil {
		t.Fatal(err)
	}
	forward := make([]bmdb.Heartbeat, len(ids))
	for i := range ids {
		forward[i] = bmdb.Heartbeat{MachineID: ids[i], AgentKey: key,
			Hardware: &bmdb.HardwareReport{Raw: []byte(fmt.Sprint(i))}}
	}
	backward := slices.Clone(forward)
	slices.Reverse(backward)
	g, ctx := errgroup.WithContext(t.Context())
	for _, batch := range [][]bmdb.Heartbeat{forward, backward, forward, backward} {
		g.Go(func() error {
			for range 30 {
				if _, err := db.RecordHeartbeats(ctx, batch); err != nil {
					return err
				}
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "shepherd_bmdb_transaction_retries_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if v := m.GetCounter().GetValue(); v != 0 {
				t.Errorf("%s%v = %v, want 0: concurrent batches deadlocked", mf.GetName(), m.GetLabel(), v)
			}
		}
	}
}

// TestReinstallForgetsRecordedHostKey: SPEC §3.3 says a reinstall clears a
// host key recorded on first use (the new OS has new host keys), so the
// next takeover records the new one instead of calling it a mismatch; a key
// the provider pinned stays (issue 10 item 14).
func TestReinstallForgetsRecordedHostKey(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	ids, keys := startedMachines(t, db, s, 2)
	hostKey := bytes.Repeat([]byte{7}, 51)
	for i, id := range ids {
		if _, _, err := db.RecordHostKey(t.Context(), id, hostKey, i == 1); err != nil {
			t.Fatal(err)
		}
		err := s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
			_, err := tx.RequestInstallation(ctx, id, "test", []byte("request"))
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	// A failed report leaves the OS (and its keys) as they were.
	var batch []bmdb.Heartbeat
	for i := range ids {
		batch = append(batch, bmdb.Heartbeat{MachineID: ids[i], AgentKey: keys[i],
			Installation: &bmdb.InstallationReport{Generation: 1, Error: "download failed", Raw: []byte{1}}})
	}
	if _, err := db.RecordHeartbeats(t.Context(), batch); err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		if _, _, err := db.HostKey(t.Context(), id); err != nil {
			t.Fatalf("host key after a failed installation: %v, want kept", err)
		}
	}
	for i := range batch {
		batch[i].Installation = &bmdb.InstallationReport{Generation: 1, Success: true, Raw: []byte{1}}
	}
	res, err := db.RecordHeartbeats(t.Context(), batch)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range res {
		if !r.Accepted || r.InstallationRecorded != 1 {
			t.Fatalf("heartbeat %d: %+v, want accepted with generation 1 recorded", i, r)
		}
	}
	if _, _, err := db.HostKey(t.Context(), ids[0]); !errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("key recorded on first use after a successful installation: %v, want forgotten", err)
	}
	if _, pinned, err := db.HostKey(t.Context(), ids[1]); err != nil || !pinned {
		t.Errorf("pinned key after a successful installation: pinned=%v err=%v, want kept", pinned, err)
	}
}
