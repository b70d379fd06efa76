package e2e

import (
	"context"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/localport"
	"github.com/shepherd/shepherd/provider"
	"github.com/shepherd/shepherd/provider/sim"
)

// simHosts makes n simulated machines reachable over TCP on loopback, one
// port each, so that a shepherd process can SSH into them through a static
// inventory while the machines (and their simulated agents) live in the
// test process and outlive any shepherd process. It returns the inventory
// lines.
func simHosts(t *testing.T, n int, cfg sim.Config) (*sim.Fleet, string) {
	t.Helper()
	cfg.Machines = n
	fleet, err := sim.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := fleet.Run(ctx); err != nil {
			t.Errorf("simulated fleet: %v", err)
		}
	})
	var lns []net.Listener
	t.Cleanup(func() {
		cancel()
		for _, ln := range lns {
			ln.Close()
		}
		wg.Wait()
	})
	slots, err := fleet.ListMachines(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var inv strings.Builder
	inv.WriteString("machines:\n")
	for _, slot := range slots[:n] {
		m, err := fleet.CreateMachine(ctx, provider.CreateRequest{From: slot, Session: uuid.New()})
		if err != nil {
			t.Fatal(err)
		}
		access, err := fleet.SSHAccess(ctx, m.ID())
		if err != nil {
			t.Fatal(err)
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		lns = append(lns, ln)
		wg.Go(func() { forward(ctx, ln, access.Dial) })
		fmt.Fprintf(&inv, "  - id: %s\n    address: 127.0.0.1\n    port: %d\n", m.ID(), ln.Addr().(*net.TCPAddr).Port)
	}
	return fleet, inv.String()
}

// forward hands every TCP connection accepted on ln to a connection dial
// opens, until ln closes.
func forward(ctx context.Context, ln net.Listener, dial func(context.Context) (net.Conn, error)) {
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		wg.Go(func() {
			defer c.Close()
			s, err := dial(ctx)
			if err != nil {
				return
			}
			defer s.Close()
			done := make(chan struct{}, 2)
			go func() { _, _ = io.Copy(s, c); done <- struct{}{} }()
			go func() { _, _ = io.Copy(c, s); done <- struct{}{} }()
			select {
			case <-done:
			case <-ctx.Done():
			}
		})
	}
}

// TestCrashMidTakeover kills a shepherd process with SIGKILL while it takes
// over 200 machines, then starts another one: every machine must reach
// Healthy, no machine may ever have been claimed twice at once, and history
// must show the abandoned work Expired.
func TestCrashMidTakeover(t *testing.T) {
	t.Parallel()
	const machines = 200
	db := bmdbtest.New(t)
	fleet, inventory := simHosts(t, machines, sim.Config{TakeoverLatency: 300 * time.Millisecond})
	dir := t.TempDir()
	invPath := filepath.Join(dir, "inventory.yaml")
	if err := os.WriteFile(invPath, []byte(inventory), 0o600); err != nil {
		t.Fatal(err)
	}
	cfgPath := filepath.Join(dir, "static.yaml")
	if err := os.WriteFile(cfgPath, []byte("inventory: "+invPath+"\nname: lab\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	stand := filepath.Join(dir, "agent-stand-in")
	if err := os.WriteFile(stand, []byte("simulated machines do not run it"), 0o755); err != nil {
		t.Fatal(err)
	}
	port := freePort(t)
	args := []string{"run", "--components", "all", "--database-url", db.URL, "--data-dir", filepath.Join(dir, "data"),
		"--provider", "static", "--provider-config", cfgPath, "--agent", stand,
		"--server-listen", fmt.Sprintf("127.0.0.1:%d", port), "--heartbeat-interval", "1s",
		"--initializer-parallelism", "20", "--initializer-query-limit", "5ms,20", "--provisioner-period", "500ms", "--chunk-size", "500", "--create-limit", "1ms,100",
		"--heartbeat-timeout", "1m", "--first-heartbeat-timeout", "2m", "--log-level", "warn"}

	first := startShepherd(t, args...)
	// Kill it with a third of the fleet taken over and takeovers in flight.
	bmdbtest.WaitFor(t, 60*time.Second, "a third of the fleet taken over", func(ctx context.Context) (bool, error) {
		n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM machine_agent_started")
		live := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work WHERE process = 'AgentStart'")
		return n >= machines/3 && live > 0, nil
	})
	first.kill(t)
	abandoned := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work")
	if abandoned == 0 {
		t.Fatal("no work in flight when the process died; the test proves nothing")
	}
	t.Logf("killed shepherd with %d machines started and %d work items in flight",
		bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM machine_agent_started"), abandoned)

	startShepherd(t, args...)
	waitStates(t, db, "lab", 3*time.Minute, "every machine Healthy after the restart", func(st map[bmdb.MachineState]int64) bool {
		return st[bmdb.StateHealthy] == machines
	})
	if v := bmdbtest.OverlappingClaims(t, db); len(v) > 0 {
		t.Errorf("claims overlapped:\n%s", strings.Join(v, "\n"))
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work_history WHERE event = 'Expired'"); n < abandoned {
		t.Errorf("%d Expired history rows, %d work items were abandoned", n, abandoned)
	}
	if n := fleet.Stats().AgentsRunning; n != machines {
		t.Errorf("%d simulated agents running, want %d", n, machines)
	}
}

// freePort returns a port for a listener the command under test opens
// itself, and opens again on a restart: below the ephemeral range (see
// package localport).
func freePort(t *testing.T) int {
	t.Helper()
	port, err := localport.Free(localport.Low, localport.High)
	if err != nil {
		t.Fatal(err)
	}
	return port
}
