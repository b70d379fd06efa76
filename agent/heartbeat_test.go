package agent

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"connectrpc.com/connect"
	"github.com/google/uuid"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/types/known/durationpb"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/api/agent/v1/agentv1connect"
)

// The tests in this file run the daemon's heartbeat loop in a synctest
// bubble, so that its schedule (the interval, the backoff after failures,
// the wait a server asks for, the heartbeat timeout) is measured on a
// virtual clock and asserted exactly: the loop's own waits are the only
// thing that moves the clock. The daemon speaks the real protocol, gRPC
// over HTTP/2, to a callback server in the bubble, over in-memory
// connections (grpc's bufconn; a goroutine reading a real socket would keep the clock from
// moving). TLS, which adds nothing to the schedule, is left to the tests
// that run the agent binary against a real server.

// scriptedCallback is a callback server whose n-th heartbeat (from 0) is
// answered by script(n, ...); it records when each arrived.
type scriptedCallback struct {
	script func(ctx context.Context, n int, req *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error)

	mu    sync.Mutex
	beats []time.Time
}

func (s *scriptedCallback) Heartbeat(ctx context.Context, req *connect.Request[agentv1.HeartbeatRequest]) (*connect.Response[agentv1.HeartbeatResponse], error) {
	s.mu.Lock()
	n := len(s.beats)
	s.beats = append(s.beats, time.Now())
	s.mu.Unlock()
	resp, err := s.script(ctx, n, req.Msg)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(resp), nil
}

func (s *scriptedCallback) received() []time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]time.Time(nil), s.beats...)
}

// runDaemon starts the heartbeat loop of a daemon with cfg (StateDir,
// HardwareRoot and the machine filled in) against a callback server that
// answers with script. Call it inside a bubble. stop ends the daemon and
// returns what its loop returned.
func runDaemon(t *testing.T, cfg daemonConfig, script func(ctx context.Context, n int, req *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error)) (cb *scriptedCallback, stop func() error, exited <-chan error) {
	t.Helper()
	return runDaemonWith(t, cfg, script, nil)
}

// runDaemonWith is runDaemon calling setup, if not nil, on the daemon
// before its loop starts.
func runDaemonWith(t *testing.T, cfg daemonConfig, script func(ctx context.Context, n int, req *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error), setup func(d *daemon)) (cb *scriptedCallback, stop func() error, exited <-chan error) {
	t.Helper()
	cb = &scriptedCallback{script: script}
	mux := http.NewServeMux()
	mux.Handle(agentv1connect.NewAgentCallbackServiceHandler(cb))
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	l := bufconn.Listen(1 << 16)
	srv := &http.Server{Handler: mux, Protocols: &protocols}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close() })
	tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) { return l.DialContext(ctx) }, Protocols: &protocols}
	t.Cleanup(tr.CloseIdleConnections)

	cfg.StateDir, cfg.HardwareRoot = t.TempDir(), t.TempDir()
	d := &daemon{
		cfg:    cfg,
		init:   &agentv1.TakeoverInit{MachineId: uuid.NewString(), ServerEndpoint: "callback.test:7443"},
		client: agentv1connect.NewAgentCallbackServiceClient(&http.Client{Transport: tr}, "http://callback.test:7443", connect.WithGRPC()),
		log:    slog.New(slog.NewTextHandler(t.Output(), nil)),
		done:   make(chan *agentv1.OSInstallationReport, 1),
	}
	if setup != nil {
		setup(d)
	}
	ctx, cancel := context.WithCancel(t.Context())
	errc := make(chan error, 1)
	go func() { errc <- d.run(ctx) }()
	return cb, func() error { cancel(); return <-errc }, errc
}

// answer is a response asking for the next heartbeat in next (0: not saying).
func answer(next time.Duration) *agentv1.HeartbeatResponse {
	r := &agentv1.HeartbeatResponse{HardwareReportRecorded: true}
	if next != 0 {
		r.NextHeartbeatIn = durationpb.New(next)
	}
	return r
}

// refusal is an Unavailable answer with the retry pushback (ms) if not "".
func refusal(pushback string) error {
	err := connect.NewError(connect.CodeUnavailable, errors.New("recording heartbeat failed; try again"))
	if pushback != "" {
		err.Meta().Set(retryPushbackKey, pushback)
	}
	return err
}

// gaps returns the times between consecutive beats.
func gaps(beats []time.Time) []time.Duration {
	var gs []time.Duration
	for i := 1; i < len(beats); i++ {
		gs = append(gs, beats[i].Sub(beats[i-1]))
	}
	return gs
}

// window is the range a wait must fall in: [lo, hi].
type window struct{ lo, hi time.Duration }

// exactly is a wait with no jitter.
func exactly(d time.Duration) window { return window{d, d} }

// jittered is d spread by ±20 %, as jitter does.
func jittered(d time.Duration) window { return window{d * 8 / 10, d * 12 / 10} }

