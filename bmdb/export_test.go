package bmdb

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	pgxuuid "github.com/vgarvardt/pgx-google-uuid/v5"

	"github.com/shepherd/shepherd/bmdb/model"
)

// ExplainUpdateProvided returns the plan of the statement UpdateProvided
// sends for updates, without running it.
func (db *DB) ExplainUpdateProvided(ctx context.Context, provider string, updates []ProvidedUpdate) (string, error) {
	return db.explainCaptured(ctx, "EXPLAIN ", func(q *model.Queries) error {
		_, err := (&Tx{q: q}).UpdateProvided(ctx, provider, updates)
		return err
	})
}

// ExplainProviderHasStatus returns the plan of the statement
// ProviderHasStatus sends, without running it.
func (db *DB) ExplainProviderHasStatus(ctx context.Context, provider string, statuses ...ProviderStatus) (string, error) {
	return db.explainCaptured(ctx, "EXPLAIN ", func(q *model.Queries) error {
		_, err := (&DB{q: q}).ProviderHasStatus(ctx, provider, statuses...)
		return err
	})
}

// ExplainAnalyzeHistory returns the EXPLAIN (ANALYZE, BUFFERS) plan of the
// statement History sends for f: it runs, and the plan says how many
// buffers it touched.
func (db *DB) ExplainAnalyzeHistory(ctx context.Context, f HistoryFilter) (string, error) {
	return db.explainCaptured(ctx, "EXPLAIN (ANALYZE, BUFFERS) ", func(q *model.Queries) error {
		_, err := (&DB{q: q}).History(ctx, f)
		return err
	})
}

// ExplainAnalyzeMatching returns the plan of the statement CountMatching
// sends for c, run with EXPLAIN (ANALYZE, BUFFERS), so that it says how
// many buffers the count touched.
func (db *DB) ExplainAnalyzeMatching(ctx context.Context, c Candidates) (string, error) {
	return db.explainCaptured(ctx, "EXPLAIN (ANALYZE, BUFFERS) ", func(q *model.Queries) error {
		_, err := c.matching(ctx, q)
		return err
	})
}

// explainCaptured captures the statement run sends and explains it with
// explain ("EXPLAIN ", or with options).
func (db *DB) explainCaptured(ctx context.Context, explain string, run func(q *model.Queries) error) (string, error) {
	var capt capturedQuery
	if err := run(model.New(&capt)); !errors.Is(err, errCaptured) {
		return "", fmt.Errorf("capturing the statement: %v", err)
	}
	rows, err := db.pool.Query(ctx, explain+capt.sql, capt.args...)
	if err != nil {
		return "", err
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return "", err
	}
	return strings.Join(lines, "\n"), nil
}

// ExplainVerboseCandidates is ExplainCandidates with EXPLAIN (VERBOSE),
// whose plans name every function the statements still call: a SQL
// function that PostgreSQL inlined into a statement is not called, and
// does not appear. The plan of the Matching count comes last.
func (db *DB) ExplainVerboseCandidates(ctx context.Context, process Process, c Candidates) ([]QueryPlan, error) {
	plans, err := db.explainCandidates(ctx, process, c, "EXPLAIN (VERBOSE) ")
	if err != nil {
		return nil, err
	}
	plan, err := db.explainCaptured(ctx, "EXPLAIN (VERBOSE) ", func(q *model.Queries) error {
		_, err := c.matching(ctx, q)
		return err
	})
	if err != nil {
		return nil, err
	}
	return append(plans, QueryPlan{Statement: "matching", Plan: plan}), nil
}

// ExplainAnalyzeCandidates is ExplainCandidates with EXPLAIN (ANALYZE,
// BUFFERS): the statements run (the claim for no session, claiming
// nothing) and the plans say how many buffers they touched.
func (db *DB) ExplainAnalyzeCandidates(ctx context.Context, process Process, c Candidates) ([]QueryPlan, error) {
	return db.explainCandidates(ctx, process, c, "EXPLAIN (ANALYZE, BUFFERS) ")
}

// FactStates are the states only a machine with facts can be in.
var FactStates = factStates

// ExplainAnalyzeHeartbeats runs the statement RecordHeartbeats sends for
// hbs (as one batch), as a prepared statement with the generic plan, which
// is the one a busy callback server's prepared statement settles on, and
// returns the plan auto_explain reports for it; it rolls the batch back.
// (EXPLAIN of the statement would plan it for these values, and EXPLAIN
// EXECUTE takes no parameters from a client.)
func (db *DB) ExplainAnalyzeHeartbeats(ctx context.Context, hbs []Heartbeat) (string, error) {
	var capt capturedQuery
	p, _ := heartbeatParams(hbs)
	if _, err := model.New(&capt).HeartbeatRecord(ctx, p); !errors.Is(err, errCaptured) {
		return "", fmt.Errorf("capturing the statement: %v", err)
	}
	return db.autoExplain(ctx, capt, "name: HeartbeatRecord", "force_generic_plan")
}

