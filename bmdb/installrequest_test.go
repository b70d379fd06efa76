package bmdb_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// TestRequestInstallationDecommissioned: an installation request on a
// machine being decommissioned, or decommissioned, fails with
// ErrDecommissioned (not ErrNotFound) and stores nothing; an unknown
// machine is ErrNotFound.
func TestRequestInstallationDecommissioned(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	m := bmdbtest.AddMachine(t, db, s, "p")
	if err := db.RequestDecommission(t.Context(), m, "alice", "disk failed"); err != nil {
		t.Fatal(err)
	}
	_, err := db.RequestInstallation(t.Context(), m, "tester", []byte("request"))
	if !errors.Is(err, bmdb.ErrDecommissioned) || errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("requesting an installation on a machine being decommissioned: %v, want ErrDecommissioned", err)
	}
	// Checked before the decommission, which deletes every tag.
	if in, err := db.GetInstallation(t.Context(), m); err != nil || in.RequestGeneration != 0 {
		t.Errorf("installation of the machine being decommissioned: %+v, %v; want none requested", in, err)
	}
	err = s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		_, err := tx.Decommission(ctx, m, true)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	_, err = db.RequestInstallation(t.Context(), m, "tester", []byte("request"))
	if !errors.Is(err, bmdb.ErrDecommissioned) || errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("requesting an installation on a decommissioned machine: %v, want ErrDecommissioned", err)
	}
	if in, err := db.GetInstallation(t.Context(), m); err != nil || in.RequestGeneration != 0 {
		t.Errorf("installation of the decommissioned machine: %+v, %v; want none requested", in, err)
	}
	if _, err := db.RequestInstallation(t.Context(), uuid.New(), "tester", []byte("request")); !errors.Is(err, bmdb.ErrNotFound) || errors.Is(err, bmdb.ErrDecommissioned) {
		t.Errorf("requesting an installation on an unknown machine: %v, want ErrNotFound", err)
	}
}