// checkGaps fails the test unless each gap between beats is in its window.
func checkGaps(t *testing.T, beats []time.Time, want []window) {
	t.Helper()
	got := gaps(beats)
	if len(got) < len(want) {
		t.Fatalf("%d heartbeats, want at least %d; gaps %v", len(beats), len(want)+1, got)
	}
	for i, w := range want {
		if got[i] < w.lo || got[i] > w.hi {
			t.Errorf("heartbeat %d came %s after heartbeat %d, want [%s, %s]; all gaps %v", i+2, got[i], i+1, w.lo, w.hi, got)
		}
	}
}

// idle is how long a scripted server asks the agent to wait once the
// script is done; the test ends long before.
const idle = 1000 * time.Hour

// TestHeartbeatSchedule: the first heartbeat goes out at once, and each
// next one after exactly the interval the server asked for, capped at a
// day, or the configured interval if the server asked for none (or for a
// wait that is not positive).
func TestHeartbeatSchedule(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const interval = 30 * time.Second
		nexts := []time.Duration{0, 50 * time.Millisecond, 48 * time.Hour, -5 * time.Second, 7 * time.Minute, idle}
		start := time.Now()
		cb, stop, _ := runDaemon(t, daemonConfig{Interval: interval, MaxBackoff: time.Minute},
			func(_ context.Context, n int, _ *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error) {
				return answer(nexts[min(n, len(nexts)-1)]), nil
			})
		time.Sleep(48 * time.Hour)
		if err := stop(); err != nil {
			t.Errorf("the daemon returned %v when stopped, want nil", err)
		}
		beats := cb.received()
		if len(beats) != len(nexts) {
			t.Errorf("%d heartbeats in 48h, want %d", len(beats), len(nexts))
		}
		if at := beats[0].Sub(start); at != 0 {
			t.Errorf("first heartbeat %s after the start, want at once", at)
		}
		checkGaps(t, beats, []window{exactly(interval), exactly(50 * time.Millisecond), exactly(24 * time.Hour),
			exactly(interval), exactly(7 * time.Minute)})
	})
}

// TestHeartbeatBackoff: after failed heartbeats the agent retries after
// 250ms, doubling to MaxBackoff, each wait jittered by ±20 %; a heartbeat
// that succeeds ends the backoff, so the next failure waits 250ms again.
func TestHeartbeatBackoff(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const maxBackoff = 2 * time.Second
		failures := []error{
			refusal(""), // Unavailable without a pushback: a network failure, as far as the agent can tell
			connect.NewError(connect.CodeUnauthenticated, errors.New("unknown agent key")), // the initializer has not recorded the key yet
			connect.NewError(connect.CodeInternal, errors.New("boom")),
			connect.NewError(connect.CodeDeadlineExceeded, errors.New("slow")),
			refusal("soon"), // a pushback that is no number counts as none
			refusal(""),
			nil, // then a success asking for 10s
			refusal(""),
			refusal(""),
		}
		cb, stop, _ := runDaemon(t, daemonConfig{Interval: time.Hour, MaxBackoff: maxBackoff},
			func(_ context.Context, n int, _ *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error) {
				switch {
				case n >= len(failures):
					return answer(idle), nil
				case failures[n] == nil:
					return answer(10 * time.Second), nil
				}
				return nil, failures[n]
			})
		time.Sleep(time.Hour)
		if err := stop(); err != nil {
			t.Errorf("the daemon returned %v when stopped, want nil", err)
		}
		beats := cb.received()
		if len(beats) != len(failures)+1 {
			t.Errorf("%d heartbeats, want %d", len(beats), len(failures)+1)
		}
		ms := time.Millisecond
		checkGaps(t, beats, []window{
			jittered(250 * ms), jittered(500 * ms), jittered(time.Second), jittered(2 * time.Second),
			jittered(maxBackoff), jittered(maxBackoff), // capped
			exactly(10 * time.Second),              // after the success, as the server asked
			jittered(250 * ms), jittered(500 * ms), // the backoff starts over
		})
	})
}

// TestRetryPushbackHonoured: a server that cannot record heartbeats (its
// database is down) answers Unavailable with a retry pushback, and the
// agent retries after that wait (jittered, within [100ms, 10s]), not after
// its growing network-failure backoff, which would leave it silent past its
// heartbeat timeout (issue 10, item 10); a pushback also ends the backoff.
func TestRetryPushbackHonoured(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		answers := []error{
			refusal("200"), refusal("200"), refusal("200"), refusal("200"), refusal("200"), refusal("200"),
			refusal(""), refusal(""), refusal(""), // the backoff grows: 250ms, 500ms, 1s
			refusal("200"), // a pushback: 200ms, and the backoff starts over
			refusal(""),    // 250ms
			refusal("10"),  // too short: 100ms exactly
			refusal("3600000"),
		}
		cb, stop, _ := runDaemon(t, daemonConfig{Interval: time.Hour, MaxBackoff: time.Minute},
			func(_ context.Context, n int, _ *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error) {
				if n < len(answers) {
					return nil, answers[n]
				}
				return answer(idle), nil
			})
		time.Sleep(time.Hour)
		if err := stop(); err != nil {
			t.Errorf("the daemon returned %v when stopped, want nil", err)
		}
		ms := time.Millisecond
		push := jittered(200 * ms)
		checkGaps(t, cb.received(), []window{
			push, push, push, push, push, push,
			jittered(250 * ms), jittered(500 * ms), jittered(time.Second),
			push,
			jittered(250 * ms),
			exactly(minPushback),
			{maxPushback * 8 / 10, maxPushback}, // capped at 10s, then jittered and capped again
		})
	})
}

