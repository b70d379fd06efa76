package bmdb_test

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// TestClaimAndFinishLockNoMachineRow checks that a claim and its finish
// leave the machines row alone (migration 00022): a foreign key check's row
// lock on it is a WAL record per claim and per finish that the commit flush
// waits for.
func TestClaimAndFinishLockNoMachineRow(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	id := bmdbtest.AddMachine(t, db, s, "p")
	// Adding the machine's tags locked it (their foreign keys do).
	xmax0 := bmdbtest.Scalar[string](t, db, `SELECT xmax::text FROM machines WHERE machine_id = $1`, id)
	claimAndFinish(t, s)
	// A row lock sets xmax: the locker's transaction id, or a MultiXact.
	if xmax := bmdbtest.Scalar[string](t, db, `SELECT xmax::text FROM machines WHERE machine_id = $1`, id); xmax != xmax0 {
		t.Errorf("machines row has xmax %s after a claim and a finish, want %s (not locked since the machine was added)", xmax, xmax0)
	}
	if got := bmdbtest.History(t, db, id); len(got) != 2 {
		t.Errorf("history = %q, want Started and Finished", got)
	}
}

// TestMachineChecks checks that work and history name only machines that
// exist, that deleting a machine deletes its work and is refused while
// history names it, and that a machine's id does not change while work or
// history names it: what the foreign keys to machines guaranteed.
func TestMachineChecks(t *testing.T) {
	t.Parallel()
	const (
		addWork    = `INSERT INTO work (machine_id, process, machine_exclusive, session_id) VALUES ($1, 'AgentStart', true, $2)`
		addHistory = `INSERT INTO work_history (machine_id, process, event, session_id) VALUES ($1, 'Reinstall', 'Reset', $2)`
	)
	runChecks(t, []checkCase{
		{"work of a machine", "", addWork, false},
		{"work of no machine", "", `INSERT INTO work (machine_id, process, machine_exclusive, session_id) VALUES (gen_random_uuid(), 'AgentStart', true, $2) RETURNING $1::uuid`, true},
		{"work moved to no machine", addWork, `UPDATE work SET machine_id = gen_random_uuid() WHERE machine_id = $1 AND session_id = $2`, true},
		{"history of a machine", "", addHistory, false},
		{"history of no machine", "", `INSERT INTO work_history (machine_id, process, event, session_id) VALUES (gen_random_uuid(), 'Reinstall', 'Reset', $2) RETURNING $1::uuid`, true},
		{"history moved to no machine", addHistory, `UPDATE work_history SET machine_id = gen_random_uuid() WHERE machine_id = $1 AND session_id = $2`, true},
		{"deleting a machine nothing names", "", `DELETE FROM machines WHERE machine_id = $1 AND $2::uuid IS NOT NULL`, false},
		{"deleting a machine with work", addWork, `DELETE FROM machines WHERE machine_id = $1 AND $2::uuid IS NOT NULL`, false},
		{"deleting a machine history names", addHistory, `DELETE FROM machines WHERE machine_id = $1 AND $2::uuid IS NOT NULL`, true},
		{"changing the id of a machine with work", addWork, `UPDATE machines SET machine_id = gen_random_uuid() WHERE machine_id = $1 AND $2::uuid IS NOT NULL`, true},
		{"changing the id of a machine history names", addHistory, `UPDATE machines SET machine_id = gen_random_uuid() WHERE machine_id = $1 AND $2::uuid IS NOT NULL`, true},
		{"changing another column of a machine history names", addHistory, `UPDATE machines SET decommissioned_at = now() WHERE machine_id = $1 AND $2::uuid IS NOT NULL`, false},
	}, untaggedMachine)
	// A deleted machine takes its work with it, as ON DELETE CASCADE did.
	t.Run("deletion deletes the work", func(t *testing.T) {
		t.Parallel()
		db := bmdbtest.New(t)
		s := bmdbtest.Session(t, db, "test", time.Minute)
		id := untaggedMachine(t, db, s)
		db.Exec(t, addWork, id, s.ID())
		db.Exec(t, `DELETE FROM machines WHERE machine_id = $1`, id)
		if n := bmdbtest.Scalar[int64](t, db, `SELECT count(*) FROM work WHERE machine_id = $1`, id); n != 0 {
			t.Errorf("%d work rows of the deleted machine, want 0", n)
		}
	})
}

// untaggedMachine adds a machine without tags, which nothing else
// references.
func untaggedMachine(t *testing.T, db *bmdbtest.DB, _ *bmdb.Session) uuid.UUID {
	t.Helper()
	return bmdbtest.Scalar[uuid.UUID](t, db, `INSERT INTO machines DEFAULT VALUES RETURNING machine_id`)
}

// TestMachineStaysWhileNamed checks that a machine's deletion waits for a
// transaction that is adding history for it (and then fails) instead of
// missing the uncommitted row, and that work added meanwhile goes with it.
func TestMachineStaysWhileNamed(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name    string
		sql     string // $1 is the machine, $2 a live session
		wantErr bool
	}{
		{"history", `INSERT INTO work_history (machine_id, process, event, session_id) VALUES ($1, 'Reinstall', 'Reset', $2)`, true},
		{"work", `INSERT INTO work (machine_id, process, machine_exclusive, session_id) VALUES ($1, 'AgentStart', true, $2)`, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			db := bmdbtest.New(t)
			s := bmdbtest.Session(t, db, "test", time.Minute)
			id := untaggedMachine(t, db, s)
			ctx := t.Context()
			tx, err := db.Pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(context.WithoutCancel(ctx))
			if _, err := tx.Exec(ctx, c.sql, id, s.ID()); err != nil {
				t.Fatal(err)
			}
			deleted := make(chan error, 1)
			go func() {
				_, err := db.Pool.Exec(ctx, `DELETE FROM machines WHERE machine_id = $1`, id)
				deleted <- err
			}()
			bmdbtest.WaitFor(t, 10*time.Second, "deletion of the machine waits for the insert", func(ctx context.Context) (bool, error) {
				return bmdbtest.LockWaiters(ctx, db)
			})
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			if err := <-deleted; isForeignKeyViolation(err) != c.wantErr || (err != nil && !c.wantErr) {
				t.Errorf("deleting a machine whose %s committed meanwhile: error = %v, want a foreign key violation: %t", c.name, err, c.wantErr)
			}
			want := int64(1)
			if !c.wantErr {
				want = 0
			}
			if n := bmdbtest.Scalar[int64](t, db, `SELECT count(*) FROM machines WHERE machine_id = $1`, id); n != want {
				t.Errorf("machine: %d rows, want %d", n, want)
			}
			if n := bmdbtest.Scalar[int64](t, db, `SELECT count(*) FROM work WHERE machine_id = $1`, id); c.name == "work" && n != 0 {
				t.Errorf("%d work rows of the deleted machine, want 0", n)
			}
		})
	}
}
