package bmdb

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/bmdb/model"
)

// maxTxAttempts bounds how often one transaction is tried when it keeps
// failing with serialization failures or deadlocks. Such failures clear up
// within a few attempts unless something is badly wrong, and then the caller
// should hear about it rather than wait.
const maxTxAttempts = 5

// retryPause is the base of the jittered, doubling pause between attempts.
const retryPause = 5 * time.Millisecond

// Tx is a BMDB transaction made on behalf of a session. Its methods change
// tags; they are valid only inside the function given to Transact or Finish.
type Tx struct {
	q *model.Queries
}

// fnError marks an error returned by the caller's transaction body, so that it
// is counted as a rollback rather than a database failure.
type fnError struct{ err error }

func (e fnError) Error() string { return e.err.Error() }
func (e fnError) Unwrap() error { return e.err }

// Transact runs fn in a transaction after checking, inside it, that the
// session is still alive. A serialization failure or deadlock restarts the
// whole transaction (a bounded number of times, with jittered pauses), so fn
// must have no side effects outside the database. The COMMIT's own error is
// returned. ErrSessionExpired means the session is dead and nothing was done.
func (s *Session) Transact(ctx context.Context, fn func(ctx context.Context, tx *Tx) error) error {
	return s.db.transact(ctx, func(ctx context.Context, q *model.Queries) error {
		alive, err := q.SessionAlive(ctx, s.id)
		if err != nil {
			return fmt.Errorf("checking session %s: %w", s.id, err)
		}
		if !alive {
			return ErrSessionExpired
		}
		if err := fn(ctx, &Tx{q: q}); err != nil {
			return fnError{err}
		}
		return nil
	})
}

// transact runs body in a transaction with the retry policy of Transact.
func (db *DB) transact(ctx context.Context, body func(ctx context.Context, q *model.Queries) error) error {
	err := db.retry(ctx, func(ctx context.Context) error {
		tx, err := db.pool.Begin(ctx)
		if err != nil {
			return fmt.Errorf("beginning transaction: %w", err)
		}
		defer func() {
			// After a successful Commit this is a no-op. Otherwise it must run
			// even if ctx is done, or the connection goes back dirty.
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			_ = tx.Rollback(rctx)
		}()
		if err := body(ctx, db.q.WithTx(tx)); err != nil {
			return err
		}
		if err := tx.Commit(ctx); err != nil {
			return fmt.Errorf("committing: %w", err)
		}
		return nil
	})
	var fe fnError
	if errors.As(err, &fe) && retryableCode(err) == "" {
		return fe.err
	}
	return err
}

// retry runs op, an idempotent database operation (a whole transaction, or a
// single statement that is its own transaction), until it succeeds, fails for
// a reason other than a serialization failure or deadlock, or has been tried
// maxTxAttempts times.
func (db *DB) retry(ctx context.Context, op func(ctx context.Context) error) error {
	for attempt := 1; ; attempt++ {
		err := op(ctx)
		code := retryableCode(err)
		if code == "" || attempt == maxTxAttempts || ctx.Err() != nil {
			db.metrics.transactions.WithLabelValues(txResult(err)).Inc()
			return err
		}
		db.metrics.txRetries.WithLabelValues(code).Inc()
		pause := time.Duration(rand.Int64N(int64(retryPause << attempt)))
		db.log.DebugContext(ctx, "retrying transaction", "sqlstate", code, "attempt", attempt, "pause", pause)
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			t.Stop()
			db.metrics.transactions.WithLabelValues(txResult(err)).Inc()
			return err
		case <-t.C:
		}
	}
}

// txResult classifies the outcome of a transaction for the metrics: a
// statement that found no row still committed; the caller's own error rolled
// back; anything else is a database failure.
func txResult(err error) string {
	var fe fnError
	switch {
	case err == nil, errors.Is(err, pgx.ErrNoRows):
		return "committed"
	case errors.As(err, &fe), errors.Is(err, ErrSessionExpired), errors.Is(err, ErrNotFound):
		return "rolled_back"
	default:
		return "failed"
	}
}
