package agent

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"github.com/google/uuid"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
)

// maxInitBytes bounds the TakeoverInit read from stdin. A real one is a few
// hundred bytes plus a CA certificate.
const maxInitBytes = 64 << 10

// readyTimeout bounds how long Takeover waits for the new daemon to replace
// the old one and report that it runs.
const readyTimeout = 20 * time.Second

// daemonConfig is what the takeover hands the daemon over a pipe: never
// through the command line or the environment (other users can read those)
// and never through a file (the private key would touch the disk).
type daemonConfig struct {
	Init          []byte        `json:"init"` // TakeoverInit, serialized
	Seed          []byte        `json:"seed"` // ed25519 private key seed
	StateDir      string        `json:"state_dir"`
	RebootCommand []string      `json:"reboot_command"`
	Interval      time.Duration `json:"interval"`
	MaxBackoff    time.Duration `json:"max_backoff"`
	HardwareRoot  string        `json:"hardware_root"`
	WorkDir       string        `json:"work_dir"`
	// FileTargetDirs is Config.Install.FileTargetDirs.
	FileTargetDirs []string `json:"file_target_dirs,omitempty"`
}

// Takeover reads a TakeoverInit from stdin, generates a key pair, starts the
// daemon detached from this process's session (replacing a daemon a
// previous takeover started), waits until the daemon runs, and writes a
// TakeoverResponse to stdout. Everything that goes wrong, from garbage on
// stdin to a daemon that would not start, becomes a TakeoverError on stdout;
// the returned error says only that even writing the response failed.
// executable is the agent binary to start as the daemon.
func Takeover(ctx context.Context, cfg Config, executable string, stdin io.Reader, stdout io.Writer) error {
	resp := takeover(ctx, cfg, executable, stdin)
	out, err := proto.Marshal(resp)
	if err != nil {
		return fmt.Errorf("encoding takeover response: %w", err)
	}
	if _, err := stdout.Write(out); err != nil {
		return fmt.Errorf("writing takeover response: %w", err)
	}
	return nil
}

func takeoverError(format string, args ...any) *agentv1.TakeoverResponse {
	return &agentv1.TakeoverResponse{Result: &agentv1.TakeoverResponse_Error{
		Error: &agentv1.TakeoverError{Message: fmt.Sprintf(format, args...)},
	}}
}

func takeover(ctx context.Context, cfg Config, executable string, stdin io.Reader) *agentv1.TakeoverResponse {
	if err := cfg.Validate(); err != nil {
		return takeoverError("%v", err)
	}
	cfg = cfg.withDefaults()
	raw, err := ReadTakeoverInit(ctx, stdin, cfg.StdinTimeout, nil)
	if err != nil {
		return takeoverError("%v", err)
	}
	var init agentv1.TakeoverInit
	if err := proto.Unmarshal(raw, &init); err != nil {
		return takeoverError("stdin does not hold a TakeoverInit: %v", err)
	}
	if err := ValidateTakeoverInit(&init); err != nil {
		return takeoverError("invalid TakeoverInit: %v", err)
	}
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return takeoverError("generating a key pair: %v", err)
	}
	dc := daemonConfig{
		Init:          raw,
		Seed:          priv.Seed(),
		StateDir:      cfg.StateDir,
		RebootCommand: cfg.RebootCommand,
		Interval:      cfg.HeartbeatInterval,
		MaxBackoff:    cfg.MaxBackoff,
		HardwareRoot:  cfg.HardwareRoot,
		WorkDir:       cfg.Install.WorkDir,

		FileTargetDirs: cfg.Install.FileTargetDirs,
	}
	if err := startDaemon(ctx, executable, dc); err != nil {
		return takeoverError("starting the agent daemon: %v", err)
	}
	return &agentv1.TakeoverResponse{Result: &agentv1.TakeoverResponse_Success{Success: &agentv1.TakeoverSuccess{
		InitMessage: &init,
		PublicKey:   pub,
	}}}
}

