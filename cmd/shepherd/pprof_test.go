package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// TestPprofIsOptIn checks that `shepherd run` serves Go's profiles on its
// metrics listener only with --pprof, and that --pprof without a metrics
// listener is refused rather than silently serving nothing.
func TestPprofIsOptIn(t *testing.T) {
	t.Parallel()
	if _, err := run(t, "run", "--components=janitor", "--database-url", bmdbtest.NewEmptyDatabase(t),
		"--data-dir", t.TempDir(), "--pprof"); err == nil || !strings.Contains(err.Error(), "--metrics-listen") {
		t.Fatalf("--pprof without --metrics-listen: got %v, want an error naming --metrics-listen", err)
	}
	for _, pprofOn := range []bool{false, true} {
		t.Run(fmt.Sprintf("pprof=%t", pprofOn), func(t *testing.T) {
			t.Parallel()
			db := bmdbtest.New(t)
			addr := freeAddr(t)
			args := []string{"run", "--components=janitor", "--database-url", db.URL, "--data-dir", t.TempDir(),
				"--metrics-listen", addr, "--log-level", "error"}
			if pprofOn {
				args = append(args, "--pprof")
			}
			cmd := startCommand(t, args...)
			var status int
			var body string
			bmdbtest.WaitFor(t, 30*time.Second, "/debug/pprof/heap answering", func(ctx context.Context) (bool, error) {
				cmd.running(t)
				req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/debug/pprof/heap?debug=1", nil)
				if err != nil {
					return false, err
				}
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					return false, err
				}
				defer resp.Body.Close()
				b, err := io.ReadAll(resp.Body)
				status, body = resp.StatusCode, string(b)
				return err == nil, err
			})
			switch {
			case pprofOn && (status != http.StatusOK || !strings.Contains(body, "heap profile")):
				t.Errorf("with --pprof: GET /debug/pprof/heap = %d %.100q, want 200 and a heap profile", status, body)
			case !pprofOn && status != http.StatusNotFound:
				t.Errorf("without --pprof: GET /debug/pprof/heap = %d, want 404", status)
			}
		})
	}
}
