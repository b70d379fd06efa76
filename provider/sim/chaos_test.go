package sim_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"net"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/sshx"
	"github.com/shepherd/shepherd/provider"
	"github.com/shepherd/shepherd/provider/sim"
)

const rebootCommand = "systemctl reboot"

// TestServeSSHTakeover takes a machine over through ServeSSH (real TCP, a
// real SSH client, real SFTP) and checks that its agent heartbeats to a
// real callback server, and what the observer and Agent report.
func TestServeSSHTakeover(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 100*time.Millisecond)
	rec := &recorder{}
	f := startFleet(t, sim.Config{Machines: 2, SSHLatency: 5 * time.Millisecond, Observer: rec})
	id := slotID(2)
	if err := f.Provision(id); err != nil {
		t.Fatal(err)
	}
	if err := f.Provision(slotID(1), "sim-999999"); err == nil {
		t.Error("Provision of an unknown id succeeded")
	}
	if st := f.Stats(); st.Used != 1 {
		t.Errorf("Stats().Used = %d after provisioning one machine (and failing to provision more), want 1", st.Used)
	}
	addr := serve(t, f, id)
	machine := e.addMachine(t, f, id)

	c := mustHandshake(t, f, id, addr)
	upload(t, c, 1<<20)
	raw, err := proto.Marshal(e.init(machine))
	if err != nil {
		t.Fatal(err)
	}
	resp := execTakeover(t, c, raw)
	if resp.GetSuccess() == nil {
		t.Fatalf("takeover answered %v, want success", resp)
	}
	c.Close()
	e.setAgentStarted(t, machine, resp.GetSuccess().GetPublicKey())
	bmdbtest.WaitFor(t, 30*time.Second, "the agent's heartbeat is recorded", func(ctx context.Context) (bool, error) {
		_, err := e.db.GetAgentHeartbeat(ctx, machine)
		return err == nil, err
	})
	first := waitHeartbeat(t, f, id, time.Time{}, "first heartbeat")
	waitHeartbeat(t, f, id, first, "a later heartbeat")

	if mid, alive := f.Agent(id); mid != machine.String() || !alive {
		t.Errorf("Agent(%s) = %q, %v; want %s, true", id, mid, alive, machine)
	}
	if mid, alive := f.Agent(slotID(1)); mid != "" || alive {
		t.Errorf("Agent of a machine without agent = %q, %v; want \"\", false", mid, alive)
	}
	if s := rec.starts(); len(s) != 1 || s[0].id != id || s[0].machine != machine.String() || s[0].at.IsZero() {
		t.Errorf("AgentStarted calls = %+v, want one for %s", s, id)
	}
	acks := rec.acks(id)
	hw := 0
	for _, a := range acks {
		if a.machine != machine.String() || a.sent.After(a.acked) || a.sent.IsZero() {
			t.Errorf("HeartbeatAcked(%+v): wrong machine or times", a)
		}
		if a.hardware {
			hw++
		}
	}
	if len(acks) < 2 || hw != 1 {
		t.Errorf("%d HeartbeatAcked calls, %d with the hardware recorded; want >= 2, exactly 1", len(acks), hw)
	}
	// Heartbeats sent before AgentStarted was recorded may be refused; those
	// are the server's answers, never transport failures.
	for _, r := range rec.refusals() {
		if r.code == connect.CodeUnavailable || r.code == connect.CodeDeadlineExceeded {
			t.Errorf("HeartbeatRefused(%+v) for a heartbeat the server answered OK or refused for cause", r)
		}
	}
}

// TestServeSSHRefused checks that machines that are not up close a TCP
// connection at once, as a refused connection, rather than hanging.
func TestServeSSHRefused(t *testing.T) {
	t.Parallel()
	f := startFleet(t, sim.Config{Machines: 3, RebootLatency: time.Hour})
	free, rebooting := slotID(1), slotID(2)
	if err := f.Provision(rebooting); err != nil {
		t.Fatal(err)
	}
	if err := f.RebootMachine(t.Context(), rebooting); err != nil {
		t.Fatal(err)
	}
	refusedFast(t, f, free, serve(t, f, free))
	refusedFast(t, f, rebooting, serve(t, f, rebooting))

	flaky := startFleet(t, sim.Config{Machines: 1, SSHFailureRate: 1})
	if err := flaky.Provision(slotID(1)); err != nil {
		t.Fatal(err)
	}
	refusedFast(t, flaky, slotID(1), serve(t, flaky, slotID(1)))

	if err := f.ServeSSH(t.Context(), "nope", newListener(t)); err == nil {
		t.Error("ServeSSH of an unknown machine succeeded")
	}
}

