package agent

import (
	"context"
	"crypto/ed25519"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"github.com/google/uuid"
	"google.golang.org/protobuf/proto"

	"github.com/shepherd/shepherd/agent/hwreport"
	"github.com/shepherd/shepherd/agent/install"
	"github.com/shepherd/shepherd/api/agent/pulse"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/api/agent/v1/agentv1connect"
	"github.com/shepherd/shepherd/internal/safetext"
)

// heartbeatTimeout bounds one heartbeat RPC.
const heartbeatTimeout = 15 * time.Second

// RunDaemon is the daemon the takeover starts. It reads its configuration
// from file descriptor 3, replaces any daemon an earlier takeover started,
// reports on file descriptor 4 that it runs, and then sends heartbeats until
// ctx ends (SIGTERM; it returns nil) or the callback server says the machine
// was decommissioned (it returns ErrRetired).
func RunDaemon(ctx context.Context, log *slog.Logger) error {
	cfgFile, readyFile := os.NewFile(3, "daemon-config"), os.NewFile(4, "daemon-ready")
	if cfgFile == nil || readyFile == nil {
		return errNoDaemonConfig
	}
	fail := func(err error) error {
		fmt.Fprintf(readyFile, "%v", err)
		readyFile.Close()
		return err
	}
	data, err := io.ReadAll(io.LimitReader(cfgFile, 1<<20))
	cfgFile.Close()
	if err != nil || len(data) == 0 {
		return fail(errNoDaemonConfig)
	}
	var dc daemonConfig
	if err := json.Unmarshal(data, &dc); err != nil {
		return fail(fmt.Errorf("parsing the daemon configuration: %w", err))
	}
	var init agentv1.TakeoverInit
	if err := proto.Unmarshal(dc.Init, &init); err != nil {
		return fail(fmt.Errorf("parsing the TakeoverInit: %w", err))
	}
	if len(dc.Seed) != ed25519.SeedSize {
		return fail(errors.New("the daemon configuration has no valid key"))
	}
	priv := ed25519.NewKeyFromSeed(dc.Seed)
	clear(dc.Seed)
	lock, err := replaceDaemon(ctx, dc.StateDir, log)
	if err != nil {
		return fail(err)
	}
	defer lock.Close()
	if err := os.WriteFile(filepath.Join(dc.StateDir, pidFile), []byte(strconv.Itoa(os.Getpid())+"\n"), 0o600); err != nil {
		return fail(fmt.Errorf("writing pid file: %w", err))
	}
	machine, err := uuid.Parse(init.GetMachineId())
	if err != nil {
		return fail(fmt.Errorf("the TakeoverInit's machine id: %w", err))
	}
	client, hc, err := newClient(&init, priv)
	if err != nil {
		return fail(err)
	}
	d := &daemon{
		cfg:       dc,
		init:      &init,
		client:    client,
		log:       log.With("machine_id", init.GetMachineId()),
		done:      make(chan *agentv1.OSInstallationReport, 1),
		machine:   machine,
		agentKey:  priv.Public().(ed25519.PublicKey),
		closeIdle: hc.CloseIdleConnections,
	}
	if _, err := readyFile.Write([]byte("R")); err != nil {
		return fmt.Errorf("reporting readiness: %w", err)
	}
	readyFile.Close()
	d.log.InfoContext(ctx, "agent daemon running", "server", init.GetServerEndpoint(), "pid", os.Getpid())
	return d.run(ctx)
}

// replaceDaemon takes the state directory's lock, which the running daemon
// holds for its whole life. If another daemon holds it, that one is from an
// earlier takeover and is stopped: SIGTERM, then SIGKILL if it lingers.
func replaceDaemon(ctx context.Context, dir string, log *slog.Logger) (*os.File, error) {
	if err := ensureStateDir(dir); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(filepath.Join(dir, lockFile), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("opening lock file: %w", err)
	}
	start := time.Now()
	signaled := syscall.Signal(0)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return f, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("locking %s: %w", f.Name(), err)
		}
		pid := readPid(filepath.Join(dir, pidFile))
		switch {
		case pid > 0 && pid != os.Getpid() && signaled == 0:
			log.InfoContext(ctx, "stopping the daemon of an earlier takeover", "pid", pid)
			_ = syscall.Kill(pid, syscall.SIGTERM)
			signaled = syscall.SIGTERM
		case pid > 0 && signaled == syscall.SIGTERM && time.Since(start) > 5*time.Second:
			log.WarnContext(ctx, "earlier daemon ignores SIGTERM, killing it", "pid", pid)
			_ = syscall.Kill(pid, syscall.SIGKILL)
			signaled = syscall.SIGKILL
		case time.Since(start) > 15*time.Second:
			f.Close()
			return nil, fmt.Errorf("another daemon (pid %d) holds %s and does not stop", pid, f.Name())
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, ctx.Err()
		case <-tick.C:
		}
	}
}

