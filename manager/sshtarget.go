package manager

import (
	"context"
	"fmt"

	"github.com/google/uuid"
	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/internal/sshx"
	"github.com/shepherd/shepherd/provider"
)

// machineTarget says how to reach machine (provider id pid) over SSH as
// user with Shepherd's key: its address and any access the provider adds
// (user, secrets, dialer, pinned host key), and the host key trust from the
// BMDB, which the caller applies to the target.
func machineTarget(ctx context.Context, db *bmdb.DB, p provider.Provider, machine uuid.UUID, pid, user string, key ssh.Signer) (sshx.Target, *hostKeyTrust, error) {
	m, err := p.GetMachine(ctx, pid)
	if err != nil {
		return sshx.Target{}, nil, fmt.Errorf("asking %s for machine %s: %w", p.Name(), pid, err)
	}
	target := sshx.Target{Addr: m.Addr().String(), User: user, Keys: []ssh.Signer{key}}
	var pinned ssh.PublicKey
	if a, ok := p.(provider.SSHAccessor); ok {
		access, err := a.SSHAccess(ctx, pid)
		if err != nil {
			return sshx.Target{}, nil, fmt.Errorf("asking %s how to reach machine %s: %w", p.Name(), pid, err)
		}
		if access.User != "" {
			target.User = access.User
		}
		target.SecretKeys, target.SecretAuth, target.SecretsOnFirstUse = access.Signers, access.Auth, access.SecretsOnFirstUse
		target.Dial = access.Dial
		pinned = access.HostKey
	}
	if target.Dial == nil && !m.Addr().IsValid() {
		return sshx.Target{}, nil, fmt.Errorf("%s has no address for machine %s yet", p.Name(), pid)
	}
	trust, err := loadHostKeyTrust(ctx, db, machine, pinned)
	if err != nil {
		return sshx.Target{}, nil, err
	}
	return target, trust, nil
}
