package bmdb

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/shepherd/shepherd/bmdb/model"
)

// Defaults of the recovery candidate query (SPEC §2.6).
const (
	DefaultFirstHeartbeatTimeout = 30 * time.Minute
	DefaultHeartbeatTimeout      = 10 * time.Minute
)

// Candidates is a candidate query of SPEC §2.6: which machines of a provider
// a process should work on, judged by their tags. Work, ListCandidates and
// CountCandidates add the exclusions every process shares (live conflicting
// work, backoff, quarantine, decommission). The queries are generated from one
// definition per kind (bmdb/candidates), so the count cannot drift from the
// query that hands out work.
type Candidates interface {
	// String names the query and its parameters, for logs.
	String() string

	list(ctx context.Context, q *model.Queries, p Process, limit int32) ([]uuid.UUID, error)
	count(ctx context.Context, q *model.Queries, p Process) (int64, error)
	matching(ctx context.Context, q *model.Queries) (int64, error)
	// matches reports whether the definition selects machine by its tags
	// alone, as matching counts them.
	matches(ctx context.Context, q *model.Queries, machine uuid.UUID) (bool, error)
	claim(ctx context.Context, q *model.Queries, c claimParams) (claimResult, error)
}

type claimParams struct {
	process  Process
	session  uuid.UUID
	scan     int32
	strategy ClaimStrategy
}

// claimResult is what every generated claim query returns; the generated row
// types of all claim queries share its fields, so they convert to it.
type claimResult model.ClaimAgentStartCandidateRow

// AgentStartCandidates selects provided machines of provider whose agent is
// not started and that are not installed.
func AgentStartCandidates(provider string) Candidates {
	return agentStartCandidates{provider: provider}
}

type agentStartCandidates struct{ provider string }

func (c agentStartCandidates) String() string {
	return fmt.Sprintf("agent start (provider %q)", c.provider)
}

func (c agentStartCandidates) list(ctx context.Context, q *model.Queries, p Process, limit int32) ([]uuid.UUID, error) {
	return q.ListAgentStartCandidates(ctx, model.ListAgentStartCandidatesParams{
		Provider: c.provider, Process: string(p), Exclusive: p.MachineExclusive(), RowLimit: limit})
}

func (c agentStartCandidates) count(ctx context.Context, q *model.Queries, p Process) (int64, error) {
	return q.CountAgentStartCandidates(ctx, model.CountAgentStartCandidatesParams{
		Provider: c.provider, Process: string(p), Exclusive: p.MachineExclusive()})
}

func (c agentStartCandidates) matching(ctx context.Context, q *model.Queries) (int64, error) {
	return q.CountAgentStartMatching(ctx, c.provider)
}

func (c agentStartCandidates) matches(ctx context.Context, q *model.Queries, machine uuid.UUID) (bool, error) {
	return q.AgentStartMatches(ctx, model.AgentStartMatchesParams{Provider: c.provider, MachineID: machine})
}

func (c agentStartCandidates) claim(ctx context.Context, q *model.Queries, a claimParams) (claimResult, error) {
	if a.strategy == ClaimPlainLimit {
		r, err := q.ClaimAgentStartCandidatePlain(ctx, model.ClaimAgentStartCandidatePlainParams{
			Provider: c.provider, Process: string(a.process), Exclusive: a.process.MachineExclusive(), SessionID: a.session})
		return claimResult(r), err
	}
	r, err := q.ClaimAgentStartCandidate(ctx, model.ClaimAgentStartCandidateParams{
		Provider: c.provider, Process: string(a.process), Exclusive: a.process.MachineExclusive(),
		ScanLimit: a.scan, SessionID: a.session})
	return claimResult(r), err
}

// RecoveryCandidates selects started, not installed machines of provider
// whose agent is silent: no heartbeat within firstHeartbeatTimeout of the
// start, or a last heartbeat older than heartbeatTimeout. Zero timeouts mean
// the defaults.
func RecoveryCandidates(provider string, firstHeartbeatTimeout, heartbeatTimeout time.Duration) Candidates {
	return recoveryCandidates{
		provider:              provider,
		firstHeartbeatTimeout: cmp.Or(firstHeartbeatTimeout, DefaultFirstHeartbeatTimeout),
		heartbeatTimeout:      cmp.Or(heartbeatTimeout, DefaultHeartbeatTimeout),
	}
}

