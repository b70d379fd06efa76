package static

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"

	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/internal/sshx"
	"github.com/shepherd/shepherd/provider"
)

// maxRebootOutput bounds what is kept of the reboot command's output: its
// stderr's end goes into the error of a failed reboot.
const maxRebootOutput = 64 << 10

// SSHAccess says how the initializer reaches machine id: the inventory's
// SSH user (machine's, else the defaults'; empty means the initializer's
// own), the machine's key and password as extra authentication (sent only
// to a verified host unless trust_on_first_use), and its pinned host key
// (nil: trust on first use).
func (p *Provider) SSHAccess(_ context.Context, id string) (provider.SSHAccess, error) {
	e, err := p.entry(id)
	if err != nil {
		return provider.SSHAccess{}, err
	}
	access := provider.SSHAccess{User: e.user, HostKey: e.hostKey, SecretsOnFirstUse: e.trustOnFirstUse, Auth: e.passwordAuth()}
	if e.signer != nil {
		access.Signers = []ssh.Signer{e.signer}
	}
	return access, nil
}

// passwordAuth returns the machine's password as an SSH method, or nil.
func (e *entry) passwordAuth() []ssh.AuthMethod {
	if e.password.Empty() {
		return nil
	}
	return []ssh.AuthMethod{ssh.Password(e.password.Reveal())}
}

// RebootMachine runs the machine's reboot command over SSH, bounded by
// SSHTimeout: it returns by then whatever the machine does.
//
// The host key must be verifiable: the key pinned in the inventory, else
// the one Env.HostKeys has recorded for the machine. On first use (neither)
// only Shepherd's key is offered, and the machine's own password and key
// only with trust_on_first_use; nothing is recorded (the initializer
// records keys, with a takeover that succeeded).
//
// How a reboot is judged: until the machine confirms it started the
// command, any failure is a failed reboot, which the recoverer repeats
// after its backoff; it wraps provider.ErrNotReached, since nothing was
// done to the machine. Once it confirmed, only the command's own exit status
// can say the reboot failed (a non-zero status: the error ends with its
// stderr). A zero status, a connection cut, or a machine that stops
// answering until SSHTimeout (one that reset at once, without closing the
// connection) all count as a reboot issued: that is what a reboot looks
// like from outside, and whether the machine came back is the heartbeat's
// business. Counting them as failures would reboot a machine again that is
// booting already.
func (p *Provider) RebootMachine(ctx context.Context, id string) error {
	e, err := p.entry(id)
	if err != nil {
		return fmt.Errorf("%w (%w)", err, provider.ErrNotReached)
	}
	fail := func(err error) error {
		return fmt.Errorf("%s: rebooting machine %q at %s: %w", p.cfg.Name, id, e.m.addr, err)
	}
	// Until the machine confirms it started the command, nothing was done
	// to it: the circuit breaker does not count such a failure.
	unreached := func(err error) error { return fail(fmt.Errorf("%w (%w)", err, provider.ErrNotReached)) }
	user := cmp.Or(e.user, p.cfg.Env.SSHUser)
	if user == "" {
		return unreached(errors.New("no SSH user: set ssh_user in the inventory or Shepherd's default SSH user"))
	}
	ctx, cancel := context.WithTimeout(ctx, p.cfg.SSHTimeout)
	defer cancel()
	target := sshx.Target{Addr: e.m.addr.String(), User: user, HostKey: e.hostKey, SecretAuth: e.passwordAuth(), SecretsOnFirstUse: e.trustOnFirstUse}
	if e.signer != nil {
		target.SecretKeys = []ssh.Signer{e.signer}
	}
	if p.cfg.Env.SSHSigner != nil {
		target.Keys = []ssh.Signer{p.cfg.Env.SSHSigner}
	}
	hk := p.cfg.Env.HostKeys
	switch {
	case target.HostKey != nil:
	case hk == nil:
		return unreached(errors.New("the host key cannot be verified: the inventory pins none (host_key) and no host key checker is configured"))
	default:
		if target.HostKey, err = hk.KnownHostKey(ctx, id); err != nil {
			return unreached(err)
		}
		target.FirstUse = func(ssh.PublicKey) error { return nil }
	}
	if len(target.Keys) == 0 && len(target.SecretKeys) == 0 && len(target.SecretAuth) == 0 {
		return unreached(errors.New("no SSH credentials: Shepherd has no SSH key and the inventory gives the machine no password or key"))
	}

	log := p.log.With(slog.String("machine_id", id))
	log.InfoContext(ctx, "rebooting machine", slog.String("addr", e.m.addr.String()), slog.String("ssh_user", user))
	client, err := sshx.Dial(ctx, target)
	switch {
	case errors.Is(err, sshx.ErrSecretsWithheld):
		return unreached(fmt.Errorf("%w; to send them, pin host_key in the inventory or set trust_on_first_use: true for the machine", err))
	case errors.Is(err, sshx.ErrHostKeyMismatch) && e.hostKey != nil:
		return unreached(fmt.Errorf("%w; the key is pinned by the inventory (host_key): if the machine was reinstalled, update it there", err))
	case errors.Is(err, sshx.ErrHostKeyMismatch):
		return unreached(hk.HostKeyMismatch(ctx, id, err))
	case err != nil:
		return unreached(err)
	}
	defer client.Close()
	_, err = sshx.Run(ctx, client, e.rebootCommand, nil, maxRebootOutput)
	var exit *sshx.ExitError
	switch {
	case err == nil:
		log.InfoContext(ctx, "reboot command done")
	case errors.As(err, &exit):
		return fail(err)
	case errors.Is(err, sshx.ErrNotStarted):
		return unreached(err)
	case ctx.Err() != nil:
		log.WarnContext(ctx, "reboot command issued; the machine did not answer again before the SSH timeout, as one that reset at once does",
			slog.Duration("ssh_timeout", p.cfg.SSHTimeout))
	default:
		log.InfoContext(ctx, "reboot command issued; the connection was cut", slog.Any("err", err))
	}
	return nil
}

// ReinstallMachine is not supported: a static inventory has no way to
// reinstall a machine from outside. The error wraps provider.ErrUnsupported.
func (p *Provider) ReinstallMachine(_ context.Context, id string) error {
	return fmt.Errorf("%s: reinstalling machine %q: a static inventory cannot reinstall machines: %w", p.cfg.Name, id, provider.ErrUnsupported)
}
