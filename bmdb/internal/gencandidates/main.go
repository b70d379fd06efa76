// Command gencandidates writes the candidate queries of SPEC §2.6 for sqlc.
//
// Each file in bmdb/candidates defines one candidate set as a plain SELECT of
// machine_id and since (when the machine became a candidate, which orders
// them oldest first), in terms of tags only. From that one definition this program
// writes the list, count and claim queries (and the plain-LIMIT claim the
// benchmark compares against), each wrapped in the same exclusions: live
// conflicting work, active backoff or quarantine, and decommission requests
// (except in the decommissioner's own query, marked by decommissionDirective);
// and, by tags alone, the count of matching machines and the match of one.
// Generating them keeps the count that feeds metrics from drifting away from
// the query that hands out work. The hold of one named machine (WorkHold,
// an operator's power action) is written here too, because it takes the
// claims' own steps once its machine is locked.
//
// A definition may come with a file <name>.cause next to it: an SQL
// expression over the claimed machine's machine_provided row p, evaluated
// by the claim in the statement that claims, whose text becomes the cause of
// the Started history row (what the claim saw: why the machine is worked on).
//
// Usage: go run ./bmdb/internal/gencandidates -in bmdb/candidates -out bmdb/queries/candidates.gen.sql
package main

import (
	"bytes"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"text/template"
)

// definition is one candidate set read from bmdb/candidates/<name>.sql.
type definition struct {
	Name   string // CamelCase, from the file name: agent_start.sql -> AgentStart
	Doc    string // the leading comment lines, without "--"
	Select string // the SELECT, indented for embedding
	// Matching is the SELECT of the Matching count: Select without the
	// lines marked with notInMatchingMarker.
	Matching string
	// One is Select for one machine (the Matches check): every read of
	// machine_provided p is the machine's row, found by its primary key.
	One string
	// Exclusions are the shared exclusions this definition is wrapped in.
	Exclusions string
	// StartedCause is the SQL of the cause the claim writes on the
	// Started history row, over the locked machine_provided row p: from
	// bmdb/candidates/<name>.cause if there is one (the recoverer's names
	// the silence it recovers), else ''.
	StartedCause string
	// Claim is the claim's steps after the candidate is locked, with the
	// definition's claimSetsDirective assignments.
	Claim string
}

// decommissionDirective, on a line of its own in a definition's leading
// comment, marks the decommissioner's own query (SPEC §2.6): machines with a
// decommission request are its candidates, so that exclusion is left out.
const decommissionDirective = "-- +gencandidates:decommission-requests-are-candidates"

// notInMatchingMarker ends a line of a definition that the Matching count
// leaves out. Candidate sets keep machines waiting in backoff out of their
// index ranges by conditions of their own (a hold that has not expired
// yet); the Matching count, which must count machines whatever backoff they
// wait in, drops those conditions.
const notInMatchingMarker = "-- +gencandidates:not-in-matching"

// exclusions is appended to every candidate set: the machine is not held by
// live work of this process or of a process excluded with it, and not backed
// off or quarantined for this process. Work held by
// a session whose deadline passed does not count: such a machine is free, and
// the claim below expires that work.
const exclusions = `NOT EXISTS (
        SELECT 1
        ` + liveConflictingWork + `)` + backoffExclusion

// liveConflictingWork selects the work that keeps machine c from the
// process: its own, or any machine-exclusive process's if it is one, held
// by a live session. The candidate queries exclude machines that have
// some; the hold names the process that holds the machine.
const liveConflictingWork = `FROM work w
        JOIN sessions s ON s.session_id = w.session_id
        WHERE w.machine_id = c.machine_id
          AND (w.process = @process OR (w.machine_exclusive AND @exclusive::boolean))
          AND s.deadline > now()
          AND s.closed_at IS NULL`

// liveSession finds the claiming session alive, and keeps it from being
// closed until the claim commits: its key-share lock lets renewal move the
// deadline but makes Close, which locks the row FOR UPDATE, wait for the
// claim and then cancel what it took. A claim that waited for a Close finds
// the row closed when it re-reads it, and claims nothing. Without the lock a
// claim whose snapshot predates Close would commit work for a closed session.
const liveSession = `
        SELECT 1 FROM sessions s
        WHERE s.session_id = @session_id AND s.deadline > now() AND s.closed_at IS NULL
        FOR KEY SHARE`

