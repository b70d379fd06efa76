package agent_test

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/google/uuid"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/api/agent/v1/agentv1connect"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// beat is one heartbeat a fakeCallback received.
type beat struct {
	at  time.Time
	req *agentv1.HeartbeatRequest
}

// fakeCallback is a callback server whose answers the test scripts: it
// speaks the real AgentCallbackService protocol (gRPC over HTTP/2 and TLS,
// client certificates required), and records every request.
type fakeCallback struct {
	t      *testing.T
	srv    *httptest.Server
	id     uuid.UUID
	answer atomic.Pointer[func(req *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error)]

	mu    sync.Mutex
	beats []beat
}

func newFakeCallback(t *testing.T, answer func(req *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error)) *fakeCallback {
	t.Helper()
	f := &fakeCallback{t: t, id: uuid.New()}
	f.setAnswer(answer)
	mux := http.NewServeMux()
	mux.Handle(agentv1connect.NewAgentCallbackServiceHandler(f))
	f.srv = httptest.NewUnstartedServer(mux)
	f.srv.EnableHTTP2 = true
	f.srv.TLS = &tls.Config{ClientAuth: tls.RequireAnyClientCert}
	f.srv.StartTLS()
	t.Cleanup(f.srv.Close)
	return f
}

func (f *fakeCallback) setAnswer(answer func(req *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error)) {
	f.answer.Store(&answer)
}

// Heartbeat implements agentv1connect.AgentCallbackServiceHandler.
func (f *fakeCallback) Heartbeat(_ context.Context, req *connect.Request[agentv1.HeartbeatRequest]) (*connect.Response[agentv1.HeartbeatResponse], error) {
	f.mu.Lock()
	f.beats = append(f.beats, beat{at: time.Now(), req: proto.CloneOf(req.Msg)})
	f.mu.Unlock()
	resp, err := (*f.answer.Load())(req.Msg)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(resp), nil
}

// init is the TakeoverInit of an agent reporting to f.
func (f *fakeCallback) init() []byte {
	f.t.Helper()
	raw, err := proto.Marshal(&agentv1.TakeoverInit{MachineId: f.id.String(), ServerEndpoint: f.srv.Listener.Addr().String(), CaCertificate: f.srv.Certificate().Raw})
	if err != nil {
		f.t.Fatal(err)
	}
	return raw
}

func (f *fakeCallback) received() []beat {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]beat(nil), f.beats...)
}

// waitFor waits until cond holds of the heartbeats received so far.
func (f *fakeCallback) waitFor(what string, cond func([]beat) bool) []beat {
	f.t.Helper()
	var beats []beat
	bmdbtest.WaitFor(f.t, 30*time.Second, what, func(context.Context) (bool, error) {
		beats = f.received()
		return cond(beats), nil
	})
	return beats
}

// ok is a response asking for the next heartbeat in 50ms.
func ok() *agentv1.HeartbeatResponse {
	return &agentv1.HeartbeatResponse{NextHeartbeatIn: durationpb.New(50 * time.Millisecond)}
}

