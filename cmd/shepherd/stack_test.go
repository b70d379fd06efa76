package main

import (
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/goleak"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// TestRunStartupFailureStopsEverything starts every component with an
// agent binary that does not exist: the initializer is built after the
// metrics and web listeners, the callback server, the janitor, the
// simulated fleet and the provisioner. `shepherd run` must return the
// initializer's error having stopped all of them: no listener still
// accepts, no session is left open in the BMDB, no goroutine is left
// behind. Not parallel, so that goleak sees this test's goroutines only.
func TestRunStartupFailureStopsEverything(t *testing.T) {
	db := bmdbtest.New(t)
	dir := t.TempDir()
	simConfig := filepath.Join(dir, "sim.yaml")
	if err := os.WriteFile(simConfig, []byte("machines: 3\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	metricsAddr, webAddr, serverAddr := freeAddr(t), freeAddr(t), freeAddr(t)
	ignore := goleak.IgnoreCurrent()

	_, err := run(t, "run", "--components=all", "--database-url", db.URL, "--data-dir", dir,
		"--provider", "sim", "--provider-config", simConfig, "--agent", filepath.Join(dir, "no-such-agent"),
		"--server-listen", serverAddr, "--metrics-listen", metricsAddr, "--web-listen", webAddr,
		"--log-level", "error", "--provisioner-period", "10ms", "--janitor-period", "10ms")
	if err == nil || !strings.Contains(err.Error(), "agent binary") {
		t.Fatalf("shepherd run with a missing agent binary: %v, want the initializer's error", err)
	}
	for what, addr := range map[string]string{"metrics": metricsAddr, "web UI": webAddr, "callback server": serverAddr} {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			t.Errorf("the %s still accepts connections on %s after the failed start", what, addr)
		}
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM sessions WHERE closed_at IS NULL"); n != 0 {
		t.Errorf("%d sessions left open by the failed start", n)
	}
	if err := goleak.Find(ignore); err != nil {
		t.Errorf("goroutines left behind by the failed start: %v", err)
	}
}
