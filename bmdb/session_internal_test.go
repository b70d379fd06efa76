package bmdb

import (
	"testing"
	"time"
)

// TestJitter checks that jitter spreads a pause over [d/2, d), so that
// processes that failed together retry apart, and copes with pauses too
// short to halve.
func TestJitter(t *testing.T) {
	t.Parallel()
	for _, d := range []time.Duration{0, 1} {
		if got := jitter(d); got != d {
			t.Errorf("jitter(%d) = %d, want %d", d, got, d)
		}
	}
	for _, d := range []time.Duration{2, 3, 100 * time.Millisecond, 5 * time.Second} {
		lo, hi := d, time.Duration(0)
		for range 1000 {
			got := jitter(d)
			if got < d/2 || got >= d {
				t.Fatalf("jitter(%s) = %s, want within [%s, %s)", d, got, d/2, d)
			}
			lo, hi = min(lo, got), max(hi, got)
		}
		if d >= 100*time.Millisecond && hi-lo < d/4 {
			t.Errorf("jitter(%s) spans only [%s, %s] in 1000 draws", d, lo, hi)
		}
	}
}
