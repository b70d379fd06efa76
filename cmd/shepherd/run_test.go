package main

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

func TestParseComponents(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		in      []string
		want    []string
		wantErr string
	}{
		{in: []string{"updater"}, want: []string{compUpdater}},
		{in: []string{"provisioner,updater", "updater"}, want: []string{compProvisioner, compUpdater}},
		{in: []string{"all"}, want: allComponents},
		{in: []string{"updater, bogus"}, wantErr: `unknown component "bogus"`},
		{in: []string{" , "}, wantErr: "name at least one"},
	} {
		got, err := parseComponents(tt.in)
		switch {
		case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
			t.Errorf("parseComponents(%q) error = %v, want one containing %q", tt.in, err, tt.wantErr)
		case tt.wantErr == "" && (err != nil || !slices.Equal(got, tt.want)):
			t.Errorf("parseComponents(%q) = %q, %v; want %q", tt.in, got, err, tt.want)
		}
	}
	if !slices.Contains(allComponents, compUpdater) {
		t.Errorf("all (%q) does not include the updater", allComponents)
	}
}

func TestRunRejectsUnknownComponent(t *testing.T) {
	t.Parallel()
	_, err := run(t, "run", "--components=updater,bogus", "--database-url", "postgres://nobody@127.0.0.1:1/none", "--data-dir", t.TempDir())
	if err == nil || !strings.Contains(err.Error(), `unknown component "bogus"`) {
		t.Fatalf("run with an unknown component: %v", err)
	}
}

// TestRunUpdater runs `shepherd run --components=provisioner,updater` on a
// simulated fleet with short updater periods, and waits for updater passes
// in its metrics.
func TestRunUpdater(t *testing.T) {
	db := bmdbtest.New(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	metricsAddr := ln.Addr().String()
	ln.Close()
	dataDir := t.TempDir()
	simConfig := filepath.Join(dataDir, "sim.yaml")
	if err := os.WriteFile(simConfig, []byte("machines: 5\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		cmd := newRootCommand()
		cmd.SetArgs([]string{"run", "--components=provisioner,updater", "--database-url", db.URL,
			"--data-dir", dataDir, "--provider", "sim", "--provider-config", simConfig,
			"--metrics-listen", metricsAddr, "--log-level", "warn", "--provisioner-period", "100ms",
			"--updater-changing-period", "50ms", "--updater-stable-period", "100ms"})
		done <- cmd.ExecuteContext(ctx)
	}()
	okPasses := regexp.MustCompile(`(?m)^shepherd_updater_passes_total\{provider="sim",result="ok"\} (\S+)$`)
	bmdbtest.WaitFor(t, 30*time.Second, "updater passes over the simulated fleet", func(ctx context.Context) (bool, error) {
		select {
		case err := <-done:
			t.Fatalf("shepherd run stopped: %v", err)
		default:
		}
		refs, err := db.ListProvided(ctx, "sim")
		if err != nil || len(refs) != 5 {
			return false, err
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+metricsAddr+"/metrics", nil)
		if err != nil {
			return false, err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return false, err
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			return false, err
		}
		m := okPasses.FindSubmatch(body)
		if m == nil {
			return false, nil
		}
		n, err := strconv.ParseFloat(string(m[1]), 64)
		// Passes after the fleet was recorded, at the short periods.
		return n >= 5, err
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("shepherd run: %v", err)
	}
}
