package manager

import (
	"errors"
	"fmt"
	"testing"
)

// TestInChunks: items go to fn in order, in chunks of at most size, none
// empty; the first error stops it.
func TestInChunks(t *testing.T) {
	t.Parallel()
	errStop := errors.New("stop")
	for _, tt := range []struct {
		n, size, failAt int // failAt: the call that fails (0: none)
		want            string
		wantErr         error
	}{
		{10, 3, 0, "[[0 1 2] [3 4 5] [6 7 8] [9]]", nil},
		{3, 3, 0, "[[0 1 2]]", nil},
		{2, 5, 0, "[[0 1]]", nil},
		{0, 3, 0, "[]", nil},
		{10, 3, 2, "[[0 1 2] [3 4 5]]", errStop},
	} {
		items := make([]int, tt.n)
		for i := range items {
			items[i] = i
		}
		var calls [][]int
		err := inChunks(items, tt.size, func(c []int) error {
			calls = append(calls, c)
			if len(calls) == tt.failAt || len(calls) > tt.n {
				return errStop // also ends a loop that would not end
			}
			return nil
		})
		if got := fmt.Sprint(calls); got != tt.want || !errors.Is(err, tt.wantErr) || (tt.wantErr == nil && err != nil) {
			t.Errorf("inChunks(%d items, %d): chunks %s, error %v; want %s, %v", tt.n, tt.size, got, err, tt.want, tt.wantErr)
		}
	}
}
