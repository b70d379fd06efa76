// Package logtest keeps what code under test logs, for tests of what a
// component tells the operator: which messages, at which level, with which
// attributes, and when (on a synctest bubble's clock inside one).
package logtest

import (
	"context"
	"log/slog"
	"slices"
	"sync"
	"time"
)

// Record is one logged line.
type Record struct {
	Level   slog.Level
	Message string
	Time    time.Time
	// Attrs are the record's attributes and those its logger was given
	// With; groups are not kept apart.
	Attrs map[string]slog.Value
}

// Attr returns the text of attribute key, "" if the record has none.
func (r Record) Attr(key string) string {
	v, ok := r.Attrs[key]
	if !ok {
		return ""
	}
	return v.String()
}

// Recorder keeps every record logged through its handler and the loggers
// derived from it. It is safe for concurrent use.
type Recorder struct {
	mu      sync.Mutex
	records []Record
	same    map[string]int
	floodAt int
	flood   func()
}

// New returns an empty Recorder.
func New() *Recorder { return &Recorder{same: map[string]int{}} }

// Handler returns a handler that records at every level.
func (r *Recorder) Handler() slog.Handler { return &handler{r: r} }

// Logger returns a logger that writes to r.
func (r *Recorder) Logger() *slog.Logger { return slog.New(r.Handler()) }

// With returns the records whose message is msg, in the order logged.
func (r *Recorder) With(msg string) []Record {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []Record
	for _, rec := range r.records {
		if rec.Message == msg {
			out = append(out, rec)
		}
	}
	return out
}

// Reset forgets the records kept so far.
func (r *Recorder) Reset() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.records = nil
	clear(r.same)
}

// OnFlood makes r call flood when a message has been logged n times (once
// for each message that gets there). Inside a synctest bubble a loop that logs on every turn and no
// longer pauses keeps the clock from moving: a test stops it this way to
// report it, instead of waiting for it forever.
func (r *Recorder) OnFlood(n int, flood func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.floodAt, r.flood = n, flood
}

func (r *Recorder) add(rec Record) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.records = append(r.records, rec)
	if r.same[rec.Message]++; r.flood != nil && r.same[rec.Message] == r.floodAt {
		r.flood()
	}
}

// handler is a Recorder's slog.Handler, carrying the attributes its logger
// was given.
type handler struct {
	r     *Recorder
	attrs []slog.Attr
}

func (h *handler) Enabled(context.Context, slog.Level) bool { return true }

func (h *handler) Handle(_ context.Context, sr slog.Record) error {
	rec := Record{Level: sr.Level, Message: sr.Message, Time: sr.Time, Attrs: map[string]slog.Value{}}
	for _, a := range h.attrs {
		rec.Attrs[a.Key] = a.Value.Resolve()
	}
	sr.Attrs(func(a slog.Attr) bool {
		rec.Attrs[a.Key] = a.Value.Resolve()
		return true
	})
	h.r.add(rec)
	return nil
}

func (h *handler) WithAttrs(as []slog.Attr) slog.Handler {
	return &handler{r: h.r, attrs: append(slices.Clip(h.attrs), as...)}
}

func (h *handler) WithGroup(string) slog.Handler { return h }