func newListener(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

// TestServeSSHBlackHole checks that a killed machine accepts connections
// and never answers, until it is revived, and that ServeSSH ends with its
// context while it holds such a connection.
func TestServeSSHBlackHole(t *testing.T) {
	t.Parallel()
	f := startFleet(t, sim.Config{Machines: 1})
	id := slotID(1)
	if err := f.Provision(id); err != nil {
		t.Fatal(err)
	}
	ln := newListener(t)
	addr := ln.Addr().String()
	ctx, cancel := context.WithCancel(t.Context())
	served := make(chan error, 1)
	go func() { served <- f.ServeSSH(ctx, id, ln) }()
	mustHandshake(t, f, id, addr).Close()

	if err := f.Kill(id); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err := handshake(t, f, id, addr, 300*time.Millisecond)
	if !isTimeout(err) {
		t.Fatalf("SSH to a killed machine: %v, want a timeout (the TCP dial succeeds, nothing answers)", err)
	}
	if d := time.Since(start); d < 300*time.Millisecond {
		t.Errorf("the handshake failed after %s, before its deadline", d)
	}

	// A connection held by the dead machine is reset when it comes back.
	held, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	if _, err := held.Write([]byte("SSH-2.0-test\r\n")); err != nil {
		t.Fatal(err)
	}
	_ = held.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	if n, err := held.Read(make([]byte, 64)); !isTimeout(err) {
		t.Fatalf("reading from a killed machine: %d bytes, %v; want a timeout", n, err)
	}
	if err := f.Revive(id); err != nil {
		t.Fatal(err)
	}
	_ = held.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadAll(held); err != nil && isTimeout(err) {
		t.Errorf("a connection held while the machine was dead is still open after Revive: %v", err)
	}
	mustHandshake(t, f, id, addr).Close()

	// ServeSSH ends with its context, also while it holds a connection.
	if err := f.Kill(id); err != nil {
		t.Fatal(err)
	}
	hole, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer hole.Close()
	cancel()
	select {
	case err := <-served:
		if err != nil {
			t.Errorf("ServeSSH returned %v after its context ended, want nil", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("ServeSSH did not return within 10s of its context's end")
	}
	_ = hole.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadAll(hole); err != nil && isTimeout(err) {
		t.Errorf("a held connection is still open after ServeSSH returned: %v", err)
	}
}

// TestRebootCommand runs the reboot command over TCP SSH on a machine with
// an agent: it answers 0, the connection closes, the agent is gone, SSH is
// refused for RebootLatency, and the observer hears of it once.
func TestRebootCommand(t *testing.T) {
	t.Parallel()
	const latency = 2 * time.Second
	cb := newCallback(t, nil)
	rec := &recorder{}
	f := startFleet(t, sim.Config{Machines: 1, RebootLatency: latency, RebootCommand: rebootCommand, Observer: rec})
	id := slotID(1)
	if err := f.Provision(id); err != nil {
		t.Fatal(err)
	}
	addr := serve(t, f, id)
	machine := newMachineID()
	tcpTakeover(t, f, id, addr, cb, machine)
	cb.waitCount(t, machine, 2, 30*time.Second, "the agent heartbeats")

	c := mustHandshake(t, f, id, addr)
	closed := make(chan error, 1)
	go func() { closed <- c.Wait() }()
	before := time.Now()
	if _, err := sshx.Run(testCtx(t), c, rebootCommand, nil, 1<<16); err != nil {
		t.Fatalf("running the reboot command: %v, want exit status 0", err)
	}
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("the connection is still open 10s after the reboot")
	}
	at, n := f.Rebooted(id)
	if n != 1 || at.Before(before) {
		t.Errorf("Rebooted(%s) = %v, %d; want one reboot after %v", id, at, n, before)
	}
	if mid, alive := f.Agent(id); mid != "" || alive {
		t.Errorf("Agent(%s) = %q, %v after the reboot; want no agent", id, mid, alive)
	}
	if time.Since(at) < latency {
		refusedFast(t, f, id, addr)
	}
	var up time.Time
	bmdbtest.WaitFor(t, 15*time.Second, "SSH answers again after the reboot", func(context.Context) (bool, error) {
		c, err := handshake(t, f, id, addr, 5*time.Second)
		if err == nil {
			up = time.Now()
			c.Close()
		}
		return err == nil, nil
	})
	if up.Sub(at) < latency {
		t.Errorf("SSH answered %s after the reboot, before RebootLatency %s", up.Sub(at), latency)
	}
	if rb := rec.reboots(); len(rb) != 1 || rb[0].id != id || !rb[0].at.Equal(at) {
		t.Errorf("Rebooted calls = %+v, want one for %s at %v", rb, id, at)
	}
	if st := f.Stats(); st.Reboots != 1 || st.RebootsFailed != 0 || st.RebootsHung != 0 || st.AgentsRunning != 0 {
		t.Errorf("Stats() = %+v, want 1 reboot, no agent", st)
	}
	// Without a reboot command configured, the same command is the takeover.
	g := startFleet(t, sim.Config{Machines: 1})
	if err := g.Provision(id); err != nil {
		t.Fatal(err)
	}
	gc, _ := mustDial(t, g, id)
	if resp := execTakeover(t, gc, []byte("garbage")); resp.GetError() == nil {
		t.Errorf("without RebootCommand, %q answered %v, want a TakeoverError", rebootCommand, resp)
	}
}

// TestRebootCommandFaults checks a reboot command that fails (exit 1, no
// reboot) and one that hangs (no answer, no reboot).
func TestRebootCommandFaults(t *testing.T) {
	t.Parallel()
	setup := func(t *testing.T, cfg sim.Config, fault sim.RebootFault) (*sim.Fleet, *recorder, string, string) {
		cb := newCallback(t, nil)
		rec := &recorder{}
		cfg.Machines, cfg.RebootCommand, cfg.Observer = 1, rebootCommand, rec
		f := startFleet(t, cfg)
		id := slotID(1)
		if err := f.Provision(id); err != nil {
			t.Fatal(err)
		}
		if err := f.SetRebootFault(id, fault); err != nil {
			t.Fatal(err)
		}
		addr := serve(t, f, id)
		machine := newMachineID()
		tcpTakeover(t, f, id, addr, cb, machine)
		cb.waitCount(t, machine, 1, 30*time.Second, "the agent heartbeats")
		return f, rec, id, addr
	}
	notRebooted := func(t *testing.T, f *sim.Fleet, rec *recorder, id, addr string) {
		t.Helper()
		if _, n := f.Rebooted(id); n != 0 {
			t.Errorf("Rebooted(%s) counts %d reboots, want 0", id, n)
		}
		if rb := rec.reboots(); len(rb) != 0 {
			t.Errorf("Rebooted calls = %+v, want none", rb)
		}
		if _, alive := f.Agent(id); !alive {
			t.Errorf("the agent of %s is gone, want it running", id)
		}
		mustHandshake(t, f, id, addr).Close()
	}
	for _, tt := range []struct {
		name  string
		cfg   sim.Config
		fault sim.RebootFault
	}{
		{"RebootFails", sim.Config{}, sim.RebootFails},
		{"RebootFailureRate", sim.Config{RebootFailureRate: 1}, sim.RebootWorks},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			f, rec, id, addr := setup(t, tt.cfg, tt.fault)
			c := mustHandshake(t, f, id, addr)
			_, err := sshx.Run(testCtx(t), c, rebootCommand, nil, 1<<16)
			var exit *sshx.ExitError
			if !errors.As(err, &exit) || exit.Status != 1 || !strings.Contains(exit.Stderr, "injected failure") {
				t.Fatalf("running the reboot command: %v, want exit status 1 with a message", err)
			}
			notRebooted(t, f, rec, id, addr)
			if st := f.Stats(); st.RebootsFailed != 1 || st.Reboots != 0 {
				t.Errorf("Stats() = %+v, want 1 failed reboot, none done", st)
			}
		})
	}
	t.Run("RebootHangs", func(t *testing.T) {
		t.Parallel()
		f, rec, id, addr := setup(t, sim.Config{}, sim.RebootHangs)
		c := mustHandshake(t, f, id, addr)
		s, err := c.NewSession()
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Start(rebootCommand); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- s.Wait() }()
		bmdbtest.WaitFor(t, 10*time.Second, "the reboot command hangs", func(context.Context) (bool, error) {
			return f.Stats().RebootsHung == 1, nil
		})
		// Not waiting for a condition: checking that nothing answers for a
		// while.
		select {
		case err := <-done:
			t.Fatalf("the hung reboot command answered: %v", err)
		case <-time.After(300 * time.Millisecond):
		}
		notRebooted(t, f, rec, id, addr)
		c.Close() // the client gives up
		select {
		case err := <-done:
			if err == nil {
				t.Error("the hung reboot command exited 0 when the client gave up")
			}
		case <-time.After(10 * time.Second):
			t.Fatal("the session did not end 10s after the client closed the connection")
		}
		bmdbtest.WaitFor(t, 10*time.Second, "the hung session's connection is gone", func(context.Context) (bool, error) {
			return f.Stats().SSHConnections == 0, nil
		})
		if st := f.Stats(); st.Reboots != 0 || st.RebootsFailed != 0 {
			t.Errorf("Stats() = %+v, want no reboot done or failed", st)
		}
	})
}

