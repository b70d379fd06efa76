package bmdb

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"math"
	"net/netip"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/bmdb/model"
	"github.com/shepherd/shepherd/internal/safetext"
)

// AcquireProviderLease gives the session the provisioning lease of
// provider if nobody alive holds it (SPEC §3.2: one reconcile pass at a time
// per provider). It reports whether the session holds the lease now. The
// lease ends with ReleaseProviderLease or with the session.
func (s *Session) AcquireProviderLease(ctx context.Context, provider string) (bool, error) {
	held, err := s.acquireLease(ctx, func(ctx context.Context) error {
		_, err := s.db.q.ProviderLeaseAcquire(ctx, model.ProviderLeaseAcquireParams{Provider: provider, SessionID: s.id})
		return err
	})
	if err != nil {
		return false, fmt.Errorf("bmdb: acquiring the provisioning lease of %s: %w", provider, err)
	}
	return held, nil
}

// ReleaseProviderLease gives up the session's provisioning lease of provider.
func (s *Session) ReleaseProviderLease(ctx context.Context, provider string) error {
	err := s.db.retry(ctx, func(ctx context.Context) error {
		return s.db.q.ProviderLeaseRelease(ctx, model.ProviderLeaseReleaseParams{Provider: provider, SessionID: s.id})
	})
	if err != nil {
		return fmt.Errorf("bmdb: releasing the provisioning lease of %s: %w", provider, err)
	}
	return nil
}

// AcquireUpdateLease gives the session the update lease of provider if
// nobody alive holds it (SPEC §3.5: one updater pass at a time per
// provider). It reports whether the session holds the lease now. The lease
// ends with ReleaseUpdateLease or with the session. It is independent of the
// provisioning lease, so that the provisioner and the updater of one
// provider run side by side.
func (s *Session) AcquireUpdateLease(ctx context.Context, provider string) (bool, error) {
	held, err := s.acquireLease(ctx, func(ctx context.Context) error {
		_, err := s.db.q.ProviderUpdateLeaseAcquire(ctx, model.ProviderUpdateLeaseAcquireParams{Provider: provider, SessionID: s.id})
		return err
	})
	if err != nil {
		return false, fmt.Errorf("bmdb: acquiring the update lease of %s: %w", provider, err)
	}
	return held, nil
}

// ReleaseUpdateLease gives up the session's update lease of provider.
func (s *Session) ReleaseUpdateLease(ctx context.Context, provider string) error {
	err := s.db.retry(ctx, func(ctx context.Context) error {
		return s.db.q.ProviderUpdateLeaseRelease(ctx, model.ProviderUpdateLeaseReleaseParams{Provider: provider, SessionID: s.id})
	})
	if err != nil {
		return fmt.Errorf("bmdb: releasing the update lease of %s: %w", provider, err)
	}
	return nil
}

// acquireLease runs acquire, a lease query that returns no row when someone
// else holds the lease, and reports whether the session holds it.
func (s *Session) acquireLease(ctx context.Context, acquire func(ctx context.Context) error) (bool, error) {
	var held bool
	err := s.db.retry(ctx, func(ctx context.Context) error {
		err := acquire(ctx)
		if errors.Is(err, pgx.ErrNoRows) {
			held = false
			return nil
		}
		held = err == nil
		return err
	})
	return held, err
}

// ProvidedRef is a machine as the provisioner and the updater compare it
// with a provider's listing: its ids and what the BMDB holds of the
// provider's details.
type ProvidedRef struct {
	MachineID     uuid.UUID
	ProviderID    string
	Status        ProviderStatus
	Address       netip.Addr // the zero Addr if unknown
	Location      string
	ReservationID string
}

// ListProvided returns every machine of provider, by provider id.
func (db *DB) ListProvided(ctx context.Context, provider string) ([]ProvidedRef, error) {
	rows, err := db.q.ProvidedList(ctx, provider)
	if err != nil {
		return nil, fmt.Errorf("bmdb: listing machines of %s: %w", provider, err)
	}
	out := make([]ProvidedRef, len(rows))
	for i, r := range rows {
		out[i] = ProvidedRef{
			MachineID: r.MachineID, ProviderID: r.ProviderID, Status: ProviderStatus(r.ProviderStatus),
			Location: r.ProviderLocation, ReservationID: r.ProviderReservationID,
		}
		if r.ProviderIPAddress != nil {
			out[i].Address = *r.ProviderIPAddress
		}
	}
	return out, nil
}

