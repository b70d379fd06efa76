package main

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// generate writes defs (file name to content) into a directory, runs the
// generator over it and returns the generated statements by name.
func generate(t *testing.T, defs map[string]string) map[string]string {
	t.Helper()
	in := t.TempDir()
	for name, text := range defs {
		if err := os.WriteFile(filepath.Join(in, name), []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	out := filepath.Join(t.TempDir(), "gen.sql")
	if err := run(in, out); err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	stmts := map[string]string{}
	for _, part := range regexp.MustCompile(`(?m)^-- name: `).Split(string(raw), -1)[1:] {
		name, _, _ := strings.Cut(part, " ")
		stmts[name] = part
	}
	return stmts
}

const twoReads = `-- Machines the test selects.
-- +gencandidates:claim-sets test_claimed_at = now(), test_claims = p.test_claims + 1
SELECT p.machine_id, p.since
FROM machine_provided p
JOIN machine_provided_extra x ON x.machine_id = p.machine_id
WHERE p.provider = @provider::text
  AND EXISTS (SELECT 1 FROM machine_provided p2 WHERE p2.machine_id = p.machine_id)
UNION ALL
SELECT p.machine_id, p.since
FROM machine_status s
JOIN machine_provided p ON p.machine_id = s.machine_id
WHERE p.provider = @provider::text
`

// TestClaimSetsGoesIntoTheClaimsOnly: the claim-sets directive's
// assignments are made by the definition's two claims, where they update
// the claimed machine; not by other definitions' claims or the hold of a
// named machine, and the directive is no part of the statements' comments.
func TestClaimSetsGoesIntoTheClaimsOnly(t *testing.T) {
	stmts := generate(t, map[string]string{"with_sets.sql": twoReads, "plain.sql": "-- Other machines.\nSELECT p.machine_id, p.since FROM machine_provided p\n"})
	const set = "SET revision = p.revision + 1,\n        test_claimed_at = now(), test_claims = p.test_claims + 1\n    FROM candidate c"
	for _, name := range []string{"ClaimWithSetsCandidate", "ClaimWithSetsCandidatePlain"} {
		if !strings.Contains(stmts[name], set) {
			t.Errorf("%s does not make the assignments in its update of the claimed machine:\n%s", name, stmts[name])
		}
	}
	for _, name := range []string{"ClaimPlainCandidate", "ClaimPlainCandidatePlain", "WorkHold"} {
		if !strings.Contains(stmts[name], "SET revision = p.revision + 1\n    FROM candidate c") || strings.Contains(stmts[name], "test_claimed_at") {
			t.Errorf("%s's update of the claimed machine is not the plain one:\n%s", name, stmts[name])
		}
	}
	for name, text := range stmts {
		if strings.Contains(text, "+gencandidates") {
			t.Errorf("%s carries a directive in its text", name)
		}
	}
}

// TestClaimSetsNeedsAnAssignment: a claim-sets directive without
// assignments, or a directive that only starts like it, is refused,
// naming the file; an empty one used to pass as a comment.
func TestClaimSetsNeedsAnAssignment(t *testing.T) {
	for _, c := range []struct{ line, want string }{
		{"-- +gencandidates:claim-sets   ", "names no assignment"},
		{"-- +gencandidates:claim-sets", "names no assignment"},
		{"-- +gencandidates:claim-setsx = 1", "unknown directive"},
	} {
		in := t.TempDir()
		path := filepath.Join(in, "bad.sql")
		if err := os.WriteFile(path, []byte("-- Bad.\n"+c.line+"\nSELECT p.machine_id, p.since FROM machine_provided p\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		err := run(in, filepath.Join(t.TempDir(), "gen.sql"))
		if err == nil || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: run: %v, want an error naming %s that says %q", c.line, err, path, c.want)
		}
	}
}

// TestMatchesReadsTheCheckedMachine: the Matches check reads every
// machine_provided p of the definition as the one machine it checks,
// fetched by its primary key; the other statements read the table.
func TestMatchesReadsTheCheckedMachine(t *testing.T) {
	stmts := generate(t, map[string]string{"with_sets.sql": twoReads})
	m := stmts["WithSetsMatches"]
	if !strings.Contains(m, "WITH checked_machine AS MATERIALIZED (\n    SELECT * FROM machine_provided WHERE machine_id = @machine_id::uuid\n)") {
		t.Errorf("Matches does not read the machine by its primary key first:\n%s", m)
	}
	if n := strings.Count(m, "checked_machine p\n") + strings.Count(m, "checked_machine p ON"); n != 2 {
		t.Errorf("Matches reads the checked machine %d times, want both reads of machine_provided p:\n%s", n, m)
	}
	if regexp.MustCompile(`machine_provided p\b`).MatchString(m) {
		t.Errorf("Matches still reads machine_provided p:\n%s", m)
	}
	if !strings.Contains(m, "FROM machine_provided p2 WHERE") {
		t.Errorf("Matches changed a read of machine_provided under another alias:\n%s", m)
	}
	for _, name := range []string{"ListWithSetsCandidates", "CountWithSetsCandidates", "CountWithSetsMatching", "ClaimWithSetsCandidate"} {
		if strings.Contains(stmts[name], "checked_machine") || strings.Count(stmts[name], "machine_provided p\n") == 0 {
			t.Errorf("%s does not read machine_provided as defined:\n%s", name, stmts[name])
		}
	}
}
