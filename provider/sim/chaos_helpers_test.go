package sim_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/google/uuid"
	"golang.org/x/crypto/ssh"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/api/agent/v1/agentv1connect"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/provider/sim"
)

// callback is a fake callback server over real TLS and HTTP/2, which
// records every heartbeat and answers as answer says.
type callback struct {
	endpoint string
	ca       []byte

	mu   sync.Mutex
	reqs map[string][]received // by machine id
	// answer answers req, the n-th heartbeat (from 0) of its machine; it
	// is called with mu held. nil answers OK, recording every report.
	answer func(n int, req *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error)
}

// received is a heartbeat as the callback server got it.
type received struct {
	at  time.Time
	req *agentv1.HeartbeatRequest
}

const callbackInterval = 20 * time.Millisecond

// newCallback starts a fake callback server until the test ends.
func newCallback(t *testing.T, answer func(n int, req *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error)) *callback {
	t.Helper()
	cb := &callback{reqs: map[string][]received{}, answer: answer}
	path, h := agentv1connect.NewAgentCallbackServiceHandler(cb)
	mux := http.NewServeMux()
	mux.Handle(path, h)
	srv := httptest.NewUnstartedServer(mux)
	srv.EnableHTTP2 = true
	srv.StartTLS()
	t.Cleanup(srv.Close)
	cb.endpoint = srv.Listener.Addr().String()
	cb.ca = srv.Certificate().Raw
	return cb
}

// okAnswer acknowledges every report req carries.
func okAnswer(req *agentv1.HeartbeatRequest) *agentv1.HeartbeatResponse {
	return &agentv1.HeartbeatResponse{
		NextHeartbeatIn:            durationpb.New(callbackInterval),
		HardwareReportRecorded:     req.GetHardwareReport() != nil,
		InstallationReportRecorded: req.GetInstallationReport().GetGeneration(),
	}
}

// Heartbeat records req and answers it.
func (cb *callback) Heartbeat(_ context.Context, req *connect.Request[agentv1.HeartbeatRequest]) (*connect.Response[agentv1.HeartbeatResponse], error) {
	cb.mu.Lock()
	defer cb.mu.Unlock()
	id := req.Msg.GetMachineId()
	n := len(cb.reqs[id])
	cb.reqs[id] = append(cb.reqs[id], received{at: time.Now(), req: req.Msg})
	if cb.answer == nil {
		return connect.NewResponse(okAnswer(req.Msg)), nil
	}
	resp, err := cb.answer(n, req.Msg)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(resp), nil
}

// got returns the heartbeats of machine so far.
func (cb *callback) got(machine string) []received {
	cb.mu.Lock()
	defer cb.mu.Unlock()
	return slices.Clone(cb.reqs[machine])
}

// waitCount polls until the server got at least n heartbeats of machine.
func (cb *callback) waitCount(t *testing.T, machine string, n int, timeout time.Duration, what string) {
	t.Helper()
	bmdbtest.WaitFor(t, timeout, what, func(context.Context) (bool, error) {
		return len(cb.got(machine)) >= n, nil
	})
}

// init is a TakeoverInit for machine that heartbeats to cb.
func (cb *callback) init(machine string) []byte {
	raw, err := proto.Marshal(&agentv1.TakeoverInit{MachineId: machine, ServerEndpoint: cb.endpoint, CaCertificate: cb.ca})
	if err != nil {
		panic(err)
	}
	return raw
}

// recorder is an Observer that keeps every call.
type recorder struct {
	mu       sync.Mutex
	acked    []acked
	refused  []refused
	failed   []failedHB
	rebooted []rebooted
	started  []started
}

type acked struct {
	id, machine string
	sent, acked time.Time
	hardware    bool
}

type refused struct {
	id, machine string
	sent        time.Time
	code        connect.Code
}

type failedHB struct {
	id, machine string
	sent        time.Time
}

type rebooted struct {
	id string
	at time.Time
}

type started struct {
	id, machine string
	at          time.Time
}

var _ sim.Observer = (*recorder)(nil)

func (r *recorder) HeartbeatAcked(id, machineID string, sent, ack time.Time, hardware bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.acked = append(r.acked, acked{id, machineID, sent, ack, hardware})
}

func (r *recorder) HeartbeatRefused(id, machineID string, sent time.Time, code connect.Code) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.refused = append(r.refused, refused{id, machineID, sent, code})
}

