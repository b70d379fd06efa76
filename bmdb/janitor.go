package bmdb

import (
	"cmp"
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/bmdb/model"
)

// FleetStateCount is the number of provided machines of one provider and
// location in one derived state.
type FleetStateCount struct {
	Provider, Location string
	State              MachineState
	Machines           int64
	// SilentAgents counts those of Machines whose agent is silent by the
	// recoverer's definition (MachineDetail.AgentSilent): the machines the
	// recovery circuit breaker counts as silent, by the state they are in.
	SilentAgents int64
}

// BackoffCount is the number of machines backed off (Quarantined false:
// in an active backoff) or quarantined for one process.
type BackoffCount struct {
	Process     Process
	Quarantined bool
	Machines    int64
}

// HardwareTotals totals the hardware reports of one provider's machines in
// one location.
type HardwareTotals struct {
	Provider, Location string
	// Machines counts the machines with a hardware report.
	Machines int64
	// MemoryBytes and CPUThreads are sums over those machines' reports.
	MemoryBytes, CPUThreads float64
}

// FleetSnapshot is the fleet as the janitor's gauges show it (SPEC §3.6),
// read in one consistent snapshot of the database. Only non-zero counts
// are listed.
type FleetSnapshot struct {
	// States counts provided machines per provider, location and derived
	// state. Decommissioned machines are not among them.
	States []FleetStateCount
	// LiveWork counts work held by live sessions, per process.
	LiveWork map[Process]int64
	// Backoffs counts active backoffs and quarantines per process.
	Backoffs []BackoffCount
	// Hardware totals hardware reports per provider and location.
	Hardware []HardwareTotals
	// Decommissioned counts decommissioned machines per provider.
	Decommissioned map[string]int64
}

// FleetSnapshot reads the fleet gauges in one read-only, repeatable-read
// transaction, so that they describe one moment: with a few set-based
// queries whatever the fleet size. Silent machines are judged by the
// recovery timeouts (zero: the defaults), as in FleetStates.
func (db *DB) FleetSnapshot(ctx context.Context, firstHeartbeatTimeout, heartbeatTimeout time.Duration) (FleetSnapshot, error) {
	params := model.FleetMachineStatesParams{
		FirstHeartbeatTimeoutMs: cmp.Or(firstHeartbeatTimeout, DefaultFirstHeartbeatTimeout).Milliseconds(),
		HeartbeatTimeoutMs:      cmp.Or(heartbeatTimeout, DefaultHeartbeatTimeout).Milliseconds(),
	}
	var snap FleetSnapshot
	err := db.retry(ctx, func(ctx context.Context) error {
		snap = FleetSnapshot{LiveWork: map[Process]int64{}, Decommissioned: map[string]int64{}}
		tx, err := db.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
		if err != nil {
			return fmt.Errorf("beginning transaction: %w", err)
		}
		defer func() {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			_ = tx.Rollback(rctx)
		}()
		q := db.q.WithTx(tx)
		states, err := q.FleetMachineStates(ctx, params)
		if err != nil {
			return fmt.Errorf("counting machine states: %w", err)
		}
		for _, r := range states {
			snap.States = append(snap.States, FleetStateCount{
				Provider: r.Provider, Location: r.Location, State: MachineState(r.State), Machines: r.Machines,
				SilentAgents: r.SilentAgents})
		}
		hw, err := q.FleetHardware(ctx)
		if err != nil {
			return fmt.Errorf("totalling hardware reports: %w", err)
		}
		for _, r := range hw {
			snap.Hardware = append(snap.Hardware, HardwareTotals{Provider: r.Provider, Location: r.Location,
				Machines: r.Machines, MemoryBytes: r.MemoryBytes, CPUThreads: r.CpuThreads})
		}
		work, err := q.FleetLiveWork(ctx)
		if err != nil {
			return fmt.Errorf("counting live work: %w", err)
		}
		for _, r := range work {
			snap.LiveWork[Process(r.Process)] = r.Work
		}
		backoffs, err := q.FleetBackoffs(ctx)
		if err != nil {
			return fmt.Errorf("counting backoffs: %w", err)
		}
		for _, r := range backoffs {
			snap.Backoffs = append(snap.Backoffs, BackoffCount{Process: Process(r.Process), Quarantined: r.Quarantined, Machines: r.Backoffs})
		}
		dec, err := q.FleetDecommissioned(ctx)
		if err != nil {
			return fmt.Errorf("counting decommissioned machines: %w", err)
		}
		for _, r := range dec {
			snap.Decommissioned[r.Provider] = r.Machines
		}
		// Read-only: committing only ends the transaction.
		if err := tx.Commit(ctx); err != nil {
			return fmt.Errorf("committing: %w", err)
		}
		return nil
	})
	if err != nil {
		return FleetSnapshot{}, fmt.Errorf("bmdb: reading the fleet gauges: %w", err)
	}
	return snap, nil
}

// SweepDecommissioned deletes tags (and backoffs) of machines decommissioned
// within window and returns how many rows it deleted. A heartbeat batch that
// authenticated an agent just before its machine was decommissioned may
// still write the heartbeat after the decommission; the janitor calls this
// to remove such strays, so a decommissioned machine keeps no live tag.
func (db *DB) SweepDecommissioned(ctx context.Context, window time.Duration) (int64, error) {
	if window <= 0 {
		return 0, fmt.Errorf("bmdb: sweep window must be > 0, got %s", window)
	}
	var n int64
	err := db.retry(ctx, func(ctx context.Context) error {
		var err error
		n, err = db.q.DecommissionedTagsSweep(ctx, window.Milliseconds())
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("bmdb: sweeping tags of decommissioned machines: %w", err)
	}
	return n, nil
}

// ReleaseRecoveredHolds deletes the ended Recovery backoffs of machines
// that heartbeat again on their own (history Reset says so) and returns how
// many it deleted. A machine's ended hold keeps it in the index range every
// recovery claim reads until then; quarantines stay.
func (db *DB) ReleaseRecoveredHolds(ctx context.Context) (int64, error) {
	var n int64
	err := db.retry(ctx, func(ctx context.Context) error {
		var err error
		n, err = db.q.RecoveryHoldsRelease(ctx)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("bmdb: releasing recovery backoffs of machines that heartbeat again: %w", err)
	}
	return n, nil
}