// Stop stops the daemon of the state directory dir, if one runs, the way a
// new takeover replaces it: SIGTERM, then SIGKILL if it lingers. It returns
// once the daemon is gone (its lock is free), and nil if none ran. Nothing
// restarts a stopped daemon; a later takeover starts a new one. The
// decommissioner runs it over SSH (shepherd-agent stop).
func Stop(ctx context.Context, dir string, log *slog.Logger) error {
	if _, err := os.Stat(filepath.Join(dir, lockFile)); errors.Is(err, fs.ErrNotExist) {
		return nil // no daemon ever ran here
	}
	lock, err := replaceDaemon(ctx, dir, log)
	if err != nil {
		return fmt.Errorf("stopping the agent daemon of %s: %w", dir, err)
	}
	return lock.Close()
}

func readPid(path string) int {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil || pid <= 1 {
		return 0
	}
	return pid
}

// daemon is the heartbeat loop and the installations it starts.
type daemon struct {
	cfg    daemonConfig
	init   *agentv1.TakeoverInit
	client agentv1connect.AgentCallbackServiceClient
	log    *slog.Logger

	handled    int64                              // highest installation generation started
	installing bool                               // an installation runs
	done       chan *agentv1.OSInstallationReport // its report, when it finishes
	report     *agentv1.OSInstallationReport      // sent with every heartbeat until acknowledged
	reboot     bool                               // reboot once report is acknowledged (if it is a success)
	stateLost  bool                               // the generation file was unreadable; see refuseUnknown

	// Heartbeat datagrams (datagram.go). A TLS heartbeat the server
	// accepted grants a key for them; with it, and no report to deliver,
	// heartbeats go as datagrams until the server asks for a TLS call or
	// stops answering, and the TLS connection is closed after each call,
	// so that the server holds nothing for this agent between heartbeats.
	machine      uuid.UUID
	agentKey     ed25519.PublicKey
	closeIdle    func()           // closes the idle TLS connection; nil: none to close
	dialDatagram dialDatagramFunc // nil: dialUDP
	dg           *datagrams       // the grant of the last TLS heartbeat; nil: heartbeats go over TLS
	counter      uint64           // the last datagram counter sent, or the server's floor if higher
	// answeredAt is when the server last answered (over TLS, or a
	// datagram); every is the heartbeat interval then in effect; dgBackoff
	// is the back-off of datagrams sent again after no answer.
	answeredAt time.Time
	every      time.Duration
	dgBackoff  time.Duration
	// failedGrants counts the grants in a row whose datagrams went
	// unanswered until the agent called over TLS, which got through at
	// once. At udpBlockedAfter of them UDP to the server is taken for
	// blocked, and grants are ignored until tlsOnlyUntil, for tlsOnlyFor
	// (doubling, from tlsOnlyMin to tlsOnlyMax); an answered datagram
	// resets both. A fallback call that fails does not count: the server
	// is down, which explains the datagrams.
	failedGrants int
	tlsOnlyUntil time.Time
	tlsOnlyFor   time.Duration
}

const (
	// udpBlockedAfter is how many grants in a row must fail before UDP
	// is taken for blocked. One is not enough: a server that stalls
	// longer than two intervals fails one grant, and its agents must come
	// back to datagrams when it recovers, not hold TLS connections.
	udpBlockedAfter = 2
	// tlsOnlyMin and tlsOnlyMax bound how long heartbeats stay on TLS
	// once UDP seems blocked, before datagrams are tried again: trying
	// costs up to two intervals of heartbeats per failed grant.
	tlsOnlyMin = 30 * time.Minute
	tlsOnlyMax = 8 * time.Hour
)

// answered notes that the server answered, asking for the next heartbeat
// after next (0: the default).
func (d *daemon) answered(next time.Duration) {
	d.answeredAt, d.dgBackoff = time.Now(), 0
	if next > 0 || d.every == 0 {
		d.every = d.interval(next)
	}
}

