package bmdb_test

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

func newKey(t *testing.T) ed25519.PublicKey {
	t.Helper()
	pub, _, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return pub
}

func TestRecordHeartbeats(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	f := fixture{t: t, db: db, s: s}
	a, b, installed := bmdbtest.AddMachine(t, db, s, "p"), bmdbtest.AddMachine(t, db, s, "p"), bmdbtest.AddMachine(t, db, s, "p")
	keyA, keyB, keyI := newKey(t), newKey(t), newKey(t)
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error {
		for m, k := range map[uuid.UUID]ed25519.PublicKey{a: keyA, b: keyB, installed: keyI} {
			if err := tx.SetAgentStarted(ctx, m, k); err != nil {
				return err
			}
		}
		if _, err := tx.RequestInstallation(ctx, a, "test", []byte("gen1")); err != nil {
			return err
		}
		if _, err := tx.RequestInstallation(ctx, installed, "test", []byte("gen1")); err != nil {
			return err
		}
		return nil
	})

	hw := &bmdb.HardwareReport{Raw: []byte("report"), CPUThreads: 64, MemoryBytes: 512 << 30, DiskCount: 2, DiskBytes: 8 << 40}
	res, err := db.RecordHeartbeats(t.Context(), []bmdb.Heartbeat{
		{MachineID: a, AgentKey: keyA, Hardware: hw}, // 0: fine, pending gen 1
		{MachineID: b, AgentKey: keyA},               // 1: a's key with b's id
		{MachineID: uuid.New(), AgentKey: keyA},      // 2: unknown machine
		{MachineID: b, AgentKey: keyB},               // 3: fine, nothing pending
		{MachineID: a, AgentKey: keyA},               // 4: duplicate of 0
		{MachineID: installed, AgentKey: keyI, Installation: &bmdb.InstallationReport{Generation: 1, Success: true, Raw: []byte("ok")}}, // 5: reports, no longer pending
		{MachineID: a, AgentKey: newKey(t), Hardware: &bmdb.HardwareReport{Raw: []byte("forged")}},                                      // 6: wrong key, report ignored
	})
	if err != nil {
		t.Fatal(err)
	}
	pending := &bmdb.PendingInstallation{Generation: 1, Request: []byte("gen1")}
	want := []bmdb.HeartbeatResult{
		{Accepted: true, HardwareRecorded: true, Pending: pending},
		{},
		{},
		{Accepted: true},
		{Accepted: true, HardwareRecorded: true, Pending: pending},
		{Accepted: true, InstallationRecorded: 1},
		{},
	}
	if diff := cmp.Diff(want, res); diff != "" {
		t.Errorf("results (-want +got):\n%s", diff)
	}
	got, err := db.GetHardwareReport(t.Context(), a)
	if err != nil {
		t.Fatal(err)
	}
	if string(got.Raw) != "report" || got.CPUThreads != 64 || got.MemoryBytes != 512<<30 || got.DiskCount != 2 || got.DiskBytes != 8<<40 {
		t.Errorf("stored hardware report %+v", got)
	}
	in, err := db.GetInstallation(t.Context(), installed)
	if err != nil {
		t.Fatal(err)
	}
	if !in.Installed() {
		t.Errorf("installation %+v, want installed", in)
	}
	if _, err := db.GetAgentHeartbeat(t.Context(), uuid.New()); !errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("heartbeat of an unknown machine: %v", err)
	}
	for _, m := range []uuid.UUID{a, b, installed} {
		if _, err := db.GetAgentHeartbeat(t.Context(), m); err != nil {
			t.Errorf("heartbeat of %s: %v", m, err)
		}
	}

	// After a recovery the old key is worthless.
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error { return tx.ClearAgent(ctx, b) })
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error { return tx.SetAgentStarted(ctx, b, newKey(t)) })
	res, err = db.RecordHeartbeats(t.Context(), []bmdb.Heartbeat{{MachineID: b, AgentKey: keyB}})
	if err != nil {
		t.Fatal(err)
	}
	if res[0].Accepted {
		t.Error("heartbeat with the key from before the recovery was accepted")
	}
	if _, err := db.GetAgentHeartbeat(t.Context(), b); !errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("rejected heartbeat left a row: %v", err)
	}
}
