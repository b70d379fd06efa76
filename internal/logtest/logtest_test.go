package logtest

import (
	"log/slog"
	"testing"
	"time"
)

func TestRecorder(t *testing.T) {
	r := New()
	log := r.Logger().With("component", "janitor")
	log.Warn("pass failed", "err", "database down", "pause", 2*time.Second)
	log.Info("pass done")
	r.Logger().Warn("pass failed", "err", "again")

	got := r.With("pass failed")
	if len(got) != 2 {
		t.Fatalf("With(pass failed) = %+v, want 2 records", got)
	}
	first := got[0]
	if first.Level != slog.LevelWarn || first.Attr("component") != "janitor" || first.Attr("err") != "database down" ||
		first.Attrs["pause"].Duration() != 2*time.Second || first.Time.IsZero() {
		t.Errorf("first record %+v", first)
	}
	if got[1].Attr("component") != "" || got[1].Attr("err") != "again" {
		t.Errorf("second record %+v: a logger's attributes leaked to its parent", got[1])
	}
	if n := len(r.With("pass done")); n != 1 {
		t.Errorf("%d records of pass done, want 1", n)
	}
	r.Reset()
	if n := len(r.With("pass failed")); n != 0 {
		t.Errorf("%d records after Reset, want 0", n)
	}
}

func TestOnFlood(t *testing.T) {
	r := New()
	calls := 0
	r.OnFlood(3, func() { calls++ })
	for range 5 {
		r.Logger().Info("same")
	}
	r.Logger().Info("other")
	if calls != 1 {
		t.Errorf("flood called %d times after 5 records of one message with n=3, want once", calls)
	}
	r.Logger().Info("other")
	r.Logger().Info("other")
	if calls != 2 {
		t.Errorf("flood called %d times once a second message was logged 3 times, want twice", calls)
	}
	r.Reset()
	for range 3 {
		r.Logger().Info("same")
	}
	if calls != 3 {
		t.Errorf("flood called %d times in all after Reset and 3 more, want 3", calls)
	}
}
