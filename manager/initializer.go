package manager

import (
	"cmp"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path"
	"strings"
	"time"

	"github.com/pkg/sftp"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/crypto/ssh"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/internal/shellquote"
	"github.com/shepherd/shepherd/internal/sshx"
	"github.com/shepherd/shepherd/provider"
)

// InitializerConfig configures the initializer (SPEC §3.3). Zero values mean
// defaults.
type InitializerConfig struct {
	Loop LoopConfig
	// ConnectTimeout bounds dialing and the SSH handshake; default 30s.
	ConnectTimeout time.Duration
	// ExecTimeout bounds the upload and the agent's takeover together, so a
	// hung machine cannot hold a worker for ever; default 2m.
	ExecTimeout time.Duration
	// SSHUser logs in unless the provider names another user; default root.
	SSHUser string
	// SSHKey is the initializer's SSH client key; required.
	SSHKey ssh.Signer
	// AgentPath is the local agent binary uploaded to every machine; required.
	AgentPath string
	// AgentDir is the remote directory of the agent binary and its state;
	// "{provider_id}" and "{machine_id}" in it are replaced. A relative
	// path is relative to the SSH user's home directory. Default
	// RootAgentDir when the machine's SSH user is root, else HomeAgentDir
	// (under the user's home), so that an unprivileged user can take
	// machines over too.
	AgentDir string
	// AgentArgs are extra arguments to the agent's takeover mode.
	AgentArgs []string
	// ServerEndpoint is the callback server's host:port as agents reach it; required.
	ServerEndpoint string
	// ServerCA is the DER CA agents verify the callback server against; nil
	// means the agents' system roots.
	ServerCA []byte
	// Backoff applies to failed agent starts; default bmdb.AgentStartBackoff().
	Backoff bmdb.BackoffPolicy
}

// Validate reports the first problem with the configuration. It changes nothing.
// (Ifs, not a switch: see LoopConfig.Validate.)
func (c InitializerConfig) Validate() error {
	if err := c.Loop.Validate("initializer"); err != nil {
		return err
	}
	if c.ConnectTimeout < 0 || c.ExecTimeout < 0 {
		return errors.New("initializer: timeouts must be >= 0 (0 = default)")
	}
	if c.SSHKey == nil {
		return errors.New("initializer: SSHKey is required")
	}
	if c.AgentPath == "" {
		return errors.New("initializer: AgentPath (the local agent binary) is required")
	}
	if c.ServerEndpoint == "" {
		return errors.New("initializer: ServerEndpoint (where agents send heartbeats) is required")
	}
	if _, _, err := net.SplitHostPort(c.ServerEndpoint); err != nil {
		return fmt.Errorf("initializer: ServerEndpoint %q is not host:port", c.ServerEndpoint)
	}
	if st, err := os.Stat(c.AgentPath); err != nil {
		return fmt.Errorf("initializer: agent binary: %w", err)
	} else if !st.Mode().IsRegular() {
		return fmt.Errorf("initializer: agent binary %s is not a regular file", c.AgentPath)
	}
	if c.Backoff != (bmdb.BackoffPolicy{}) {
		return c.Backoff.Validate()
	}
	return nil
}

// Initializer starts agents on provided machines (SPEC §3.3): SSH in,
// upload the agent with SFTP, run it with a TakeoverInit on stdin, and
// record the key it answers with as AgentStarted.
type Initializer struct {
	cfg    InitializerConfig
	db     *bmdb.DB
	p      provider.Provider
	runner *Runner
}

// NewInitializer validates cfg and returns the initializer for provider p.
func NewInitializer(cfg InitializerConfig, db *bmdb.DB, p provider.Provider, reg prometheus.Registerer, log *slog.Logger) (*Initializer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.ConnectTimeout = cmp.Or(cfg.ConnectTimeout, 30*time.Second)
	cfg.ExecTimeout = cmp.Or(cfg.ExecTimeout, 2*time.Minute)
	cfg.SSHUser = cmp.Or(cfg.SSHUser, "root")
	if cfg.Backoff == (bmdb.BackoffPolicy{}) {
		cfg.Backoff = bmdb.AgentStartBackoff()
	}
	in := &Initializer{cfg: cfg, db: db, p: p}
	r, err := NewRunner("initializer", cfg.Loop, Loop{
		Process:    bmdb.ProcessAgentStart,
		Candidates: func() bmdb.Candidates { return bmdb.AgentStartCandidates(p.Name()) },
		Backoff:    cfg.Backoff,
		Do:         in.startAgent,
	}, db, reg, log)
	if err != nil {
		return nil, err
	}
	in.runner = r
	return in, nil
}

// Run runs the initializer until ctx ends.
func (in *Initializer) Run(ctx context.Context) error { return in.runner.Run(ctx) }