func withReport(beats []beat, gen int64) int {
	n := 0
	for _, b := range beats {
		if b.req.GetInstallationReport().GetGeneration() == gen {
			n++
		}
	}
	return n
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// TestReportsResentUntilAcknowledged: an accepted heartbeat does not mean
// its reports were stored (issue 10, item 2: a hardware report lost for
// good). The agent sends its hardware report and an installation report with
// every heartbeat until a response acknowledges it, then stops sending it,
// and reboots only once the success report was acknowledged.
func TestReportsResentUntilAcknowledged(t *testing.T) {
	t.Parallel()
	images := newImageServer(t, 256<<10)
	targets := t.TempDir()
	stateDir := t.TempDir()
	rebooted := filepath.Join(t.TempDir(), "rebooted")
	const gen = 7
	ir := &agentv1.OSInstallationRequest{Generation: gen, ImageUrl: images.URL + "/os.img", ImageSha256: images.sha256(),
		TargetDevice: filepath.Join(targets, "disk.img"), RebootAfter: true}
	const unacknowledged = 3 // heartbeats carrying a report that the server does not store
	var hwSeen, reportsSeen atomic.Int32
	var rebootedEarly atomic.Bool
	f := newFakeCallback(t, func(req *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error) {
		resp := ok()
		if req.GetHardwareReport() != nil && hwSeen.Add(1) > unacknowledged {
			resp.HardwareReportRecorded = true
		}
		switch r := req.GetInstallationReport(); {
		case r != nil:
			if reportsSeen.Add(1) > unacknowledged {
				resp.InstallationReportRecorded = r.GetGeneration()
			} else if exists(rebooted) {
				rebootedEarly.Store(true)
			}
		case reportsSeen.Load() == 0:
			resp.InstallationRequest = ir
		}
		return resp, nil
	})
	resp, _ := takeover(t, stateDir, f.init(), "--reboot-command", "touch "+rebooted, "--work-dir", t.TempDir(), "--allow-file-target-dir", targets)
	successOf(t, resp)

	beats := f.waitFor("the installation report acknowledged and 5 heartbeats after", func(beats []beat) bool {
		last := -1
		for i, b := range beats {
			if b.req.GetInstallationReport() != nil {
				last = i
			}
		}
		return reportsSeen.Load() > unacknowledged && last >= 0 && len(beats)-last > 5
	})

	var hwBeats []int
	for i, b := range beats {
		if b.req.GetHardwareReport() != nil {
			hwBeats = append(hwBeats, i)
		}
	}
	if want := []int{0, 1, 2, 3}; fmt.Sprint(hwBeats) != fmt.Sprint(want) {
		t.Errorf("hardware report sent with heartbeats %v, want %v: until the fourth was acknowledged, and never after", hwBeats, want)
	}
	if n := withReport(beats, gen); n != unacknowledged+1 {
		t.Errorf("installation report sent %d times, want %d: until acknowledged, and never after", n, unacknowledged+1)
	}
	if withReport(beats, 0) != len(beats)-(unacknowledged+1) {
		t.Errorf("heartbeats carried reports of generations other than %d", gen)
	}
	if rebootedEarly.Load() {
		t.Error("the agent rebooted before the server acknowledged the success report")
	}
	bmdbtest.WaitFor(t, 10*time.Second, "reboot after the acknowledgement", func(context.Context) (bool, error) { return exists(rebooted), nil })
	if exists(filepath.Join(stateDir, "installation-report")) {
		t.Error("the acknowledged report is still kept in the state directory")
	}
	if n := images.downloads.Load(); n != 1 {
		t.Errorf("%d downloads, want 1", n)
	}
}

// TestInstallationReportSurvivesRestart: a report the agent could not
// deliver before it stopped is kept in the state directory and sent by the
// next daemon (issue 10, item 19); it was lost, the generation being
// recorded as handled. The reboot the installation asked for happens once
// the report is acknowledged, by the daemon that delivered it.
func TestInstallationReportSurvivesRestart(t *testing.T) {
	t.Parallel()
	images := newImageServer(t, 256<<10)
	targets := t.TempDir()
	stateDir := t.TempDir()
	rebooted := filepath.Join(t.TempDir(), "rebooted")
	const gen = 3
	ir := &agentv1.OSInstallationRequest{Generation: gen, ImageUrl: images.URL + "/os.img", ImageSha256: images.sha256(),
		TargetDevice: filepath.Join(targets, "disk.img"), RebootAfter: true}
	// The server's database is down from when the report comes.
	f := newFakeCallback(t, func(req *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error) {
		if req.GetInstallationReport() != nil {
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("database down"))
		}
		resp := ok()
		resp.HardwareReportRecorded = true
		resp.InstallationRequest = ir
		return resp, nil
	})
	args := []string{"--reboot-command", "touch " + rebooted, "--work-dir", t.TempDir(), "--allow-file-target-dir", targets}
	resp, _ := takeover(t, stateDir, f.init(), args...)
	successOf(t, resp)
	f.waitFor("the installation report", func(beats []beat) bool { return withReport(beats, gen) > 0 })
	stopDaemon(t, stateDir)
	if exists(rebooted) {
		t.Fatal("rebooted before the report was delivered")
	}

	before := len(f.received())
	f.setAnswer(func(req *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error) {
		resp := ok()
		resp.HardwareReportRecorded = true
		if r := req.GetInstallationReport(); r != nil {
			resp.InstallationReportRecorded = r.GetGeneration()
		}
		return resp, nil
	})
	resp, _ = takeover(t, stateDir, f.init(), args...)
	successOf(t, resp)
	beats := f.waitFor("the new daemon sends the report", func(beats []beat) bool { return withReport(beats[before:], gen) > 0 })
	for _, b := range beats[before:] {
		if r := b.req.GetInstallationReport(); r != nil && r.GetSuccess() == nil {
			t.Errorf("report %v, want the success of generation %d", r, gen)
		}
	}
	bmdbtest.WaitFor(t, 10*time.Second, "reboot after the acknowledgement", func(context.Context) (bool, error) { return exists(rebooted), nil })
	bmdbtest.WaitFor(t, 10*time.Second, "acknowledged report forgotten", func(context.Context) (bool, error) {
		return !exists(filepath.Join(stateDir, "installation-report")), nil
	})
	if n := images.downloads.Load(); n != 1 {
		t.Errorf("%d downloads, want 1: a generation was installed twice", n)
	}
}