// backoffExclusion is the part of exclusions about backoff and quarantine.
const backoffExclusion = `
  AND NOT EXISTS (
        SELECT 1
        FROM work_backoff b
        WHERE b.machine_id = c.machine_id
          AND b.process = @process
          AND (b.backoff_until > now() OR b.quarantined_at IS NOT NULL))`

// oneMachine replaces each machine_provided p of a definition in the
// Matches check: the machine's row, read by its primary key in a
// materialized CTE, which the planner cannot look through. Without it the planner
// may choose to find the machine by scanning a partial candidate index and
// filtering on the id, and does when its statistics are stale in the way
// a fleet provisioned in bulk leaves them (analyzed while provisioning, so
// the index looks empty): a scan of every candidate for each check.
const oneMachine = "checked_machine p"

// providedP matches the definitions' reads of machine_provided as p.
var providedP = regexp.MustCompile(`\bmachine_provided p\b`)

// heldDirective, on a line of its own in a definition's leading comment,
// says that the definition itself leaves out the machines in backoff or
// quarantine for its process, through the holds the work_backoff trigger
// keeps on machine_provided (migration 00014), so backoffExclusion is left
// out: it would only repeat the test, and as an anti-join against every
// backoff of the fleet it costs as much as there are backoffs.
const heldDirective = "-- +gencandidates:holds-exclude-backoff"

// claimSetsDirective, followed by column assignments ("col = expr, ..."),
// on a line of its own in a definition's leading comment, adds those
// assignments to the update of the claimed machine's machine_provided row
// that every claim makes (it moves the revision). A definition whose
// since depends on them can so move a claimed machine within its index
// range (agent start moves it to the end: migration 00026).
const claimSetsDirective = "-- +gencandidates:claim-sets"

// decommissionExclusion is added to exclusions for every definition but the
// decommissioner's own: a machine being decommissioned is not worked on by
// anything else.
const decommissionExclusion = `
  AND NOT EXISTS (
        SELECT 1 FROM machine_decommission_request d WHERE d.machine_id = c.machine_id)`

