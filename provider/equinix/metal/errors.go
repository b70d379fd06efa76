package metal

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
)

// ErrNotFound means the API answered 404: the object does not exist, or
// not for this token. Every *APIError with status 404 matches it with
// errors.Is.
var ErrNotFound = errors.New("metal: not found")

// ErrRaceLost means CreateDevice found the hardware reservation taken by a
// device that does not carry the caller's witness tag: someone else got
// there first. The reservation is not ours to use now.
var ErrRaceLost = errors.New("metal: hardware reservation taken by another device")

// ErrRateLimited means the API answered 429 and the call's deadline
// would pass before the client may send again. The last 429 *APIError
// matches it too.
var ErrRateLimited = errors.New("metal: rate limited")

// ErrOutcomeUnknown means a request that must not be repeated blindly
// failed after the server may have acted on it (network error, timeout,
// 5xx, lost response), and the client could not find out what happened. An
// object may have been created. CreateSSHKey returns it after any such
// failure; CreateDevice and MoveHardwareReservation only when they could
// not check within the deadline.
var ErrOutcomeUnknown = errors.New("metal: outcome unknown, the server may have acted")

// APIError is a non-2xx answer of the API that the client did not retry,
// or the last one before it gave up.
type APIError struct {
	Method   string   // HTTP method
	Path     string   // request path below Config.BaseURL, e.g. "/devices/<id>"
	Status   int      // HTTP status code
	Messages []string // the API's "errors", scrubbed of the token
}

// Error says what was requested and what the API answered, e.g.
// `metal: GET /devices/1234: 404 Not Found: not found`.
func (e *APIError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "metal: %s %s: %d", e.Method, e.Path, e.Status)
	if t := http.StatusText(e.Status); t != "" {
		b.WriteString(" " + t)
	}
	if len(e.Messages) > 0 {
		b.WriteString(": " + strings.Join(e.Messages, "; "))
	}
	return b.String()
}

// Is makes a 404 match ErrNotFound and a 429 ErrRateLimited.
func (e *APIError) Is(target error) bool {
	switch target {
	case ErrNotFound:
		return e.Status == http.StatusNotFound
	case ErrRateLimited:
		return e.Status == http.StatusTooManyRequests
	}
	return false
}

// IsPermanent reports whether err is an answer that repeating the request
// cannot change: 400, 401, 403, 404 or 422 (including ErrNotFound).
func IsPermanent(err error) bool {
	if errors.Is(err, ErrNotFound) {
		return true
	}
	var ae *APIError
	if !errors.As(err, &ae) {
		return false
	}
	switch ae.Status {
	case http.StatusBadRequest, http.StatusUnauthorized, http.StatusForbidden,
		http.StatusNotFound, http.StatusUnprocessableEntity:
		return true
	}
	return false
}

// hasStatus reports whether err is an *APIError with the given status.
func hasStatus(err error, status int) bool {
	var ae *APIError
	return errors.As(err, &ae) && ae.Status == status
}