// TestInterruptedInstallationIsReported: an agent killed in the middle of
// an installation (or a machine that lost power) never reports it; the next
// daemon reports it failed, instead of leaving the server waiting for a
// report that never comes (issue 10, item 19).
func TestInterruptedInstallationIsReported(t *testing.T) {
	t.Parallel()
	images := newImageServer(t, 8<<20)
	images.hold.Store(true) // never released: the daemon is killed in the middle
	targets := t.TempDir()
	stateDir := t.TempDir()
	const gen = 4
	ir := &agentv1.OSInstallationRequest{Generation: gen, ImageUrl: images.URL + "/os.img", ImageSha256: images.sha256(),
		TargetDevice: filepath.Join(targets, "disk.img")}
	f := newFakeCallback(t, func(req *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error) {
		resp := ok()
		resp.HardwareReportRecorded = true
		if r := req.GetInstallationReport(); r != nil {
			resp.InstallationReportRecorded = r.GetGeneration()
		} else {
			resp.InstallationRequest = ir
		}
		return resp, nil
	})
	args := []string{"--work-dir", t.TempDir(), "--allow-file-target-dir", targets}
	resp, _ := takeover(t, stateDir, f.init(), args...)
	successOf(t, resp)
	select {
	case <-images.started:
	case <-time.After(20 * time.Second):
		t.Fatal("the agent did not start downloading")
	}
	pid := daemonPid(stateDir)
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	waitGone(t, pid, "killed daemon")

	before := len(f.received())
	resp, _ = takeover(t, stateDir, f.init(), args...)
	successOf(t, resp)
	beats := f.waitFor("report of the interrupted installation", func(beats []beat) bool { return withReport(beats[before:], gen) > 0 })
	for _, b := range beats[before:] {
		if r := b.req.GetInstallationReport(); r != nil && !strings.Contains(r.GetError().GetMessage(), "interrupted") {
			t.Errorf("report %v, want an error saying the installation was interrupted", r)
		}
	}
	// Acknowledged, it is not sent again, and the generation not installed again.
	n := len(f.received())
	beats = f.waitFor("5 more heartbeats", func(beats []beat) bool { return len(beats) >= n+5 })
	if withReport(beats[n:], gen) != 0 {
		t.Error("the acknowledged report was sent again")
	}
	if n := images.downloads.Load(); n != 1 {
		t.Errorf("%d downloads, want 1: an interrupted generation was started again", n)
	}
}

// TestDecommissionedAgentStops: once its machine is decommissioned, the
// callback server answers the agent PermissionDenied, and the agent daemon
// exits for good instead of retrying forever (issue 10, item 23).
func TestDecommissionedAgentStops(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	id := bmdbtest.AddMachine(t, f.db, f.s, "p")
	stateDir := t.TempDir()
	resp, _ := takeover(t, stateDir, f.init(id))
	key := successOf(t, resp).GetPublicKey()
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error { return tx.SetAgentStarted(ctx, id, key) })
	bmdbtest.WaitFor(t, 20*time.Second, "first heartbeat", func(ctx context.Context) (bool, error) {
		_, err := f.db.GetAgentHeartbeat(ctx, id)
		return err == nil, err
	})
	pid := daemonPid(stateDir)

	f.tx(func(ctx context.Context, tx *bmdb.Tx) error {
		if err := tx.RequestDecommission(ctx, id, "test", "retired"); err != nil {
			return err
		}
		_, err := tx.Decommission(ctx, id, false)
		return err
	})
	waitGone(t, pid, "the agent of the decommissioned machine exits")
	log, err := os.ReadFile(filepath.Join(stateDir, "agent.log"))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(log), "\n") {
		if strings.Contains(line, "decommissioned") {
			n++
		}
	}
	if n != 1 {
		t.Errorf("the agent log says %d times that the machine was decommissioned, want once:\n%s", n, log)
	}
	if strings.Contains(string(log), "agent daemon failed") {
		t.Errorf("the agent logged its retirement as a failure:\n%s", log)
	}
}

