// Package ratelog bounds the log lines of a failure that repeats: per key
// (a kind of failure, such as the message), at most one line per interval
// gets through, and the occurrences held back are counted and logged, as
// one line with the count, when the interval ends. A database outage that
// makes every worker of every loop fail every few hundred milliseconds
// then logs one line per kind of failure per interval, not hundreds.
package ratelog

import (
	"context"
	"log/slog"
	"slices"
	"sync"
	"time"
)

// DefaultInterval is the interval of New when it is given 0.
const DefaultInterval = 10 * time.Second

// Logger lets one line per key through every interval. It is safe for
// concurrent use; its zero value is not usable, call New.
type Logger struct {
	log      *slog.Logger
	interval time.Duration

	mu   sync.Mutex
	keys map[string]*state
}

// state is one key's window.
type state struct {
	last time.Time // when a line of the key was last logged
	// held counts the occurrences held back since last; level, msg and
	// attrs are those of the latest of them, which the line that reports
	// them repeats.
	held  int
	level slog.Level
	msg   string
	attrs []any
	timer *time.Timer // reports held occurrences at the end of the window
	// gen numbers the timers: one that fired as its window was ended by
	// other means (a line let through, Flush) finds a newer number, or
	// none, and reports nothing, rather than the next window's count.
	gen uint64
}

// New returns a Logger that writes to log, one line per key per interval
// (0: DefaultInterval).
func New(log *slog.Logger, interval time.Duration) *Logger {
	if interval <= 0 {
		interval = DefaultInterval
	}
	return &Logger{log: log, interval: interval, keys: map[string]*state{}}
}

// Log logs msg with attrs at level, unless a line of key was logged less
// than an interval ago: then it is held back and counted, and when the
// interval ends the latest of the held occurrences is logged with the
// attributes "repeated" (how many occurrences were held back since the
// previous line) and "interval". Keys
// must come from a closed set (kinds of failure, not machine ids), so
// that the Logger stays small.
func (l *Logger) Log(ctx context.Context, level slog.Level, key, msg string, attrs ...any) {
	l.mu.Lock()
	st := l.keys[key]
	if st == nil {
		st = &state{}
		l.keys[key] = st
	}
	now := time.Now()
	if st.last.IsZero() || now.Sub(st.last) >= l.interval {
		// The window ended: this line gets through, and reports what the
		// window held back if its timer has not yet (it fires at the same
		// instant, and finds its window ended).
		held := st.held
		st.last, st.held, st.attrs = now, 0, nil
		if st.timer != nil {
			st.timer.Stop()
			st.timer = nil
		}
		l.mu.Unlock()
		if held > 0 {
			attrs = append(slices.Clip(attrs), "repeated", held, "interval", l.interval)
		}
		l.log.Log(ctx, level, msg, attrs...)
		return
	}
	st.held++
	st.level, st.msg, st.attrs = level, msg, attrs
	if st.timer == nil {
		st.gen++
		gen := st.gen
		st.timer = time.AfterFunc(st.last.Add(l.interval).Sub(now), func() { l.report(key, gen) })
	}
	l.mu.Unlock()
}

// Warn is Log at slog.LevelWarn with msg as the key.
func (l *Logger) Warn(ctx context.Context, msg string, attrs ...any) {
	l.Log(ctx, slog.LevelWarn, msg, msg, attrs...)
}

// Error is Log at slog.LevelError with msg as the key.
func (l *Logger) Error(ctx context.Context, msg string, attrs ...any) {
	l.Log(ctx, slog.LevelError, msg, msg, attrs...)
}

// report logs the occurrences of key held back, if any, and starts a new
// window. gen is the number of the timer that calls it, 0 for Flush.
func (l *Logger) report(key string, gen uint64) {
	l.mu.Lock()
	st := l.keys[key]
	if gen != 0 && (st.timer == nil || st.gen != gen) {
		// The window this timer was to end ended already (it fired as a
		// line got through); what is held now is the next window's.
		l.mu.Unlock()
		return
	}
	st.timer = nil
	if st.held == 0 {
		l.mu.Unlock()
		return
	}
	held, level, msg, attrs := st.held, st.level, st.msg, st.attrs
	st.held, st.attrs, st.last = 0, nil, time.Now()
	l.mu.Unlock()
	l.log.Log(context.Background(), level, msg, append(slices.Clip(attrs), "repeated", held, "interval", l.interval)...)
}

// Flush logs the occurrences held back of every key now, rather than at
// the end of their intervals, and stops the timers that would have: the
// owner calls it when it stops, so that no count is lost and no line
// comes after it stopped.
func (l *Logger) Flush() {
	l.mu.Lock()
	var keys []string
	for k, st := range l.keys {
		if st.timer != nil && st.timer.Stop() {
			st.timer = nil
			keys = append(keys, k)
		}
	}
	l.mu.Unlock()
	slices.Sort(keys)
	for _, k := range keys {
		l.report(k, 0)
	}
}
