package agent

import (
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
)

func TestRetryPushback(t *testing.T) {
	t.Parallel()
	unavailable := func(pushback string) error {
		err := connect.NewError(connect.CodeUnavailable, errors.New("try again"))
		if pushback != "" {
			err.Meta().Set(retryPushbackKey, pushback)
		}
		return err
	}
	for _, c := range []struct {
		name     string
		err      error
		ok       bool
		min, max time.Duration
	}{
		{"as asked, jittered", unavailable("1000"), true, 800 * time.Millisecond, 1200 * time.Millisecond},
		{"zero is raised to the minimum", unavailable("0"), true, minPushback, minPushback},
		{"too short", unavailable("10"), true, minPushback, minPushback},
		{"too long", unavailable("3600000"), true, maxPushback * 8 / 10, maxPushback},
		{"huge", unavailable("9223372036854775807"), true, maxPushback * 8 / 10, maxPushback},
		{"negative: no pushback", unavailable("-1"), false, 0, 0},
		{"garbage: no pushback", unavailable("soon"), false, 0, 0},
		{"none: a network failure", unavailable(""), false, 0, 0},
		{"another code", connect.NewError(connect.CodeUnauthenticated, errors.New("who?")), false, 0, 0},
	} {
		for range 20 {
			got, ok := retryPushback(c.err)
			if ok != c.ok || got < c.min || got > c.max {
				t.Errorf("%s: retryPushback = %s, %v; want %v in [%s, %s]", c.name, got, ok, c.ok, c.min, c.max)
				break
			}
		}
	}
}

// TestRecoverInstallation covers every state a daemon can find its state
// directory in, including one written by an agent before reports were kept.
func TestRecoverInstallation(t *testing.T) {
	t.Parallel()
	success := func(gen int64) *agentv1.OSInstallationReport {
		return &agentv1.OSInstallationReport{Generation: gen, Result: &agentv1.OSInstallationReport_Success{Success: &agentv1.InstallationSuccess{}}}
	}
	for _, c := range []struct {
		name       string
		generation string // content of the generation file; "" none
		kept       *agentv1.OSInstallationReport
		handled    int64
		wantGen    int64  // generation of the report to send; 0 none
		wantError  string // part of its error message; "" a success
		stateLost  bool
	}{
		{name: "new machine"},
		{name: "delivered (also an older agent's state)", generation: "5\n", handled: 5},
		{name: "finished, not delivered", generation: "5 started\n", kept: success(5), handled: 5, wantGen: 5},
		{name: "delivered, crashed before removing the report", generation: "5\n", kept: success(5), handled: 5, wantGen: 5},
		{name: "interrupted", generation: "5 started\n", handled: 5, wantGen: 5, wantError: "interrupted"},
		{name: "interrupted, older report kept", generation: "6 started\n", kept: success(5), handled: 6, wantGen: 6, wantError: "interrupted"},
		{name: "generation unreadable: decided at the first response", generation: "garbage\n", stateLost: true},
		{name: "generation unreadable, report kept", generation: "\n", kept: success(5), handled: 5, wantGen: 5},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			dir := t.TempDir()
			if c.generation != "" {
				if err := os.WriteFile(filepath.Join(dir, generationFile), []byte(c.generation), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			if c.kept != nil {
				if err := writeReport(dir, c.kept, false); err != nil {
					t.Fatal(err)
				}
			}
			d := &daemon{cfg: daemonConfig{StateDir: dir}, log: slog.New(slog.DiscardHandler)}
			d.recoverInstallation(t.Context())
			if d.handled != c.handled || d.stateLost != c.stateLost {
				t.Errorf("handled %d, state lost %v; want %d, %v", d.handled, d.stateLost, c.handled, c.stateLost)
			}
			switch {
			case c.wantGen == 0 && d.report != nil:
				t.Errorf("report %v to send, want none", d.report)
			case c.wantGen != 0 && d.report.GetGeneration() != c.wantGen:
				t.Errorf("report %v to send, want one of generation %d", d.report, c.wantGen)
			case c.wantGen != 0 && c.wantError == "" && d.report.GetSuccess() == nil:
				t.Errorf("report %v to send, want a success", d.report)
			case c.wantError != "" && !strings.Contains(d.report.GetError().GetMessage(), c.wantError):
				t.Errorf("report %v to send, want an error saying %q", d.report, c.wantError)
			}
			kept, _, err := readReport(dir)
			if err != nil {
				t.Fatal(err)
			}
			if c.wantGen != 0 && kept.GetGeneration() != c.wantGen {
				t.Errorf("kept report %v, want the one to send, kept until acknowledged", kept)
			}
		})
	}
}
