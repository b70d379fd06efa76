package sim

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/shepherd/shepherd/agent/install"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
)

// Simulated disks.
//
// A simulated agent carries out an installation with the real agent's
// code (package agent/install): it downloads the image, checks its
// SHA-256, writes it to the target and reads it back, and reports what
// happened, so a wrong digest or a missing image fails as it would in
// production, with the same message. The target is a simulated disk: a
// regular file per machine and block device, created by the first
// installation that writes it, under a directory the fleet makes in
// Config.DiskDir when the first installation starts and removes when Run
// returns. Machines that never install cost no file; an image is
// streamed (staged in a file, as the real agent does, then copied), never
// held in memory.

// simDisks are the block devices of every simulated machine, as its
// hardware report lists them.
var simDisks = []string{"nvme0n1", "nvme1n1"}

// installation is an installation a simulated agent started and has not
// yet reported.
type installation struct {
	generation int64
	// done is when the report may go out at the earliest (an offset from
	// Fleet.start): Config.InstallLatency after the start, or when the
	// installation finished, whichever is later.
	done time.Duration
	// report is the outcome; nil while the installation runs.
	report *agentv1.OSInstallationReport
	cancel context.CancelFunc
}

// runInstall carries out ir for agent a as installation in, then hands
// the report to a, which sends it with its next heartbeat, due at once
// (or when in.done says). It ends early when ctx is cancelled: the agent
// stopped or the fleet stops.
func (f *Fleet) runInstall(ctx context.Context, a *daemon, in *installation, ir *agentv1.OSInstallationRequest) {
	defer f.installs.Done()
	defer in.cancel()
	select {
	case f.installSlots <- struct{}{}:
	case <-ctx.Done():
		return // the agent stopped or the fleet stops: nobody is left to report
	}
	report := f.install(ctx, a.slot, ir)
	<-f.installSlots
	ok := report.GetSuccess() != nil
	f.mu.Lock()
	defer f.mu.Unlock()
	if a.inst != in || ctx.Err() != nil {
		// The agent stopped (which cancels ctx under f.mu), or the fleet
		// stops and is about to stop it: nobody is left to report, and an
		// interrupted installation is not counted.
		return
	}
	if ok {
		f.stats.Installations++
	} else {
		f.stats.InstallationsFailed++
	}
	in.report = report
	in.done = max(in.done, f.now())
	if !a.inflight && !a.silenced && !a.stopped {
		f.scheduleLocked(a, a.due)
	}
	f.log.Info("installation finished", "machine_id", a.machineID, "provider_id", f.id(a.slot),
		"generation", in.generation, "success", ok, "error", report.GetError().GetMessage())
}

// install runs the real installation code for ir on machine i, with the
// target device mapped to the machine's simulated disk of that name, and
// returns its report. A target that is not one of the machine's disks
// fails as a missing device does on a real machine.
func (f *Fleet) install(ctx context.Context, i int32, ir *agentv1.OSInstallationRequest) *agentv1.OSInstallationReport {
	gen := ir.GetGeneration()
	name, isDev := strings.CutPrefix(ir.GetTargetDevice(), "/dev/")
	if !isDev || !slices.Contains(simDisks, name) {
		if err := install.CheckRequest(ir, install.RequestOptions{}); err != nil {
			return install.ErrorReport(gen, "invalid installation request: "+err.Error())
		}
		return install.ErrorReport(gen, fmt.Sprintf("checking target %s: it does not exist; a target must be an existing block device, "+
			"and the simulated machine has /dev/%s", ir.GetTargetDevice(), strings.Join(simDisks, ", /dev/")))
	}
	root, dir, err := f.diskDir(i)
	if err != nil {
		return install.ErrorReport(gen, fmt.Sprintf("simulated disk of %s: %v", f.id(i), err))
	}
	req := proto.CloneOf(ir)
	req.TargetDevice = filepath.Join(dir, name)
	cfg := install.Config{
		WorkDir:        root,
		MaxImageBytes:  f.cfg.MaxImageBytes,
		FileTargetDirs: []string{dir},
		Logger:         f.log.With("provider_id", f.id(i)),
	}
	return install.Install(ctx, cfg, req)
}

// diskDir returns the directory of every simulated disk (made on first
// use) and machine i's directory in it (made if missing).
func (f *Fleet) diskDir(i int32) (root, dir string, err error) {
	f.mu.Lock()
	if f.stopped {
		f.mu.Unlock()
		return "", "", errors.New("the simulated fleet has stopped")
	}
	if f.disks == "" {
		if err := os.MkdirAll(f.cfg.DiskDir, 0o700); err != nil {
			f.mu.Unlock()
			return "", "", fmt.Errorf("creating disk directory: %w", err)
		}
		if f.disks, err = os.MkdirTemp(f.cfg.DiskDir, "shepherd-sim-disks-"); err != nil {
			f.mu.Unlock()
			return "", "", fmt.Errorf("creating disk directory: %w", err)
		}
	}
	root = f.disks
	f.mu.Unlock()
	dir = filepath.Join(root, f.id(i))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", "", fmt.Errorf("creating disk directory: %w", err)
	}
	return root, dir, nil
}

// wipeDisks removes machine i's simulated disks, as a device given back
// to the provider is wiped. f.mu must not be held.
func (f *Fleet) wipeDisks(i int32) {
	f.mu.Lock()
	root := f.disks
	f.mu.Unlock()
	if root == "" {
		return
	}
	if err := os.RemoveAll(filepath.Join(root, f.id(i))); err != nil {
		f.log.Warn("wiping simulated disks", "provider_id", f.id(i), "err", err)
	}
}

// removeDisks removes every simulated disk once no installation runs.
func (f *Fleet) removeDisks() {
	f.mu.Lock()
	root := f.disks
	f.disks = ""
	f.mu.Unlock()
	if root == "" {
		return
	}
	if err := os.RemoveAll(root); err != nil {
		f.log.Warn("removing simulated disks", "dir", root, "err", err)
	}
}
