package sim

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"github.com/pkg/sftp"
	"golang.org/x/crypto/ssh"
	"google.golang.org/protobuf/proto"

	"github.com/shepherd/shepherd/agent"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/provider"
)

// stdinTimeout bounds how long a takeover waits for its stdin to end, as
// the real agent's default StdinTimeout does.
const stdinTimeout = 10 * time.Second

// ErrUnreachable is wrapped by SSH dials that fail because the machine is
// down (killed, rebooting, powered off, hung, not provisioned) or because a
// failure was injected.
var ErrUnreachable = errors.New("sim: machine unreachable over SSH")

// SSHAccess tells the initializer how to reach a simulated machine: the
// initializer's own user and key (the simulated SSH server accepts anyone),
// trust on first use for the host key, and a Dial that hands out
// in-process connections.
func (f *Fleet) SSHAccess(ctx context.Context, id string) (provider.SSHAccess, error) {
	if err := ctx.Err(); err != nil {
		return provider.SSHAccess{}, err
	}
	i, err := f.lookup(id)
	if err != nil {
		return provider.SSHAccess{}, err
	}
	return provider.SSHAccess{Dial: func(ctx context.Context) (net.Conn, error) { return f.dial(ctx, i) }}, nil
}

// dial waits SSHLatency, then returns one end of an in-process connection
// (see pipe) whose other end an SSH server of machine i serves, unless the
// machine cannot be reached.
func (f *Fleet) dial(ctx context.Context, i int32) (net.Conn, error) {
	client, server := pipe(f.id(i) + ":22")
	if _, err := f.open(ctx, i, server); err != nil {
		client.Close()
		server.Close()
		return nil, err
	}
	return client, nil
}

// answer is how a machine answers a new SSH connection.
type answer int

const (
	answered   answer = iota // its SSH server serves the connection
	refused                  // the connection is closed at once, like a refused one
	blackHoled               // nothing answers: the machine is dead
)

// open waits SSHLatency (or until ctx ends), then decides how machine i
// answers a new connection, of which conn is the server's end: if the
// machine is up, its SSH server serves conn and open returns answered;
// otherwise open returns how the connection goes unanswered and an error
// wrapping ErrUnreachable that says why, and leaves conn to the caller.
// Every way to reach a machine (dial, ServeSSH) goes through it.
func (f *Fleet) open(ctx context.Context, i int32, conn net.Conn) (answer, error) {
	id := f.id(i)
	if d := f.cfg.SSHLatency; d > 0 {
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return refused, fmt.Errorf("sim: dialing %s: %w", id, ctx.Err())
		case <-t.C:
		}
	} else if err := ctx.Err(); err != nil {
		return refused, fmt.Errorf("sim: dialing %s: %w", id, err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	s := &f.slots[i]
	var why string
	ans := refused
	switch {
	case f.stopped:
		why = "the simulated fleet has stopped"
	case !s.used:
		why = "the machine is not provisioned"
	case s.killed:
		why, ans = "no route to host (machine killed)", blackHoled
	case s.off:
		// The router's ARP for it fails: host unreachable, quickly.
		why = "no route to host (machine powered off)"
	case s.hung:
		// Refused at once rather than black-holed, so that tests and
		// benchmarks of hung machines do not wait out SSH timeouts.
		why = "connection refused (machine hung)"
	case s.rebootUntil > f.now():
		why = "connection refused (machine rebooting)"
	case f.chance(f.cfg.SSHFailureRate):
		why = "connection timed out (injected failure)"
	}
	if why != "" {
		return ans, fmt.Errorf("%w: dialing %s: %s", ErrUnreachable, id, why)
	}
	boot, reinstalls := s.boot, s.reinstalls
	if f.conns[i] == nil {
		f.conns[i] = map[net.Conn]struct{}{}
	}
	f.conns[i][conn] = struct{}{}
	f.conWG.Go(func() { f.serveConn(i, boot, reinstalls, conn) })
	return answered, nil
}

// ServeSSH serves machine id's SSH server on ln, a real (TCP) listener,
// until ctx ends, when it closes ln and returns nil, or until Accept fails,
// when it returns the error. Other processes reach the machine there as
// they would a real one, e.g. through a static inventory (see Provision
// and Config.RebootCommand). A connection is treated as a dial is: after
// SSHLatency, a machine that is not provisioned, is rebooting or fails
// with SSHFailureRate closes it at once (as a refused connection); a
// killed machine accepts it and never answers, until the client closes
// it, ctx ends, the machine is revived or the fleet stops; a machine that
// is powered off or hung closes it at once; a machine that is up serves it
// with the same SSH server as SSHAccess's connections.
// When ctx ends, the connections ServeSSH accepted are closed too.
func (f *Fleet) ServeSSH(ctx context.Context, id string, ln net.Listener) error {
	i, err := f.lookup(id)
	if err != nil {
		ln.Close()
		return fmt.Errorf("sim: serving SSH: %w", err)
	}
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	var handlers sync.WaitGroup
	defer handlers.Wait()
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			ln.Close()
			return fmt.Errorf("sim: serving SSH of %s on %s: %w", id, ln.Addr(), err)
		}
		conn := &ctxConn{Conn: c}
		conn.stop = context.AfterFunc(ctx, func() { c.Close() })
		handlers.Go(func() { f.serveAccepted(ctx, i, conn) })
	}
}