func (r *recorder) HeartbeatFailed(id, machineID string, sent time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.failed = append(r.failed, failedHB{id, machineID, sent})
}

// failures returns the unanswered heartbeats of machine id.
func (r *recorder) failures(id string) []failedHB {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []failedHB
	for _, f := range r.failed {
		if f.id == id {
			out = append(out, f)
		}
	}
	return out
}

func (r *recorder) Rebooted(id string, at time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.rebooted = append(r.rebooted, rebooted{id, at})
}

func (r *recorder) AgentStarted(id, machineID string, at time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.started = append(r.started, started{id, machineID, at})
}

// acks returns the acknowledged heartbeats of machine id.
func (r *recorder) acks(id string) []acked {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []acked
	for _, a := range r.acked {
		if a.id == id {
			out = append(out, a)
		}
	}
	return out
}

func (r *recorder) refusals() []refused {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.refused)
}

func (r *recorder) reboots() []rebooted {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.rebooted)
}

func (r *recorder) starts() []started {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.started)
}

// serve serves machine id's SSH server on a TCP listener of the loopback
// until the test ends, and returns its address.
func serve(t *testing.T, f *sim.Fleet, id string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.ServeSSH(ctx, id, ln) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("ServeSSH(%s): %v", id, err)
		}
	})
	return ln.Addr().String()
}

// handshake connects to addr over TCP and runs an SSH handshake that
// verifies machine id's host key, within timeout. It returns the client.
func handshake(t *testing.T, f *sim.Fleet, id, addr string, timeout time.Duration) (*ssh.Client, error) {
	t.Helper()
	key, err := f.HostKey(id)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := net.DialTimeout("tcp", addr, 10*time.Second)
	if err != nil {
		return nil, err
	}
	_ = conn.SetDeadline(time.Now().Add(timeout))
	sc, chans, reqs, err := ssh.NewClientConn(conn, addr, &ssh.ClientConfig{
		User:            "root",
		Auth:            []ssh.AuthMethod{ssh.PublicKeys(clientKey())},
		HostKeyCallback: ssh.FixedHostKey(key),
	})
	if err != nil {
		conn.Close()
		return nil, err
	}
	_ = conn.SetDeadline(time.Time{})
	c := ssh.NewClient(sc, chans, reqs)
	t.Cleanup(func() { c.Close() })
	return c, nil
}

// mustHandshake is handshake that fails the test on error.
func mustHandshake(t *testing.T, f *sim.Fleet, id, addr string) *ssh.Client {
	t.Helper()
	c, err := handshake(t, f, id, addr, 10*time.Second)
	if err != nil {
		t.Fatalf("SSH to %s at %s: %v", id, addr, err)
	}
	return c
}

// refusedFast checks that an SSH connection to addr fails, and at once
// (the connection closed), not by timing out as a black hole would.
func refusedFast(t *testing.T, f *sim.Fleet, id, addr string) {
	t.Helper()
	_, err := handshake(t, f, id, addr, 10*time.Second)
	switch {
	case err == nil:
		t.Errorf("SSH to %s succeeded, want the connection closed", id)
	case isTimeout(err):
		t.Errorf("SSH to %s timed out (%v), want the connection closed at once", id, err)
	}
}

// isTimeout says whether err is a network timeout.
func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// tcpTakeover takes machine id, served at addr, over for machine with cb as
// its callback server; it returns the agent's key.
func tcpTakeover(t *testing.T, f *sim.Fleet, id, addr string, cb *callback, machine string) []byte {
	t.Helper()
	c := mustHandshake(t, f, id, addr)
	defer c.Close()
	upload(t, c, 4096)
	resp := execTakeover(t, c, cb.init(machine))
	if resp.GetSuccess() == nil {
		t.Fatalf("takeover of %s: %v", id, resp)
	}
	return resp.GetSuccess().GetPublicKey()
}

// pipeTakeover takes machine id over through the in-process transport.
func pipeTakeover(t *testing.T, f *sim.Fleet, id string, cb *callback, machine string) {
	t.Helper()
	c, _ := mustDial(t, f, id)
	defer c.Close()
	resp := execTakeover(t, c, cb.init(machine))
	if resp.GetSuccess() == nil {
		t.Fatalf("takeover of %s: %v", id, resp)
	}
}

func newMachineID() string { return uuid.NewString() }
