package server

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// logThrottle lets one line per key through every period and counts the
// rest, so that a client sending bad requests as fast as it can cannot fill
// the disk with the server's log. The line that gets through says how many
// were held back since the last one.
type logThrottle struct {
	log    *slog.Logger
	period time.Duration
	now    func() time.Time

	mu   sync.Mutex
	keys map[string]*throttled
}

type throttled struct {
	last       time.Time
	suppressed int
}

func newLogThrottle(log *slog.Logger, period time.Duration) *logThrottle {
	return &logThrottle{log: log, period: period, now: time.Now, keys: map[string]*throttled{}}
}

// Log logs msg at level unless a line with the same key was logged less than
// a period ago. Keys come from a closed set (rejection reasons), so the map
// stays small.
func (l *logThrottle) Log(ctx context.Context, level slog.Level, key, msg string, attrs ...any) {
	l.mu.Lock()
	t := l.keys[key]
	if t == nil {
		t = &throttled{}
		l.keys[key] = t
	}
	now := l.now()
	if !t.last.IsZero() && now.Sub(t.last) < l.period {
		t.suppressed++
		l.mu.Unlock()
		return
	}
	suppressed := t.suppressed
	t.last, t.suppressed = now, 0
	l.mu.Unlock()
	if suppressed > 0 {
		attrs = append(attrs, "suppressed_since_last", suppressed)
	}
	l.log.Log(ctx, level, msg, attrs...)
}
