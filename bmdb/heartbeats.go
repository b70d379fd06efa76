package bmdb

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/bmdb/model"
)

// Heartbeat is one agent's heartbeat as the callback server received it,
// with the public key of the client certificate it came with.
type Heartbeat struct {
	MachineID uuid.UUID
	AgentKey  ed25519.PublicKey
	// Hardware and Installation are set when the agent sent those reports.
	Hardware     *HardwareReport
	Installation *InstallationReport
}

// HardwareReport is a hardware report as stored: the agent's protobuf and
// the few values queries need.
type HardwareReport struct {
	Raw         []byte
	CPUThreads  int32
	MemoryBytes int64
	DiskCount   int32
	DiskBytes   int64
	ReportedAt  time.Time // set when read back; ignored when recording
}

// HeartbeatResult says what became of one heartbeat.
type HeartbeatResult struct {
	// Accepted means the key is the machine's current agent key, and the
	// heartbeat and its reports were recorded. A heartbeat for an unknown
	// machine is simply not accepted, like one with a wrong key.
	Accepted bool
	// Pending is the installation the agent should carry out, if any.
	Pending *PendingInstallation
}

// PendingInstallation is an installation request the agent has not reported on.
type PendingInstallation struct {
	Generation int64
	Request    []byte // the request as stored (protobuf)
}

// RecordHeartbeats records a batch of heartbeats in one transaction and
// returns one result per heartbeat, in order. Authentication happens inside
// the statements that write: a heartbeat (and its reports) counts only if
// AgentKey is the key the machine's agent answered the takeover with.
// Duplicates in a batch are recorded once; reports of a duplicate come from
// the last one.
func (db *DB) RecordHeartbeats(ctx context.Context, hbs []Heartbeat) ([]HeartbeatResult, error) {
	type pair struct {
		machine uuid.UUID
		key     string
	}
	index := make(map[pair]int32, len(hbs)) // pair -> ordinal in the batch arrays
	slot := make([]int32, len(hbs))         // heartbeat -> ordinal
	var (
		hb  model.HeartbeatBatchParams
		ord []int32
		hw  = map[int32]*HardwareReport{}
		ins = map[int32]*InstallationReport{}
	)
	for i, h := range hbs {
		p := pair{h.MachineID, string(h.AgentKey)}
		o, ok := index[p]
		if !ok {
			o = int32(len(ord))
			index[p] = o
			ord = append(ord, o)
			hb.MachineIds = append(hb.MachineIds, h.MachineID)
			hb.PublicKeys = append(hb.PublicKeys, h.AgentKey)
		}
		slot[i] = o
		if h.Hardware != nil {
			hw[o] = h.Hardware
		}
		if h.Installation != nil {
			ins[o] = h.Installation
		}
	}
	hb.Ordinals = ord

	var rows []model.HeartbeatBatchRow
	record := func(ctx context.Context, q *model.Queries) error {
		if len(hw) > 0 {
			var p model.HardwareReportBatchParams
			for o, r := range hw {
				p.MachineIds = append(p.MachineIds, hb.MachineIds[o])
				p.PublicKeys = append(p.PublicKeys, hb.PublicKeys[o])
				p.Raws = append(p.Raws, r.Raw)
				p.CpuThreads = append(p.CpuThreads, r.CPUThreads)
				p.MemoryBytes = append(p.MemoryBytes, r.MemoryBytes)
				p.DiskCounts = append(p.DiskCounts, r.DiskCount)
				p.DiskBytes = append(p.DiskBytes, r.DiskBytes)
			}
			if _, err := q.HardwareReportBatch(ctx, p); err != nil {
				return fmt.Errorf("storing hardware reports: %w", err)
			}
		}
		if len(ins) > 0 {
			var p model.InstallationReportBatchParams
			for o, r := range ins {
				p.MachineIds = append(p.MachineIds, hb.MachineIds[o])
				p.PublicKeys = append(p.PublicKeys, hb.PublicKeys[o])
				p.Generations = append(p.Generations, r.Generation)
				p.Successes = append(p.Successes, r.Success)
				p.ErrorMessages = append(p.ErrorMessages, r.Error)
				p.Raws = append(p.Raws, r.Raw)
			}
			if _, err := q.InstallationReportBatch(ctx, p); err != nil {
				return fmt.Errorf("storing installation reports: %w", err)
			}
		}
		var err error
		rows, err = q.HeartbeatBatch(ctx, hb)
		if err != nil {
			return fmt.Errorf("recording heartbeats: %w", err)
		}
		return nil
	}
	var err error
	if len(hw) == 0 && len(ins) == 0 {
		// The common case is one statement: no BEGIN and COMMIT round trips.
		err = db.retry(ctx, func(ctx context.Context) error { return record(ctx, db.q) })
	} else {
		err = db.transact(ctx, record)
	}
	if err != nil {
		return nil, fmt.Errorf("bmdb: %w", err)
	}
	byOrdinal := make([]*HeartbeatResult, len(ord))
	for _, r := range rows {
		if r.Ordinal < 0 || int(r.Ordinal) >= len(ord) {
			return nil, fmt.Errorf("bmdb: recording heartbeats: database returned ordinal %d of %d", r.Ordinal, len(ord))
		}
		res := &HeartbeatResult{Accepted: true}
		if r.PendingGeneration != nil {
			res.Pending = &PendingInstallation{Generation: *r.PendingGeneration, Request: r.PendingRequest}
		}
		byOrdinal[r.Ordinal] = res
	}
	out := make([]HeartbeatResult, len(hbs))
	for i, o := range slot {
		if r := byOrdinal[o]; r != nil {
			out[i] = *r
		}
	}
	return out, nil
}

