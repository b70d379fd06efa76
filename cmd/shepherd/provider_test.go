package main

import (
	"strings"
	"testing"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

func TestProviderAcceptListing(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"--max-missing", "4"}, "--provider is required"},
		{[]string{"--provider", "lab"}, "--max-missing must be at least 1"},
		{[]string{"--provider", "lab", "--max-missing", "4", "--valid-for", "48h"}, "--valid-for must be within"},
		{[]string{"--provider", "lab", "--max-missing", "4", "--valid-for", "-1m"}, "--valid-for must be within"},
	} {
		args := append([]string{"provider", "accept-listing", "--database-url", db.URL}, tt.args...)
		if _, err := run(t, args...); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("shepherd %s: %v, want an error containing %q", strings.Join(tt.args, " "), err, tt.want)
		}
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM provider_state"); n != 0 {
		t.Fatalf("refused commands recorded %d acceptances", n)
	}

	out, err := run(t, "provider", "accept-listing", "--database-url", db.URL, "--provider", "lab", "--max-missing", "40", "--valid-for", "30m")
	if err != nil || !strings.Contains(out, "the next listing of lab that lacks at most 40 machines is believed") {
		t.Fatalf("accept-listing: %v\n%s", err, out)
	}
	if n := bmdbtest.Scalar[int64](t, db, `SELECT count(*) FROM provider_state WHERE provider = 'lab'
		AND listing_accept_max_missing = 40 AND listing_accept_by <> ''
		AND listing_accept_until BETWEEN now() + interval '29 minutes' AND now() + interval '30 minutes'`); n != 1 {
		t.Errorf("the acceptance is not recorded as given")
	}
}
