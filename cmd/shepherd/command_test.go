package main

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// stopTimeout bounds how long a command may take to return once its
// context ended (a SIGTERM): its components' own cleanup timeouts are
// shorter, so a command still running then hangs at shutdown.
const stopTimeout = 30 * time.Second

// background is a shepherd command running in this process until the test
// stops it.
type background struct {
	what   string
	cancel context.CancelFunc
	done   chan struct{} // closed when the command returned, after err is set
	err    error
	// told is set once a failure message named err, so that it is not
	// reported twice.
	told atomic.Bool
}

// startCommand runs `shepherd args...` in the background. It is stopped
// (as by SIGTERM) at the latest when the test ends, and the test fails if
// it then returns an error or does not return within stopTimeout.
func startCommand(t *testing.T, args ...string) *background {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	b := &background{what: "shepherd " + strings.Join(args[:min(2, len(args))], " "), cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(b.done)
		cmd := newRootCommand()
		cmd.SetArgs(args)
		b.err = cmd.ExecuteContext(ctx)
	}()
	t.Cleanup(func() { b.stop(t) })
	return b
}

// running fails the test at once if the command has returned: a command
// meant to run until stopped has failed.
func (b *background) running(t *testing.T) {
	t.Helper()
	select {
	case <-b.done:
		b.told.Store(true)
		t.Fatalf("%s stopped by itself: %v", b.what, b.err)
	default:
	}
}

// stop ends the command's context and waits for it to return. It fails the
// test if the command returns an error, or hangs for stopTimeout.
func (b *background) stop(t *testing.T) {
	t.Helper()
	b.cancel()
	select {
	case <-b.done:
	case <-time.After(stopTimeout):
		t.Fatalf("%s still runs %s after it was stopped: it hangs at shutdown", b.what, stopTimeout)
	}
	if b.err != nil && !b.told.Swap(true) {
		t.Errorf("%s: %v", b.what, b.err)
	}
}
