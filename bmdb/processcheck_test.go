package bmdb_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// foreignKeyViolation is the SQLSTATE the process checks raise, as the
// foreign keys they replace did.
const foreignKeyViolation = "23503"

func isForeignKeyViolation(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == foreignKeyViolation
}

// claimAndFinish claims agent start on a machine of provider "p" for s and
// finishes it: the cycle P2 measures. It returns the machine.
func claimAndFinish(t *testing.T, s *bmdb.Session) uuid.UUID {
	t.Helper()
	w, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"))
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Finish(t.Context(), nil); err != nil {
		t.Fatal(err)
	}
	return w.MachineID
}

// checkCase is a statement that the checks replacing a foreign key (the
// process checks, migration 00019; the machine checks, 00022) must let
// through or refuse, as the foreign key did.
type checkCase struct {
	name    string
	setup   string // run first; $1 is a machine, $2 a live session
	sql     string // $1 is the machine, $2 the session
	wantErr bool
}

// runChecks runs each case on a fresh database with a machine made by
// addMachine, and checks it fails with a foreign key violation exactly when
// it should.
func runChecks(t *testing.T, cases []checkCase, addMachine func(t *testing.T, db *bmdbtest.DB, s *bmdb.Session) uuid.UUID) {
	t.Helper()
	for _, tt := range cases {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			db := bmdbtest.New(t)
			s := bmdbtest.Session(t, db, "test", time.Minute)
			id := addMachine(t, db, s)
			if tt.setup != "" {
				db.Exec(t, tt.setup, id, s.ID())
			}
			_, err := db.Pool.Exec(t.Context(), tt.sql, id, s.ID())
			if got := isForeignKeyViolation(err); got != tt.wantErr || (err != nil && !got) {
				t.Fatalf("error = %v, want a foreign key violation: %t", err, tt.wantErr)
			}
		})
	}
}

// TestClaimAndFinishLockNoProcessRow checks that a claim and its finish
// leave the processes row alone (migration 00019): every worker of a
// process references the same row, and a row lock on it from each of them
// turns into a new MultiXact per claim and per finish, WAL that the commit
// flush waits for.
func TestClaimAndFinishLockNoProcessRow(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	bmdbtest.AddMachine(t, db, s, "p")
	id := claimAndFinish(t, s)
	// A row lock sets xmax: the locker's transaction id, or a MultiXact.
	if xmax := bmdbtest.Scalar[string](t, db, `SELECT xmax::text FROM processes WHERE process = 'AgentStart'`); xmax != "0" {
		t.Errorf("processes row AgentStart has xmax %s after a claim and a finish, want 0 (not locked)", xmax)
	}
	if got := bmdbtest.History(t, db, id); len(got) != 2 {
		t.Errorf("history = %q, want Started and Finished", got)
	}
}

// TestProcessChecks checks that work and history still name only known
// processes, with the right exclusive flag, and that a process stays while
// anything names it: what the foreign keys to processes guaranteed.
func TestProcessChecks(t *testing.T) {
	t.Parallel()
	const (
		addWork    = `INSERT INTO work (machine_id, process, machine_exclusive, session_id) VALUES ($1, 'AgentStart', true, $2)`
		addHistory = `INSERT INTO work_history (machine_id, process, event, session_id) VALUES ($1, 'Reinstall', 'Reset', $2)`
	)
	runChecks(t, []checkCase{
		{"work of a known process", "", addWork, false},
		{"work of an unknown process", "", `INSERT INTO work (machine_id, process, machine_exclusive, session_id) VALUES ($1, 'Nope', true, $2)`, true},
		{"work with the wrong exclusive flag", "", `INSERT INTO work (machine_id, process, machine_exclusive, session_id) VALUES ($1, 'ProviderUpdate', true, $2)`, true},
		{"work moved to an unknown process", addWork, `UPDATE work SET process = 'Nope' WHERE machine_id = $1 AND session_id = $2`, true},
		{"work given the wrong exclusive flag", addWork, `UPDATE work SET machine_exclusive = false WHERE machine_id = $1 AND session_id = $2`, true},
		{"history of a known process", "", addHistory, false},
		{"history of an unknown process", "", `INSERT INTO work_history (machine_id, process, event, session_id) VALUES ($1, 'Nope', 'Reset', $2)`, true},
		{"history moved to an unknown process", addHistory, `UPDATE work_history SET process = 'Nope' WHERE machine_id = $1 AND session_id = $2`, true},
		{"deleting a process nothing names", "", `DELETE FROM processes WHERE process = 'Reinstall' AND $1::uuid <> $2::uuid`, false},
		{"deleting a process history names", addHistory, `DELETE FROM processes WHERE process = 'Reinstall' AND $1::uuid <> $2::uuid`, true},
	}, func(t *testing.T, db *bmdbtest.DB, s *bmdb.Session) uuid.UUID {
		return bmdbtest.AddMachine(t, db, s, "p")
	})
}

// TestProcessStaysWhileNamed checks that a process cannot be deleted, or
// its name or exclusive flag changed, while work or history names it, and
// that its deletion waits for a transaction that is adding history for it
// (and then fails) instead of missing the uncommitted row.
func TestProcessStaysWhileNamed(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	id := bmdbtest.AddMachine(t, db, s, "p")
	ctx := t.Context()

	// Named by work: neither deleted nor changed.
	db.Exec(t, `INSERT INTO work (machine_id, process, machine_exclusive, session_id) VALUES ($1, 'Decommission', true, $2)`, id, s.ID())
	for _, sql := range []string{
		`DELETE FROM processes WHERE process = 'Decommission'`,
		`UPDATE processes SET process = 'Decommissioning' WHERE process = 'Decommission'`,
		`UPDATE processes SET machine_exclusive = false WHERE process = 'Decommission'`,
	} {
		if _, err := db.Pool.Exec(ctx, sql); !isForeignKeyViolation(err) {
			t.Errorf("%s: error = %v, want a foreign key violation", sql, err)
		}
	}
	// An update that changes neither is no change to what work names.
	db.Exec(t, `UPDATE processes SET machine_exclusive = true WHERE process = 'Decommission'`)

	// History being added in an open transaction: the deletion waits for it.
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	if _, err := tx.Exec(ctx, `INSERT INTO work_history (machine_id, process, event, session_id) VALUES ($1, 'Reinstall', 'Reset', $2)`, id, s.ID()); err != nil {
		t.Fatal(err)
	}
	deleted := make(chan error, 1)
	go func() {
		_, err := db.Pool.Exec(ctx, `DELETE FROM processes WHERE process = 'Reinstall'`)
		deleted <- err
	}()
	bmdbtest.WaitFor(t, 10*time.Second, "deletion of the process waits for the history insert", func(ctx context.Context) (bool, error) {
		return bmdbtest.LockWaiters(ctx, db)
	})
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-deleted; !isForeignKeyViolation(err) {
		t.Errorf("deleting a process whose history committed meanwhile: error = %v, want a foreign key violation", err)
	}
	if n := bmdbtest.Scalar[int64](t, db, `SELECT count(*) FROM processes WHERE process = 'Reinstall'`); n != 1 {
		t.Errorf("process Reinstall: %d rows, want 1", n)
	}
}
