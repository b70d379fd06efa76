package server

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"
	"testing/synctest"
	"time"
)

// The throttle lets one line per key through each period, counting the
// rest; the next line that gets through says how many were held back. A
// line exactly one period after the last gets through.
func TestLogThrottle(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		var buf bytes.Buffer
		log := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{
			ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
				if a.Key == slog.TimeKey {
					return slog.Attr{}
				}
				return a
			},
		}))
		const period = 10 * time.Second
		l := newLogThrottle(log, period)
		ctx := context.Background()
		l.Log(ctx, slog.LevelWarn, "busy", "first", "n", 1)
		time.Sleep(period - time.Nanosecond)
		l.Log(ctx, slog.LevelWarn, "busy", "held back", "n", 2)
		l.Log(ctx, slog.LevelInfo, "retired", "another key", "n", 3)
		l.Log(ctx, slog.LevelWarn, "busy", "held back", "n", 4)
		time.Sleep(time.Nanosecond)
		l.Log(ctx, slog.LevelWarn, "busy", "a period after the first", "n", 5)
		time.Sleep(period - time.Nanosecond)
		l.Log(ctx, slog.LevelWarn, "busy", "held back", "n", 6)
		time.Sleep(time.Nanosecond)
		l.Log(ctx, slog.LevelWarn, "busy", "a period after that", "n", 7)

		want := `level=WARN msg=first n=1
level=INFO msg="another key" n=3
level=WARN msg="a period after the first" n=5 suppressed_since_last=2
level=WARN msg="a period after that" n=7 suppressed_since_last=1
`
		if got := buf.String(); got != want {
			t.Errorf("logged:\n%s\nwant:\n%s", got, want)
		}
		if strings.Contains(buf.String(), "held back") {
			t.Error("a line within the period got through")
		}
	})
}
