// Command shepherd-agent is the small static binary Shepherd uploads to every
// machine it takes over.
//
// Run without a mode (or with "takeover") it reads a TakeoverInit from stdin,
// starts the agent daemon detached from the calling session and writes a
// TakeoverResponse to stdout. Its exit status is 0 whenever a response was
// written, including a TakeoverError; it is 1 only if not even that worked.
// The "daemon" mode is started by the takeover and reads its configuration
// from an inherited pipe; it runs until SIGTERM, or until the callback
// server says the machine was decommissioned (PermissionDenied), when it
// exits 0 for good: nothing supervises or restarts it, and only a new
// takeover starts another daemon. "stop --state-dir DIR" stops the daemon of
// DIR, if one runs, and exits 0 once it is gone (the decommissioner runs it
// over SSH). "version" prints the version.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/shepherd/shepherd/agent"
)

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	mode := "takeover"
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		mode, args = args[0], args[1:]
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	switch mode {
	case "takeover":
		return takeover(args, log)
	case "daemon":
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
		defer stop()
		err := agent.RunDaemon(ctx, log)
		switch {
		case errors.Is(err, agent.ErrRetired):
			// The daemon logged why. Exiting 0 says this is the end it
			// was told to come to; nothing restarts the daemon.
			return 0
		case err != nil:
			log.Error("agent daemon failed", "err", err)
			return 1
		}
		return 0
	case "stop":
		return stop(args, log)
	case "version":
		fmt.Println("shepherd-agent", agent.Version())
		return 0
	default:
		fmt.Fprintf(os.Stderr, "shepherd-agent: unknown mode %q (want takeover, daemon, stop or version)\n", mode)
		return 2
	}
}

func takeover(args []string, log *slog.Logger) int {
	var cfg agent.Config
	fs := flag.NewFlagSet("takeover", flag.ContinueOnError)
	fs.StringVar(&cfg.StateDir, "state-dir", "", "daemon state directory (default /var/lib/shepherd-agent)")
	reboot := fs.String("reboot-command", "", "command run to reboot after an installation, split on spaces (default \"reboot\")")
	fs.DurationVar(&cfg.HeartbeatInterval, "heartbeat-interval", 0, "heartbeat interval until the server says otherwise (default 30s)")
	fs.DurationVar(&cfg.StdinTimeout, "stdin-timeout", 0, "how long to wait for the TakeoverInit on stdin (default 10s)")
	fs.StringVar(&cfg.HardwareRoot, "hardware-root", "", "where /proc and /sys are read from (default /)")
	fs.StringVar(&cfg.Install.WorkDir, "work-dir", "", "where images are staged while they download (default $TMPDIR)")
	fs.Func("allow-file-target-dir", "directory under which an installation target may be a regular file instead of a block\ndevice, for tests; repeat for several (default none: block devices only)", func(dir string) error {
		cfg.Install.FileTargetDirs = append(cfg.Install.FileTargetDirs, dir)
		return nil
	})
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *reboot != "" {
		cfg.RebootCommand = strings.Fields(*reboot)
	}
	cfg.Logger = log
	exe, err := os.Executable()
	if err != nil {
		log.Error("finding the agent binary", "err", err)
		return 1
	}
	if err := agent.Takeover(context.Background(), cfg, exe, os.Stdin, os.Stdout); err != nil {
		log.Error("takeover", "err", err)
		return 1
	}
	return 0
}

func stop(args []string, log *slog.Logger) int {
	fs := flag.NewFlagSet("stop", flag.ContinueOnError)
	stateDir := fs.String("state-dir", "/var/lib/shepherd-agent", "state directory of the daemon to stop")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := agent.Stop(ctx, *stateDir, log); err != nil {
		log.Error("stopping the agent daemon", "err", err)
		return 1
	}
	return 0
}
