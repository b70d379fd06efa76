package main

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/provider/sim"
)

const (
	p6Machines = 200
	// p6Silenced agents go silent at once: 5 % of the fleet, within the
	// breaker's default budget and silent fraction, so that the figure
	// measures detection, not the breaker.
	p6Silenced         = 10
	p6Interval         = time.Second
	p6HeartbeatTimeout = 5 * time.Second
	p6LoopPeriod       = time.Second
)

// benchSilenceToReboot is P6: how long after an agent's last heartbeat the
// recoverer asks the provider to reboot the machine, for a fleet of
// simulated machines taken over by the real initializer, against the
// limit heartbeat_timeout + 2 × the recoverer's loop period.
func benchSilenceToReboot(ctx context.Context, e *env) error {
	url, err := e.database(ctx, "p6")
	if err != nil {
		return err
	}
	db, err := bmdb.Open(ctx, bmdb.Config{URL: url})
	if err != nil {
		return err
	}
	defer db.Close()
	st, err := startSimStack(ctx, db, sim.Config{Machines: p6Machines, RebootLatency: time.Second}, p6Interval)
	if err != nil {
		return err
	}
	defer st.stop()
	if err := st.runProvisioner(manager.ProvisionerConfig{Period: time.Second, ChunkSize: p6Machines}); err != nil {
		return err
	}
	if err := st.runInitializer(manager.InitializerConfig{Loop: manager.LoopConfig{IdleSleep: 200 * time.Millisecond}}); err != nil {
		return err
	}
	if err := st.runRecoverer(manager.RecovererConfig{
		Loop:             manager.LoopConfig{IdleSleep: p6LoopPeriod},
		HeartbeatTimeout: p6HeartbeatTimeout,
	}); err != nil {
		return err
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if err := waitFor(ctx, 2*time.Minute, "every machine heartbeating", func() (bool, error) {
		n, err := heartbeating(ctx, conn, st.fleet.Name())
		return n == p6Machines, err
	}); err != nil {
		return err
	}

	listing, err := st.fleet.ListMachines(ctx)
	if err != nil {
		return err
	}
	var victims []string
	for i := 0; i < len(listing) && len(victims) < p6Silenced; i += len(listing) / p6Silenced {
		victims = append(victims, listing[i].ID())
	}
	for _, id := range victims {
		if err := st.fleet.Silence(id); err != nil {
			return err
		}
	}
	if err := waitFor(ctx, 2*time.Minute, "every silenced machine rebooted", func() (bool, error) {
		for _, id := range victims {
			if _, n := st.fleet.Rebooted(id); n == 0 {
				return false, nil
			}
		}
		return true, nil
	}); err != nil {
		return err
	}
	var delays []time.Duration
	for _, id := range victims {
		at, _ := st.fleet.Rebooted(id)
		last := st.fleet.LastHeartbeat(id)
		if last.IsZero() || at.Before(last) {
			return fmt.Errorf("machine %s: rebooted at %s, last heartbeat at %s", id, at, last)
		}
		delays = append(delays, at.Sub(last))
	}
	if err := st.stop(); err != nil {
		return err
	}
	slices.Sort(delays)
	limit := p6HeartbeatTimeout + 2*p6LoopPeriod
	worst := delays[len(delays)-1]
	report("P6", "silence_to_reboot_max_s", worst.Seconds(), "p50", delays[len(delays)/2].Seconds(),
		"min", delays[0].Seconds(), "limit", limit.Seconds(), "limit_ratio", worst.Seconds()/limit.Seconds(),
		"heartbeat_timeout_s", p6HeartbeatTimeout.Seconds(), "loop_period_s", p6LoopPeriod.Seconds(),
		"heartbeat_interval_s", p6Interval.Seconds(), "silenced", len(victims), "machines", p6Machines)
	return nil
}