// serveAccepted answers conn, a connection ServeSSH accepted for machine i, as
// open decides.
func (f *Fleet) serveAccepted(ctx context.Context, i int32, conn net.Conn) {
	ans, err := f.open(ctx, i, conn)
	switch ans {
	case answered:
		return
	case blackHoled:
		f.hold(i, conn)
	default:
		conn.Close()
	}
	f.log.Debug("SSH connection not answered", "provider_id", f.id(i), "remote", conn.RemoteAddr().String(), "err", err)
}

// hold keeps conn, a connection to dead machine i, open without answering
// anything, until it is closed: by the client, by ServeSSH's context, by
// Revive or by the fleet's end.
func (f *Fleet) hold(i int32, conn net.Conn) {
	f.mu.Lock()
	if f.stopped {
		f.mu.Unlock()
		conn.Close()
		return
	}
	if f.holes[i] == nil {
		f.holes[i] = map[net.Conn]struct{}{}
	}
	f.holes[i][conn] = struct{}{}
	f.mu.Unlock()
	_, _ = io.Copy(io.Discard, conn) // what the client sends is lost
	conn.Close()
	f.mu.Lock()
	if hs := f.holes[i]; hs != nil {
		delete(hs, conn)
		if len(hs) == 0 {
			delete(f.holes, i)
		}
	}
	f.mu.Unlock()
}

// ctxConn is a connection ServeSSH accepted; closing it forgets the
// context.AfterFunc that closes it when ServeSSH's context ends, so that
// a long-lived listener does not pile them up.
type ctxConn struct {
	net.Conn
	stop func() bool
}

// Close closes the connection.
func (c *ctxConn) Close() error {
	c.stop()
	return c.Conn.Close()
}

// HostKey returns machine id's SSH host key as it is now; it changes with
// every ReinstallMachine.
func (f *Fleet) HostKey(id string) (ssh.PublicKey, error) {
	i, err := f.lookup(id)
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	n := f.slots[i].reinstalls
	f.mu.Unlock()
	signer, err := f.hostSigner(i, n)
	if err != nil {
		return nil, err
	}
	return signer.PublicKey(), nil
}

// hostSigner derives machine i's host key after reinstalls reinstallations
// from the fleet's seed: nothing is stored per slot, and the same seed
// gives the same keys in every run.
func (f *Fleet) hostSigner(i int32, reinstalls uint32) (ssh.Signer, error) {
	var n [8]byte
	binary.BigEndian.PutUint32(n[:4], uint32(i))
	binary.BigEndian.PutUint32(n[4:], reinstalls)
	key := ed25519.NewKeyFromSeed(sha256Of(f.hostKey[:], f.id(i), n[:]))
	signer, err := ssh.NewSignerFromKey(key)
	if err != nil {
		return nil, fmt.Errorf("sim: host key of %s: %w", f.id(i), err)
	}
	return signer, nil
}