// ErrRetired is what the daemon returns when the callback server answers
// that its machine was decommissioned: the agent is not wanted any more and
// stops for good instead of retrying. Nothing restarts it; a later takeover
// starts a new daemon.
var ErrRetired = errors.New("the callback server says the machine was decommissioned; the agent stops")

// Bounds of the wait the server asks for with a retry pushback.
const (
	minPushback = 100 * time.Millisecond
	maxPushback = 10 * time.Second
)

// retryPushbackKey is gRPC's retry pushback trailer (milliseconds), with
// which the callback server answers Unavailable when it cannot record a
// heartbeat now (its database is down or busy).
const retryPushbackKey = "grpc-retry-pushback-ms"

// recoverInstallation restores, from the state directory, what an earlier
// daemon left: the highest generation handled and a report the server has
// not acknowledged, or, for an installation that never finished, an error
// report saying it was interrupted.
func (d *daemon) recoverInstallation(ctx context.Context) {
	dir := d.cfg.StateDir
	r, reboot, err := readReport(dir)
	if err != nil {
		d.log.ErrorContext(ctx, "kept installation report unreadable", "err", err)
	}
	st, err := readGeneration(dir)
	switch {
	case err != nil && r != nil:
		d.log.ErrorContext(ctx, "installation generation unreadable; going by the kept report", "err", err, "generation", r.GetGeneration())
		st = generationState{gen: r.GetGeneration(), started: true}
	case err != nil:
		d.log.ErrorContext(ctx, "installation generation unreadable; the installation the server asks for now will not be carried out", "err", err)
		d.stateLost = true
	}
	d.handled = st.gen
	switch {
	case r != nil && r.GetGeneration() == st.gen:
		d.report, d.reboot = r, reboot
		d.log.InfoContext(ctx, "resending the report of an earlier installation", "generation", r.GetGeneration(), "success", r.GetSuccess() != nil)
		return
	case r != nil:
		// A report of an older generation, superseded by one started since.
		_ = removeReport(dir)
	}
	if st.started {
		d.report = install.InterruptedReport(st.gen)
		d.log.WarnContext(ctx, "an earlier installation was interrupted; reporting it failed", "generation", st.gen)
		if err := writeReport(dir, d.report, false); err != nil {
			d.log.ErrorContext(ctx, "keeping installation report", "err", err)
		}
	}
}

// finished takes the report of the installation that just ended: it is
// kept in the state directory, and sent with every heartbeat, until the
// server acknowledges it.
func (d *daemon) finished(ctx context.Context, r *agentv1.OSInstallationReport) {
	d.installing = false
	if msg := r.GetError().GetMessage(); r.GetError() != nil && msg != safetext.Cut(msg, install.MaxErrorBytes) {
		r = install.ErrorReport(r.GetGeneration(), msg)
	}
	d.report = r
	d.log.InfoContext(ctx, "installation finished", "generation", r.GetGeneration(), "success", r.GetSuccess() != nil)
	if err := writeReport(d.cfg.StateDir, r, d.reboot); err != nil {
		d.log.ErrorContext(ctx, "keeping the installation report; it is lost if the agent stops before the server has it", "err", err)
	}
}

// acknowledged forgets the report the server stored, and reboots if the
// installation asked for it.
func (d *daemon) acknowledged(ctx context.Context) {
	r := d.report
	d.report = nil
	if r.GetGeneration() == d.handled && !d.installing {
		if err := writeGeneration(d.cfg.StateDir, generationState{gen: r.GetGeneration()}); err != nil {
			// The report stays on disk and is sent again after a restart.
			d.log.ErrorContext(ctx, "recording the delivered installation report", "err", err)
		} else if err := removeReport(d.cfg.StateDir); err != nil {
			d.log.ErrorContext(ctx, "recording the delivered installation report", "err", err)
		}
	} else if err := removeReport(d.cfg.StateDir); err != nil {
		d.log.ErrorContext(ctx, "recording the delivered installation report", "err", err)
	}
	if d.reboot && r.GetSuccess() != nil {
		d.runReboot(ctx)
	}
	d.reboot = false
}