// SetProviderStatus records status for the machines of provider with the
// given provider ids and returns how many it changed. Machines that have the
// status already are not written: their StatusAt keeps saying since when.
func (tx *Tx) SetProviderStatus(ctx context.Context, provider string, status ProviderStatus, providerIDs []string) (int64, error) {
	n, err := tx.q.ProvidedSetStatus(ctx, model.ProvidedSetStatusParams{Provider: provider, ProviderStatus: string(status), ProviderIds: providerIDs})
	if err != nil {
		return 0, fmt.Errorf("bmdb: setting status %s on %d machines of %s: %w", status, len(providerIDs), provider, err)
	}
	return n, nil
}

// ProvidedUpdate is what a provider says now about one of its machines: the
// details of the Provided tag that the provider, not Shepherd, decides.
type ProvidedUpdate struct {
	ProviderID    string         // the machine, by provider id
	Status        ProviderStatus // default ProviderStatusUnknown
	Address       netip.Addr     // main IP address; the zero Addr if unknown
	Location      string
	ReservationID string
}

// MaxProvidedUpdates bounds the updates one UpdateProvided call takes. It
// keeps a transaction short (its row locks block claims of those machines
// until it commits) and its statement a few hundred kilobytes, while still
// writing a fleet of 100,000 machines in 100 transactions.
const MaxProvidedUpdates = 1000

// UpdateProvided refreshes the details of provider's machines, all in one
// set-based statement, and returns how many machines it changed. Machines
// the BMDB lacks are skipped, and so are machines that have the given
// details already, which are not written at all. StatusAt moves only for
// machines whose status changes. Provider ids should be distinct (of repeated
// ones, one update is applied), and at most MaxProvidedUpdates are taken
// per call: split larger batches over transactions.
func (tx *Tx) UpdateProvided(ctx context.Context, provider string, updates []ProvidedUpdate) (int64, error) {
	if len(updates) > MaxProvidedUpdates {
		return 0, fmt.Errorf("bmdb: updating %d machines of %s at once; at most %d per call", len(updates), provider, MaxProvidedUpdates)
	}
	if len(updates) == 0 {
		return 0, nil
	}
	arg := model.ProvidedUpdateManyParams{
		Provider:       provider,
		ProviderIds:    make([]string, len(updates)),
		Statuses:       make([]string, len(updates)),
		IpAddresses:    make([]string, len(updates)),
		Locations:      make([]string, len(updates)),
		ReservationIds: make([]string, len(updates)),
	}
	for i, u := range updates {
		p := Provided{Provider: provider, ProviderID: u.ProviderID, Status: u.Status}
		if err := p.Validate(); err != nil {
			return 0, err
		}
		arg.ProviderIds[i] = u.ProviderID
		arg.Statuses[i] = string(cmp.Or(u.Status, ProviderStatusUnknown))
		if u.Address.IsValid() {
			// inet has no zones; a zone would only make the cast fail.
			arg.IpAddresses[i] = u.Address.WithZone("").String()
		}
		arg.Locations[i] = u.Location
		arg.ReservationIds[i] = u.ReservationID
	}
	n, err := tx.q.ProvidedUpdateMany(ctx, arg)
	if err != nil {
		return 0, fmt.Errorf("bmdb: updating %d machines of %s: %w", len(updates), provider, err)
	}
	return n, nil
}

// ProviderHasStatus reports whether any machine of provider has one of
// statuses (the updater polls faster while some machine is Provisioning).
func (db *DB) ProviderHasStatus(ctx context.Context, provider string, statuses ...ProviderStatus) (bool, error) {
	ss := make([]string, len(statuses))
	for i, st := range statuses {
		ss[i] = string(st)
	}
	found, err := db.q.ProvidedStatusExists(ctx, model.ProvidedStatusExistsParams{Provider: provider, Statuses: ss})
	if err != nil {
		return false, fmt.Errorf("bmdb: looking for machines of %s in status %v: %w", provider, statuses, err)
	}
	return found, nil
}

