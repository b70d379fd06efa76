package bmdb_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/shepherd/shepherd/bmdb"
)

func TestRetryOpen(t *testing.T) {
	t.Parallel()
	pg := func(code string) error { return &pgconn.PgError{Severity: "FATAL", Code: code, Message: "m"} }
	// A multi-host URL's error names every host's failure.
	hosts := func(errs ...error) error { return fmt.Errorf("bmdb: connecting: %w", errors.Join(errs...)) }
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"nil", nil, false},
		{"starting up", hosts(pg("57P03")), true},
		{"primary starting, standby read-only", hosts(pg("57P03"), errors.New("ValidateConnect failed: read only connection")), true},
		{"terminated by an administrator", pg("57P01"), true},
		{"connection exception", pg("08006"), true},
		{"read-only transaction during migration", fmt.Errorf("migrating: %w", pg("25006")), true},
		{"password refused", hosts(pg("28P01")), false},
		{"no such role", pg("28000"), false},
		{"no such database", pg("3D000"), false},
		{"one host refuses the login", hosts(pg("57P03"), pg("28P01")), false},
		{"a schema newer than the binary", errors.New("bmdb: the database schema is at version 99, newer than this binary's 14"), false},
		{"a syntax error", pg("42601"), false},
	} {
		if got := bmdb.RetryOpen(tc.err); got != tc.want {
			t.Errorf("%s: RetryOpen(%v) = %v, want %v", tc.name, tc.err, got, tc.want)
		}
	}
}