// TestProviderRebootFaults checks SetRebootFault on the provider's
// RebootMachine and ReinstallMachine.
func TestProviderRebootFaults(t *testing.T) {
	t.Parallel()
	rec := &recorder{}
	f := startFleet(t, sim.Config{Machines: 2, Observer: rec})
	id := slotID(1)
	if err := f.Provision(id); err != nil {
		t.Fatal(err)
	}
	if err := f.SetRebootFault(id, sim.RebootFault(7)); err == nil {
		t.Error("SetRebootFault with an unknown fault succeeded")
	}
	if err := f.SetRebootFault("nope", sim.RebootFails); err == nil {
		t.Error("SetRebootFault of an unknown machine succeeded")
	}

	if err := f.SetRebootFault(id, sim.RebootFails); err != nil {
		t.Fatal(err)
	}
	for _, reboot := range []func(context.Context, string) error{f.RebootMachine, f.ReinstallMachine} {
		err := reboot(t.Context(), id)
		if err == nil || errors.Is(err, provider.ErrNotReached) {
			t.Errorf("reboot with RebootFails: %v, want an error that does not wrap ErrNotReached", err)
		}
	}

	if err := f.SetRebootFault(id, sim.RebootHangs); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	if err := f.RebootMachine(ctx, id); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("reboot with RebootHangs: %v, want DeadlineExceeded", err)
	}
	// The order of events, not a duration (the clock ran before the call
	// began): the hung reboot returns once its context has ended.
	if ctx.Err() == nil {
		t.Error("the hung reboot returned before its context ended")
	}
	if _, n := f.Rebooted(id); n != 0 || len(rec.reboots()) != 0 {
		t.Errorf("%d reboots and %d Rebooted calls after failed and hung reboots, want none", n, len(rec.reboots()))
	}
	if st := f.Stats(); st.RebootsFailed != 2 || st.RebootsHung != 1 || st.Reboots != 0 {
		t.Errorf("Stats() = %+v, want 2 failed and 1 hung reboot", st)
	}

	if err := f.SetRebootFault(id, sim.RebootWorks); err != nil {
		t.Fatal(err)
	}
	if err := f.RebootMachine(t.Context(), id); err != nil {
		t.Fatal(err)
	}
	at, n := f.Rebooted(id)
	if rb := rec.reboots(); n != 1 || len(rb) != 1 || rb[0].id != id || !rb[0].at.Equal(at) {
		t.Errorf("Rebooted(%s) = %v, %d; observer %+v; want one reboot seen by both", id, at, n, rb)
	}
}

