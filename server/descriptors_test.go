package server_test

import (
	"bufio"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/agent"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/api/agent/v1/agentv1connect"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/metricstest"
	"github.com/shepherd/shepherd/server"
	"github.com/shepherd/shepherd/server/servertest"
)

// fdChildEnv, set to a database URL, makes
// TestAcceptSurvivesRunningOutOfDescriptors the server process of the test
// rather than the test (see fdChild).
const fdChildEnv = "SHEPHERD_TEST_FD_CHILD_DATABASE_URL"

// fdChildPrefix starts the lines the server process writes for the test on
// its standard output, among those of the testing package.
const fdChildPrefix = "fdchild: "

// The outOfFDsMsg is what the server logs when an accept fails for lack of
// file descriptors.
const outOfFDsMsg = "out of file descriptors"

// A server that runs out of file descriptors keeps serving its open
// connections, counts the accepts that fail, logs them at a bounded rate,
// and accepts new connections again once descriptors are free.
//
// The server runs in a child process (this test binary again, with
// fdChildEnv set) whose open-file limit the test lowers: lowering it here
// would fail the tests running in parallel. The test and the child talk
// over the child's standard input and output, which need no new
// descriptors: the child starts with "ready ADDR CA", "limit" leaves the child a few free descriptors, "count"
// reads its counter of accepts failed for lack of descriptors, "exit" ends
// it. The child's standard error is the server's log.
func TestAcceptSurvivesRunningOutOfDescriptors(t *testing.T) {
	if url := os.Getenv(fdChildEnv); url != "" {
		fdChild(t, url)
		return
	}
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	agentKey := func(id uuid.UUID) ed25519.PrivateKey {
		pub, priv, err := ed25519.GenerateKey(rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error { return tx.SetAgentStarted(ctx, id, pub) }); err != nil {
			t.Fatal(err)
		}
		return priv
	}
	idA, idB := bmdbtest.AddMachine(t, db, s, "p"), bmdbtest.AddMachine(t, db, s, "p")
	keyA, keyB := agentKey(idA), agentKey(idB)

	var logs syncBuffer
	cmd := exec.Command(os.Args[0], "-test.run=^TestAcceptSurvivesRunningOutOfDescriptors$", "-test.count=1")
	cmd.Env = append(os.Environ(), fdChildEnv+"="+db.URL)
	cmd.Stderr = &logs
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	lines := make(chan string)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if line, ok := strings.CutPrefix(sc.Text(), fdChildPrefix); ok {
				lines <- line
			}
		}
		close(lines)
		exited <- cmd.Wait()
	}()
	childDone := false
	defer func() {
		if !childDone {
			_ = cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			t.Logf("the server process's output:\n%s", logs.String())
		}
	}()
	// ask sends a command to the child and returns its answer.
	ask := func(command string) string {
		t.Helper()
		if command != "" {
			if _, err := io.WriteString(stdin, command+"\n"); err != nil {
				t.Fatalf("telling the server process %q: %v", command, err)
			}
		}
		select {
		case line, ok := <-lines:
			if !ok {
				t.Fatalf("the server process ended before answering %q", command)
			}
			return line
		case <-time.After(time.Minute):
			t.Fatalf("the server process did not answer %q within a minute", command)
		}
		return ""
	}

	ready := strings.Fields(ask(""))
	if len(ready) != 3 || ready[0] != "ready" {
		t.Fatalf("the server process said %q, want ready ADDR CA", ready)
	}
	addr := ready[1]
	ca, err := base64.StdEncoding.DecodeString(ready[2])
	if err != nil {
		t.Fatal(err)
	}
	client := func(id uuid.UUID, key ed25519.PrivateKey) agentv1connect.AgentCallbackServiceClient {
		tlsCfg, err := agent.ClientTLS(id.String(), addr, ca, key)
		if err != nil {
			t.Fatal(err)
		}
		return agent.NewCallbackClient(addr, tlsCfg)
	}
	heartbeat := func(c agentv1connect.AgentCallbackServiceClient, id uuid.UUID, timeout time.Duration) error {
		ctx, cancel := context.WithTimeout(t.Context(), timeout)
		defer cancel()
		_, err := c.Heartbeat(ctx, connect.NewRequest(&agentv1.HeartbeatRequest{MachineId: id.String()}))
		return err
	}
	count := func() float64 {
		t.Helper()
		n, err := strconv.ParseFloat(strings.TrimPrefix(ask("count"), "count "), 64)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}

	// Agent A is connected before descriptors run out.
	a := client(idA, keyA)
	if err := heartbeat(a, idA, 10*time.Second); err != nil {
		t.Fatalf("agent A before the limit: %v", err)
	}
	if n := count(); n != 0 {
		t.Fatalf("%v accepts failed for lack of descriptors before the limit", n)
	}
	limited := time.Now()
	t.Logf("server process: %s", ask("limit"))

	// Connections beyond the few free descriptors wait in the kernel's
	// backlog while the server's accepts fail.
	var fillers []net.Conn
	closeFillers := func() {
		for _, c := range fillers {
			c.Close()
		}
		fillers = nil
	}
	defer closeFillers()
	for range 4 * fdSlack {
		c, err := net.DialTimeout("tcp", addr, 10*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		fillers = append(fillers, c)
	}
	// With pauses of 5 ms doubling, 8 failures take at least 635 ms.
	const failures = 8
	heartbeats := 0
	bmdbtest.WaitFor(t, time.Minute, fmt.Sprintf("%d accepts failed for lack of descriptors", failures), func(context.Context) (bool, error) {
		// (a) The connected agent is served all along.
		if err := heartbeat(a, idA, 10*time.Second); err != nil {
			t.Fatalf("agent A's heartbeat %d while out of descriptors: %v", heartbeats+1, err)
		}
		heartbeats++
		n := count()
		return n >= failures, fmt.Errorf("%v failed accepts counted", n)
	})
	// (b) is the wait above; (c): the log has a line per 10 s, not one per
	// failure.
	n := count()
	got := strings.Count(logs.String(), outOfFDsMsg)
	if want := 2 + int(time.Since(limited)/(10*time.Second)); got < 1 || got > want || float64(got) >= n {
		t.Errorf("%d log lines say %q after %v failed accepts in %v; want between 1 and %d", got, outOfFDsMsg, n, time.Since(limited).Round(time.Millisecond), want)
	}
	t.Logf("%d heartbeats of agent A served while %v accepts failed, %d log lines", heartbeats, n, got)

	// (d) Once the waiting connections are closed, their descriptors are
	// free again and a new agent is served.
	closeFillers()
	b := client(idB, keyB)
	bmdbtest.WaitFor(t, time.Minute, "a new agent is served once descriptors are free", func(context.Context) (bool, error) {
		err := heartbeat(b, idB, 5*time.Second)
		return err == nil, err
	})
	if err := heartbeat(a, idA, 10*time.Second); err != nil {
		t.Errorf("agent A after descriptors were freed: %v", err)
	}

	t.Logf("served again %v after the limit", time.Since(limited))
	if _, err := io.WriteString(stdin, "exit\n"); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		childDone = true
		t.Logf("exited %v after the limit", time.Since(limited))
		if err != nil {
			t.Errorf("the server process: %v", err)
		}
	case <-time.After(time.Minute):
		t.Error("the server process did not exit within a minute of being told to")
	}
}

