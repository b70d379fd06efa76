package agent_test

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"google.golang.org/protobuf/proto"

	"github.com/shepherd/shepherd/agent"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/server"
	"github.com/shepherd/shepherd/server/servertest"
)

var (
	buildOnce sync.Once
	binDir    string
	binPath   string
	buildErr  error
)

func TestMain(m *testing.M) {
	bmdbtest.Main(m, func() {
		if binDir != "" {
			os.RemoveAll(binDir)
		}
	})
}

// agentBinary builds the real, static agent binary once per test run.
func agentBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		if binDir, buildErr = os.MkdirTemp("", "shepherd-agent-test-"); buildErr != nil {
			return
		}
		binPath = filepath.Join(binDir, "shepherd-agent")
		cmd := exec.Command("go", "build", "-o", binPath, "github.com/shepherd/shepherd/cmd/shepherd-agent")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = fmt.Errorf("building the agent: %v\n%s", err, out)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return binPath
}

// fleet is a callback server with a database, for agents to report to.
type fleet struct {
	t        *testing.T
	db       *bmdbtest.DB
	s        *bmdb.Session
	srv      *server.Server
	endpoint string
}

func newFleet(t *testing.T) *fleet {
	t.Helper()
	db := bmdbtest.New(t)
	srv, endpoint := servertest.Start(t, db.DB, server.Config{HeartbeatInterval: 200 * time.Millisecond})
	return &fleet{t: t, db: db, s: bmdbtest.Session(t, db, "test", time.Minute), srv: srv, endpoint: endpoint}
}

func (f *fleet) init(id uuid.UUID) []byte {
	f.t.Helper()
	raw, err := proto.Marshal(&agentv1.TakeoverInit{MachineId: id.String(), ServerEndpoint: f.endpoint, CaCertificate: f.srv.CA()})
	if err != nil {
		f.t.Fatal(err)
	}
	return raw
}

func (f *fleet) tx(fn func(ctx context.Context, tx *bmdb.Tx) error) {
	f.t.Helper()
	if err := f.s.Transact(f.t.Context(), fn); err != nil {
		f.t.Fatal(err)
	}
}

// takeover runs the agent binary as the initializer would and returns its
// response and its exit code. A daemon it started is stopped when the test
// ends.
func takeover(t *testing.T, stateDir string, stdin []byte, args ...string) (*agentv1.TakeoverResponse, int) {
	t.Helper()
	// The takeover bounds itself (10s for stdin, 20s for the daemon to
	// report); this only stops one that hangs for good.
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, agentBinary(t), append([]string{"takeover", "--state-dir", stateDir}, args...)...)
	cmd.Stdin = bytes.NewReader(stdin)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	t.Cleanup(func() { stopDaemon(t, stateDir) })
	code := 0
	var exitErr *exec.ExitError
	if errors.As(err, &exitErr) {
		code = exitErr.ExitCode()
	} else if err != nil {
		t.Fatalf("running the agent: %v", err)
	}
	var resp agentv1.TakeoverResponse
	if err := proto.Unmarshal(stdout.Bytes(), &resp); err != nil {
		t.Fatalf("stdout is no TakeoverResponse (%v); stderr:\n%s", err, stderr.String())
	}
	return &resp, code
}

func daemonPid(stateDir string) int {
	data, err := os.ReadFile(filepath.Join(stateDir, "agent.pid"))
	if err != nil {
		return 0
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(data)))
	return pid
}

// procStat returns the state and session id of pid, or ok=false if it is
// gone (a zombie counts as gone).
func procStat(pid int) (state byte, session int, ok bool) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, 0, false
	}
	// pid (comm) state ppid pgrp session ...; comm may contain spaces.
	fields := strings.Fields(string(data[bytes.LastIndexByte(data, ')')+1:]))
	if len(fields) < 4 || fields[0] == "Z" {
		return 0, 0, false
	}
	session, _ = strconv.Atoi(fields[3])
	return fields[0][0], session, true
}

func alive(pid int) bool {
	_, _, ok := procStat(pid)
	return pid > 0 && ok
}

func waitGone(t *testing.T, pid int, what string) {
	t.Helper()
	bmdbtest.WaitFor(t, 20*time.Second, what, func(context.Context) (bool, error) { return !alive(pid), nil })
}