// TestPartition checks that a partitioned machine's heartbeats never reach
// the server, without holding the only heartbeat worker (other agents go
// on), across a reboot and a takeover, and that they resume when it ends.
func TestPartition(t *testing.T) {
	t.Parallel()
	cb := newCallback(t, nil)
	rec := &recorder{}
	// One worker: an agent whose heartbeat held it for the simulated
	// timeout (15s) would silence every other agent for as long.
	f := startFleet(t, sim.Config{Machines: 3, HeartbeatConcurrency: 1, Observer: rec})
	a, b, c := slotID(1), slotID(2), slotID(3)
	if err := f.Provision(a, b, c); err != nil {
		t.Fatal(err)
	}
	ma, mb, mc := newMachineID(), newMachineID(), newMachineID()
	for id, m := range map[string]string{a: ma, b: mb, c: mc} {
		pipeTakeover(t, f, id, cb, m)
		cb.waitCount(t, m, 1, 30*time.Second, "first heartbeat of "+id)
	}

	if err := f.Partition(a, true); err != nil {
		t.Fatal(err)
	}
	partitioned := time.Now()
	// With one worker, once b has had a heartbeat sent after the
	// partition answered, a heartbeat of a that was in flight then is over.
	nb := len(cb.got(mb))
	cb.waitCount(t, mb, nb+2, 10*time.Second, "b heartbeats after a was partitioned")
	na := len(cb.got(ma))
	nb, nc := len(cb.got(mb)), len(cb.got(mc))
	cb.waitCount(t, mb, nb+20, 10*time.Second, "b keeps heartbeating with a partitioned")
	cb.waitCount(t, mc, nc+20, 10*time.Second, "c keeps heartbeating with a partitioned")
	if got := len(cb.got(ma)); got != na {
		t.Errorf("%d heartbeats of partitioned machine %s reached the server", got-na, a)
	}
	for _, ack := range rec.acks(a) {
		if ack.sent.After(partitioned) {
			t.Errorf("a heartbeat of partitioned machine %s sent at %v was answered", a, ack.sent)
		}
	}
	if mid, alive := f.Agent(a); mid != ma || !alive {
		t.Errorf("Agent(%s) = %q, %v; a partitioned agent is alive", a, mid, alive)
	}
	st := f.Stats()
	if st.HeartbeatsDropped == 0 || st.HeartbeatsFailed < st.HeartbeatsDropped {
		t.Errorf("Stats() = %+v, want dropped heartbeats, counted as failed", st)
	}
	if r := rec.refusals(); len(r) != 0 {
		t.Errorf("HeartbeatRefused calls %+v for dropped heartbeats, want none", r)
	}

	// The partition belongs to the machine: a new system and agent on it
	// are cut off too.
	if err := f.RebootMachine(t.Context(), a); err != nil {
		t.Fatal(err)
	}
	ma2 := newMachineID()
	pipeTakeover(t, f, a, cb, ma2)
	nb = len(cb.got(mb))
	cb.waitCount(t, mb, nb+10, 10*time.Second, "b heartbeats after a's new agent started")
	if got := len(cb.got(ma2)); got != 0 {
		t.Errorf("%d heartbeats of the new agent of partitioned machine %s reached the server", got, a)
	}

	// Healed: the agent heartbeats again, well before a simulated timeout
	// and backoff would have passed.
	if err := f.Partition(a, false); err != nil {
		t.Fatal(err)
	}
	cb.waitCount(t, ma2, 3, 10*time.Second, "a heartbeats again once the partition ends")
	if err := f.Partition("nope", true); err == nil {
		t.Error("Partition of an unknown machine succeeded")
	}
}