func (d *daemon) run(ctx context.Context) error {
	d.recoverInstallation(ctx)
	hw := hwreport.Gather(d.cfg.HardwareRoot)
	for _, w := range hw.GetWarnings() {
		d.log.WarnContext(ctx, "hardware report incomplete", "warning", w)
	}
	installCtx, stopInstall := context.WithCancel(ctx)
	defer stopInstall()
	var backoff time.Duration
	started, accepted := time.Now(), false
	timer := time.NewTimer(0)
	defer timer.Stop()
	defer d.dropGrant()
	for {
		select {
		case <-ctx.Done():
			d.log.InfoContext(ctx, "agent daemon stopping")
			if d.installing {
				// The installation sees ctx too; its report is kept.
				d.finished(context.WithoutCancel(ctx), <-d.done)
			}
			return nil
		case r := <-d.done:
			d.finished(ctx, r)
		case <-timer.C:
		}
		// fellBack: this heartbeat's datagrams went unanswered and it is
		// sent over TLS instead.
		fellBack := false
		if d.dg != nil && hw == nil && d.report == nil {
			r, err := d.dg.beat(ctx, &d.counter, d.handled)
			switch {
			case ctx.Err() != nil:
				continue
			case errors.Is(err, errNoReply) && time.Since(d.answeredAt) < 2*d.every:
				// No answer, but the server answered within two
				// intervals: it may be stalled (its database, its
				// process) or the network may drop datagrams for a
				// moment. Falling back to TLS at once would make every
				// agent of the fleet open a connection in the same
				// seconds, a handshake each, against a server that cannot
				// answer; a datagram again after a back-off costs
				// nothing. The machine is silent for at most two
				// intervals, far less than the heartbeat timeout.
				d.dgBackoff = min(max(2*d.dgBackoff, time.Second), d.every)
				wait := jitter(d.dgBackoff)
				d.log.WarnContext(ctx, "heartbeat datagrams unanswered, sending again", "err", err, "retry_in", wait.Round(time.Millisecond))
				timer.Reset(wait)
				continue
			case err != nil:
				fellBack = true
				d.log.WarnContext(ctx, "heartbeat datagrams unanswered, calling over TLS", "err", err)
			case r.Status == pulse.StatusRecorded:
				backoff, accepted = 0, true
				d.datagramAnswered()
				d.answered(r.NextIn)
				timer.Reset(d.interval(r.NextIn))
				continue
			case r.Status == pulse.StatusRetryLater:
				// As with a TLS retry pushback; TLS would cost a
				// handshake and record nothing more.
				backoff = 0
				d.datagramAnswered()
				d.answered(0)
				wait := pushbackWait(r.NextIn)
				d.log.WarnContext(ctx, "heartbeat datagram not recorded, retrying as the server asks", "retry_in", wait.Round(time.Millisecond))
				timer.Reset(wait)
				continue
			default:
				d.datagramAnswered()
				d.log.InfoContext(ctx, "the server asks for a heartbeat over TLS")
			}
		}
		// A TLS heartbeat replaces the grant: an accepted one comes with a
		// new one, a refused one means the key is worthless.
		hadGrant := d.dropGrant()
		// The reports go with every heartbeat until the server says it
		// stored them: an accepted heartbeat alone does not say so.
		req := &agentv1.HeartbeatRequest{MachineId: d.init.GetMachineId(), AgentVersion: Version(), InstallationReport: d.report, HardwareReport: hw}
		rctx, cancel := context.WithTimeout(ctx, heartbeatTimeout)
		resp, err := d.client.Heartbeat(rctx, connect.NewRequest(req))
		cancel()
		if err == nil {
			d.answered(resp.Msg.GetNextHeartbeatIn().AsDuration())
			if fellBack {
				d.failedGrants++ // TLS got through where UDP did not
			}
			d.takeGrant(ctx, resp.Msg.GetDatagramGrant(), hadGrant)
		}
		if (hadGrant || d.dg != nil) && d.closeIdle != nil {
			// The next heartbeat goes as a datagram: the server need not
			// hold this agent's connection in between. Without a grant
			// (an old server, or one with datagrams off) the connection
			// is kept, so that a heartbeat costs no handshake.
			d.closeIdle()
		}
		if err != nil {
			if ctx.Err() != nil {
				continue
			}
			if connect.CodeOf(err) == connect.CodePermissionDenied {
				d.log.WarnContext(ctx, "the callback server says this machine was decommissioned; the agent stops for good", "err", err)
				stopInstall()
				if d.installing {
					<-d.done
				}
				return ErrRetired
			}
			if wait, ok := retryPushback(err); ok {
				// The server is reachable but cannot record heartbeats
				// now (its database is down or busy), and said when to
				// retry. Backing off as if the network were down would
				// leave this machine silent past its heartbeat timeout.
				backoff = 0
				d.log.WarnContext(ctx, "heartbeat not recorded, retrying as the server asks", "err", err, "retry_in", wait.Round(time.Millisecond))
				timer.Reset(wait)
				continue
			}
			// The first retry comes soon: a new agent's first heartbeats race
			// the initializer recording its key, and are refused until it
			// has. Doubling still backs off fast when the server is down.
			backoff = min(max(2*backoff, 250*time.Millisecond), d.cfg.MaxBackoff)
			wait := jitter(backoff)
			if expectedRefusal(err, accepted, time.Since(started)) {
				d.log.InfoContext(ctx, "heartbeat refused: the initializer has not recorded this agent's key yet, retrying",
					"err", err, "retry_in", wait.Round(time.Millisecond))
			} else {
				d.log.WarnContext(ctx, "heartbeat failed, retrying", "err", err, "retry_in", wait.Round(time.Millisecond))
			}
			timer.Reset(wait)
			continue
		}
		backoff, accepted = 0, true
		if resp.Msg.GetHardwareReportRecorded() {
			hw = nil
		}
		if sent := req.GetInstallationReport(); sent != nil && sent == d.report && resp.Msg.GetInstallationReportRecorded() == sent.GetGeneration() {
			d.acknowledged(ctx)
		}
		if d.stateLost {
			d.refuseUnknown(ctx, resp.Msg.GetInstallationRequest())
		}
		if ir := resp.Msg.GetInstallationRequest(); ir != nil {
			d.maybeInstall(installCtx, ir)
		}
		timer.Reset(d.interval(resp.Msg.GetNextHeartbeatIn().AsDuration()))
	}
}

