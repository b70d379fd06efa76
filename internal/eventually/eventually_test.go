package eventually

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

// fakeT records a failure instead of ending the test.
type fakeT struct {
	testing.TB
	msg string
}

func (f *fakeT) Helper() {}

func (f *fakeT) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	panic(f)
}

func TestHoldsReturnsOnceTrue(t *testing.T) {
	n := 0
	Holds(t, 10*time.Second, "three polls", func(context.Context) (bool, error) {
		n++
		return n == 3, nil
	})
	if n != 3 {
		t.Fatalf("polled %d times, want 3", n)
	}
}

func TestHoldsFailsWithTheLastError(t *testing.T) {
	ft := &fakeT{TB: t}
	func() {
		defer func() {
			if r := recover(); r != ft {
				t.Fatalf("Holds did not fail the test (recovered %v)", r)
			}
		}()
		Holds(ft, 100*time.Millisecond, "never", func(context.Context) (bool, error) {
			return false, errors.New("still down")
		})
	}()
	if !strings.Contains(ft.msg, "never: still false after") || !strings.Contains(ft.msg, "still down") {
		t.Errorf("failure message %q", ft.msg)
	}
}
