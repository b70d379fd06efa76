package manager

import (
	"bytes"
	"context"
	"errors"
	"fmt"

	"github.com/google/uuid"
	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/internal/sshx"
	"github.com/shepherd/shepherd/provider"
)

// Host keys (SPEC §3.3, R7). The key in force for a machine is the one its
// provider pins, else the one the BMDB recorded (on first use, or pinned by
// an earlier takeover). Nothing is in force on first use: then any key is
// trusted for Shepherd's own key, and recorded only in the transaction that
// records the successful takeover, so a failed first attempt trusts nothing.
//
// A machine that presents another key fails with a cause that names both
// keys and the way out. For a recorded key, the key presented is kept in
// the BMDB, and `shepherd machine host-key accept ID --fingerprint SHA256:…`
// (or the web UI) makes exactly that key the recorded one. A key the
// provider pins is changed at the provider: accepting would not help, since
// the pin wins at the next takeover.

// hostKeyTrust is what one takeover knows about a machine's host key, and
// what it learns: the key in force, or the key trusted on first use.
type hostKeyTrust struct {
	machine uuid.UUID
	// pinned is the provider's pin; nil if it pins none.
	pinned ssh.PublicKey
	// inForce is pinned, else the recorded key; nil on first use.
	inForce ssh.PublicKey
	// record says inForce (the pin) is not the key the BMDB holds yet.
	record bool
	// firstUse is the key trusted on first use; set by the handshake.
	firstUse ssh.PublicKey
}

// loadHostKeyTrust reads what the BMDB holds for the machine, next to the
// provider's pin.
func loadHostKeyTrust(ctx context.Context, db *bmdb.DB, machine uuid.UUID, pinned ssh.PublicKey) (*hostKeyTrust, error) {
	h := &hostKeyTrust{machine: machine, pinned: pinned, inForce: pinned}
	raw, rawPinned, err := db.HostKey(ctx, machine)
	switch {
	case errors.Is(err, bmdb.ErrNotFound):
		h.record = pinned != nil
		return h, nil
	case err != nil:
		return nil, err
	case pinned != nil:
		// The provider's pin wins over a key recorded on first use.
		h.record = !rawPinned || !bytes.Equal(raw, pinned.Marshal())
		return h, nil
	}
	if h.inForce, err = ssh.ParsePublicKey(raw); err != nil {
		return nil, fmt.Errorf("the host key recorded for machine %s is unreadable: %w", machine, err)
	}
	return h, nil
}

// apply sets t's host key check: the key in force, or trust on first use.
func (h *hostKeyTrust) apply(t *sshx.Target) {
	t.HostKey = h.inForce
	t.FirstUse = func(k ssh.PublicKey) error {
		h.firstUse = k
		return nil
	}
}

// save records the key trusted in tx, failing if another key was recorded
// since loadHostKeyTrust read it.
func (h *hostKeyTrust) save(ctx context.Context, tx *bmdb.Tx) error {
	key, pin := h.firstUse, false
	switch {
	case h.record:
		key, pin = h.pinned, true
	case key == nil:
		return nil // the key in force was verified; nothing new
	}
	recorded, _, err := tx.RecordHostKey(ctx, h.machine, key.Marshal(), pin)
	if err != nil {
		return err
	}
	if !bytes.Equal(recorded, key.Marshal()) {
		want, err := ssh.ParsePublicKey(recorded)
		if err != nil {
			return fmt.Errorf("%w: the key recorded meanwhile is unreadable: %w", sshx.ErrHostKeyMismatch, err)
		}
		return fmt.Errorf("another process recorded a host key for machine %s meanwhile: %w", h.machine, &sshx.HostKeyMismatchError{Want: want, Got: key})
	}
	return nil
}

// explain turns a failed login into the error an operator acts on: for a
// host key mismatch it names both keys and the way out, and keeps the
// presented key in the BMDB so that it can be accepted.
func (h *hostKeyTrust) explain(ctx context.Context, db *bmdb.DB, err error) error {
	return explainMismatch(ctx, db, h.machine, h.pinned != nil, err)
}

// explainMismatch is hostKeyTrust.explain for callers without one: pinned
// says the key in force is the provider's pin.
func explainMismatch(ctx context.Context, db *bmdb.DB, machine uuid.UUID, pinned bool, err error) error {
	var mm *sshx.HostKeyMismatchError
	switch {
	case !errors.As(err, &mm):
		return err
	case pinned:
		return fmt.Errorf("%w; the key is pinned by the provider (a static inventory's host_key): if the machine was reinstalled, update the pin there", err)
	case mm.Got == nil:
		return fmt.Errorf("%w; the key it presents now could not be learnt to offer it for accepting: the next attempt tries again", err)
	}
	if _, oerr := db.OfferHostKey(ctx, machine, mm.Got.Marshal()); oerr != nil {
		return fmt.Errorf("%w; keeping the presented key for accepting failed: %v", err, oerr)
	}
	return fmt.Errorf("%w; if the machine was reinstalled, accept the new key after checking it: %s",
		err, bmdb.AcceptHostKeyCommand(machine, ssh.FingerprintSHA256(mm.Got)))
}

// HostKeys gives providers that SSH into machines themselves (a static
// inventory's reboot command) the BMDB's record of their host keys: the
// same keys, and the same way out of a mismatch, as the initializer's.
// Only the initializer records keys on first use, with a takeover that
// succeeded.
type HostKeys struct {
	DB       *bmdb.DB
	Provider string
}

var _ provider.HostKeyChecker = (*HostKeys)(nil)

// KnownHostKey returns the host key recorded for the provider's machine
// providerID, or nil if none is.
func (h *HostKeys) KnownHostKey(ctx context.Context, providerID string) (ssh.PublicKey, error) {
	id, err := h.DB.MachineByProviderID(ctx, h.Provider, providerID)
	if err != nil {
		return nil, fmt.Errorf("looking up the host key of %s: %w", providerID, err)
	}
	t, err := loadHostKeyTrust(ctx, h.DB, id, nil)
	if err != nil {
		return nil, fmt.Errorf("looking up the host key of %s: %w", providerID, err)
	}
	return t.inForce, nil
}

// HostKeyMismatch turns err, a failed login to providerID against its
// recorded key, into the error to report (see explainMismatch).
func (h *HostKeys) HostKeyMismatch(ctx context.Context, providerID string, err error) error {
	id, lerr := h.DB.MachineByProviderID(ctx, h.Provider, providerID)
	if lerr != nil {
		return err
	}
	return explainMismatch(ctx, h.DB, id, false, err)
}