// stopDaemon stops the daemon of stateDir, if one runs, and waits until it is gone.
func stopDaemon(t *testing.T, stateDir string) {
	pid := daemonPid(stateDir)
	if !alive(pid) {
		return
	}
	_ = syscall.Kill(pid, syscall.SIGTERM)
	// Not bmdbtest.WaitFor: this runs in cleanups too, after t.Context ended.
	deadline := time.NewTimer(20 * time.Second)
	defer deadline.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for alive(pid) {
		select {
		case <-deadline.C:
			_ = syscall.Kill(pid, syscall.SIGKILL)
			t.Errorf("agent daemon %d ignored SIGTERM for 20s", pid)
			return
		case <-tick.C:
		}
	}
}

func successOf(t *testing.T, resp *agentv1.TakeoverResponse) *agentv1.TakeoverSuccess {
	t.Helper()
	s := resp.GetSuccess()
	if s == nil {
		t.Fatalf("takeover failed: %v", resp.GetError().GetMessage())
	}
	if len(s.GetPublicKey()) != ed25519.PublicKeySize {
		t.Fatalf("public key has %d bytes", len(s.GetPublicKey()))
	}
	return s
}

func TestTakeoverStartsHeartbeatingDaemon(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	id := bmdbtest.AddMachine(t, f.db, f.s, "p")
	stateDir := t.TempDir()
	init := f.init(id)

	resp, code := takeover(t, stateDir, init)
	if code != 0 {
		t.Errorf("exit code %d", code)
	}
	ok := successOf(t, resp)
	var want agentv1.TakeoverInit
	if err := proto.Unmarshal(init, &want); err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(ok.GetInitMessage(), &want) {
		t.Errorf("echoed init %v, want %v", ok.GetInitMessage(), &want)
	}
	// The initializer records the key; from then on heartbeats count.
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error { return tx.SetAgentStarted(ctx, id, ok.GetPublicKey()) })
	bmdbtest.WaitFor(t, 20*time.Second, "first heartbeat", func(ctx context.Context) (bool, error) {
		_, err := f.db.GetAgentHeartbeat(ctx, id)
		return err == nil, err
	})

	// The daemon left the session that started it (it survives SSH ending).
	pid := daemonPid(stateDir)
	_, session, running := procStat(pid)
	if !running {
		t.Fatalf("daemon %d not running", pid)
	}
	if session != pid || session == syscall.Getpid() {
		t.Errorf("daemon %d is in session %d, want a session of its own", pid, session)
	}

	// The hardware report came from this machine's /proc and /sys.
	bmdbtest.WaitFor(t, 10*time.Second, "hardware report", func(ctx context.Context) (bool, error) {
		_, err := f.db.GetHardwareReport(ctx, id)
		return err == nil, err
	})
	hw, err := f.db.GetHardwareReport(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	if want := onlineCPUs(t); int(hw.CPUThreads) != want {
		t.Errorf("reported %d CPU threads, the OS has %d online", hw.CPUThreads, want)
	}
	var si syscall.Sysinfo_t
	if err := syscall.Sysinfo(&si); err != nil {
		t.Fatal(err)
	}
	total := float64(si.Totalram) * float64(si.Unit)
	if diff := math.Abs(float64(hw.MemoryBytes)-total) / total; diff > 0.001 {
		t.Errorf("reported %d bytes of memory, the OS says %.0f", hw.MemoryBytes, total)
	}

	// A second takeover replaces the daemon.
	resp2, _ := takeover(t, stateDir, init)
	ok2 := successOf(t, resp2)
	if bytes.Equal(ok2.GetPublicKey(), ok.GetPublicKey()) {
		t.Error("the second takeover reused the key")
	}
	waitGone(t, pid, "first daemon stops after the second takeover")
	pid2 := daemonPid(stateDir)
	if pid2 == pid || !alive(pid2) {
		t.Fatalf("second daemon %d not running (first was %d)", pid2, pid)
	}
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error { return tx.SetAgentStarted(ctx, id, ok2.GetPublicKey()) })
	since := bmdbtest.Scalar[time.Time](t, f.db, "SELECT now()")
	bmdbtest.WaitFor(t, 20*time.Second, "heartbeat of the second daemon", func(ctx context.Context) (bool, error) {
		at, err := f.db.GetAgentHeartbeat(ctx, id)
		return err == nil && at.After(since), err
	})

	stopDaemon(t, stateDir)
	if alive(pid2) {
		t.Error("daemon survived SIGTERM")
	}
}

