package bmdb_test

import (
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// TestCandidateStatementsCallNoPlannedSQLFunction checks that no candidate
// statement calls a SQL-language function of ours that PostgreSQL does not
// inline. Such a call starts the SQL function executor, which parses and
// plans the function's body again in every statement that calls it: it cost
// the recovery statements, which called heartbeat_recording_impaired once
// per arm, about 0.3 ms each (migration 00025). PL/pgSQL functions keep
// their plans for the connection's life, and an inlined SQL function is no
// call at all (it does not appear in the plan).
func TestCandidateStatementsCallNoPlannedSQLFunction(t *testing.T) {
	db := bmdbtest.New(t)
	names := strings.Split(bmdbtest.Scalar[string](t, db, `
		SELECT COALESCE(string_agg(p.proname::text, ','), '') FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
		WHERE p.pronamespace = 'public'::regnamespace AND l.lanname = 'sql'`), ",")
	if names[0] == "" {
		t.Fatal("no SQL function of ours found: the check below would check nothing")
	}
	calls := make(map[string]*regexp.Regexp, len(names))
	for _, n := range names {
		calls[n] = regexp.MustCompile(`\b` + regexp.QuoteMeta(n) + `\(`)
	}
	cases := []struct {
		process bmdb.Process
		cands   bmdb.Candidates
	}{
		{bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p")},
		{bmdb.ProcessRecovery, bmdb.RecoveryCandidates("p", 30*time.Minute, 10*time.Minute)},
		{bmdb.ProcessDecommission, bmdb.DecommissionCandidates("p")},
	}
	for _, c := range cases {
		plans, err := db.ExplainVerboseCandidates(t.Context(), c.process, c.cands)
		if err != nil {
			t.Fatal(err)
		}
		for _, p := range plans {
			for name, call := range calls {
				if call.MatchString(p.Plan) {
					t.Errorf("%s, %s statement calls SQL function %s, which PostgreSQL did not inline: it plans the function's body in every statement (make it inlinable or PL/pgSQL)\n%s",
						c.cands, p.Statement, name, p.Plan)
				}
			}
		}
	}
}
