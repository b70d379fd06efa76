package static

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"syscall"

	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/internal/sshx"
	"github.com/shepherd/shepherd/provider"
)

// maxRebootOutput bounds what is kept of the reboot command's output: its
// stderr's end goes into the error of a failed reboot.
const maxRebootOutput = 64 << 10

// SSHAccess says how the initializer reaches machine id: the inventory's
// SSH user (machine's, else the defaults'; empty means the initializer's
// own), the machine's key and password as extra authentication, and its
// pinned host key (nil: trust on first use).
func (p *Provider) SSHAccess(_ context.Context, id string) (provider.SSHAccess, error) {
	e, err := p.entry(id)
	if err != nil {
		return provider.SSHAccess{}, err
	}
	var access provider.SSHAccess
	access.User, access.HostKey = e.user, e.hostKey
	if e.signer != nil {
		access.Signers = []ssh.Signer{e.signer}
	}
	if !e.password.empty() {
		access.Auth = []ssh.AuthMethod{ssh.Password(e.password.reveal())}
	}
	return access, nil
}

// RebootMachine runs the machine's reboot command over SSH, bounded by
// SSHTimeout. A reboot usually cuts the connection before the command
// reports an exit status; that counts as success. A non-zero exit status is
// an error that ends with the command's stderr.
//
// The host key must be verifiable: the key pinned in the inventory, or else
// the one Env.HostKeys knows for the machine. Without either the reboot is
// refused rather than sending credentials to whoever answers.
func (p *Provider) RebootMachine(ctx context.Context, id string) error {
	e, err := p.entry(id)
	if err != nil {
		return err
	}
	fail := func(err error) error {
		return fmt.Errorf("%s: rebooting machine %q at %s: %w", p.cfg.Name, id, e.m.addr, err)
	}
	user := cmp.Or(e.user, p.cfg.Env.SSHUser)
	if user == "" {
		return fail(errors.New("no SSH user: set ssh_user in the inventory or Shepherd's default SSH user"))
	}
	hostKey, err := p.hostKeyCallback(ctx, id, e)
	if err != nil {
		return fail(err)
	}
	// One publickey method with every key: an SSH client does not try a
	// method a second time once the server has rejected it.
	var signers []ssh.Signer
	if p.cfg.Env.SSHSigner != nil {
		signers = append(signers, p.cfg.Env.SSHSigner)
	}
	if e.signer != nil {
		signers = append(signers, e.signer)
	}
	var auth []ssh.AuthMethod
	if len(signers) > 0 {
		auth = append(auth, ssh.PublicKeys(signers...))
	}
	if !e.password.empty() {
		auth = append(auth, ssh.Password(e.password.reveal()))
	}
	if len(auth) == 0 {
		return fail(errors.New("no SSH credentials: Shepherd has no SSH key and the inventory gives the machine no password or key"))
	}

	ctx, cancel := context.WithTimeout(ctx, p.cfg.SSHTimeout)
	defer cancel()
	log := p.log.With(slog.String("machine_id", id))
	log.InfoContext(ctx, "rebooting machine", slog.String("addr", e.m.addr.String()), slog.String("ssh_user", user))
	client, err := sshx.Dial(ctx, sshx.Target{Addr: e.m.addr.String(), User: user, Auth: auth, HostKey: hostKey})
	if err != nil {
		return fail(err)
	}
	defer client.Close()
	_, err = sshx.Run(ctx, client, e.rebootCommand, nil, maxRebootOutput)
	if err != nil && (errors.Is(err, sshx.ErrNotStarted) || !connectionCut(err)) {
		return fail(err)
	}
	log.InfoContext(ctx, "reboot command sent", slog.Bool("connection_cut", err != nil))
	return nil
}

// hostKeyCallback verifies the machine's host key against the inventory's
// pin, or else asks Env.HostKeys.
func (p *Provider) hostKeyCallback(ctx context.Context, id string, e *entry) (ssh.HostKeyCallback, error) {
	if e.hostKey != nil {
		return sshx.CheckKey(e.hostKey), nil
	}
	hk := p.cfg.Env.HostKeys
	if hk == nil {
		return nil, errors.New("the host key cannot be verified: the inventory pins none (host_key) and no host key checker is configured")
	}
	return func(_ string, _ net.Addr, key ssh.PublicKey) error {
		return hk.CheckHostKey(ctx, id, key)
	}, nil
}

// connectionCut reports whether err means the connection ended while the
// reboot command ran, which is what a reboot does: the session closed
// without an exit status, or the connection hit EOF or was reset.
//
// It cannot tell a connection that broke before the command reached the
// machine from one the reboot broke; sshx.Run reports both alike. The
// recoverer finds out from the heartbeat either way.
func connectionCut(err error) bool {
	var missing *ssh.ExitMissingError
	return errors.As(err, &missing) ||
		errors.Is(err, io.EOF) ||
		errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, net.ErrClosed) ||
		errors.Is(err, syscall.ECONNRESET)
}

// ReinstallMachine is not supported: a static inventory has no way to
// reinstall a machine from outside. The error wraps provider.ErrUnsupported.
func (p *Provider) ReinstallMachine(_ context.Context, id string) error {
	return fmt.Errorf("%s: reinstalling machine %q: a static inventory cannot reinstall machines: %w", p.cfg.Name, id, provider.ErrUnsupported)
}
