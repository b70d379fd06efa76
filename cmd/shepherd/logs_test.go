package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// duplicateKeys returns the keys that occur more than once in one object
// of the JSON line (at any depth), in order.
func duplicateKeys(line string) ([]string, error) {
	dec := json.NewDecoder(strings.NewReader(line))
	var dups []string
	var object func() error
	object = func() error {
		seen := map[string]bool{}
		for dec.More() {
			tok, err := dec.Token()
			if err != nil {
				return err
			}
			key := tok.(string)
			if seen[key] {
				dups = append(dups, key)
			}
			seen[key] = true
			if err := value(dec, object); err != nil {
				return err
			}
		}
		_, err := dec.Token() // }
		return err
	}
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, fmt.Errorf("not a JSON object: %q", line)
	}
	return dups, object()
}

// value reads one JSON value, descending into objects with object.
func value(dec *json.Decoder, object func() error) error {
	tok, err := dec.Token()
	if err != nil {
		return err
	}
	switch tok {
	case json.Delim('{'):
		return object()
	case json.Delim('['):
		for dec.More() {
			if err := value(dec, object); err != nil {
				return err
			}
		}
		_, err := dec.Token()
		return err
	}
	return nil
}

// TestLogLinesHaveNoDuplicateAttributes runs every component of `shepherd
// run` over a simulated fleet with JSON logs at debug level, until the fleet
// is taken over and heartbeats, and checks that no line carries an attribute
// twice (a logger given component=server by the stack and again by the
// server wrote `component=server component=server`; issue 13 item 8).
func TestLogLinesHaveNoDuplicateAttributes(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	dir := t.TempDir()
	simConfig := filepath.Join(dir, "sim.yaml")
	agent := filepath.Join(dir, "shepherd-agent")
	for name, data := range map[string]string{simConfig: "machines: 4\n", agent: "stand-in: simulated machines do not run it"} {
		if err := os.WriteFile(name, []byte(data), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	var logs lockedBuffer
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		cmd := newRootCommand()
		cmd.SetArgs([]string{"run", "--components=all", "--database-url", db.URL, "--data-dir", dir,
			"--provider", "sim", "--provider-config", simConfig, "--agent", agent,
			"--server-listen", "127.0.0.1:0", "--log-format", "json", "--log-level", "debug",
			"--provisioner-period", "100ms", "--janitor-period", "100ms"})
		cmd.SetOut(&logs)
		cmd.SetErr(&logs)
		done <- cmd.ExecuteContext(ctx)
	}()
	bmdbtest.WaitFor(t, 120*time.Second, "the simulated fleet heartbeats", func(ctx context.Context) (bool, error) {
		select {
		case err := <-done:
			return false, fmt.Errorf("shepherd run stopped: %v\n%s", err, logs.String())
		default:
		}
		var n int64
		err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM machine_agent_heartbeat").Scan(&n)
		return n >= 4, err
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("shepherd run: %v", err)
	}

	components := map[string]bool{}
	sc := bufio.NewScanner(strings.NewReader(logs.String()))
	sc.Buffer(nil, 1<<20)
	lines := 0
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "{") {
			continue // the command's own output
		}
		lines++
		dups, err := duplicateKeys(line)
		if err != nil {
			t.Fatalf("log line: %v", err)
		}
		if len(dups) > 0 {
			t.Errorf("attributes %v more than once: %s", dups, line)
		}
		var rec struct{ Component string }
		if json.Unmarshal([]byte(line), &rec) == nil {
			components[rec.Component] = true
		}
	}
	// The check covers the components' own loggers, not only the stack's.
	for _, c := range []string{"server", "bmdb", "initializer", "provisioner", "sim"} {
		if !components[c] {
			t.Errorf("no line of component %s among %d lines: the check did not see it", c, lines)
		}
	}
}