// ReadTakeoverInit reads stdin to its end, at most 64 KiB, within timeout,
// as a takeover does; the simulated fleet reads its stdin the same way. A
// reader that never ends (an SSH session that keeps stdin open) makes the
// takeover fail instead of hang. The read itself cannot be interrupted: it
// runs on a goroutine that goStart starts (nil: a plain go statement), so
// that a caller that must wait for its goroutines can count it, and it ends
// when stdin does.
func ReadTakeoverInit(ctx context.Context, stdin io.Reader, timeout time.Duration, goStart func(func())) ([]byte, error) {
	type result struct {
		data []byte
		err  error
	}
	ch := make(chan result, 1)
	read := func() {
		data, err := io.ReadAll(io.LimitReader(stdin, maxInitBytes+1))
		ch <- result{data, err}
	}
	if goStart != nil {
		goStart(read)
	} else {
		go read()
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case r := <-ch:
		switch {
		case r.err != nil:
			return nil, fmt.Errorf("reading TakeoverInit from stdin: %w", r.err)
		case len(r.data) == 0:
			return nil, errors.New("stdin is empty: expected a TakeoverInit")
		case len(r.data) > maxInitBytes:
			return nil, fmt.Errorf("stdin holds more than %d bytes: not a TakeoverInit", maxInitBytes)
		}
		return r.data, nil
	case <-t.C:
		return nil, fmt.Errorf("no TakeoverInit on stdin within %s (stdin must be closed after it)", timeout)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// ValidateTakeoverInit checks what a takeover needs of its TakeoverInit:
// a UUID machine id and a usable server endpoint and CA.
func ValidateTakeoverInit(init *agentv1.TakeoverInit) error {
	if _, err := uuid.Parse(init.GetMachineId()); err != nil {
		return fmt.Errorf("machine_id %q is not a UUID", init.GetMachineId())
	}
	return ValidateEndpoint(init.GetServerEndpoint(), init.GetCaCertificate())
}

// ValidateEndpoint checks a callback server endpoint (host:port) and the
// DER CA certificate an agent verifies it with (empty: system roots).
func ValidateEndpoint(endpoint string, caDER []byte) error {
	host, port, err := net.SplitHostPort(endpoint)
	if err != nil || host == "" {
		return fmt.Errorf("server_endpoint %q is not host:port", endpoint)
	}
	if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 {
		return fmt.Errorf("server_endpoint %q has no valid port", endpoint)
	}
	if len(caDER) > 0 {
		if _, err := x509.ParseCertificate(caDER); err != nil {
			return fmt.Errorf("ca_certificate: %w", err)
		}
	}
	return nil
}

// startDaemon starts executable as the daemon in a new session, with its
// output going to the log in the state directory, hands it dc over a pipe
// (file descriptor 3) and waits until it reports on another pipe (file
// descriptor 4) that it runs, or dies trying.
func startDaemon(ctx context.Context, executable string, dc daemonConfig) error {
	if err := ensureStateDir(dc.StateDir); err != nil {
		return err
	}
	logf, err := os.OpenFile(filepath.Join(dc.StateDir, logFile), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("opening daemon log: %w", err)
	}
	defer logf.Close()
	cfgR, cfgW, err := os.Pipe()
	if err != nil {
		return err
	}
	defer cfgR.Close()
	defer cfgW.Close()
	readyR, readyW, err := os.Pipe()
	if err != nil {
		return err
	}
	defer readyR.Close()
	defer readyW.Close()

	cmd := exec.Command(executable, "daemon")
	cmd.Dir = "/"
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.ExtraFiles = []*os.File{cfgR, readyW}
	// A new session: no controlling terminal, no SIGHUP when the SSH
	// session that ran the takeover ends.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", executable, err)
	}
	// Only the daemon holds these ends now.
	cfgR.Close()
	readyW.Close()
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()

	data, err := json.Marshal(dc)
	if err != nil {
		return err
	}
	if _, err := cfgW.Write(data); err != nil {
		return fmt.Errorf("handing the daemon its configuration: %w", err)
	}
	cfgW.Close()

	ready := make(chan error, 1)
	go func() {
		buf := make([]byte, 512)
		n, err := io.ReadFull(readyR, buf[:1])
		if n == 1 && buf[0] == 'R' {
			ready <- nil
			return
		}
		// The daemon wrote an error message, or closed the pipe by dying.
		rest, _ := io.ReadAll(io.LimitReader(readyR, 4096))
		msg := string(bytes.TrimSpace(append(buf[:n], rest...)))
		if msg == "" && err != nil {
			msg = "it exited before reporting that it runs"
		}
		ready <- errors.New(msg)
	}()
	t := time.NewTimer(readyTimeout)
	defer t.Stop()
	select {
	case err := <-ready:
		if err != nil {
			return fmt.Errorf("daemon failed: %w (log: %s)", err, filepath.Join(dc.StateDir, logFile))
		}
		// The daemon runs on without us: it is in its own session and
		// outlives this process, which exits right after the response.
		return nil
	case err := <-exited:
		return fmt.Errorf("daemon exited before it ran: %v (log: %s)", err, filepath.Join(dc.StateDir, logFile))
	case <-t.C:
		_ = cmd.Process.Kill()
		return fmt.Errorf("daemon did not report within %s (log: %s)", readyTimeout, filepath.Join(dc.StateDir, logFile))
	case <-ctx.Done():
		_ = cmd.Process.Kill()
		return ctx.Err()
	}
}