func onlineCPUs(t *testing.T) int {
	t.Helper()
	data, err := os.ReadFile("/sys/devices/system/cpu/online")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, part := range strings.Split(strings.TrimSpace(string(data)), ",") {
		lo, hi, found := strings.Cut(part, "-")
		a, err := strconv.Atoi(lo)
		if err != nil {
			t.Fatalf("parsing %q: %v", data, err)
		}
		b := a
		if found {
			if b, err = strconv.Atoi(hi); err != nil {
				t.Fatalf("parsing %q: %v", data, err)
			}
		}
		n += b - a + 1
	}
	return n
}

func TestTakeoverRejectsBadInput(t *testing.T) {
	t.Parallel()
	random := make([]byte, 4096)
	if _, err := rand.Read(random); err != nil {
		t.Fatal(err)
	}
	cases := map[string][]byte{
		"empty":              nil,
		"garbage":            []byte("this is not a protobuf message\n"),
		"random bytes":       random,
		"too large":          bytes.Repeat([]byte{0}, 1<<20),
		"machine id":         agent.MarshalTakeoverInit(t, func(i *agentv1.TakeoverInit) { i.MachineId = "machine-1" }),
		"endpoint":           agent.MarshalTakeoverInit(t, func(i *agentv1.TakeoverInit) { i.ServerEndpoint = "shepherd.example" }),
		"endpoint port":      agent.MarshalTakeoverInit(t, func(i *agentv1.TakeoverInit) { i.ServerEndpoint = "shepherd.example:99999" }),
		"ca certificate":     agent.MarshalTakeoverInit(t, func(i *agentv1.TakeoverInit) { i.CaCertificate = []byte("not DER") }),
		"missing everything": agent.MarshalTakeoverInit(t, func(i *agentv1.TakeoverInit) { *i = agentv1.TakeoverInit{} }),
	}
	for name, stdin := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			stateDir := t.TempDir()
			resp, code := takeover(t, stateDir, stdin)
			if resp.GetError() == nil || resp.GetError().GetMessage() == "" {
				t.Fatalf("response %v, want a TakeoverError", resp)
			}
			if code != 0 {
				t.Errorf("exit code %d, want 0 (a response was written)", code)
			}
			if pid := daemonPid(stateDir); pid != 0 {
				t.Errorf("a daemon (pid %d) was started", pid)
			}
			t.Logf("%s: %s", name, resp.GetError().GetMessage())
		})
	}
}

// imageServer serves one image and counts downloads. While hold is set, a
// download stops after its first chunk until release: an installation
// in progress for as long as a test needs one.
type imageServer struct {
	*httptest.Server
	image     []byte
	hold      atomic.Bool
	downloads atomic.Int64
	started   chan struct{} // closed when the first held download has sent its first chunk
	finished  chan struct{} // closed when that download ends
	released  chan struct{} // closed by release
	once      sync.Once
	doneOnce  sync.Once
	relOnce   sync.Once
}

func newImageServer(t *testing.T, size int) *imageServer {
	t.Helper()
	s := &imageServer{image: make([]byte, size), started: make(chan struct{}), finished: make(chan struct{}),
		released: make(chan struct{})}
	if _, err := rand.Read(s.image); err != nil {
		t.Fatal(err)
	}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.downloads.Add(1)
		w.Header().Set("Content-Length", strconv.Itoa(len(s.image)))
		if !s.hold.Load() {
			w.Write(s.image)
			return
		}
		defer s.doneOnce.Do(func() { close(s.finished) })
		first := min(64<<10, len(s.image)-1)
		if _, err := w.Write(s.image[:first]); err != nil {
			return
		}
		w.(http.Flusher).Flush()
		s.once.Do(func() { close(s.started) })
		select {
		case <-r.Context().Done():
			return
		case <-s.released:
		}
		w.Write(s.image[first:])
	}))
	t.Cleanup(s.Close)
	t.Cleanup(s.release) // first: Close waits for the held download
	return s
}

// release lets held downloads finish.
func (s *imageServer) release() { s.relOnce.Do(func() { close(s.released) }) }

func (s *imageServer) sha256() string {
	sum := sha256.Sum256(s.image)
	return hex.EncodeToString(sum[:])
}

