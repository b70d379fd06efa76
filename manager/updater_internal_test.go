package manager

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/provider"
)

// listing is a provider whose listing is machines, or err.
type listing struct {
	named
	machines []provider.Machine
	err      error
}

func (l listing) ListMachines(context.Context) ([]provider.Machine, error) { return l.machines, l.err }

// TestUpdaterPassWhenChangingUnknown: when the BMDB cannot say whether a
// machine is changing, a pass reports it as changing (the short period is
// the safe one) and returns that error, unless the pass failed itself:
// then its own error is the one returned.
func TestUpdaterPassWhenChangingUnknown(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "updater", time.Minute)
	errChanging, errListing := errors.New("cannot tell"), errors.New("listing failed")
	for _, tt := range []struct {
		name      string
		listErr   error
		changeErr error
		want      error
	}{
		{"pass and look succeed", nil, nil, nil},
		{"the look fails", nil, errChanging, errChanging},
		{"both fail", errListing, errChanging, errListing},
	} {
		u, err := NewUpdater(UpdaterConfig{}, db.DB, listing{named: named{name: "lab"}, err: tt.listErr}, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		u.isChanging = func(context.Context) (bool, error) { return false, tt.changeErr }
		r, err := u.Pass(t.Context(), s)
		if !errors.Is(err, tt.want) || (tt.want == nil && err != nil) {
			t.Errorf("%s: Pass() error = %v, want %v", tt.name, err, tt.want)
		}
		if r.Changing != (tt.changeErr != nil) {
			t.Errorf("%s: Changing = %v, want %v", tt.name, r.Changing, tt.changeErr != nil)
		}
	}
}