// ConfirmUpdate records that an updater pass applied a listing of provider
// it believed: every machine of the provider that is not Missing had the
// details the BMDB holds at this (database) time. It is the per-provider
// counterpart of a per-machine "last confirmed" time, which would cost a
// write of every machine on every pass.
func (tx *Tx) ConfirmUpdate(ctx context.Context, provider string) error {
	if err := tx.q.ProviderUpdateConfirm(ctx, provider); err != nil {
		return fmt.Errorf("bmdb: recording the update of %s: %w", provider, err)
	}
	return nil
}

// UpdateConfirmedAt returns when ConfirmUpdate last ran for provider, or
// the zero time if it never did.
func (db *DB) UpdateConfirmedAt(ctx context.Context, provider string) (time.Time, error) {
	at, err := db.q.ProviderUpdateConfirmedAt(ctx, provider)
	if errors.Is(err, pgx.ErrNoRows) || (err == nil && at == nil) {
		return time.Time{}, nil
	} else if err != nil {
		return time.Time{}, fmt.Errorf("bmdb: reading when %s was last updated: %w", provider, err)
	}
	return *at, nil
}

// ProviderAgentCounts returns how many machines provider has, and how many
// of them have a started, not installed agent.
func (db *DB) ProviderAgentCounts(ctx context.Context, provider string) (provided, started int64, err error) {
	r, err := db.q.ProviderAgentCounts(ctx, provider)
	if err != nil {
		return 0, 0, fmt.Errorf("bmdb: counting machines of %s: %w", provider, err)
	}
	return r.Provided, r.Started, nil
}

// HostKey returns the SSH host key recorded (or pinned) for a machine, in
// SSH wire format, or ErrNotFound.
func (db *DB) HostKey(ctx context.Context, machine uuid.UUID) (key []byte, pinned bool, err error) {
	r, err := db.q.HostKeyGet(ctx, machine)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, false, ErrNotFound
	} else if err != nil {
		return nil, false, fmt.Errorf("bmdb: reading host key of machine %s: %w", machine, err)
	}
	return r.HostKey, r.Pinned, nil
}

// RecordHostKey records key (SSH wire format) as the machine's host key
// unless one is recorded already, and returns the key in force: trust on
// first use, so the first key seen wins. A pinned key (from the provider)
// replaces one recorded on first use.
func (db *DB) RecordHostKey(ctx context.Context, machine uuid.UUID, key []byte, pinned bool) (recorded []byte, recordedPinned bool, err error) {
	err = db.retry(ctx, func(ctx context.Context) error {
		recorded, recordedPinned, err = recordHostKey(ctx, db.q, machine, key, pinned)
		return err
	})
	if err != nil {
		return nil, false, fmt.Errorf("bmdb: recording host key of machine %s: %w", machine, err)
	}
	return recorded, recordedPinned, nil
}

// RecordHostKey is DB.RecordHostKey inside a transaction, so that a worker
// can record the key it trusted together with the result of its work.
func (tx *Tx) RecordHostKey(ctx context.Context, machine uuid.UUID, key []byte, pinned bool) (recorded []byte, recordedPinned bool, err error) {
	recorded, recordedPinned, err = recordHostKey(ctx, tx.q, machine, key, pinned)
	if err != nil {
		return nil, false, fmt.Errorf("bmdb: recording host key of machine %s: %w", machine, err)
	}
	return recorded, recordedPinned, nil
}

func recordHostKey(ctx context.Context, q *model.Queries, machine uuid.UUID, key []byte, pinned bool) ([]byte, bool, error) {
	r, err := q.HostKeyRecord(ctx, model.HostKeyRecordParams{MachineID: machine, HostKey: key, Pinned: pinned})
	if errors.Is(err, pgx.ErrNoRows) {
		// A key is recorded already and this one does not replace it.
		g, err := q.HostKeyGet(ctx, machine)
		return g.HostKey, g.Pinned, err
	}
	return r.HostKey, r.Pinned, err
}

// OfferHostKey keeps key (SSH wire format), which the machine presented
// instead of the host key in force, so that an operator can accept it with
// AcceptHostKey. It reports whether it kept it: not when no key is in
// force, or key is the one in force. A later offer replaces an earlier one.
func (db *DB) OfferHostKey(ctx context.Context, machine uuid.UUID, key []byte) (bool, error) {
	var n int64
	err := db.retry(ctx, func(ctx context.Context) error {
		var err error
		n, err = db.q.HostKeyOffer(ctx, model.HostKeyOfferParams{MachineID: machine, OfferedHostKey: key})
		return err
	})
	if err != nil {
		return false, fmt.Errorf("bmdb: keeping the host key machine %s offered: %w", machine, err)
	}
	return n > 0, nil
}

