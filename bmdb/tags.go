package bmdb

import (
	"cmp"
	"context"
	"crypto/ed25519"
	"encoding/base64"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/bmdb/model"
	"github.com/shepherd/shepherd/internal/safetext"
)

// ProviderStatus is what the provider last said about a machine.
type ProviderStatus string

// Provider statuses (SPEC §2.2).
const (
	ProviderStatusMissing                     ProviderStatus = "Missing"
	ProviderStatusProvisioning                ProviderStatus = "Provisioning"
	ProviderStatusProvisioningFailedPermanent ProviderStatus = "ProvisioningFailedPermanent"
	ProviderStatusRunning                     ProviderStatus = "Running"
	ProviderStatusStopped                     ProviderStatus = "Stopped"
	ProviderStatusUnknown                     ProviderStatus = "Unknown"
)

// Provided is the Provided tag: which provider machine backs a BMDB machine.
type Provided struct {
	Provider      string         // provider name; required
	ProviderID    string         // opaque id at the provider, 1–128 bytes; unique per provider
	ReservationID string         // provider reservation, if any
	Address       netip.Addr     // main IP address; the zero Addr if unknown
	Location      string         // provider location (facility, metro, rack)
	Status        ProviderStatus // default ProviderStatusUnknown
	StatusAt      time.Time      // since when the machine has had Status (recorded or changed then); read-only
}

// Validate reports the first problem with the tag. It changes nothing.
func (p Provided) Validate() error {
	if p.Provider == "" {
		return errors.New("bmdb: Provided.Provider is required")
	}
	if n := len(p.ProviderID); n < 1 || n > 128 {
		return fmt.Errorf("bmdb: Provided.ProviderID must be 1-128 bytes, got %d", n)
	}
	switch p.Status {
	case "", ProviderStatusMissing, ProviderStatusProvisioning, ProviderStatusProvisioningFailedPermanent,
		ProviderStatusRunning, ProviderStatusStopped, ProviderStatusUnknown:
	default:
		return fmt.Errorf("bmdb: Provided.Status %q is not a provider status", string(p.Status))
	}
	return nil
}

// AddMachine creates a machine with its Provided tag and returns its id.
func (t *Tx) AddMachine(ctx context.Context, p Provided) (uuid.UUID, error) {
	if err := p.Validate(); err != nil {
		return uuid.Nil, err
	}
	status := p.Status
	if status == "" {
		status = ProviderStatusUnknown
	}
	var addr *netip.Addr
	if p.Address.IsValid() {
		addr = &p.Address
	}
	id, err := t.q.MachineAdd(ctx, model.MachineAddParams{
		Provider:              p.Provider,
		ProviderID:            p.ProviderID,
		ProviderReservationID: p.ReservationID,
		ProviderIPAddress:     addr,
		ProviderLocation:      p.Location,
		ProviderStatus:        string(status),
	})
	if err != nil {
		return uuid.Nil, fmt.Errorf("bmdb: adding machine %s/%s: %w", p.Provider, p.ProviderID, err)
	}
	return id, nil
}

// AgentKeyText renders an agent's public key (the raw ed25519 key of the
// AgentStarted tag) the one way logs, the CLI and the web UI show it: the
// key's 32 bytes in standard base64 (44 characters), as `shepherd machine
// show` and the machine page print it and the initializer logs it.
func AgentKeyText(key []byte) string {
	if len(key) == 0 {
		return ""
	}
	return base64.StdEncoding.EncodeToString(key)
}

// SetAgentStarted records that the agent was started now and answered with key.
func (t *Tx) SetAgentStarted(ctx context.Context, machine uuid.UUID, key ed25519.PublicKey) error {
	if len(key) != ed25519.PublicKeySize {
		return fmt.Errorf("bmdb: agent key of machine %s is %d bytes, want %d", machine, len(key), ed25519.PublicKeySize)
	}
	if err := t.q.AgentStartedSet(ctx, model.AgentStartedSetParams{MachineID: machine, AgentPublicKey: key}); err != nil {
		return fmt.Errorf("bmdb: setting AgentStarted on machine %s: %w", machine, err)
	}
	return nil
}

// ClearAgent removes AgentStarted and AgentHeartbeat, which makes the machine
// an agent-start candidate again; recovery does this after a reboot.
func (t *Tx) ClearAgent(ctx context.Context, machine uuid.UUID) error {
	if err := t.q.AgentClear(ctx, machine); err != nil {
		return fmt.Errorf("bmdb: clearing agent tags of machine %s: %w", machine, err)
	}
	return nil
}

// RecordHeartbeat records a heartbeat of the machine's agent at database time.
func (t *Tx) RecordHeartbeat(ctx context.Context, machine uuid.UUID) error {
	if err := t.q.AgentHeartbeatSet(ctx, machine); err != nil {
		return fmt.Errorf("bmdb: recording heartbeat of machine %s: %w", machine, err)
	}
	return nil
}

