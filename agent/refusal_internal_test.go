package agent

import (
	"errors"
	"testing"
	"time"

	"connectrpc.com/connect"
)

// A new agent's first heartbeats are refused until the initializer has
// recorded its key: that race is expected and logged at Info; a refusal
// after a heartbeat was accepted, one that outlasts the grace, or another
// failure is a warning (issue 13 item 8).
func TestExpectedRefusal(t *testing.T) {
	t.Parallel()
	unauth := connect.NewError(connect.CodeUnauthenticated, errors.New("unknown machine or wrong agent key"))
	down := connect.NewError(connect.CodeUnavailable, errors.New("connection refused"))
	for _, tt := range []struct {
		name     string
		err      error
		accepted bool
		since    time.Duration
		want     bool
	}{
		{"first heartbeats before the key is recorded", unauth, false, 2 * time.Second, true},
		{"just within the grace", unauth, false, firstHeartbeatGrace - time.Millisecond, true},
		{"refused past the grace", unauth, false, firstHeartbeatGrace, false},
		{"refused after a heartbeat was accepted", unauth, true, time.Second, false},
		{"server unreachable", down, false, time.Second, false},
		{"not a connect error", errors.New("dial tcp: connection refused"), false, time.Second, false},
	} {
		if got := expectedRefusal(tt.err, tt.accepted, tt.since); got != tt.want {
			t.Errorf("%s: expectedRefusal = %v, want %v", tt.name, got, tt.want)
		}
	}
}
