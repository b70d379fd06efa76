package bmdb_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// TestAcceptHostKey walks a changed host key through the BMDB: the key a
// machine presents instead of the recorded one is kept, an operator accepts
// exactly that key by its fingerprint, and the accept replaces the key,
// clears the agent start's quarantine and the recovery's backoff, and
// writes history, all at once. Wrong fingerprints change nothing.
func TestAcceptHostKey(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	id := bmdbtest.AddMachine(t, db, s, "lab")
	ctx := t.Context()
	old, offered, later := []byte("old-key"), []byte("offered-key"), []byte("later-key")

	if _, err := db.AcceptHostKey(ctx, id, bmdb.HostKeyFingerprint(offered), "alice", ""); !errors.Is(err, bmdb.ErrNotFound) {
		t.Fatalf("accepting without a recorded key: %v, want ErrNotFound", err)
	}
	if kept, err := db.OfferHostKey(ctx, id, offered); err != nil || kept {
		t.Fatalf("offering a key with none recorded: %v, %v; want not kept", kept, err)
	}
	if _, _, err := db.RecordHostKey(ctx, id, old, false); err != nil {
		t.Fatal(err)
	}
	if kept, err := db.OfferHostKey(ctx, id, old); err != nil || kept {
		t.Fatalf("offering the recorded key: %v, %v; want not kept", kept, err)
	}
	if _, err := db.AcceptHostKey(ctx, id, bmdb.HostKeyFingerprint(offered), "alice", ""); !errors.Is(err, bmdb.ErrNoOfferedHostKey) {
		t.Fatalf("accepting with nothing offered: %v, want ErrNoOfferedHostKey", err)
	}
	if kept, err := db.OfferHostKey(ctx, id, offered); err != nil || !kept {
		t.Fatalf("offering another key: %v, %v; want kept", kept, err)
	}
	d, err := db.GetMachine(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if string(d.HostKey) != string(old) || string(d.OfferedHostKey) != string(offered) || d.OfferedHostKeyAt == nil {
		t.Fatalf("machine shows key %q, offered %q at %v", d.HostKey, d.OfferedHostKey, d.OfferedHostKeyAt)
	}

	// The agent start is quarantined and the recovery backed off over it.
	db.Exec(t, `INSERT INTO work_backoff (machine_id, process, backoff_until, cause, last_interval_ms, attempts, quarantined_at)
		VALUES ($1, 'AgentStart', now() + interval '1 hour', 'SSH host key mismatch', 3600000, 9, now()),
		       ($1, 'Recovery', now() + interval '1 hour', 'SSH host key mismatch', 3600000, 2, NULL)`, id)
	before := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work_history WHERE machine_id = $1", id)

	// The machine presented yet another key since the operator looked.
	if _, err := db.OfferHostKey(ctx, id, later); err != nil {
		t.Fatal(err)
	}
	_, err = db.AcceptHostKey(ctx, id, bmdb.HostKeyFingerprint(offered), "alice", "")
	if !errors.Is(err, bmdb.ErrOfferedHostKeyDiffers) || !strings.Contains(err.Error(), bmdb.HostKeyFingerprint(later)) {
		t.Fatalf("accepting a key no longer offered: %v, want ErrOfferedHostKeyDiffers naming the new one", err)
	}
	if key, _, _ := db.HostKey(ctx, id); string(key) != string(old) {
		t.Fatalf("a refused accept changed the key to %q", key)
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work_backoff WHERE machine_id = $1", id); n != 2 {
		t.Fatalf("a refused accept left %d backoffs, want 2", n)
	}

	ch, err := db.AcceptHostKey(ctx, id, bmdb.HostKeyFingerprint(later), "alice@ops", "reinstalled by the DC team")
	if err != nil {
		t.Fatal(err)
	}
	if string(ch.Old) != string(old) || string(ch.New) != string(later) || ch.OldPinned || ch.NewFingerprint != bmdb.HostKeyFingerprint(later) {
		t.Errorf("change %+v", ch)
	}
	key, pinned, err := db.HostKey(ctx, id)
	if err != nil || string(key) != string(later) || pinned {
		t.Errorf("after the accept the key is %q (pinned %v, %v), want the accepted one, recorded", key, pinned, err)
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work_backoff WHERE machine_id = $1", id); n != 0 {
		t.Errorf("after the accept %d backoffs remain, want none", n)
	}
	h, err := db.History(ctx, bmdb.HistoryFilter{MachineID: id})
	if err != nil {
		t.Fatal(err)
	}
	if len(h) != int(before)+2 {
		t.Fatalf("the accept wrote %d history rows, want 2: %+v", len(h)-int(before), h)
	}
	procs := map[bmdb.Process]bool{}
	for _, e := range h[before:] {
		procs[e.Process] = true
		if e.Event != bmdb.EventReset || !strings.Contains(e.Cause, bmdb.HostKeyFingerprint(old)+" replaced by "+bmdb.HostKeyFingerprint(later)) ||
			!strings.Contains(e.Cause, "alice@ops") || !strings.Contains(e.Cause, "reinstalled by the DC team") {
			t.Errorf("history %+v", e)
		}
	}
	if !procs[bmdb.ProcessAgentStart] || !procs[bmdb.ProcessRecovery] {
		t.Errorf("history Reset for %v, want AgentStart and Recovery", procs)
	}
	if _, err := db.AcceptHostKey(ctx, id, bmdb.HostKeyFingerprint(later), "alice", ""); !errors.Is(err, bmdb.ErrNoOfferedHostKey) {
		t.Errorf("accepting twice: %v, want ErrNoOfferedHostKey", err)
	}

	// Without backoffs the accept still writes the agent start's history.
	if _, err := db.OfferHostKey(ctx, id, old); err != nil {
		t.Fatal(err)
	}
	if _, err := db.AcceptHostKey(ctx, id, bmdb.HostKeyFingerprint(old), "bob", ""); err != nil {
		t.Fatal(err)
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work_history WHERE machine_id = $1", id); n != before+3 {
		t.Errorf("an accept without backoffs wrote %d rows, want 1", n-before-2)
	}
}

// TestClearHostKeyKeepsPin: a reinstall forgets a key recorded on first
// use, and the key the machine presented instead, but not a pinned key.
func TestClearHostKeyKeepsPin(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	recorded, pinned := bmdbtest.AddMachine(t, db, s, "lab"), bmdbtest.AddMachine(t, db, s, "lab")
	ctx := t.Context()
	if _, _, err := db.RecordHostKey(ctx, recorded, []byte("first-use"), false); err != nil {
		t.Fatal(err)
	}
	if _, err := db.OfferHostKey(ctx, recorded, []byte("other")); err != nil {
		t.Fatal(err)
	}
	if _, _, err := db.RecordHostKey(ctx, pinned, []byte("pin"), true); err != nil {
		t.Fatal(err)
	}
	err := s.Transact(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
		if err := tx.ClearHostKey(ctx, recorded); err != nil {
			return err
		}
		return tx.ClearHostKey(ctx, pinned)
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := db.HostKey(ctx, recorded); !errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("the key recorded on first use after ClearHostKey: %v, want ErrNotFound", err)
	}
	if key, isPinned, err := db.HostKey(ctx, pinned); err != nil || string(key) != "pin" || !isPinned {
		t.Errorf("the pinned key after ClearHostKey: %q pinned %v, %v; want it kept", key, isPinned, err)
	}
}