// ErrNoOfferedHostKey means the machine has presented no SSH host key
// other than the one in force since it was recorded: there is nothing to
// accept.
var ErrNoOfferedHostKey = errors.New("bmdb: the machine has presented no other SSH host key")

// ErrOfferedHostKeyDiffers means the key the machine presented instead of
// the one in force has a fingerprint other than the one the operator
// accepted (it presented yet another key since they looked): nothing was
// changed.
var ErrOfferedHostKeyDiffers = errors.New("bmdb: the SSH host key the machine presented has another fingerprint")

// HostKeyChange is a host key an operator accepted: the key it replaced
// and the new one (SSH wire format) with their SHA-256 fingerprints.
type HostKeyChange struct {
	Old, New                       []byte
	OldFingerprint, NewFingerprint string
	// OldPinned says the replaced key had been pinned by the provider.
	OldPinned bool
	// OfferedAt is when the machine last presented the new key.
	OfferedAt time.Time
}

// HostKeyFingerprint returns the SHA-256 fingerprint of a public key in
// SSH wire format, as ssh-keygen -l prints it ("SHA256:" and unpadded
// base64).
func HostKeyFingerprint(key []byte) string {
	sum := sha256.Sum256(key)
	return "SHA256:" + base64.RawStdEncoding.EncodeToString(sum[:])
}

// hostKeyProcesses are the processes that SSH into a machine, and whose
// backoffs an accepted host key clears: the agent start and the recovery
// (whose reboot goes over SSH for a static inventory).
var hostKeyProcesses = []string{string(ProcessAgentStart), string(ProcessRecovery)}

// AcceptHostKey makes the key the machine presented instead of the one in
// force its recorded key (trust on first use starts over from it), if that
// key has the SHA-256 fingerprint the operator checked. In the same
// transaction it clears the AgentStart and Recovery backoffs and
// quarantines of the machine, so that they try it again at once, and writes
// history Reset saying which key replaced which, with by (who asked) and
// reason. Errors: ErrNotFound (no key in force), ErrNoOfferedHostKey,
// ErrOfferedHostKeyDiffers; none of them changes anything.
func (db *DB) AcceptHostKey(ctx context.Context, machine uuid.UUID, fingerprint, by, reason string) (HostKeyChange, error) {
	var ch HostKeyChange
	err := db.transact(ctx, func(ctx context.Context, q *model.Queries) error {
		r, err := q.HostKeyLock(ctx, machine)
		if errors.Is(err, pgx.ErrNoRows) {
			return ErrNotFound
		} else if err != nil {
			return err
		}
		if r.OfferedHostKey == nil || r.OfferedAt == nil {
			return ErrNoOfferedHostKey
		}
		ch = HostKeyChange{
			Old: r.HostKey, New: r.OfferedHostKey, OldPinned: r.Pinned, OfferedAt: *r.OfferedAt,
			OldFingerprint: HostKeyFingerprint(r.HostKey), NewFingerprint: HostKeyFingerprint(r.OfferedHostKey),
		}
		if ch.NewFingerprint != fingerprint {
			return fmt.Errorf("%w: it presented %s, not %s", ErrOfferedHostKeyDiffers, ch.NewFingerprint, fingerprint)
		}
		if err := q.HostKeyAccept(ctx, machine); err != nil {
			return err
		}
		cause := fmt.Sprintf("SSH host key %s replaced by %s (presented %s), accepted by %s",
			ch.OldFingerprint, ch.NewFingerprint, ch.OfferedAt.UTC().Format(time.RFC3339), by)
		if ch.OldPinned {
			cause = "pinned " + cause
		}
		if reason != "" {
			cause += ": " + reason
		}
		return q.HostKeyAcceptHistory(ctx, model.HostKeyAcceptHistoryParams{
			MachineID: machine, Cause: cause, Process: string(ProcessAgentStart), Processes: hostKeyProcesses,
		})
	})
	switch {
	case errors.Is(err, ErrNotFound), errors.Is(err, ErrNoOfferedHostKey), errors.Is(err, ErrOfferedHostKeyDiffers):
		return ch, err
	case err != nil:
		return ch, fmt.Errorf("bmdb: accepting the host key of machine %s: %w", machine, err)
	}
	return ch, nil
}