// interval is the wait before the next heartbeat when the server asks for
// next: the configured interval if it asks for none (or for no positive
// wait), at most a day.
func (d *daemon) interval(next time.Duration) time.Duration {
	if next <= 0 {
		return d.cfg.Interval
	}
	return min(next, 24*time.Hour)
}

// takeGrant keeps the datagram grant g of an accepted TLS heartbeat (nil:
// the server grants none, and heartbeats stay on TLS). hadGrant says the
// agent held one before that heartbeat. g is never logged: its String
// prints the key.
func (d *daemon) takeGrant(ctx context.Context, g *agentv1.DatagramGrant, hadGrant bool) {
	if g == nil {
		return
	}
	if d.failedGrants >= udpBlockedAfter {
		// The server answers over TLS but never over UDP: a firewall or
		// a port mapping that passes only TCP. Datagrams would cost the
		// machine up to two intervals of silence per grant, and a warning
		// every few seconds; the kept TLS connection costs the server
		// memory, which only opening the path (or the server's
		// --server-no-datagrams) saves.
		d.failedGrants = 0
		d.tlsOnlyFor = min(max(2*d.tlsOnlyFor, tlsOnlyMin), tlsOnlyMax)
		d.tlsOnlyUntil = time.Now().Add(d.tlsOnlyFor)
		d.log.WarnContext(ctx, "heartbeat datagrams go unanswered while TLS heartbeats get through: UDP to the server seems blocked; "+
			"heartbeats stay on TLS until datagrams are tried again (open the UDP port to the server, or run it with --server-no-datagrams)",
			"udp_port", g.GetPort(), "grants_failed", udpBlockedAfter, "tls_only_for", d.tlsOnlyFor)
	}
	if time.Now().Before(d.tlsOnlyUntil) {
		return
	}
	dial := d.dialDatagram
	if dial == nil {
		dial = dialUDP
	}
	dg, err := newDatagrams(ctx, dial, d.init.GetServerEndpoint(), g, d.machine, d.agentKey)
	if err != nil {
		d.log.WarnContext(ctx, "ignoring the server's datagram grant; heartbeats stay on TLS", "err", err)
		return
	}
	d.dg = dg
	d.counter = max(d.counter, g.GetCounterFloor())
	if !hadGrant {
		d.log.InfoContext(ctx, "heartbeats go as datagrams", "port", g.GetPort())
	}
}

// datagramAnswered notes that an authentic reply to a datagram came back:
// UDP to the server works.
func (d *daemon) datagramAnswered() {
	d.failedGrants, d.tlsOnlyFor = 0, 0
}

// dropGrant forgets the datagram grant, and reports whether there was one.
func (d *daemon) dropGrant() bool {
	if d.dg == nil {
		return false
	}
	d.dg.close()
	d.dg = nil
	return true
}