// TestStopMode: "shepherd-agent stop" (run by the decommissioner over SSH)
// stops the daemon of a state directory and returns once it is gone; with no
// daemon it does nothing and succeeds.
func TestStopMode(t *testing.T) {
	t.Parallel()
	f := newFakeCallback(t, func(*agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error) { return ok(), nil })
	stateDir := t.TempDir()
	resp, _ := takeover(t, stateDir, f.init())
	successOf(t, resp)
	pid := daemonPid(stateDir)
	if !alive(pid) {
		t.Fatalf("daemon %d not running", pid)
	}
	stop := func(dir string) {
		t.Helper()
		out, err := exec.CommandContext(t.Context(), agentBinary(t), "stop", "--state-dir", dir).CombinedOutput()
		if err != nil {
			t.Fatalf("shepherd-agent stop: %v\n%s", err, out)
		}
	}
	stop(stateDir)
	waitGone(t, pid, "the daemon stops") // gone already, bar the exit after releasing its lock
	stop(stateDir)                       // nothing runs any more

	empty := filepath.Join(t.TempDir(), "never-used")
	stop(empty)
	if exists(empty) {
		t.Error("stop created the state directory of a machine where no daemon ever ran")
	}
}

// TestUnreadableStateRefusesOnlyTheUncertainInstallation: with its record
// of installations unreadable, the agent cannot know whether the
// installation the server asks for ran already. It refuses that one with an
// error report, rather than risk installing a generation twice, and carries
// out the next one, rather than refusing installations for good.
func TestUnreadableStateRefusesOnlyTheUncertainInstallation(t *testing.T) {
	t.Parallel()
	images := newImageServer(t, 64<<10)
	targets := t.TempDir()
	stateDir := t.TempDir()
	if err := os.WriteFile(filepath.Join(stateDir, "installed-generation"), nil, 0o600); err != nil { // torn by a crash
		t.Fatal(err)
	}
	request := func(gen int64) *agentv1.OSInstallationRequest {
		return &agentv1.OSInstallationRequest{Generation: gen, ImageUrl: images.URL + "/os.img", ImageSha256: images.sha256(),
			TargetDevice: filepath.Join(targets, "disk.img")}
	}
	var pending atomic.Int64
	pending.Store(5)
	f := newFakeCallback(t, func(req *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error) {
		resp := ok()
		resp.HardwareReportRecorded = true
		if r := req.GetInstallationReport(); r != nil {
			resp.InstallationReportRecorded = r.GetGeneration()
			pending.CompareAndSwap(r.GetGeneration(), 0)
		}
		if g := pending.Load(); g != 0 {
			resp.InstallationRequest = request(g)
		}
		return resp, nil
	})
	resp, _ := takeover(t, stateDir, f.init(), "--work-dir", t.TempDir(), "--allow-file-target-dir", targets)
	successOf(t, resp)
	beats := f.waitFor("report of generation 5", func(beats []beat) bool { return withReport(beats, 5) > 0 })
	for _, b := range beats {
		if r := b.req.GetInstallationReport(); r != nil && !strings.Contains(r.GetError().GetMessage(), "may have run already") {
			t.Errorf("report %v, want an error saying generation 5 may have run already", r)
		}
	}
	if n := images.downloads.Load(); n != 0 {
		t.Errorf("%d downloads for a generation that may have been installed already, want 0", n)
	}

	pending.Store(6)
	beats = f.waitFor("report of generation 6", func(beats []beat) bool { return withReport(beats, 6) > 0 })
	for _, b := range beats {
		if r := b.req.GetInstallationReport(); r.GetGeneration() == 6 && r.GetSuccess() == nil {
			t.Errorf("report %v, want generation 6 installed", r)
		}
	}
	if n := images.downloads.Load(); n != 1 {
		t.Errorf("%d downloads, want 1 (generation 6)", n)
	}
}