// TestReportsResent checks that the agent resends its hardware report, and
// an installation report, until the server says it recorded them, as the
// real agent does, however many heartbeats the server accepts meanwhile.
func TestReportsResent(t *testing.T) {
	t.Parallel()
	const hwAfter, instAfter = 3, 2 // answers that do not record the report
	instSeen := 0
	image := testImage()
	sum := sha256.Sum256(image)
	srv := imageServer(t, image)
	cb := newCallback(t, func(n int, req *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error) {
		resp := okAnswer(req)
		resp.HardwareReportRecorded = req.GetHardwareReport() != nil && n >= hwAfter
		if n == 0 {
			resp.InstallationRequest = &agentv1.OSInstallationRequest{
				Generation: 1, ImageUrl: srv.URL + "/os.img", TargetDevice: "/dev/nvme0n1",
				ImageSha256: hex.EncodeToString(sum[:]),
			}
		}
		if req.GetInstallationReport() != nil {
			instSeen++
			if instSeen <= instAfter {
				resp.InstallationReportRecorded = 0
			}
		}
		return resp, nil
	})
	rec := &recorder{}
	f := startFleet(t, sim.Config{Machines: 1, InstallLatency: 10 * time.Millisecond, Observer: rec, DiskDir: t.TempDir()})
	id := slotID(1)
	if err := f.Provision(id); err != nil {
		t.Fatal(err)
	}
	machine := newMachineID()
	pipeTakeover(t, f, id, cb, machine)
	var reqs []received
	bmdbtest.WaitFor(t, 30*time.Second, "the reports are delivered and more heartbeats follow", func(context.Context) (bool, error) {
		reqs = cb.got(machine)
		last := -1
		for n, r := range reqs {
			if r.req.GetInstallationReport() != nil {
				last = n
			}
		}
		return len(reqs) >= hwAfter+4 && last >= 0 && len(reqs) >= last+4, nil
	})
	var inst []int
	for n, r := range reqs {
		if got, want := r.req.GetHardwareReport() != nil, n <= hwAfter; got != want {
			t.Errorf("heartbeat %d carries a hardware report: %v, want %v", n, got, want)
		}
		if ir := r.req.GetInstallationReport(); ir != nil {
			if ir.GetGeneration() != 1 || ir.GetSuccess() == nil {
				t.Errorf("heartbeat %d carries installation report %v, want generation 1's success", n, ir)
			}
			inst = append(inst, n)
		}
	}
	if len(inst) != instAfter+1 {
		t.Errorf("the installation report went with heartbeats %v, want %d consecutive ones", inst, instAfter+1)
	}
	for k := 1; k < len(inst); k++ {
		if inst[k] != inst[k-1]+1 {
			t.Errorf("the installation report went with heartbeats %v, want consecutive ones", inst)
		}
	}
	hw := 0
	for _, a := range rec.acks(id) {
		if a.hardware {
			hw++
		}
	}
	if hw != 1 {
		t.Errorf("%d HeartbeatAcked calls said the hardware was recorded, want 1", hw)
	}
	if st := f.Stats(); st.Installations != 1 {
		t.Errorf("Stats().Installations = %d, want 1", st.Installations)
	}
}