// RequestInstallation stores an OS installation request (protobuf bytes)
// under the machine's next generation, which it returns, with by (who
// asks) and a Requested history row naming both.
func (t *Tx) RequestInstallation(ctx context.Context, machine uuid.UUID, by string, request []byte) (int64, error) {
	by = safetext.Clean(by)
	gen, err := t.q.InstallationRequestSet(ctx, model.InstallationRequestSetParams{MachineID: machine, RequestRaw: request, RequestedBy: by})
	if err != nil {
		return 0, fmt.Errorf("bmdb: requesting installation on machine %s: %w", machine, err)
	}
	err = t.q.HistoryRequested(ctx, model.HistoryRequestedParams{
		MachineID: machine, Process: string(ProcessReinstall),
		Cause: fmt.Sprintf("OS installation generation %d requested by %s", gen, cmp.Or(by, "an unnamed operator")),
	})
	if err != nil {
		return 0, fmt.Errorf("bmdb: recording the installation request of machine %s in history: %w", machine, err)
	}
	return gen, nil
}

// InstallationReport is the agent's report on one installation generation.
type InstallationReport struct {
	Generation int64
	Success    bool
	Error      string // the agent's error message unless Success
	Raw        []byte // the report as the agent sent it (protobuf)
}

// ReportInstallation stores the agent's installation report.
func (t *Tx) ReportInstallation(ctx context.Context, machine uuid.UUID, r InstallationReport) error {
	if r.Generation <= 0 {
		return fmt.Errorf("bmdb: installation report of machine %s: generation must be > 0, got %d", machine, r.Generation)
	}
	err := t.q.InstallationReportSet(ctx, model.InstallationReportSetParams{
		MachineID: machine, Generation: r.Generation, Success: r.Success, ErrorMessage: r.Error, ReportRaw: r.Raw,
	})
	if err != nil {
		return fmt.Errorf("bmdb: storing installation report of machine %s: %w", machine, err)
	}
	return nil
}

// RequestDecommission records that an operator (by) asked for the machine to
// leave the fleet, and why, with a Requested history row. Asking again
// changes nothing.
func (t *Tx) RequestDecommission(ctx context.Context, machine uuid.UUID, by, reason string) error {
	n, err := t.q.DecommissionRequestSet(ctx, model.DecommissionRequestSetParams{MachineID: machine, RequestedBy: by, Reason: reason})
	if err != nil {
		return fmt.Errorf("bmdb: requesting decommission of machine %s: %w", machine, err)
	}
	if n == 0 {
		return nil
	}
	err = t.q.HistoryRequested(ctx, model.HistoryRequestedParams{
		MachineID: machine, Process: string(ProcessDecommission),
		Cause: fmt.Sprintf("decommission requested by %s: %s", by, reason),
	})
	if err != nil {
		return fmt.Errorf("bmdb: recording the decommission request of machine %s in history: %w", machine, err)
	}
	return nil
}

// AgentPhase is where a machine stands with its agent, derived from its tags
// in the database (machine_agent_phase); candidate queries read it.
type AgentPhase string

// Agent phases. They follow the agent's tags only: an installation does not
// end the watch on a machine (an installed machine that falls silent is
// silent), so "installed" is a derived state, not a phase.
const (
	AgentPhaseAwaitingAgent          AgentPhase = "AwaitingAgent"
	AgentPhaseAwaitingFirstHeartbeat AgentPhase = "AwaitingFirstHeartbeat"
	AgentPhaseHeartbeating           AgentPhase = "Heartbeating"
)

// ProvidedMachine is a machine's Provided tag and its derived agent phase.
type ProvidedMachine struct {
	MachineID uuid.UUID
	Provided
	AgentPhase AgentPhase
}

// GetProvided returns the Provided tag of a machine, or ErrNotFound.
func (db *DB) GetProvided(ctx context.Context, machine uuid.UUID) (ProvidedMachine, error) {
	r, err := db.q.MachineProvidedGet(ctx, machine)
	if errors.Is(err, pgx.ErrNoRows) {
		return ProvidedMachine{}, ErrNotFound
	} else if err != nil {
		return ProvidedMachine{}, fmt.Errorf("bmdb: reading machine %s: %w", machine, err)
	}
	return providedMachine(r.MachineID, model.ClaimAgentStartCandidateRow{
		Provider:              r.Provider,
		ProviderID:            r.ProviderID,
		ProviderReservationID: r.ProviderReservationID,
		ProviderIPAddress:     r.ProviderIPAddress,
		ProviderLocation:      r.ProviderLocation,
		ProviderStatus:        r.ProviderStatus,
		ProviderStatusAt:      r.ProviderStatusAt,
		AgentPhase:            r.AgentPhase,
	}), nil
}

// providedMachine converts the Provided columns a query returned; claims
// return the same columns, so that a worker needs no second read.
func providedMachine(id uuid.UUID, r model.ClaimAgentStartCandidateRow) ProvidedMachine {
	pm := ProvidedMachine{
		MachineID: id,
		Provided: Provided{
			Provider:      r.Provider,
			ProviderID:    r.ProviderID,
			ReservationID: r.ProviderReservationID,
			Location:      r.ProviderLocation,
			Status:        ProviderStatus(r.ProviderStatus),
		},
		AgentPhase: AgentPhase(r.AgentPhase),
	}
	if r.ProviderIPAddress != nil {
		pm.Address = *r.ProviderIPAddress
	}
	if r.ProviderStatusAt != nil {
		pm.StatusAt = *r.ProviderStatusAt
	}
	return pm
}