// AcceptHostKeyCommand is the operator command that runs AcceptHostKey for
// the key with the given fingerprint, as host key mismatch causes, `shepherd
// machine show` and the web UI name it.
func AcceptHostKeyCommand(machine uuid.UUID, fingerprint string) string {
	return fmt.Sprintf("shepherd machine host-key accept %s --fingerprint %s", machine, fingerprint)
}

// ClearHostKey forgets the host key the machine's first use recorded (and
// any key it presented instead), for a reinstall, which gives the machine
// new host keys (SPEC §3.3): call it in the transaction that records the
// reinstall, so that the next takeover trusts the reinstalled machine's
// key on first use. A key pinned by the provider stays: the provider, not
// a reinstall, decides about it.
func (tx *Tx) ClearHostKey(ctx context.Context, machine uuid.UUID) error {
	if _, err := tx.q.HostKeyClear(ctx, machine); err != nil {
		return fmt.Errorf("bmdb: clearing host key of machine %s: %w", machine, err)
	}
	return nil
}

// MachineState is a machine's derived state (SPEC §3.7): computed from its
// tags, never stored.
type MachineState string

// Derived machine states.
const (
	StateProvided               MachineState = "Provided"
	StateAgentStarting          MachineState = "AgentStarting"
	StateAwaitingFirstHeartbeat MachineState = "AwaitingFirstHeartbeat"
	StateHealthy                MachineState = "Healthy"
	StateSilent                 MachineState = "Silent"
	StateRecovering             MachineState = "Recovering"
	StateInstalling             MachineState = "Installing"
	StateInstalled              MachineState = "Installed"
	StateInstallFailed          MachineState = "InstallFailed"
	StateBackedOff              MachineState = "BackedOff"
	StateQuarantined            MachineState = "Quarantined"
	StateMissing                MachineState = "Missing"
	// StateStopped: the provider says the machine is powered off. Its
	// agent cannot run, so it is neither silent nor taken over.
	StateStopped         MachineState = "Stopped"
	StateDecommissioning MachineState = "Decommissioning"
)

// FleetStates counts provider's machines per derived state. Silent uses
// the recovery timeouts (zero: the defaults).
func (db *DB) FleetStates(ctx context.Context, provider string, firstHeartbeatTimeout, heartbeatTimeout time.Duration) (map[MachineState]int64, error) {
	if firstHeartbeatTimeout == 0 {
		firstHeartbeatTimeout = DefaultFirstHeartbeatTimeout
	}
	if heartbeatTimeout == 0 {
		heartbeatTimeout = DefaultHeartbeatTimeout
	}
	rows, err := db.q.FleetStates(ctx, model.FleetStatesParams{
		Provider: provider, FirstHeartbeatTimeoutMs: firstHeartbeatTimeout.Milliseconds(), HeartbeatTimeoutMs: heartbeatTimeout.Milliseconds(),
	})
	if err != nil {
		return nil, fmt.Errorf("bmdb: counting machine states of %s: %w", provider, err)
	}
	out := make(map[MachineState]int64, len(rows))
	for _, r := range rows {
		out[MachineState(r.State)] = r.Machines
	}
	return out, nil
}

// MachineByProviderID returns the id of provider's machine providerID, or
// ErrNotFound.
func (db *DB) MachineByProviderID(ctx context.Context, provider, providerID string) (uuid.UUID, error) {
	id, err := db.q.MachineByProviderID(ctx, model.MachineByProviderIDParams{Provider: provider, ProviderID: providerID})
	if errors.Is(err, pgx.ErrNoRows) {
		return uuid.Nil, ErrNotFound
	} else if err != nil {
		return uuid.Nil, fmt.Errorf("bmdb: finding machine %s/%s: %w", provider, providerID, err)
	}
	return id, nil
}

// MachineRef names a machine by its id and by its provider's id for it.
type MachineRef struct {
	MachineID            uuid.UUID
	Provider, ProviderID string
	// Decommissioned: the machine left the fleet; Provider and ProviderID
	// are what its Provided tag said.
	Decommissioned bool
}