var queries = template.Must(template.New("queries").Parse(`-- Code generated by gencandidates from bmdb/candidates. DO NOT EDIT.
{{range .Defs}}
-- name: List{{.Name}}Candidates :many
{{.Doc}}
SELECT c.machine_id
FROM (
{{.Select}}
) c
WHERE {{.Exclusions}}
ORDER BY c.since
LIMIT @row_limit::integer;

-- name: Count{{.Name}}Candidates :one
SELECT count(*)
FROM (
{{.Select}}
) c
WHERE {{.Exclusions}};

-- name: Count{{.Name}}Matching :one
-- Count{{.Name}}Matching counts the machines the definition selects by
-- their tags alone, whatever works on them or waits in backoff (the
-- recoverer's circuit breaker looks at how many machines are silent, not at
-- how many it could work on).
SELECT count(*)
FROM (
{{.Matching}}
) c;

-- name: {{.Name}}Matches :one
-- {{.Name}}Matches reports whether the definition selects one machine by
-- its tags alone: a worker that holds the machine asks it, in the
-- transaction that admits a side effect, to verify that the machine is
-- still what it was claimed for (a heartbeat does not end a claim). It
-- reads the machine's row by its primary key first (checked_machine), so
-- that no planner estimate can turn the check into a scan of the
-- candidates.
WITH checked_machine AS MATERIALIZED (
    SELECT * FROM machine_provided WHERE machine_id = @machine_id::uuid
)
SELECT EXISTS (
    SELECT 1
    FROM (
{{.One}}
    ) c
    WHERE c.machine_id = @machine_id::uuid
)::boolean AS matches;

-- name: Claim{{.Name}}Candidate :one
-- Claim{{.Name}}Candidate claims the oldest free candidate for the process
-- under the session, in one statement. It locks the machine_provided row of
-- the candidate, skipping rows other claimers hold, so that concurrent
-- workers spread over the candidates instead of queueing on the first; and it
-- locks the row only if its revision is still the one the snapshot read, so a
-- machine someone claimed (and maybe finished) since the snapshot was taken
-- is skipped, not handed out again. It moves the revision, expires work of
-- dead sessions on the machine (history Expired, naming the dead session),
-- inserts the work row and writes history Started, whose cause is what
-- the definition's cause expression made of the locked machine (why it is
-- a candidate; empty without one). The primary key and
-- work_machine_exclusive keep the work unique even if all that was not
-- enough, and the work_process_check trigger checks the exclusive flag
-- the caller passes (migration 00019). It returns the machine's Provided tag as the claim saw
-- it, which saves the worker a round trip, and the expired count and dead
-- sessions. No row means nothing to do or a dead session; a row without
-- claimed_id means the insert lost a race.
WITH candidate AS (
    SELECT p.machine_id, p.provider, p.provider_id, p.provider_reservation_id, p.provider_ip_address,
           p.provider_location, p.provider_status, p.provider_status_at, p.agent_phase,
           {{.StartedCause}} AS started_cause
    FROM (
        SELECT c.machine_id, c.since, seen.revision
        FROM (
{{.Select}}
        ) c
        JOIN machine_provided seen ON seen.machine_id = c.machine_id
        WHERE {{.Exclusions}}
        ORDER BY c.since
        LIMIT @scan_limit::integer
    ) c
    JOIN machine_provided p ON p.machine_id = c.machine_id AND p.revision = c.revision
    WHERE EXISTS ({{$.LiveSession}})
    ORDER BY c.since
    LIMIT 1
    FOR UPDATE OF p SKIP LOCKED
),
{{.Claim}}
-- name: Claim{{.Name}}CandidatePlain :one
-- Claim{{.Name}}CandidatePlain is the baseline the benchmark compares
-- Claim{{.Name}}Candidate against: the oldest candidate, locked with a plain
-- FOR UPDATE, so that concurrent workers pick the same machine and queue on it.
WITH candidate AS (
    SELECT p.machine_id, p.provider, p.provider_id, p.provider_reservation_id, p.provider_ip_address,
           p.provider_location, p.provider_status, p.provider_status_at, p.agent_phase,
           {{.StartedCause}} AS started_cause
    FROM (
        SELECT c.machine_id, c.since, seen.revision
        FROM (
{{.Select}}
        ) c
        JOIN machine_provided seen ON seen.machine_id = c.machine_id
        WHERE {{.Exclusions}}
        ORDER BY c.since
        LIMIT 1
    ) c
    JOIN machine_provided p ON p.machine_id = c.machine_id AND p.revision = c.revision
    WHERE EXISTS ({{$.LiveSession}})
    FOR UPDATE OF p
),
{{.Claim}}
{{- end}}
-- name: WorkHold :one
-- WorkHold claims one named machine for a machine-exclusive process under
-- the session, in one statement (an operator's power action: the machine is
-- chosen, not found). It takes the same steps as the candidate claims once
-- the machine is locked, and so writes history Started with the cause.
-- Unlike them it waits for a concurrent claim's lock on the machine rather
-- than skipping it (there is no other candidate to go to), and it returns,
-- as holder, the process of the live work that keeps it from the machine
-- ('' if none).
-- Backoffs and decommission requests do not keep an operator out. No row
-- means the session is dead or the machine has no Provided tag; a row
-- with neither holder nor claimed_id means the insert lost a race with a claim
-- its snapshot did not see.
WITH target AS (
    SELECT c.machine_id, c.provider, c.provider_id, c.provider_reservation_id, c.provider_ip_address,
           c.provider_location, c.provider_status, c.provider_status_at, c.agent_phase,
           COALESCE((SELECT w.process
        {{.Conflict}}
        ORDER BY w.started_at
        LIMIT 1), '')::text AS holder
    FROM machine_provided c
    WHERE c.machine_id = @machine_id
      AND EXISTS ({{.LiveSession}})
    FOR UPDATE OF c
),
candidate AS (
    SELECT t.machine_id FROM target t WHERE t.holder = ''
),
{{.HoldSteps}}
SELECT t.machine_id AS candidate_id, st.machine_id AS claimed_id, x.expired_count, x.expired_sessions, t.holder,
       t.provider, t.provider_id, t.provider_reservation_id, t.provider_ip_address,
       t.provider_location, t.provider_status, t.provider_status_at, t.agent_phase
FROM target t
LEFT JOIN started st ON true
CROSS JOIN (` + expiredCounts + `) x;
`))

