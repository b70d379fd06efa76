// Package agent is the part of Shepherd that runs on every machine (SPEC
// §4.2, §4.3). The initializer uploads the agent binary over SSH and runs it
// with a TakeoverInit on stdin: Takeover generates a key pair, starts the
// daemon detached from the SSH session and answers with the public key. The
// daemon (Daemon) sends heartbeats to the callback server over TLS with a
// client certificate of that key, reports the hardware and the result of
// each OS installation it carries out (resending each until the server
// acknowledges it), and stops for good once the server says the machine was
// decommissioned. Once a TLS heartbeat's answer grants it a key, and while
// it has no report to deliver, it sends its heartbeats as UDP datagrams
// (api/agent/pulse, datagram.go) and holds no connection to the server in
// between; it returns to TLS when the server says so or does not answer.
package agent

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime/debug"
	"time"

	"github.com/shepherd/shepherd/agent/install"
)

// Config configures the agent in both modes. Zero values mean defaults.
type Config struct {
	// StateDir holds the daemon's lock, pid file, log, the last
	// installation generation it handled and that installation's report
	// until the server has it (see state.go); default /var/lib/shepherd-agent.
	StateDir string
	// RebootCommand runs after a successful installation that asked for a
	// reboot, once the server has the report; default ["reboot"].
	RebootCommand []string
	// HeartbeatInterval is used until the server says otherwise; default 30s.
	HeartbeatInterval time.Duration
	// MaxBackoff caps the wait between failed heartbeats; default 1 min.
	// A server that answers Unavailable with a retry pushback (it cannot
	// record heartbeats now) is retried after the wait it asks for,
	// between 100ms and 10s, without growing the backoff.
	MaxBackoff time.Duration
	// StdinTimeout bounds how long Takeover waits for the TakeoverInit;
	// default 10s.
	StdinTimeout time.Duration
	// HardwareRoot is where /proc and /sys are read from; default "/".
	HardwareRoot string
	// Install configures installations.
	Install install.Config
	// Logger receives the agent's logs; nil discards them.
	Logger *slog.Logger
}

// Validate reports the first problem with the configuration. It changes nothing.
func (c Config) Validate() error {
	switch {
	case c.StateDir != "" && !filepath.IsAbs(c.StateDir):
		return fmt.Errorf("agent: StateDir must be an absolute path, got %q", c.StateDir)
	case c.HeartbeatInterval < 0:
		return fmt.Errorf("agent: HeartbeatInterval must be >= 0 (0 = default), got %s", c.HeartbeatInterval)
	case c.MaxBackoff < 0:
		return fmt.Errorf("agent: MaxBackoff must be >= 0 (0 = default), got %s", c.MaxBackoff)
	case c.StdinTimeout < 0:
		return fmt.Errorf("agent: StdinTimeout must be >= 0 (0 = default), got %s", c.StdinTimeout)
	}
	return c.Install.Validate()
}

// withDefaults returns a copy of c with defaults filled in.
func (c Config) withDefaults() Config {
	c.StateDir = cmp.Or(c.StateDir, "/var/lib/shepherd-agent")
	if len(c.RebootCommand) == 0 {
		c.RebootCommand = []string{"reboot"}
	}
	c.HeartbeatInterval = cmp.Or(c.HeartbeatInterval, 30*time.Second)
	c.MaxBackoff = cmp.Or(c.MaxBackoff, time.Minute)
	c.StdinTimeout = cmp.Or(c.StdinTimeout, 10*time.Second)
	c.HardwareRoot = cmp.Or(c.HardwareRoot, "/")
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c
}

// Version is the agent binary's version, sent with every heartbeat.
func Version() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		return bi.Main.Version
	}
	return "unknown"
}

// State directory entries.
const (
	lockFile       = "agent.lock"
	pidFile        = "agent.pid"
	logFile        = "agent.log"
	generationFile = "installed-generation"
	reportFile     = "installation-report"
)

var errNoDaemonConfig = errors.New("no daemon configuration on file descriptor 3: the daemon is started by the takeover, not by hand")

// ensureStateDir creates the state directory, readable only by its owner.
func ensureStateDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("creating state directory %s: %w", dir, err)
	}
	return nil
}