// serveConn is the SSH server of one connection to machine i, booted as
// boot. It returns when the connection closes.
func (f *Fleet) serveConn(i int32, boot, reinstalls uint32, conn net.Conn) {
	defer func() {
		conn.Close()
		f.mu.Lock()
		if cs := f.conns[i]; cs != nil {
			delete(cs, conn)
			if len(cs) == 0 {
				delete(f.conns, i)
			}
		}
		f.mu.Unlock()
	}()
	signer, err := f.hostSigner(i, reinstalls)
	if err != nil {
		f.log.Error("serving SSH", "provider_id", f.id(i), "err", err)
		return
	}
	// Every key and every password is accepted: the simulator checks
	// nothing about who takes its machines over.
	cfg := &ssh.ServerConfig{
		PublicKeyCallback: func(ssh.ConnMetadata, ssh.PublicKey) (*ssh.Permissions, error) { return nil, nil },
		PasswordCallback:  func(ssh.ConnMetadata, []byte) (*ssh.Permissions, error) { return nil, nil },
		ServerVersion:     "SSH-2.0-shepherd-sim",
	}
	cfg.AddHostKey(signer)
	// The handshake is bounded like a real sshd's login grace time, so a
	// client that dials and never speaks does not hold the goroutine.
	_ = conn.SetDeadline(time.Now().Add(30 * time.Second))
	sc, chans, reqs, err := ssh.NewServerConn(conn, cfg)
	if err != nil {
		f.log.Debug("SSH handshake failed", "provider_id", f.id(i), "err", err)
		return
	}
	_ = conn.SetDeadline(time.Time{})
	defer sc.Close()
	// Connection-level requests (keepalives) need an answer; there are none
	// we serve.
	f.conWG.Go(func() { ssh.DiscardRequests(reqs) })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel() // the connection is gone: stop its sessions' work
	for nc := range chans {
		if nc.ChannelType() != "session" {
			_ = nc.Reject(ssh.UnknownChannelType, "only session channels are served")
			continue
		}
		ch, chReqs, err := nc.Accept()
		if err != nil {
			continue
		}
		f.conWG.Go(func() { f.serveSession(ctx, i, boot, ch, chReqs) })
	}
}

// serveSession serves one session channel: an "sftp" subsystem or an exec,
// which is the takeover whatever the command, except Config.RebootCommand.
// Everything else is refused.
func (f *Fleet) serveSession(ctx context.Context, i int32, boot uint32, ch ssh.Channel, reqs <-chan *ssh.Request) {
	// The request channel closes with the SSH channel, however it ends
	// (the client closed the session, the connection died), which stops
	// the work started for it.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	started := false
	for req := range reqs {
		var run func()
		switch req.Type {
		case "exec":
			var cmd struct{ Command string }
			if rc := f.cfg.RebootCommand; rc != "" && ssh.Unmarshal(req.Payload, &cmd) == nil && cmd.Command == rc {
				run = func() { f.runReboot(ctx, i, boot, ch) }
			} else {
				run = func() { f.runTakeover(ctx, i, boot, ch) }
			}
		case "subsystem":
			var sub struct{ Name string }
			if ssh.Unmarshal(req.Payload, &sub) == nil && sub.Name == "sftp" {
				run = func() { f.runSFTP(i, ch) }
			}
		}
		ok := run != nil && !started // one program per session, as in sshd
		if req.WantReply {
			_ = req.Reply(ok, nil)
		}
		if ok {
			started = true
			f.conWG.Go(run)
		}
	}
}

// exit reports status as the command's exit status and closes the channel.
func exit(ch ssh.Channel, status uint32) {
	_, _ = ch.SendRequest("exit-status", false, ssh.Marshal(struct{ Status uint32 }{status}))
	_ = ch.Close()
}

// runReboot is Config.RebootCommand run on machine i, booted as boot,
// until ctx (the session's) ends. As SetRebootFault and RebootFailureRate
// say, it reboots the machine after answering exit status 0 (and the
// machine going down closes the connection), or exits 1 with a line on
// stderr and does nothing, or never answers and does nothing.
func (f *Fleet) runReboot(ctx context.Context, i int32, boot uint32, ch ssh.Channel) {
	id := f.id(i)
	f.mu.Lock()
	outcome := RebootWorks
	if f.slots[i].boot == boot {
		outcome = f.rebootOutcomeLocked(i)
	}
	switch outcome {
	case RebootFails:
		f.stats.RebootsFailed++
	case RebootHangs:
		f.stats.RebootsHung++
	}
	f.mu.Unlock()
	switch outcome {
	case RebootFails:
		f.metrics.reboots.WithLabelValues("error").Inc()
		f.log.Info("reboot command failed (injected)", "provider_id", id)
		_, _ = io.WriteString(ch.Stderr(), "reboot: Failed to reboot system: injected failure\n")
		exit(ch, 1)
		return
	case RebootHangs:
		f.metrics.reboots.WithLabelValues("error").Inc()
		f.log.Info("reboot command hangs (injected)", "provider_id", id)
		<-ctx.Done() // the client gave up, or the connection died
		_ = ch.Close()
		return
	}
	f.mu.Lock()
	if s := &f.slots[i]; s.boot != boot || s.hung {
		f.mu.Unlock() // the system the command ran on is gone or froze
		_ = ch.Close()
		return
	}
	at, closeAfter := f.rebootLocked(i, false, outcome)
	f.mu.Unlock()
	// The reboot is counted and observed before the client hears of it,
	// so that whoever it tells finds it done; then the answer goes out,
	// and only then do the machine's connections close.
	f.rebooted(ctx, i, at, false)
	exit(ch, 0)
	closeAfter()
}

