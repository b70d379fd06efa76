package manager_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/manager"
)

// TestRecovererRecordsTimeouts: a running recoverer records the heartbeat
// timeouts it judges silence by in the BMDB, for every other surface to
// judge by, naming itself; the defaults where its configuration has none.
func TestRecovererRecordsTimeouts(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	p := &recordingRebooter{scripted: newScripted("lab"), reboots: map[string]int{}, budget: map[string]time.Duration{},
		fail: func(string) error { return nil }}
	rc, err := manager.NewRecoverer(manager.RecovererConfig{HeartbeatTimeout: 90 * time.Second},
		db.DB, p, prometheus.NewRegistry(), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- rc.Run(ctx) }()
	bmdbtest.WaitFor(t, 30*time.Second, "the timeouts are recorded", func(ctx context.Context) (bool, error) {
		to, err := db.SilenceTimeouts(ctx)
		return to.Recorded, err
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	to, err := db.SilenceTimeouts(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if to.Heartbeat != 90*time.Second || to.FirstHeartbeat != 30*time.Minute || to.Provider != "lab" ||
		!strings.HasPrefix(to.WrittenBy, "recoverer on ") || !strings.HasSuffix(to.WrittenBy, fmt.Sprintf("(pid %d)", os.Getpid())) {
		t.Errorf("recorded %+v, want heartbeat 1m30s, first heartbeat 30m (the default), by this recoverer of lab", to)
	}
}