// claimSteps is the part of every claim query (and of the hold) after the
// candidate is locked, up to the result. claimed reads expired_history so
// that the dead work is deleted before the insert that would otherwise
// collide with it. startedCause stands for the SQL of the cause of the
// Started row.
const claimSteps = `revised AS (
    UPDATE machine_provided p
    SET revision = p.revision + 1{{claim_sets}}
    FROM candidate c
    WHERE p.machine_id = c.machine_id
    RETURNING p.machine_id
),
expired AS (
    DELETE FROM work w
    USING sessions s, candidate c
    WHERE w.machine_id = c.machine_id
      AND s.session_id = w.session_id
      AND (w.process = @process OR (w.machine_exclusive AND @exclusive::boolean))
      AND NOT (s.deadline > now() AND s.closed_at IS NULL)
    RETURNING w.machine_id, w.process, w.session_id,
              dead_session_cause(s.session_id, s.component, s.hostname, s.pid, s.deadline, s.closed_at) AS cause
),
expired_history AS (
    INSERT INTO work_history (machine_id, process, event, session_id, cause)
    SELECT e.machine_id, e.process, 'Expired', e.session_id, e.cause
    FROM expired e
    RETURNING history_id
),
claimed AS (
    INSERT INTO work (machine_id, process, machine_exclusive, session_id)
    SELECT c.machine_id, @process, @exclusive::boolean, @session_id
    FROM candidate c
    WHERE (SELECT count(*) FROM expired_history) >= 0
    ON CONFLICT DO NOTHING
    RETURNING machine_id, process, session_id
),
started AS (
    INSERT INTO work_history (machine_id, process, event, session_id, cause)
    SELECT cl.machine_id, cl.process, 'Started', cl.session_id, ` + startedCause + `
    FROM claimed cl
    RETURNING machine_id
)`

// startedCause marks where claimSteps takes the Started row's cause.
const startedCause = "{{started_cause}}"

// claimSets marks where claimSteps takes a definition's
// claimSetsDirective assignments.
const claimSets = "{{claim_sets}}"

// steps is claimSteps with the Started row's cause and the assignments of
// claimSetsDirective (sets, "" for none).
func steps(cause, sets string) string {
	if sets != "" {
		sets = ",\n        " + sets
	}
	return strings.Replace(strings.Replace(claimSteps, startedCause, cause, 1), claimSets, sets, 1)
}

// claimResult is the end of every candidate claim query: the candidate, and
// the machine claimed if the insert won.
const claimResult = `SELECT c.machine_id AS candidate_id, st.machine_id AS claimed_id, x.expired_count, x.expired_sessions,
       c.provider, c.provider_id, c.provider_reservation_id, c.provider_ip_address,
       c.provider_location, c.provider_status, c.provider_status_at, c.agent_phase
FROM candidate c
LEFT JOIN started st ON true
CROSS JOIN (` + expiredCounts + `) x;
`

// expiredCounts is the claims' report of the dead work they expired: how
// many items, and the dead sessions that held them (comma-separated ids,
// empty if none), so that the log names them.
const expiredCounts = `SELECT count(*) AS expired_count,
           COALESCE((SELECT string_agg(DISTINCT e.session_id::text, ', ') FROM expired e), '')::text AS expired_sessions
    FROM expired_history`