// startAgent takes one machine over.
func (in *Initializer) startAgent(ctx context.Context, t *Task) (FinishFunc, error) {
	target, trust, err := machineTarget(ctx, in.db, in.p, t.Machine.MachineID, t.Machine.ProviderID, in.cfg.SSHUser, in.cfg.SSHKey)
	if err != nil {
		return nil, err
	}
	trust.apply(&target)

	dctx, cancel := context.WithTimeout(ctx, in.cfg.ConnectTimeout)
	client, err := sshx.Dial(dctx, target)
	cancel()
	if errors.Is(err, sshx.ErrSecretsWithheld) {
		return nil, fmt.Errorf("%w; to send them, pin the machine's host key at the provider (a static inventory's host_key) or opt it into trust on first use (trust_on_first_use: true)", err)
	} else if err != nil {
		return nil, trust.explain(ctx, in.db, err)
	}
	defer client.Close()

	ectx, cancel := context.WithTimeout(ctx, in.cfg.ExecTimeout)
	defer cancel()
	// Closing the connection is what stops SFTP and the remote command when
	// the exec timeout strikes, even if the machine went silent.
	stop := sshx.CloseWhenDone(ectx, client)
	defer stop()

	// The takeover replaces whatever agent runs on the machine: verify, as
	// late as possible, that this worker still holds the machine and that
	// it still has no agent. A worker stalled past its lease (a GC pause,
	// SIGSTOP, a paused VM) finds here that another one took it over.
	// Finish checks the work again when it records AgentStarted.
	switch err := t.Session.CheckWork(ectx, bmdb.ProcessAgentStart, t.Machine.MachineID, bmdb.AgentStartCandidates(in.p.Name())); {
	case errors.Is(err, bmdb.ErrNotCandidate):
		return nil, fmt.Errorf("not taking over: %w: %w", err, ErrRetryLater)
	case err != nil:
		return nil, fmt.Errorf("not taking over: %w", err)
	}
	sc, err := sftp.NewClient(client)
	if err != nil {
		if ectx.Err() != nil {
			return nil, fmt.Errorf("starting SFTP: exec timeout (%s) exceeded", in.cfg.ExecTimeout)
		}
		return nil, fmt.Errorf("starting SFTP: %w", err)
	}
	dir, err := resolveAgentDir(sc, agentDir(in.cfg.AgentDir, target.User, t.Machine))
	if err != nil {
		sc.Close()
		return nil, err
	}
	bin := path.Join(dir, "shepherd-agent")
	err = upload(sc, in.cfg.AgentPath, bin)
	sc.Close()
	if err != nil {
		if ectx.Err() != nil {
			return nil, fmt.Errorf("uploading the agent to %s on %s: exec timeout (%s) exceeded", bin, target.Addr, in.cfg.ExecTimeout)
		}
		return nil, fmt.Errorf("uploading the agent to %s on %s: %w", bin, target.Addr, err)
	}
	init := &agentv1.TakeoverInit{
		MachineId:      t.Machine.MachineID.String(),
		ServerEndpoint: in.cfg.ServerEndpoint,
		CaCertificate:  in.cfg.ServerCA,
	}
	stdin, err := proto.Marshal(init)
	if err != nil {
		return nil, err
	}
	cmd := shellquote.Join(append([]string{bin, "takeover", "--state-dir", path.Join(dir, "state")}, in.cfg.AgentArgs...)...)
	out, err := sshx.Run(ectx, client, cmd, stdin, 1<<20)
	if err != nil {
		if ectx.Err() != nil {
			return nil, fmt.Errorf("running the agent's takeover on %s: exec timeout (%s) exceeded", target.Addr, in.cfg.ExecTimeout)
		}
		return nil, fmt.Errorf("running the agent's takeover on %s: %w", target.Addr, err)
	}
	key, err := checkTakeover(out.Stdout, init)
	if err != nil {
		return nil, fmt.Errorf("takeover on %s: %w", target.Addr, err)
	}
	t.Log.InfoContext(ctx, "agent started", "agent_key", bmdb.AgentKeyText(key))
	return func(ctx context.Context, tx *bmdb.Tx) error {
		if err := trust.save(ctx, tx); err != nil {
			return err
		}
		return tx.SetAgentStarted(ctx, t.Machine.MachineID, key)
	}, nil
}