// TestHungHeartbeatTimesOut: a heartbeat the server never answers is given
// up after exactly heartbeatTimeout, and retried one backoff later.
func TestHungHeartbeatTimesOut(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		cb, stop, _ := runDaemon(t, daemonConfig{Interval: time.Hour, MaxBackoff: time.Minute},
			func(ctx context.Context, n int, _ *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error) {
				if n == 0 {
					<-ctx.Done() // hang until the agent gives up
					return nil, ctx.Err()
				}
				return answer(idle), nil
			})
		time.Sleep(time.Hour)
		if err := stop(); err != nil {
			t.Errorf("the daemon returned %v when stopped, want nil", err)
		}
		beats := cb.received()
		if len(beats) != 2 {
			t.Errorf("%d heartbeats, want 2", len(beats))
		}
		t.Logf("gaps %v", gaps(beats))
		w := jittered(250 * time.Millisecond)
		checkGaps(t, beats, []window{{heartbeatTimeout + w.lo, heartbeatTimeout + w.hi}})
	})
}

// TestDecommissionedStopsAtOnce: PermissionDenied (the machine was
// decommissioned) ends the daemon with ErrRetired at once, and it sends
// no heartbeat again.
func TestDecommissionedStopsAtOnce(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		cb, _, exited := runDaemon(t, daemonConfig{Interval: time.Second, MaxBackoff: time.Second},
			func(_ context.Context, n int, _ *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error) {
				if n == 0 {
					return answer(0), nil
				}
				return nil, connect.NewError(connect.CodePermissionDenied, errors.New("machine decommissioned"))
			})
		var err error
		select {
		case err = <-exited:
		case <-time.After(time.Hour):
			t.Fatal("the daemon still runs an hour after the server said the machine was decommissioned")
		}
		if !errors.Is(err, ErrRetired) {
			t.Errorf("the daemon returned %v, want ErrRetired", err)
		}
		if took := time.Since(start); took != time.Second {
			t.Errorf("the daemon returned %s after the start, want 1s: at the refused second heartbeat", took)
		}
		time.Sleep(time.Hour)
		if n := len(cb.received()); n != 2 {
			t.Errorf("%d heartbeats, want 2: none after the refusal", n)
		}
	})
}

// TestTakeoverRefusesBadInputAtOnce: a takeover given a bad TakeoverInit
// answers with an error at once, without waiting for anything (stdin is
// closed), and one whose stdin is never closed after exactly StdinTimeout.
func TestTakeoverRefusesBadInputAtOnce(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]struct {
		stdin []byte
		want  string
	}{
		"empty":      {nil, "stdin is empty"},
		"garbage":    {[]byte("this is not a protobuf message\n"), "stdin does not hold a TakeoverInit"},
		"too large":  {bytes.Repeat([]byte{0}, maxInitBytes+1), "more than 65536 bytes"},
		"machine id": {MarshalTakeoverInit(t, func(i *agentv1.TakeoverInit) { i.MachineId = "machine-1" }), `machine_id "machine-1" is not a UUID`},
		"endpoint":   {MarshalTakeoverInit(t, func(i *agentv1.TakeoverInit) { i.ServerEndpoint = "shepherd.example" }), "is not host:port"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			synctest.Test(t, func(t *testing.T) {
				start := time.Now()
				resp := takeover(t.Context(), Config{StateDir: t.TempDir()}, "/nonexistent/agent", bytes.NewReader(c.stdin))
				if msg := resp.GetError().GetMessage(); !strings.Contains(msg, c.want) {
					t.Errorf("response %v, want an error saying %q", resp, c.want)
				}
				if took := time.Since(start); took != 0 {
					t.Errorf("took %s, want no time: nothing to wait for", took)
				}
			})
		})
	}
	t.Run("stdin never closed", func(t *testing.T) {
		t.Parallel()
		synctest.Test(t, func(t *testing.T) {
			stdin, w := io.Pipe()
			defer w.Close() // ends the read, which cannot be interrupted
			start := time.Now()
			const timeout = 7 * time.Second
			resp := takeover(t.Context(), Config{StateDir: t.TempDir(), StdinTimeout: timeout}, "/nonexistent/agent", stdin)
			if want := "no TakeoverInit on stdin within 7s"; !strings.Contains(resp.GetError().GetMessage(), want) {
				t.Errorf("response %v, want an error saying %q", resp, want)
			}
			if took := time.Since(start); took != timeout {
				t.Errorf("took %s, want exactly the StdinTimeout %s", took, timeout)
			}
		})
	})
}