// fdSlack is how many descriptors "limit" leaves the server process.
const fdSlack = 4

// fdChild is the server process of TestAcceptSurvivesRunningOutOfDescriptors:
// it serves the database at url and answers the test's commands until told
// to exit.
func fdChild(t *testing.T, url string) {
	db, err := bmdb.Open(t.Context(), bmdb.Config{URL: url, Schema: bmdb.SchemaRequireCurrent})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(db.Close) // after the server has stopped: cleanups run last first
	reg := prometheus.NewRegistry()
	srv, addr := servertest.Start(t, db, server.Config{
		// Far above the descriptors left: the process runs out first.
		MaxConnections: 1 << 20,
		Registerer:     reg,
		Logger:         slog.New(slog.NewTextHandler(os.Stderr, nil)),
	})
	var orig syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &orig); err != nil {
		t.Fatal(err)
	}
	// The limit is restored before the server stops (deferred calls run
	// before cleanups), so that nothing after the test lacks descriptors.
	defer func() {
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &orig); err != nil {
			t.Error(err)
		}
	}()
	say := func(format string, args ...any) { fmt.Printf(fdChildPrefix+format+"\n", args...) }
	say("ready %s %s", addr, base64.StdEncoding.EncodeToString(srv.CA()))
	sc := bufio.NewScanner(os.Stdin)
	for sc.Scan() {
		switch sc.Text() {
		case "count":
			say("count %v", metricstest.Value(t, reg, "shepherd_server_accept_errors_total", "reason", "descriptors"))
		case "limit":
			lim := orig
			lim.Cur = fdLimitLeaving(t, fdSlack)
			if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
				t.Fatal(err)
			}
			say("open-file limit lowered to %d, %d descriptors free", lim.Cur, fdSlack)
		case "exit":
			return
		default:
			t.Fatalf("unknown command %q", sc.Text())
		}
	}
	t.Fatal("the test closed the server process's input without telling it to exit")
}

// fdLimitLeaving returns the open-file limit under which the process has
// free descriptors left: a new descriptor takes the lowest free number,
// and none may reach the limit.
func fdLimitLeaving(t *testing.T, free int) uint64 {
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	// The directory's own descriptor, closed again, counts as open: one
	// more is free than asked, which changes nothing the test checks.
	open := map[uint64]bool{}
	for _, e := range entries {
		n, err := strconv.ParseUint(e.Name(), 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		open[n] = true
	}
	var fd uint64
	for ; free > 0; fd++ {
		if !open[fd] {
			free--
		}
	}
	return fd
}