// autoExplain runs the captured statement in transactions it rolls back,
// with the plan cache mode given, and returns the plan auto_explain reports
// for it (with ANALYZE and BUFFERS): the notice that contains name.
func (db *DB) autoExplain(ctx context.Context, capt capturedQuery, name, planCacheMode string) (string, error) {
	cfg := db.pool.Config().ConnConfig.Copy()
	var mu sync.Mutex
	var notices []string
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		mu.Lock()
		defer mu.Unlock()
		notices = append(notices, n.Message)
	}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return "", err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	for _, set := range []string{
		"LOAD 'auto_explain'", "SET auto_explain.log_min_duration = 0", "SET auto_explain.log_analyze = on",
		"SET auto_explain.log_buffers = on", "SET client_min_messages = log", "SET plan_cache_mode = " + planCacheMode,
	} {
		if _, err := conn.Exec(ctx, set); err != nil {
			return "", fmt.Errorf("%s: %w", set, err)
		}
	}
	// Twice, each in a transaction rolled back, keeping the second plan: the
	// first one's buffers include what a new connection reads once (the
	// catalog, to compile PL/pgSQL functions). The plan is logged when the
	// executor ends, which for a plain SELECT is when its transaction ends:
	// the notices are read after the rollback.
	for range 2 {
		mu.Lock()
		notices = nil
		mu.Unlock()
		tx, err := conn.Begin(ctx)
		if err != nil {
			return "", err
		}
		rows, err := tx.Query(ctx, capt.sql, capt.args...)
		if err != nil {
			_ = tx.Rollback(ctx)
			return "", err
		}
		rows.Close()
		if err := errors.Join(rows.Err(), tx.Rollback(ctx)); err != nil {
			return "", err
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for _, n := range notices {
		if strings.Contains(n, name) {
			return n, nil
		}
	}
	return "", fmt.Errorf("auto_explain reported no plan of the statement (notices: %q)", notices)
}

// HoldConnections takes every connection of the main pool, as control
// loops with more workers than connections do, until release.
func (db *DB) HoldConnections(ctx context.Context) (release func(), err error) {
	var held []*pgxpool.Conn
	release = func() {
		for _, c := range held {
			c.Release()
		}
	}
	for range db.pool.Config().MaxConns {
		c, err := db.pool.Acquire(ctx)
		if err != nil {
			release()
			return nil, err
		}
		held = append(held, c)
	}
	return release, nil
}

// EncodesUUIDsAsBytes reports whether connections of both pools encode a
// uuid.UUID parameter with the plan pgx-google-uuid registers (as
// encodeUUIDsAsBytes does) rather than through its database/sql string.
func (db *DB) EncodesUUIDsAsBytes(ctx context.Context) (bool, error) {
	ref := pgtype.NewMap()
	pgxuuid.Register(ref)
	want := reflect.TypeOf(ref.PlanEncode(pgtype.UUIDOID, pgtype.BinaryFormatCode, uuid.UUID{}))
	for _, pool := range []*pgxpool.Pool{db.pool, db.hbPool} {
		c, err := pool.Acquire(ctx)
		if err != nil {
			return false, err
		}
		plan := c.Conn().TypeMap().PlanEncode(pgtype.UUIDOID, pgtype.BinaryFormatCode, uuid.UUID{})
		c.Release()
		if reflect.TypeOf(plan) != want {
			return false, nil
		}
	}
	return true, nil
}

// ExplainAnalyzeClaim runs the claim Work would send for process and c
// under session s, in a transaction it rolls back, and returns the plan
// auto_explain reports for it (with ANALYZE and BUFFERS): the claim for a
// live session, which ExplainAnalyzeCandidates (which claims for no
// session) does not run whole. generic asks for the generic plan, which a
// busy worker's prepared statement may settle on; else the plan is made for
// the values.
func (db *DB) ExplainAnalyzeClaim(ctx context.Context, s *Session, process Process, c Candidates, generic bool) (string, error) {
	var capt capturedQuery
	params := claimParams{process: process, session: s.id, scan: int32(s.cfg.ScanLimit), strategy: s.cfg.ClaimStrategy}
	if _, err := c.claim(ctx, model.New(&capt), params); !errors.Is(err, errCaptured) {
		return "", fmt.Errorf("capturing the claim: %v", err)
	}
	mode := "force_custom_plan"
	if generic {
		mode = "force_generic_plan"
	}
	return db.autoExplain(ctx, capt, "name: Claim", mode)
}

// ExplainAnalyzeMatches runs the statement c's Matches check sends for
// machine, in a transaction it rolls back, and returns the plan
// auto_explain reports for it (with ANALYZE and BUFFERS): the generic plan
// if generic, else the plan for the values.
func (db *DB) ExplainAnalyzeMatches(ctx context.Context, c Candidates, machine uuid.UUID, generic bool) (string, error) {
	var capt capturedQuery
	if _, err := c.matches(ctx, model.New(&capt), machine); !errors.Is(err, errCaptured) {
		return "", fmt.Errorf("capturing the statement: %v", err)
	}
	mode := "force_custom_plan"
	if generic {
		mode = "force_generic_plan"
	}
	return db.autoExplain(ctx, capt, "Matches", mode)
}

// Matches reports whether c's definition selects machine by its tags.
func (db *DB) Matches(ctx context.Context, c Candidates, machine uuid.UUID) (bool, error) {
	return c.matches(ctx, db.q, machine)
}
