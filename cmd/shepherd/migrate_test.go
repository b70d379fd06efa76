package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

func TestMain(m *testing.M) { bmdbtest.Main(m) }

func run(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := newRootCommand()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(args)
	err := cmd.ExecuteContext(t.Context())
	return out.String(), err
}

func TestMigrateCommands(t *testing.T) {
	url := bmdbtest.NewEmptyDatabase(t)
	out, err := run(t, "migrate", "status", "--database-url", url)
	if err != nil || !strings.Contains(out, "pending") || strings.Contains(out, "applied ") {
		t.Fatalf("status of an empty database: %v\n%s", err, out)
	}
	out, err = run(t, "migrate", "up", "--database-url", url)
	if err != nil || !strings.Contains(out, "applied 00001_init.sql") {
		t.Fatalf("migrate up: %v\n%s", err, out)
	}
	out, err = run(t, "migrate", "status", "--database-url", url)
	if err != nil || strings.Contains(out, "pending") {
		t.Fatalf("status after migrate up: %v\n%s", err, out)
	}
	out, err = run(t, "migrate", "up", "--database-url", url)
	if err != nil || strings.Contains(out, "applied 0") {
		t.Fatalf("second migrate up applied something: %v\n%s", err, out)
	}
	t.Setenv("SHEPHERD_DATABASE_URL", "")
	if _, err := run(t, "migrate", "up"); err == nil || !strings.Contains(err.Error(), "--database-url") {
		t.Fatalf("migrate up without a database: %v", err)
	}
}