func main() {
	in := flag.String("in", "bmdb/candidates", "directory of candidate definitions")
	out := flag.String("out", "bmdb/queries/candidates.gen.sql", "generated sqlc query file")
	flag.Parse()
	if err := run(*in, *out); err != nil {
		fmt.Fprintln(os.Stderr, "gencandidates:", err)
		os.Exit(1)
	}
}

func run(in, out string) error {
	files, err := filepath.Glob(filepath.Join(in, "*.sql"))
	if err != nil {
		return err
	}
	if len(files) == 0 {
		return fmt.Errorf("no candidate definitions in %s", in)
	}
	sort.Strings(files)
	var defs []definition
	for _, f := range files {
		d, err := parse(f)
		if err != nil {
			return err
		}
		defs = append(defs, d)
	}
	var buf bytes.Buffer
	err = queries.Execute(&buf, struct {
		Defs        []definition
		Conflict    string
		HoldSteps   string
		LiveSession string
	}{defs, liveConflictingWork, steps("@cause::text", ""), liveSession})
	if err != nil {
		return err
	}
	return os.WriteFile(out, buf.Bytes(), 0o644)
}

func parse(path string) (definition, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return definition{}, err
	}
	var doc, body, matching []string
	decommission, held := false, false
	sets := ""
	for _, line := range strings.Split(strings.TrimSpace(string(raw)), "\n") {
		if len(body) == 0 && strings.TrimSpace(line) == decommissionDirective {
			decommission = true
			continue
		}
		if len(body) == 0 && strings.TrimSpace(line) == heldDirective {
			held = true
			continue
		}
		if a, ok := strings.CutPrefix(strings.TrimSpace(line), claimSetsDirective); ok && len(body) == 0 {
			if a != "" && a[0] != ' ' && a[0] != '\t' {
				return definition{}, fmt.Errorf("%s: unknown directive %q", path, strings.TrimSpace(line))
			}
			if sets = strings.TrimSpace(a); sets == "" {
				return definition{}, fmt.Errorf("%s: %s names no assignment", path, claimSetsDirective)
			}
			continue
		}
		if len(body) == 0 && strings.HasPrefix(line, "--") {
			doc = append(doc, line)
			continue
		}
		if l, ok := strings.CutSuffix(strings.TrimRight(line, " "), notInMatchingMarker); ok {
			body = append(body, "        "+strings.TrimRight(l, " "))
			continue
		}
		body = append(body, "        "+line)
		matching = append(matching, "        "+line)
	}
	excl := exclusions
	if held {
		excl = strings.TrimSuffix(excl, backoffExclusion)
	}
	if !decommission {
		excl += decommissionExclusion
	}
	if len(doc) == 0 {
		return definition{}, fmt.Errorf("%s: the definition must start with a comment saying what it selects and why", path)
	}
	if len(body) == 0 || !strings.HasPrefix(strings.TrimSpace(body[0]), "SELECT") {
		return definition{}, fmt.Errorf("%s: expected a SELECT after the comment", path)
	}
	base := strings.TrimSuffix(filepath.Base(path), ".sql")
	cause := "''::text"
	if raw, err := os.ReadFile(strings.TrimSuffix(path, ".sql") + ".cause"); err == nil {
		var lines []string
		for _, line := range strings.Split(strings.TrimSpace(string(raw)), "\n") {
			if !strings.HasPrefix(strings.TrimSpace(line), "--") {
				lines = append(lines, "           "+line)
			}
		}
		cause = "(\n" + strings.Join(lines, "\n") + "\n           )::text"
	} else if !os.IsNotExist(err) {
		return definition{}, err
	}
	var name strings.Builder
	for _, part := range strings.Split(base, "_") {
		if part == "" {
			continue
		}
		name.WriteString(strings.ToUpper(part[:1]) + part[1:])
	}
	return definition{Name: name.String(), Doc: strings.Join(doc, "\n"), Select: strings.Join(body, "\n"),
		Matching: strings.Join(matching, "\n"), Exclusions: excl, StartedCause: cause,
		One:   providedP.ReplaceAllLiteralString(strings.Join(body, "\n"), oneMachine),
		Claim: steps("(SELECT c.started_cause FROM candidate c)", sets) + "\n" + claimResult}, nil
}
