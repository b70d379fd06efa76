package manager_test

import (
	"context"
	"log/slog"
	"slices"
	"sync"
)

// logLine is one line a logCapture saw.
type logLine struct {
	level slog.Level
	msg   string
	attrs map[string]string
}

// logCapture is a slog.Handler that keeps every line, for tests of what a
// component tells the operator.
type logCapture struct {
	mu    *sync.Mutex
	lines *[]logLine
	attrs []slog.Attr
}

func newLogCapture() *logCapture { return &logCapture{mu: &sync.Mutex{}, lines: &[]logLine{}} }

// logger returns a logger that writes to c.
func (c *logCapture) logger() *slog.Logger { return slog.New(c) }

func (c *logCapture) Enabled(context.Context, slog.Level) bool { return true }

func (c *logCapture) Handle(_ context.Context, r slog.Record) error {
	l := logLine{level: r.Level, msg: r.Message, attrs: map[string]string{}}
	for _, a := range c.attrs {
		l.attrs[a.Key] = a.Value.String()
	}
	r.Attrs(func(a slog.Attr) bool {
		l.attrs[a.Key] = a.Value.String()
		return true
	})
	c.mu.Lock()
	defer c.mu.Unlock()
	*c.lines = append(*c.lines, l)
	return nil
}

func (c *logCapture) WithAttrs(as []slog.Attr) slog.Handler {
	return &logCapture{mu: c.mu, lines: c.lines, attrs: append(slices.Clip(c.attrs), as...)}
}

func (c *logCapture) WithGroup(string) slog.Handler { return c }

// with returns the lines whose message is msg.
func (c *logCapture) with(msg string) []logLine {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []logLine
	for _, l := range *c.lines {
		if l.msg == msg {
			out = append(out, l)
		}
	}
	return out
}

// reset forgets the lines seen so far.
func (c *logCapture) reset() {
	c.mu.Lock()
	defer c.mu.Unlock()
	*c.lines = nil
}