// MachinesWithProviderID returns the machines, live and decommissioned,
// whose provider id is providerID at any provider, by provider; none is no
// error. A provider id is unique within its provider only, so there may be
// several.
func (db *DB) MachinesWithProviderID(ctx context.Context, providerID string) ([]MachineRef, error) {
	if !safetext.Storable(providerID) {
		// No stored provider id holds a NUL or invalid UTF-8, and
		// PostgreSQL would refuse the parameter.
		return nil, nil
	}
	rows, err := db.q.MachinesWithProviderID(ctx, providerID)
	if err != nil {
		return nil, fmt.Errorf("bmdb: finding machines with provider id %q: %w", safetext.Cut(providerID, 128), err)
	}
	refs := make([]MachineRef, len(rows))
	for i, r := range rows {
		refs[i] = MachineRef{MachineID: r.MachineID, Provider: r.Provider, ProviderID: providerID, Decommissioned: r.Decommissioned}
	}
	return refs, nil
}

// MaxListingAcceptance bounds how long an operator's acceptance of a
// suspect listing waits for a pass to take it. The acceptance is for the
// listing the operator just looked at; a day later it could only vouch for
// some other, unrelated bad listing.
const MaxListingAcceptance = 24 * time.Hour

// ListingAcceptance is an operator's word that the next suspect listing of
// a provider (SPEC §3.2) is right after all: the machines it lacks, at most
// MaxMissing of them, are really gone.
type ListingAcceptance struct {
	Provider   string
	MaxMissing int
	By         string    // who accepted, for the logs
	At, Until  time.Time // when it was recorded, and when it lapses untaken
}

// AcceptListing records that the next suspect listing of provider that
// lacks at most maxMissing machines is to be believed, if a pass finds it
// within validFor (at most MaxListingAcceptance). It replaces an earlier
// acceptance of the provider. Bad arguments change nothing.
func (db *DB) AcceptListing(ctx context.Context, provider string, maxMissing int, validFor time.Duration, by string) (ListingAcceptance, error) {
	switch {
	case provider == "":
		return ListingAcceptance{}, errors.New("bmdb: accepting a listing: the provider name is empty")
	case maxMissing < 1 || maxMissing > math.MaxInt32:
		return ListingAcceptance{}, fmt.Errorf("bmdb: accepting a listing of %s: max missing must be between 1 and %d, got %d", provider, math.MaxInt32, maxMissing)
	case validFor <= 0 || validFor > MaxListingAcceptance:
		return ListingAcceptance{}, fmt.Errorf("bmdb: accepting a listing of %s: validity must be within (0, %s], got %s", provider, MaxListingAcceptance, validFor)
	}
	var r model.ProviderListingAcceptRow
	err := db.retry(ctx, func(ctx context.Context) error {
		var err error
		r, err = db.q.ProviderListingAccept(ctx, model.ProviderListingAcceptParams{
			Provider: provider, MaxMissing: int32(maxMissing), AcceptedBy: by, ValidForSeconds: validFor.Seconds()})
		return err
	})
	if err != nil {
		return ListingAcceptance{}, fmt.Errorf("bmdb: accepting a listing of %s: %w", provider, err)
	}
	return ListingAcceptance{Provider: provider, MaxMissing: maxMissing, By: by, At: r.AcceptedAt, Until: r.AcceptedUntil}, nil
}

// TakeListingAcceptance takes provider's acceptance if it covers a listing
// that lacks missing machines and has not lapsed, and reports whether there
// was one. Taking it clears it: one acceptance believes one listing, and of
// processes that find the same suspect listing at once only one takes it.
func (tx *Tx) TakeListingAcceptance(ctx context.Context, provider string, missing int) (ListingAcceptance, bool, error) {
	r, err := tx.q.ProviderListingAcceptanceTake(ctx, model.ProviderListingAcceptanceTakeParams{
		Provider: provider, Missing: int32(min(missing, math.MaxInt32))})
	if errors.Is(err, pgx.ErrNoRows) {
		return ListingAcceptance{}, false, nil
	} else if err != nil {
		return ListingAcceptance{}, false, fmt.Errorf("bmdb: taking the listing acceptance of %s: %w", provider, err)
	}
	return ListingAcceptance{Provider: provider, MaxMissing: int(r.MaxMissing), By: r.AcceptedBy, At: r.AcceptedAt, Until: r.AcceptedUntil}, true, nil
}