type recoveryCandidates struct {
	provider                                string
	firstHeartbeatTimeout, heartbeatTimeout time.Duration
}

func (c recoveryCandidates) String() string {
	return fmt.Sprintf("recovery (provider %q, first heartbeat timeout %s, heartbeat timeout %s)",
		c.provider, c.firstHeartbeatTimeout, c.heartbeatTimeout)
}

func (c recoveryCandidates) list(ctx context.Context, q *model.Queries, p Process, limit int32) ([]uuid.UUID, error) {
	return q.ListRecoveryCandidates(ctx, model.ListRecoveryCandidatesParams{
		Provider:                c.provider,
		FirstHeartbeatTimeoutMs: c.firstHeartbeatTimeout.Milliseconds(),
		HeartbeatTimeoutMs:      c.heartbeatTimeout.Milliseconds(),
		Process:                 string(p),
		Exclusive:               p.MachineExclusive(),
		RowLimit:                limit,
	})
}

func (c recoveryCandidates) count(ctx context.Context, q *model.Queries, p Process) (int64, error) {
	return q.CountRecoveryCandidates(ctx, model.CountRecoveryCandidatesParams{
		Provider:                c.provider,
		FirstHeartbeatTimeoutMs: c.firstHeartbeatTimeout.Milliseconds(),
		HeartbeatTimeoutMs:      c.heartbeatTimeout.Milliseconds(),
		Process:                 string(p),
		Exclusive:               p.MachineExclusive(),
	})
}

func (c recoveryCandidates) matching(ctx context.Context, q *model.Queries) (int64, error) {
	return q.CountRecoveryMatching(ctx, model.CountRecoveryMatchingParams{
		Provider:                c.provider,
		FirstHeartbeatTimeoutMs: c.firstHeartbeatTimeout.Milliseconds(),
		HeartbeatTimeoutMs:      c.heartbeatTimeout.Milliseconds(),
	})
}

func (c recoveryCandidates) matches(ctx context.Context, q *model.Queries, machine uuid.UUID) (bool, error) {
	return q.RecoveryMatches(ctx, model.RecoveryMatchesParams{
		Provider:                c.provider,
		FirstHeartbeatTimeoutMs: c.firstHeartbeatTimeout.Milliseconds(),
		HeartbeatTimeoutMs:      c.heartbeatTimeout.Milliseconds(),
		MachineID:               machine,
	})
}

func (c recoveryCandidates) claim(ctx context.Context, q *model.Queries, a claimParams) (claimResult, error) {
	if a.strategy == ClaimPlainLimit {
		r, err := q.ClaimRecoveryCandidatePlain(ctx, model.ClaimRecoveryCandidatePlainParams{
			Provider:                c.provider,
			FirstHeartbeatTimeoutMs: c.firstHeartbeatTimeout.Milliseconds(),
			HeartbeatTimeoutMs:      c.heartbeatTimeout.Milliseconds(),
			Process:                 string(a.process),
			Exclusive:               a.process.MachineExclusive(),
			SessionID:               a.session,
		})
		return claimResult(r), err
	}
	r, err := q.ClaimRecoveryCandidate(ctx, model.ClaimRecoveryCandidateParams{
		Provider:                c.provider,
		FirstHeartbeatTimeoutMs: c.firstHeartbeatTimeout.Milliseconds(),
		HeartbeatTimeoutMs:      c.heartbeatTimeout.Milliseconds(),
		Process:                 string(a.process),
		Exclusive:               a.process.MachineExclusive(),
		ScanLimit:               a.scan,
		SessionID:               a.session,
	})
	return claimResult(r), err
}

// ListCandidates returns up to limit machines that process could claim now
// from c, without claiming them.
func (db *DB) ListCandidates(ctx context.Context, process Process, c Candidates, limit int) ([]uuid.UUID, error) {
	if err := process.Validate(); err != nil {
		return nil, err
	}
	if limit <= 0 {
		return nil, fmt.Errorf("bmdb: listing candidates: limit must be > 0, got %d", limit)
	}
	ids, err := c.list(ctx, db.q, process, int32(min(limit, 1<<30)))
	if err != nil {
		return nil, fmt.Errorf("bmdb: listing %s candidates for %s: %w", c, process, err)
	}
	return ids, nil
}