// Installation is the installation request and report of a machine.
type Installation struct {
	// RequestGeneration is 0 if nothing was ever requested.
	RequestGeneration int64
	Request           []byte
	RequestedAt       time.Time
	// Report is nil until the agent reported on some generation.
	Report     *InstallationReport
	ReportedAt time.Time
}

// Installed reports whether the current request has a successful report of
// its generation, the one definition of "installed" (SPEC §2.6).
func (i Installation) Installed() bool {
	return i.RequestGeneration > 0 && i.Report != nil && i.Report.Generation == i.RequestGeneration && i.Report.Success
}

// GetInstallation returns the installation state of a machine, or
// ErrNotFound if the machine does not exist.
func (db *DB) GetInstallation(ctx context.Context, machine uuid.UUID) (Installation, error) {
	r, err := db.q.InstallationGet(ctx, machine)
	if errors.Is(err, pgx.ErrNoRows) {
		return Installation{}, ErrNotFound
	} else if err != nil {
		return Installation{}, fmt.Errorf("bmdb: reading installation of machine %s: %w", machine, err)
	}
	var in Installation
	if r.RequestGeneration != nil {
		in.RequestGeneration, in.Request = *r.RequestGeneration, r.RequestRaw
		if r.RequestedAt != nil {
			in.RequestedAt = *r.RequestedAt
		}
	}
	if r.ReportGeneration != nil {
		in.Report = &InstallationReport{Generation: *r.ReportGeneration, Raw: r.ReportRaw}
		if r.ReportSuccess != nil {
			in.Report.Success = *r.ReportSuccess
		}
		if r.ReportError != nil {
			in.Report.Error = *r.ReportError
		}
		if r.ReportedAt != nil {
			in.ReportedAt = *r.ReportedAt
		}
	}
	return in, nil
}

// GetHardwareReport returns the last hardware report of a machine, or
// ErrNotFound if its agent never sent one.
func (db *DB) GetHardwareReport(ctx context.Context, machine uuid.UUID) (HardwareReport, error) {
	r, err := db.q.HardwareReportGet(ctx, machine)
	if errors.Is(err, pgx.ErrNoRows) {
		return HardwareReport{}, ErrNotFound
	} else if err != nil {
		return HardwareReport{}, fmt.Errorf("bmdb: reading hardware report of machine %s: %w", machine, err)
	}
	return HardwareReport{
		Raw: r.HardwareReportRaw, ReportedAt: r.ReportedAt,
		CPUThreads: r.CpuThreads, MemoryBytes: r.MemoryBytes, DiskCount: r.DiskCount, DiskBytes: r.DiskBytes,
	}, nil
}

// GetAgentHeartbeat returns when the machine's agent last sent a heartbeat
// (database time), or ErrNotFound if it never did since its last start.
func (db *DB) GetAgentHeartbeat(ctx context.Context, machine uuid.UUID) (time.Time, error) {
	at, err := db.q.AgentHeartbeatGet(ctx, machine)
	if errors.Is(err, pgx.ErrNoRows) {
		return time.Time{}, ErrNotFound
	} else if err != nil {
		return time.Time{}, fmt.Errorf("bmdb: reading heartbeat of machine %s: %w", machine, err)
	}
	return at, nil
}

// GetAgentStarted returns when the machine's agent was started and its key,
// or ErrNotFound if it has no AgentStarted tag.
func (db *DB) GetAgentStarted(ctx context.Context, machine uuid.UUID) (time.Time, ed25519.PublicKey, error) {
	r, err := db.q.AgentStartedGet(ctx, machine)
	if errors.Is(err, pgx.ErrNoRows) {
		return time.Time{}, nil, ErrNotFound
	} else if err != nil {
		return time.Time{}, nil, fmt.Errorf("bmdb: reading AgentStarted of machine %s: %w", machine, err)
	}
	return r.AgentStartedAt, ed25519.PublicKey(r.AgentPublicKey), nil
}

// RequestInstallation stores an OS installation request (protobuf bytes)
// for a provided machine under its next generation, which it returns; the
// agent receives it with its next heartbeat. It returns ErrNotFound if the
// machine does not exist or is not provided. Operators make requests outside
// any session.
func (db *DB) RequestInstallation(ctx context.Context, machine uuid.UUID, request []byte) (int64, error) {
	var gen int64
	err := db.transact(ctx, func(ctx context.Context, q *model.Queries) error {
		if _, err := q.MachineProvidedGet(ctx, machine); errors.Is(err, pgx.ErrNoRows) {
			return ErrNotFound
		} else if err != nil {
			return err
		}
		var err error
		gen, err = (&Tx{q: q}).RequestInstallation(ctx, machine, request)
		return err
	})
	if errors.Is(err, ErrNotFound) {
		return 0, fmt.Errorf("bmdb: requesting installation on machine %s: %w", machine, ErrNotFound)
	} else if err != nil {
		return 0, err
	}
	return gen, nil
}
