package ratelog_test

import (
	"context"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/shepherd/shepherd/internal/logtest"
	"github.com/shepherd/shepherd/internal/ratelog"
)

// A burst of failures of one kind logs one line at once and one line with
// the count when the interval ends; another kind has a window of its own;
// a failure after a quiet interval logs at once again.
func TestBurstLogsOneLineAndACount(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		rec := logtest.New()
		const interval = 10 * time.Second
		l := ratelog.New(rec.Logger(), interval)
		ctx := context.Background()
		start := time.Now()
		// A 20 s outage: a failure every 70 ms (none falls at the end
		// of an interval).
		for i := range 286 {
			l.Error(ctx, "claiming work", "n", i)
			if i == 50 {
				l.Warn(ctx, "session renewal failed")
			}
			time.Sleep(70 * time.Millisecond)
		}
		time.Sleep(interval)
		synctest.Wait()
		lines := rec.With("claiming work")
		if len(lines) != 3 {
			t.Fatalf("%d lines for a 20 s burst with a 10 s interval, want 3: %+v", len(lines), lines)
		}
		if lines[0].Attr("repeated") != "" || lines[0].Attr("n") != "0" || !lines[0].Time.Equal(start) {
			t.Errorf("first line %+v, want the first failure at once, without a count", lines[0])
		}
		if lines[1].Attr("repeated") != "142" || lines[1].Attr("n") != "142" || lines[1].Time.Sub(start) != interval {
			t.Errorf("second line %+v, want 142 repeated at the end of the interval, with the latest failure's attributes", lines[1])
		}
		if lines[2].Attr("repeated") != "143" || lines[2].Attr("n") != "285" || lines[2].Time.Sub(start) != 2*interval {
			t.Errorf("third line %+v, want the other 143 at the end of the next interval", lines[2])
		}
		if got := rec.With("session renewal failed"); len(got) != 1 || got[0].Attr("repeated") != "" {
			t.Errorf("another kind of failure: %+v, want its one line", got)
		}

		// Quiet for an interval: the next failure logs at once.
		time.Sleep(interval)
		l.Error(ctx, "claiming work", "n", 286)
		if got := rec.With("claiming work"); len(got) != 4 || got[3].Attr("repeated") != "" {
			t.Errorf("a failure after a quiet interval: %+v", got)
		}
	})
}

// Flush reports what is held back at once, and no line follows it.
func TestFlush(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		rec := logtest.New()
		l := ratelog.New(rec.Logger(), time.Minute)
		for range 5 {
			l.Warn(context.Background(), "ending work failed")
		}
		l.Flush()
		lines := rec.With("ending work failed")
		if len(lines) != 2 || lines[1].Attr("repeated") != "4" {
			t.Fatalf("after Flush: %+v, want the first line and one with 4 repeated", lines)
		}
		time.Sleep(2 * time.Minute)
		synctest.Wait()
		if got := rec.With("ending work failed"); len(got) != 2 {
			t.Errorf("%d lines after Flush, want 2", len(got))
		}
	})
}

// A failure at the very instant its window ends (its timer fires then too)
// is neither lost nor counted twice, whichever runs first: either it gets
// through and reports the two the window held back, or the timer reports
// them and it is held back in the next window (which Flush reports).
func TestFailureAtTheEndOfTheWindow(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		rec := logtest.New()
		const interval = 10 * time.Second
		l := ratelog.New(rec.Logger(), interval)
		for range 3 {
			l.Warn(context.Background(), "heartbeat recorder check-in failed")
		}
		time.Sleep(interval)
		l.Warn(context.Background(), "heartbeat recorder check-in failed")
		synctest.Wait()
		l.Flush()
		lines := rec.With("heartbeat recorder check-in failed")
		var repeated []string
		for _, r := range lines {
			repeated = append(repeated, r.Attr("repeated"))
		}
		switch strings.Join(repeated, ",") {
		case ",2": // the failure got through, reporting the 2 held back
		case ",2,1": // the timer reported the 2, the failure was held and flushed
		default:
			t.Errorf("lines with repeated %q, want \",2\" or \",2,1\": %+v", repeated, lines)
		}
	})
}

// A timer that fires as a line gets through at the end of its window
// reports nothing: the failures held back after that line are the next
// window's, reported at its end, not at once. Which of the two runs first
// at that instant varies, so the test tries it many times.
func TestTimerOfAnEndedWindowReportsNothing(t *testing.T) {
	t.Parallel()
	for range 100 {
		synctest.Test(t, func(t *testing.T) {
			rec := logtest.New()
			const interval = 10 * time.Second
			l := ratelog.New(rec.Logger(), interval)
			for range 3 {
				l.Warn(context.Background(), "claiming work")
			}
			time.Sleep(interval)
			l.Warn(context.Background(), "claiming work")
			l.Warn(context.Background(), "claiming work")
			synctest.Wait()
			if got := rec.With("claiming work"); len(got) != 2 {
				t.Fatalf("at the end of the first window: %+v, want 2 lines (the first, and one with the 2 held back)", got)
			}
			time.Sleep(interval)
			synctest.Wait()
			if got := rec.With("claiming work"); len(got) != 3 || got[2].Attr("repeated") == "" {
				t.Fatalf("at the end of the second window: %+v, want a third line with the count held back", got)
			}
		})
	}
}
