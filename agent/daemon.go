package agent

import (
	"context"
	"crypto/ed25519"
	"encoding/json"
	"errors"
	"fmt"
	"io"
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
	"google.golang.org/protobuf/proto"

	"github.com/shepherd/shepherd/agent/hwreport"
	"github.com/shepherd/shepherd/agent/install"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/api/agent/v1/agentv1connect"
)

// heartbeatTimeout bounds one heartbeat RPC.
const heartbeatTimeout = 15 * time.Second

// RunDaemon is the daemon the takeover starts. It reads its configuration
// from file descriptor 3, replaces any daemon an earlier takeover started,
// reports on file descriptor 4 that it runs, and then sends heartbeats until
// ctx ends (SIGTERM).
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
	client, err := newClient(&init, priv)
	if err != nil {
		return fail(err)
	}
	d := &daemon{
		cfg:    dc,
		init:   &init,
		client: client,
		log:    log.With("machine_id", init.GetMachineId()),
		done:   make(chan *agentv1.OSInstallationReport, 1),
	}
	d.handled = d.readGeneration()
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
	report     *agentv1.OSInstallationReport      // to deliver with the next heartbeat
	reboot     bool                               // reboot once report is delivered (if it is a success)
}

func (d *daemon) run(ctx context.Context) error {
	hw := hwreport.Gather(d.cfg.HardwareRoot)
	for _, w := range hw.GetWarnings() {
		d.log.WarnContext(ctx, "hardware report incomplete", "warning", w)
	}
	installCtx, stopInstall := context.WithCancel(ctx)
	defer stopInstall()
	var backoff time.Duration
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			d.log.InfoContext(ctx, "agent daemon stopping")
			if d.installing {
				<-d.done // the installation sees ctx too
			}
			return nil
		case r := <-d.done:
			d.installing = false
			d.report = r
			d.log.InfoContext(ctx, "installation finished", "generation", r.GetGeneration(), "success", r.GetSuccess() != nil)
		case <-timer.C:
		}
		req := &agentv1.HeartbeatRequest{MachineId: d.init.GetMachineId(), AgentVersion: Version(), InstallationReport: d.report}
		if hw != nil {
			req.HardwareReport = hw
		}
		rctx, cancel := context.WithTimeout(ctx, heartbeatTimeout)
		resp, err := d.client.Heartbeat(rctx, connect.NewRequest(req))
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				continue
			}
			// The first retry comes soon: a new agent's first heartbeats race
			// the initializer recording its key, and are refused until it
			// has. Doubling still backs off fast when the server is down.
			backoff = min(max(2*backoff, 250*time.Millisecond), d.cfg.MaxBackoff)
			wait := jitter(backoff)
			d.log.WarnContext(ctx, "heartbeat failed, retrying", "err", err, "retry_in", wait.Round(time.Millisecond))
			timer.Reset(wait)
			continue
		}
		backoff = 0
		hw = nil // delivered
		if req.InstallationReport != nil {
			delivered := d.report
			d.report = nil
			if d.reboot && delivered.GetSuccess() != nil {
				d.runReboot(ctx)
			}
			d.reboot = false
		}
		if ir := resp.Msg.GetInstallationRequest(); ir != nil {
			d.maybeInstall(installCtx, ir)
		}
		interval := d.cfg.Interval
		if n := resp.Msg.GetNextHeartbeatIn(); n != nil && n.AsDuration() > 0 {
			interval = min(n.AsDuration(), 24*time.Hour)
		}
		timer.Reset(interval)
	}
}

// maybeInstall starts the installation ir asks for unless its generation
// was already handled (by this daemon or, through the state directory, by an
// earlier one) or another installation runs. The generation is recorded
// before the installation starts, so no generation is ever installed twice.
func (d *daemon) maybeInstall(ctx context.Context, ir *agentv1.OSInstallationRequest) {
	if ir.GetGeneration() <= d.handled || d.installing {
		return
	}
	if err := d.writeGeneration(ir.GetGeneration()); err != nil {
		d.log.ErrorContext(ctx, "recording installation generation; not installing", "generation", ir.GetGeneration(), "err", err)
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

func (d *daemon) readGeneration() int64 {
	data, err := os.ReadFile(filepath.Join(d.cfg.StateDir, generationFile))
	if err != nil {
		return 0
	}
	g, err := strconv.ParseInt(strings.TrimSpace(string(data)), 10, 64)
	if err != nil {
		return 0
	}
	return g
}

func (d *daemon) writeGeneration(g int64) error {
	path := filepath.Join(d.cfg.StateDir, generationFile)
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(strconv.FormatInt(g, 10)+"\n"), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// jitter spreads d by ±20 %, so agents that failed together retry apart.
func jitter(d time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
}