// TestReportKeptAcrossRestart checks that an installation report the
// server has not acknowledged when the machine restarts goes with the first
// heartbeat of the machine's next agent, as the real agent resends it from
// its state directory.
func TestReportKeptAcrossRestart(t *testing.T) {
	t.Parallel()
	image := testImage()
	sum := sha256.Sum256(image)
	srv := imageServer(t, image)
	var ack atomic.Bool // whether installation reports are acknowledged
	cb := newCallback(t, func(n int, req *agentv1.HeartbeatRequest) (*agentv1.HeartbeatResponse, error) {
		resp := okAnswer(req)
		if n == 0 {
			resp.InstallationRequest = &agentv1.OSInstallationRequest{
				Generation: 1, ImageUrl: srv.URL + "/os.img", TargetDevice: "/dev/nvme0n1",
				ImageSha256: hex.EncodeToString(sum[:]),
			}
		}
		if !ack.Load() {
			resp.InstallationReportRecorded = 0
		}
		return resp, nil
	})
	f := startFleet(t, sim.Config{Machines: 1, DiskDir: t.TempDir()})
	id := slotID(1)
	if err := f.Provision(id); err != nil {
		t.Fatal(err)
	}
	machine := newMachineID()
	pipeTakeover(t, f, id, cb, machine)
	sent := 0 // heartbeats received once the first agent sent the report
	bmdbtest.WaitFor(t, 30*time.Second, "the first agent sends the installation report", func(context.Context) (bool, error) {
		reqs := cb.got(machine)
		for _, r := range reqs {
			if r.req.GetInstallationReport().GetSuccess() != nil {
				sent = len(reqs)
				return true, nil
			}
		}
		return false, nil
	})
	if err := f.RebootMachine(t.Context(), id); err != nil {
		t.Fatal(err)
	}
	ack.Store(true)
	pipeTakeover(t, f, id, cb, machine)
	// An agent's first heartbeat is the only one with the hardware report
	// (okAnswer records it), and the first agent sent its own before the
	// installation was requested.
	var first *agentv1.HeartbeatRequest
	bmdbtest.WaitFor(t, 30*time.Second, "the next agent's first heartbeat", func(context.Context) (bool, error) {
		for _, r := range cb.got(machine)[sent:] {
			if r.req.GetHardwareReport() != nil {
				first = r.req
				return true, nil
			}
		}
		return false, nil
	})
	if ir := first.GetInstallationReport(); ir.GetGeneration() != 1 || ir.GetSuccess() == nil {
		t.Errorf("the next agent's first heartbeat carries installation report %v, want generation 1's success", ir)
	}
	if st := f.Stats(); st.Installations != 1 {
		t.Errorf("Stats().Installations = %d, want 1", st.Installations)
	}
}

