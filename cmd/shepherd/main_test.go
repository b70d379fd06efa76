package main

import (
	"bytes"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// lockedBuffer is a bytes.Buffer safe for a writer and a reader in
// different goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestShutdownOnSignal: the first signal cancels the context (a clean
// shutdown) and says so; the second exits at once with 128+signal. The
// real binary is checked end to end in e2e (TestSecondSignalExitsAtOnce).
func TestShutdownOnSignal(t *testing.T) {
	t.Parallel()
	sigs := make(chan os.Signal, 2)
	var stderr lockedBuffer
	exited := make(chan int, 1)
	ctx, stop := shutdownOnSignal(t.Context(), sigs, &stderr, func(code int) { exited <- code })
	defer stop()
	sigs <- syscall.SIGTERM
	select {
	case <-ctx.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the first signal did not cancel the context")
	}
	if !strings.Contains(stderr.String(), "terminated: shutting down cleanly") {
		t.Errorf("after the first signal stderr says %q", stderr.String())
	}
	select {
	case code := <-exited:
		t.Fatalf("the first signal exited with %d", code)
	default:
	}
	sigs <- syscall.SIGINT
	select {
	case code := <-exited:
		if code != 128+int(syscall.SIGINT) {
			t.Errorf("exit status %d, want %d", code, 128+int(syscall.SIGINT))
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the second signal did not exit")
	}
	if lines := strings.Count(stderr.String(), "\n"); lines != 2 || !strings.Contains(stderr.String(), "interrupt again: exiting at once") {
		t.Errorf("stderr = %q, want one line per signal", stderr.String())
	}
}

// TestShutdownOnSignalStop: stop ends the watch without a signal.
func TestShutdownOnSignalStop(t *testing.T) {
	t.Parallel()
	ctx, stop := shutdownOnSignal(t.Context(), make(chan os.Signal), &lockedBuffer{}, func(int) { t.Error("exit called") })
	stop()
	if ctx.Err() == nil {
		t.Error("stop left the context alive")
	}
}