// refuseUnknown settles which generations are new when the generation
// file was unreadable. The server asks only for an installation it has no
// report of, so the one it asks for in the first response (ir, nil if none)
// may have run already (its report lost with the state): it is refused with
// an error report, and a new request installs. Every later generation is new.
func (d *daemon) refuseUnknown(ctx context.Context, ir *agentv1.OSInstallationRequest) {
	d.stateLost = false
	if ir == nil {
		if err := writeGeneration(d.cfg.StateDir, generationState{}); err != nil {
			d.log.ErrorContext(ctx, "resetting the installation state", "err", err)
		}
		return
	}
	g := ir.GetGeneration()
	d.handled = g
	d.report = install.ErrorReport(g, fmt.Sprintf("not installing generation %d: the agent's record of the installations it ran "+
		"was unreadable, so it may have run already; request the installation again", g))
	d.log.ErrorContext(ctx, "refusing an installation that may have run already", "generation", g)
	if err := writeGeneration(d.cfg.StateDir, generationState{gen: g, started: true}); err != nil {
		d.log.ErrorContext(ctx, "recording the refused installation", "err", err)
	}
	if err := writeReport(d.cfg.StateDir, d.report, false); err != nil {
		d.log.ErrorContext(ctx, "keeping installation report", "err", err)
	}
}

// firstHeartbeatGrace is how long after the daemon starts its heartbeats
// may be refused as unauthenticated without a warning.
const firstHeartbeatGrace = time.Minute

// expectedRefusal reports whether a failed heartbeat is the expected race
// of a new agent's first heartbeats with the initializer recording its key
// (the takeover ends after the agent started): refused as unauthenticated,
// before any heartbeat of this daemon was accepted, within
// firstHeartbeatGrace of its start. Anything else (a refusal after the
// server knew the key, or one that lasts) is an anomaly worth a warning.
func expectedRefusal(err error, accepted bool, sinceStart time.Duration) bool {
	return !accepted && sinceStart < firstHeartbeatGrace && connect.CodeOf(err) == connect.CodeUnauthenticated
}

// retryPushback returns the jittered wait an Unavailable answer asks for
// with gRPC's retry pushback, bounded to [minPushback, maxPushback], and
// whether it asked for one.
func retryPushback(err error) (time.Duration, bool) {
	var cerr *connect.Error
	if !errors.As(err, &cerr) || cerr.Code() != connect.CodeUnavailable {
		return 0, false
	}
	ms, perr := strconv.ParseInt(cerr.Meta().Get(retryPushbackKey), 10, 64)
	if perr != nil || ms < 0 {
		return 0, false
	}
	return pushbackWait(time.Duration(min(ms, maxPushback.Milliseconds())) * time.Millisecond), true
}

// pushbackWait is the wait when the server asks for one of asked (≥ 0)
// before a retry: jittered, within [minPushback, maxPushback].
func pushbackWait(asked time.Duration) time.Duration {
	return min(max(jitter(min(asked, maxPushback)), minPushback), maxPushback)
}

// maybeInstall starts the installation ir asks for unless its generation
// was already handled (by this daemon or, through the state directory, by an
// earlier one) or another installation runs. The generation is recorded
// durably before the installation starts, so no generation is ever
// installed twice.
func (d *daemon) maybeInstall(ctx context.Context, ir *agentv1.OSInstallationRequest) {
	if ir.GetGeneration() <= d.handled || d.installing {
		return
	}
	if err := writeGeneration(d.cfg.StateDir, generationState{gen: ir.GetGeneration(), started: true}); err != nil {
		d.log.ErrorContext(ctx, "not installing", "generation", ir.GetGeneration(), "err", err)
		return
	}
	d.handled = ir.GetGeneration()
	d.installing = true
	d.reboot = ir.GetRebootAfter()
	d.log.InfoContext(ctx, "installing", "generation", ir.GetGeneration(), "image_url", ir.GetImageUrl(), "target", ir.GetTargetDevice())
	cfg := install.Config{WorkDir: d.cfg.WorkDir, FileTargetDirs: d.cfg.FileTargetDirs, Logger: d.log}
	go func() { d.done <- install.Install(ctx, cfg, ir) }()
}

func (d *daemon) runReboot(ctx context.Context) {
	d.log.InfoContext(ctx, "rebooting after the installation", "command", d.cfg.RebootCommand)
	rctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	out, err := exec.CommandContext(rctx, d.cfg.RebootCommand[0], d.cfg.RebootCommand[1:]...).CombinedOutput()
	if err != nil {
		d.log.ErrorContext(ctx, "reboot command failed", "err", err, "output", string(out))
	}
}

// jitter spreads d by ±20 %, so agents that failed together retry apart.
func jitter(d time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
}
