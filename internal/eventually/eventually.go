// Package eventually waits in tests for a condition to become true: it
// polls with a deadline instead of sleeping, and fails the test with what
// was awaited and the last error once the deadline passes.
package eventually

import (
	"context"
	"testing"
	"time"
)

// Interval is how often Holds polls.
const Interval = 20 * time.Millisecond

// Holds polls cond every Interval until it reports true, and fails the test
// with what and cond's last error if timeout passes first.
func Holds(t testing.TB, timeout time.Duration, what string, cond func(context.Context) (bool, error)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), timeout)
	defer cancel()
	tick := time.NewTicker(Interval)
	defer tick.Stop()
	for {
		ok, err := cond(ctx)
		if ok {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("%s: still false after %s (last error: %v)", what, timeout, err)
		case <-tick.C:
		}
	}
}