// CountCandidates returns how many machines process could claim now from c.
func (db *DB) CountCandidates(ctx context.Context, process Process, c Candidates) (int64, error) {
	if err := process.Validate(); err != nil {
		return 0, err
	}
	n, err := c.count(ctx, db.q, process)
	if err != nil {
		return 0, fmt.Errorf("bmdb: counting %s candidates for %s: %w", c, process, err)
	}
	return n, nil
}

// CountMatching counts the machines c selects by their tags alone,
// ignoring work, backoff and quarantine: for recovery, how many machines are
// silent, which the circuit breaker compares with the fleet.
func (db *DB) CountMatching(ctx context.Context, c Candidates) (int64, error) {
	n, err := c.matching(ctx, db.q)
	if err != nil {
		return 0, fmt.Errorf("bmdb: counting machines matching %s: %w", c, err)
	}
	return n, nil
}

// QueryPlan is PostgreSQL's plan for one of the statements behind a
// candidate query.
type QueryPlan struct {
	Statement string // "list", "count" or "claim"
	Plan      string // EXPLAIN output, one line per plan node
}

// ExplainCandidates returns the plans PostgreSQL chooses right now for the
// list, count and claim statements of c, without running them. Operators use
// it to check that a candidate query reads only its partial indexes.
func (db *DB) ExplainCandidates(ctx context.Context, process Process, c Candidates) ([]QueryPlan, error) {
	return db.explainCandidates(ctx, process, c, "EXPLAIN ")
}

// explainCandidates runs explain (an EXPLAIN with its options) on the
// statements of c. The claim is explained for no session, so even EXPLAIN
// ANALYZE claims nothing.
func (db *DB) explainCandidates(ctx context.Context, process Process, c Candidates, explain string) ([]QueryPlan, error) {
	if err := process.Validate(); err != nil {
		return nil, err
	}
	stmts := []struct {
		name string
		run  func(q *model.Queries) error
	}{
		{"list", func(q *model.Queries) error { _, err := c.list(ctx, q, process, 1); return err }},
		{"count", func(q *model.Queries) error { _, err := c.count(ctx, q, process); return err }},
		{"claim", func(q *model.Queries) error {
			_, err := c.claim(ctx, q, claimParams{process: process, scan: 64})
			return err
		}},
	}
	var plans []QueryPlan
	for _, st := range stmts {
		var capt capturedQuery
		if err := st.run(model.New(&capt)); !errors.Is(err, errCaptured) {
			return nil, fmt.Errorf("bmdb: capturing the %s statement of %s: %v", st.name, c, err)
		}
		rows, err := db.pool.Query(ctx, explain+capt.sql, capt.args...)
		if err != nil {
			return nil, fmt.Errorf("bmdb: explaining the %s statement of %s: %w", st.name, c, err)
		}
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return nil, fmt.Errorf("bmdb: explaining the %s statement of %s: %w", st.name, c, err)
		}
		plans = append(plans, QueryPlan{Statement: st.name, Plan: strings.Join(lines, "\n")})
	}
	return plans, nil
}

var errCaptured = errors.New("statement captured, not run")

// capturedQuery is a model.DBTX that records the statement a generated query
// method would send, instead of sending it.
type capturedQuery struct {
	sql  string
	args []any
}

func (c *capturedQuery) Exec(_ context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	c.sql, c.args = sql, args
	return pgconn.CommandTag{}, errCaptured
}

func (c *capturedQuery) Query(_ context.Context, sql string, args ...any) (pgx.Rows, error) {
	c.sql, c.args = sql, args
	return nil, errCaptured
}

func (c *capturedQuery) QueryRow(_ context.Context, sql string, args ...any) pgx.Row {
	c.sql, c.args = sql, args
	return errRow{}
}

type errRow struct{}

func (errRow) Scan(...any) error { return errCaptured }
