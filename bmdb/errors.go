package bmdb

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// ErrSessionExpired means the session's lease lapsed (or it was closed) and
// its locks are gone. Start a new session: no call on this one can succeed again.
var ErrSessionExpired = errors.New("bmdb: session expired")

// ErrNothingToDo means no machine is a free candidate for the process right now.
var ErrNothingToDo = errors.New("bmdb: nothing to do")

// ErrWorkConflict means every attempt to claim a candidate lost a race with
// another claimer. It is transient: try again later.
var ErrWorkConflict = errors.New("bmdb: work conflict")

// ErrWorkEnded means Finish, Fail or Cancel was called on a work item that
// had already ended.
var ErrWorkEnded = errors.New("bmdb: work already ended")

// ErrNotCandidate means a claimed machine no longer matches the candidate
// query it was claimed from (its agent heartbeat again, another process
// changed its tags): the side effect the work was claimed for must not
// happen. It is nobody's failure; give the work back.
var ErrNotCandidate = errors.New("bmdb: the machine is no longer a candidate")

// ErrNotFound means the machine, session or record asked for does not exist.
var ErrNotFound = errors.New("bmdb: not found")

// ErrDecommissioned means the machine was decommissioned, or an operator
// asked for it to be and the decommissioner is taking it out of the fleet:
// it takes no new requests.
var ErrDecommissioned = errors.New("bmdb: decommissioned")

// SQLSTATEs that make a transaction worth retrying as a whole.
const (
	sqlstateSerializationFailure = "40001"
	sqlstateDeadlockDetected     = "40P01"
)

// retryableCode returns the SQLSTATE of err if retrying the whole transaction
// can succeed (serialization failure or deadlock), and "" otherwise.
func retryableCode(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case sqlstateSerializationFailure, sqlstateDeadlockDetected:
			return pgErr.Code
		}
	}
	return ""
}

// isContentError reports whether the database refused a statement for the
// values it was given (SQLSTATE classes 22, data exception, and 23,
// integrity constraint violation) rather than because it failed: retrying
// the same values cannot help, retrying without the culprit can.
func isContentError(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	return strings.HasPrefix(pgErr.Code, "22") || strings.HasPrefix(pgErr.Code, "23")
}

// contentErrorText is the database's own message for a content error, which
// names the problem without the values.
func contentErrorText(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Message + " (SQLSTATE " + pgErr.Code + ")"
	}
	return err.Error()
}

// Unavailable reports whether err means the database could not be reached
// or the connection broke (or timed out) before an answer arrived, rather
// than a refusal by the database or by the caller's own code. Whether a
// write that failed so committed is unknown, and the same call may succeed
// once the database is back: retry it.
func Unavailable(err error) bool {
	if err == nil {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return false
	}
	var connErr *pgconn.ConnectError
	var netErr net.Error
	return errors.As(err, &connErr) || errors.As(err, &netErr) || pgconn.Timeout(err) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, context.DeadlineExceeded) || errors.Is(err, pgconn.ErrConnClosed) ||
		pgconn.SafeToRetry(err)
}

// outcomeUnknown reports whether a write that failed with err may have
// committed: the statement was sent, and no answer from the database says
// how it went.
func outcomeUnknown(err error) bool {
	var pgErr *pgconn.PgError
	if err == nil || errors.Is(err, pgx.ErrNoRows) || errors.As(err, &pgErr) ||
		errors.Is(err, ErrSessionExpired) || errors.Is(err, ErrNothingToDo) {
		return false
	}
	return !pgconn.SafeToRetry(err)
}

// RetryOpen reports whether an error of Open may go away by itself, so that
// a long-running process should try again instead of exiting: no server
// answered, the servers were starting, shutting down or read-only (a
// failover under way), or a connection broke. A refused login, a database
// that does not exist, a bad URL or a schema newer than this binary are
// configuration errors: they are not.
func RetryOpen(err error) bool {
	if err == nil {
		return false
	}
	// A multi-host URL joins one error per host: any host refusing the
	// login or the database name is the operator's to fix.
	var permanent, transient bool
	walkErrors(err, func(e error) {
		pgErr, ok := e.(*pgconn.PgError)
		if !ok {
			return
		}
		switch {
		case strings.HasPrefix(pgErr.Code, "28"), pgErr.Code == "3D000":
			permanent = true
		case pgErr.Code == "57P03", pgErr.Code == "25006", strings.HasPrefix(pgErr.Code, "08"),
			pgErr.Code == "57P01", pgErr.Code == "57P02":
			// Cannot connect now (starting, shutting down), read-only
			// transaction, connection exceptions, terminated by an
			// administrator or a crash.
			transient = true
		}
	})
	if permanent {
		return false
	}
	var connErr *pgconn.ConnectError
	return transient || errors.As(err, &connErr) || Unavailable(err)
}

// walkErrors calls fn on err and everything it wraps, joined errors
// included.
func walkErrors(err error, fn func(error)) {
	if err == nil {
		return
	}
	fn(err)
	switch u := err.(type) {
	case interface{ Unwrap() error }:
		walkErrors(u.Unwrap(), fn)
	case interface{ Unwrap() []error }:
		for _, e := range u.Unwrap() {
			walkErrors(e, fn)
		}
	}
}