// checkTakeover parses the agent's answer: success requires the echoed init
// to equal what was sent and a 32-byte ed25519 key.
func checkTakeover(stdout []byte, sent *agentv1.TakeoverInit) (ed25519.PublicKey, error) {
	var resp agentv1.TakeoverResponse
	if err := proto.Unmarshal(stdout, &resp); err != nil {
		return nil, fmt.Errorf("the agent's output is no TakeoverResponse: %v (%d bytes: %q)", err, len(stdout), truncate(string(stdout), 200))
	}
	switch r := resp.GetResult().(type) {
	case *agentv1.TakeoverResponse_Error:
		return nil, fmt.Errorf("the agent refused the takeover: %s", truncate(r.Error.GetMessage(), 1000))
	case *agentv1.TakeoverResponse_Success:
		if !proto.Equal(r.Success.GetInitMessage(), sent) {
			return nil, errors.New("the agent echoed a TakeoverInit other than the one sent")
		}
		if k := r.Success.GetPublicKey(); len(k) != ed25519.PublicKeySize {
			return nil, fmt.Errorf("the agent answered with a %d-byte key, want %d", len(k), ed25519.PublicKeySize)
		}
		return ed25519.PublicKey(r.Success.GetPublicKey()), nil
	}
	return nil, errors.New("the agent's TakeoverResponse is empty")
}

// upload copies the local file to remote with SFTP: to a temporary name
// first, then renamed over remote, so a running agent's binary (which can
// not be overwritten in place) is replaced atomically.
func upload(sc *sftp.Client, local, remote string) error {
	src, err := os.Open(local)
	if err != nil {
		return err
	}
	defer src.Close()
	if err := sc.MkdirAll(path.Dir(remote)); err != nil {
		return fmt.Errorf("creating %s: %w", path.Dir(remote), err)
	}
	var suffix [6]byte
	_, _ = rand.Read(suffix[:])
	tmp := remote + ".upload-" + hex.EncodeToString(suffix[:])
	dst, err := sc.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC)
	if err != nil {
		return fmt.Errorf("creating %s: %w", tmp, err)
	}
	if _, err := io.Copy(dst, src); err != nil {
		dst.Close()
		_ = sc.Remove(tmp)
		return fmt.Errorf("writing %s: %w", tmp, err)
	}
	if err := dst.Close(); err != nil {
		_ = sc.Remove(tmp)
		return fmt.Errorf("writing %s: %w", tmp, err)
	}
	if err := sc.Chmod(tmp, 0o755); err != nil {
		_ = sc.Remove(tmp)
		return fmt.Errorf("making %s executable: %w", tmp, err)
	}
	if err := sc.PosixRename(tmp, remote); err != nil {
		// Servers without the posix-rename extension: remove, then rename.
		_ = sc.Remove(remote)
		if err := sc.Rename(tmp, remote); err != nil {
			_ = sc.Remove(tmp)
			return fmt.Errorf("moving %s to %s: %w", tmp, remote, err)
		}
	}
	return nil
}

// RootAgentDir is the agent's directory on a machine whose SSH user is
// root, unless configured otherwise.
const RootAgentDir = "/var/lib/shepherd-agent"

// HomeAgentDir is the agent's directory on a machine whose SSH user is not
// root, unless configured otherwise: relative to the user's home, where
// such a user may write (XDG's state directory).
const HomeAgentDir = ".local/state/shepherd-agent"

// agentDir is the agent's directory on machine m, reached as user: the
// configured one with m's ids in it, else the default for user. A relative
// result is relative to the user's home (resolveAgentDir).
func agentDir(configured, user string, m bmdb.ProvidedMachine) string {
	if configured != "" {
		return expandAgentDir(configured, m)
	}
	if user == "root" {
		return RootAgentDir
	}
	return HomeAgentDir
}

// resolveAgentDir makes dir absolute: a relative dir is taken relative to
// the SSH user's home, which is the SFTP server's working directory (as it
// is a command's), since the agent needs an absolute state directory.
func resolveAgentDir(sc *sftp.Client, dir string) (string, error) {
	if path.IsAbs(dir) {
		return dir, nil
	}
	home, err := sc.Getwd()
	if err != nil {
		return "", fmt.Errorf("finding the SSH user's home directory for the agent directory %s: %w", dir, err)
	}
	if !path.IsAbs(home) {
		return "", fmt.Errorf("the SSH user's home directory %q is not an absolute path (agent directory %s)", home, dir)
	}
	return path.Join(home, dir), nil
}

func expandAgentDir(dir string, m bmdb.ProvidedMachine) string {
	r := strings.NewReplacer("{provider_id}", safePathElem(m.ProviderID), "{machine_id}", m.MachineID.String())
	return r.Replace(dir)
}

// safePathElem makes a provider id (an opaque string) usable as one path
// element.
func safePathElem(s string) string {
	var b strings.Builder
	for _, r := range s {
		if r == '/' || r == 0 || r < ' ' {
			b.WriteByte('_')
			continue
		}
		b.WriteRune(r)
	}
	if out := b.String(); out != "." && out != ".." {
		return out
	}
	return "_"
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