// TestObserverRefused checks that HeartbeatRefused reports the server's
// errors with their code, and HeartbeatFailed, never HeartbeatRefused, a
// transport failure.
func TestObserverRefused(t *testing.T) {
	t.Parallel()
	// The real callback server, which refuses an agent whose key the BMDB
	// does not hold: this takeover is never recorded as AgentStarted.
	e := newEnv(t, 100*time.Millisecond)
	rec := &recorder{}
	f := startFleet(t, sim.Config{Machines: 2, Observer: rec})
	refusedID, unreachable := slotID(1), slotID(2)
	if err := f.Provision(refusedID, unreachable); err != nil {
		t.Fatal(err)
	}
	mid := e.addMachine(t, f, refusedID)
	machine := mid.String()
	c, _ := mustDial(t, f, refusedID)
	raw, err := proto.Marshal(e.init(mid))
	if err != nil {
		t.Fatal(err)
	}
	if resp := execTakeover(t, c, raw); resp.GetSuccess() == nil {
		t.Fatalf("takeover: %v", resp)
	}
	c.Close()
	bmdbtest.WaitFor(t, 30*time.Second, "refusals are observed", func(context.Context) (bool, error) {
		return len(rec.refusals()) >= 2, nil
	})
	for _, r := range rec.refusals() {
		if r.id != refusedID || r.machine != machine || r.code != connect.CodeUnauthenticated || r.sent.IsZero() {
			t.Errorf("HeartbeatRefused(%+v), want %s, %s, Unauthenticated", r, refusedID, machine)
		}
	}
	if a := rec.acks(refusedID); len(a) != 0 {
		t.Errorf("HeartbeatAcked calls %+v for refused heartbeats", a)
	}

	// A server nobody listens at: transport failures are not refusals.
	ln := newListener(t)
	dead := ln.Addr().String()
	ln.Close()
	raw, err = proto.Marshal(&agentv1.TakeoverInit{MachineId: newMachineID(), ServerEndpoint: dead, CaCertificate: e.ca})
	if err != nil {
		t.Fatal(err)
	}
	cl, _ := mustDial(t, f, unreachable)
	if resp := execTakeover(t, cl, raw); resp.GetSuccess() == nil {
		t.Fatalf("takeover: %v", resp)
	}
	// Stats count refusals as failures too: wait for the observer itself.
	bmdbtest.WaitFor(t, 30*time.Second, "unanswered heartbeats are observed", func(context.Context) (bool, error) {
		return len(rec.failures(unreachable)) >= 3, nil
	})
	for _, r := range rec.refusals() {
		if r.id == unreachable {
			t.Errorf("HeartbeatRefused(%+v) for a transport failure", r)
		}
	}
	if got := rec.failures(unreachable); got[0].sent.IsZero() || got[0].machine == "" {
		t.Errorf("HeartbeatFailed calls %+v for heartbeats to a dead server, want their machine and time", got)
	}
	if got := rec.failures(refusedID); len(got) != 0 {
		t.Errorf("HeartbeatFailed calls %+v for refused heartbeats, want none", got)
	}
}