func TestInstallation(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	id := bmdbtest.AddMachine(t, f.db, f.s, "p")
	stateDir := t.TempDir()
	rebooted := filepath.Join(t.TempDir(), "rebooted")
	// The target is a file, which the agent writes only when told to.
	targets := t.TempDir()
	target := filepath.Join(targets, "disk.img")
	resp, _ := takeover(t, stateDir, f.init(id), "--reboot-command", "touch "+rebooted, "--work-dir", t.TempDir(),
		"--allow-file-target-dir", targets)
	ok := successOf(t, resp)
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error { return tx.SetAgentStarted(ctx, id, ok.GetPublicKey()) })

	images := newImageServer(t, 2<<20)
	images.hold.Store(true)
	request := func(req *agentv1.OSInstallationRequest) int64 {
		t.Helper()
		raw, err := proto.Marshal(req)
		if err != nil {
			t.Fatal(err)
		}
		var gen int64
		f.tx(func(ctx context.Context, tx *bmdb.Tx) error {
			gen, err = tx.RequestInstallation(ctx, id, "test", raw)
			return err
		})
		return gen
	}
	installed := func(gen int64) func(context.Context) (bool, error) {
		return func(ctx context.Context) (bool, error) {
			in, err := f.db.GetInstallation(ctx, id)
			return err == nil && in.Report != nil && in.Report.Generation == gen, err
		}
	}

	gen := request(&agentv1.OSInstallationRequest{ImageUrl: images.URL + "/os.img", ImageSha256: images.sha256(), TargetDevice: target, RebootAfter: true})

	// Heartbeats go on while the download is in progress (held).
	select {
	case <-images.started:
	case <-time.After(20 * time.Second):
		t.Fatal("the agent did not start downloading")
	}
	waitHeartbeats(t, f, id, 3)
	select {
	case <-images.finished:
		t.Fatal("the held download ended before it was released")
	default:
	}
	images.release()

	bmdbtest.WaitFor(t, 30*time.Second, "installation report", installed(gen))
	in, err := f.db.GetInstallation(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	if !in.Installed() {
		t.Fatalf("installation %+v (error %q), want installed", in, in.Report.Error)
	}
	got, err := os.ReadFile(target)
	if err != nil || !bytes.Equal(got, images.image) {
		t.Fatalf("target is not byte-identical to the image (%v)", err)
	}
	bmdbtest.WaitFor(t, 10*time.Second, "reboot command after the report", func(context.Context) (bool, error) {
		_, err := os.Stat(rebooted)
		return err == nil, nil
	})

	// The same generation again (say the report was lost): not installed twice.
	if err := os.WriteFile(target, []byte("changed since"), 0o600); err != nil {
		t.Fatal(err)
	}
	f.db.Exec(t, "DELETE FROM machine_os_installation_report WHERE machine_id = $1", id)
	waitHeartbeats(t, f, id, 3)
	if n := images.downloads.Load(); n != 1 {
		t.Errorf("%d downloads, want 1: a generation was installed twice", n)
	}
	if got, _ := os.ReadFile(target); string(got) != "changed since" {
		t.Error("the target was written again for a generation already installed")
	}

	// A wrong checksum is reported and leaves the target alone.
	images.hold.Store(false)
	gen = request(&agentv1.OSInstallationRequest{ImageUrl: images.URL + "/os.img", ImageSha256: strings.Repeat("00", 32), TargetDevice: target})
	bmdbtest.WaitFor(t, 30*time.Second, "error report", installed(gen))
	in, err = f.db.GetInstallation(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	if in.Report.Success || !strings.Contains(in.Report.Error, "checksum") || in.Installed() {
		t.Errorf("report %+v, want a checksum error", in.Report)
	}
	if got, _ := os.ReadFile(target); string(got) != "changed since" {
		t.Error("a failed installation wrote to the target")
	}
}

// waitHeartbeats waits until n more heartbeats of the machine were recorded.
func waitHeartbeats(t *testing.T, f *fleet, id uuid.UUID, n int) {
	t.Helper()
	last, _ := f.db.GetAgentHeartbeat(t.Context(), id)
	seen := 0
	bmdbtest.WaitFor(t, 30*time.Second, fmt.Sprintf("%d more heartbeats", n), func(ctx context.Context) (bool, error) {
		at, err := f.db.GetAgentHeartbeat(ctx, id)
		if err == nil && at.After(last) {
			last = at
			seen++
		}
		return seen >= n, err
	})
}
