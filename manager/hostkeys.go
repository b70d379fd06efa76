package manager

import (
	"context"
	"fmt"

	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/provider"
)

// HostKeys checks machines' SSH host keys against the BMDB for providers
// that SSH into machines themselves (a static inventory's reboot command):
// the same trust-on-first-use record the initializer keeps.
type HostKeys struct {
	DB       *bmdb.DB
	Provider string
}

var _ provider.HostKeyChecker = (*HostKeys)(nil)

// CheckHostKey verifies key for the provider's machine providerID.
func (h *HostKeys) CheckHostKey(ctx context.Context, providerID string, key ssh.PublicKey) error {
	id, err := h.DB.MachineByProviderID(ctx, h.Provider, providerID)
	if err != nil {
		return fmt.Errorf("checking the host key of %s: %w", providerID, err)
	}
	return hostKeyCallback(ctx, h.DB, id, nil)("", nil, key)
}
