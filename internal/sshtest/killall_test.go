package sshtest

import (
	"context"
	"slices"
	"strings"
	"testing"
	"testing/synctest"
	"time"
)

// TestKillAllOutlastsSlowScans: on a loaded machine one scan of /proc took
// longer than half of stopTimeout, so power off gave up after two scans
// ("processes [] still run after SIGKILL") although the first scan's kill
// had worked and the second found nothing. killAll gives up only when the
// time is over and it has scanned enough times to tell a process that
// stays from a slow machine.
func TestKillAllOutlastsSlowScans(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var killed []int
		alive := true
		scans := 0
		scan := func() []int {
			scans++
			time.Sleep(stopTimeout * 6 / 10) // a slow machine
			if alive {
				return []int{4242}
			}
			return nil
		}
		kill := func(pid int) { killed = append(killed, pid); alive = false }
		if err := killAll(t.Context(), scan, kill); err != nil {
			t.Fatalf("killAll with slow scans: %v (after %d scans)", err, scans)
		}
		if !slices.Equal(killed, []int{4242}) || scans != 3 {
			t.Errorf("killed %v in %d scans, want [4242] in 3", killed, scans)
		}
	})
}

// TestKillAllGivesUpOnAProcessThatStays: a process that survives every
// SIGKILL fails the power off, naming it, once the time is over.
func TestKillAllGivesUpOnAProcessThatStays(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		err := killAll(t.Context(), func() []int { return []int{4242} }, func(int) {})
		if err == nil || !strings.Contains(err.Error(), "[4242] still run after SIGKILL") {
			t.Fatalf("killAll of a process that stays: %v", err)
		}
		if took := time.Since(start); took < stopTimeout {
			t.Errorf("gave up after %s, want at least %s", took, stopTimeout)
		}
	})
}

// TestKillAllStopsWithItsContext: the caller's cancel ends the wait.
func TestKillAllStopsWithItsContext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		if err := killAll(ctx, func() []int { return []int{4242} }, func(int) {}); err == nil {
			t.Fatal("killAll with a canceled context returned nil")
		}
	})
}