// runSFTP serves SFTP on ch from machine i's in-memory file system.
func (f *Fleet) runSFTP(i int32, ch ssh.Channel) {
	f.mu.Lock()
	fs := f.files[i]
	if fs == nil {
		fs = newMemFS()
		f.files[i] = fs
	}
	f.mu.Unlock()
	srv := sftp.NewRequestServer(ch, fs.handlers())
	if err := srv.Serve(); err != nil && !errors.Is(err, io.EOF) {
		f.log.Debug("SFTP session ended", "provider_id", f.id(i), "err", err)
	}
	srv.Close()
	exit(ch, 0)
}

// runTakeover is the simulated agent binary run with a TakeoverInit on
// stdin: like the real one it always exits 0 and puts what went wrong into
// a TakeoverError on stdout.
func (f *Fleet) runTakeover(ctx context.Context, i int32, boot uint32, ch ssh.Channel) {
	resp := f.takeover(ctx, i, boot, ch)
	if resp == nil {
		_ = ch.Close() // the connection or the machine is gone; nobody reads an answer
		return
	}
	out, err := proto.Marshal(resp)
	if err == nil {
		_, err = ch.Write(out)
	}
	if err != nil {
		f.log.Debug("writing takeover response", "provider_id", f.id(i), "err", err)
	}
	exit(ch, 0)
}

func takeoverError(format string, args ...any) *agentv1.TakeoverResponse {
	return &agentv1.TakeoverResponse{Result: &agentv1.TakeoverResponse_Error{
		Error: &agentv1.TakeoverError{Message: fmt.Sprintf(format, args...)},
	}}
}

// takeover reads the TakeoverInit, waits TakeoverLatency and starts (or
// replaces) machine i's agent. It returns nil if ctx ended first.
func (f *Fleet) takeover(ctx context.Context, i int32, boot uint32, stdin io.Reader) *agentv1.TakeoverResponse {
	id := f.id(i)
	resp := f.takeoverResult(ctx, i, boot, stdin)
	if resp == nil {
		return nil
	}
	if e := resp.GetError(); e != nil {
		f.mu.Lock()
		f.stats.TakeoversFailed++
		f.mu.Unlock()
		f.metrics.takeovers.WithLabelValues("error").Inc()
		f.log.InfoContext(ctx, "takeover failed", "provider_id", id, "err", e.GetMessage())
		return resp
	}
	f.metrics.takeovers.WithLabelValues("ok").Inc()
	f.log.InfoContext(ctx, "agent started", "provider_id", id, "machine_id", resp.GetSuccess().GetInitMessage().GetMachineId())
	return resp
}

func (f *Fleet) takeoverResult(ctx context.Context, i int32, boot uint32, stdin io.Reader) *agentv1.TakeoverResponse {
	raw, err := agent.ReadTakeoverInit(ctx, stdin, stdinTimeout, f.conWG.Go)
	if ctx.Err() != nil {
		return nil
	}
	if err != nil {
		return takeoverError("%v", err)
	}
	if d := f.cfg.TakeoverLatency; d > 0 {
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
	}
	var init agentv1.TakeoverInit
	if err := proto.Unmarshal(raw, &init); err != nil {
		return takeoverError("stdin does not hold a TakeoverInit: %v", err)
	}
	if err := agent.ValidateTakeoverInit(&init); err != nil {
		return takeoverError("invalid TakeoverInit: %v", err)
	}
	f.mu.Lock()
	fail := f.chance(f.cfg.TakeoverFailureRate)
	f.mu.Unlock()
	if fail {
		return takeoverError("starting the agent daemon: injected failure")
	}
	key := f.agentKey
	if !f.cfg.SharedAgentKey {
		if _, key, err = ed25519.GenerateKey(rand.Reader); err != nil {
			return takeoverError("generating a key pair: %v", err)
		}
	}
	a, err := f.newAgent(i, &init, key)
	if err != nil {
		return takeoverError("starting the agent daemon: %v", err)
	}
	if err := f.startAgent(a, boot); err != nil {
		return takeoverError("starting the agent daemon: %v", err)
	}
	return &agentv1.TakeoverResponse{Result: &agentv1.TakeoverResponse_Success{Success: &agentv1.TakeoverSuccess{
		InitMessage: &init,
		PublicKey:   key.Public().(ed25519.PublicKey),
	}}}
}
