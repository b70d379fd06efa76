package bmdb_test

import (
	"context"
	"slices"
	"sort"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// statesByProvider sums a snapshot's state counts over locations.
func statesByProvider(snap bmdb.FleetSnapshot) map[string]map[bmdb.MachineState]int64 {
	out := map[string]map[bmdb.MachineState]int64{}
	for _, s := range snap.States {
		if out[s.Provider] == nil {
			out[s.Provider] = map[bmdb.MachineState]int64{}
		}
		out[s.Provider][s.State] += s.Machines
	}
	return out
}

// TestFleetSnapshotMatchesFleetStates builds a fleet with a machine in every
// derived state and checks that the janitor's set-based snapshot tells the
// same as FleetStates, provider by provider, for default and short
// timeouts; and that its other gauges count what the tables hold.
func TestFleetSnapshotMatchesFleetStates(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	f := fixture{t: t, db: db, s: bmdbtest.Session(t, db, "test", time.Minute)}
	const hour, min = time.Hour, time.Minute
	add := func(location string, setup func(id uuid.UUID)) uuid.UUID {
		id := bmdbtest.AddMachine(t, db, f.s, "p")
		db.Exec(t, "UPDATE machine_provided SET provider_location = $2 WHERE machine_id = $1", id, location)
		if setup != nil {
			setup(id)
		}
		return id
	}
	healthy := func(id uuid.UUID) { f.started(id, hour); f.heartbeat(id, 0) }
	add("rack-1", nil) // Provided
	add("rack-1", f.requestDecommission)
	add("rack-1", func(id uuid.UUID) { f.status(id, bmdb.ProviderStatusMissing) })
	add("rack-1", func(id uuid.UUID) { f.backoff(id, bmdb.ProcessAgentStart, -min, true) })
	add("rack-1", func(id uuid.UUID) { f.work(id, bmdb.ProcessAgentStart, false) })
	add("rack-1", func(id uuid.UUID) { f.work(id, bmdb.ProcessAgentStart, true) }) // dead work: Provided
	add("rack-2", func(id uuid.UUID) {
		f.started(id, hour)
		f.heartbeat(id, hour)
		f.work(id, bmdb.ProcessRecovery, false)
	})
	add("rack-2", func(id uuid.UUID) { healthy(id); f.install(id, 1, 1, true) })
	add("rack-2", func(id uuid.UUID) { healthy(id); f.install(id, 1, 1, false) })
	add("rack-2", func(id uuid.UUID) { healthy(id); f.install(id, 2, 1, true) }) // Installing
	add("rack-2", func(id uuid.UUID) { healthy(id); f.backoff(id, bmdb.ProcessRecovery, hour, false) })
	add("rack-3", func(id uuid.UUID) { f.started(id, min) })                           // AwaitingFirstHeartbeat
	add("rack-3", func(id uuid.UUID) { f.started(id, hour) })                          // Silent: no first heartbeat
	add("rack-3", func(id uuid.UUID) { f.started(id, hour); f.heartbeat(id, 20*min) }) // Silent: heartbeat too old
	add("rack-3", healthy)
	add("rack-3", healthy)
	gone := add("rack-3", healthy)
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error {
		_, err := tx.Decommission(ctx, gone, true)
		return err
	})
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "q", Healthy: 20, Stale: 3, Installed: 4, AwaitingAgent: 5, NeverHeartbeat: 2})
	db.Exec(t, "UPDATE machine_provided SET provider_location = 'fr/fr2' WHERE provider = 'q'")
	db.Exec(t, `INSERT INTO machine_hardware_report (machine_id, hardware_report_raw, cpu_threads, memory_bytes)
		SELECT machine_id, '\x00', 16, 64::bigint << 30 FROM machine_agent_heartbeat`)

	// Every state but Decommissioned is represented in p.
	want, err := db.FleetStates(t.Context(), "p", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, st := range []bmdb.MachineState{bmdb.StateProvided, bmdb.StateAgentStarting, bmdb.StateAwaitingFirstHeartbeat,
		bmdb.StateHealthy, bmdb.StateSilent, bmdb.StateRecovering, bmdb.StateInstalling, bmdb.StateInstalled,
		bmdb.StateInstallFailed, bmdb.StateBackedOff, bmdb.StateQuarantined, bmdb.StateMissing, bmdb.StateDecommissioning} {
		if want[st] == 0 {
			t.Errorf("the fleet has no %s machine: the comparison would not cover it (%v)", st, want)
		}
	}

	for _, timeouts := range [][2]time.Duration{{0, 0}, {5 * min, 30 * min}} {
		snap, err := db.FleetSnapshot(t.Context(), timeouts[0], timeouts[1])
		if err != nil {
			t.Fatal(err)
		}
		got := statesByProvider(snap)
		for _, p := range []string{"p", "q"} {
			want, err := db.FleetStates(t.Context(), p, timeouts[0], timeouts[1])
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(want, got[p]); diff != "" {
				t.Errorf("timeouts %v, provider %s: snapshot states differ from FleetStates (-FleetStates +snapshot):\n%s", timeouts, p, diff)
			}
		}
		if len(got) != 2 {
			t.Errorf("snapshot has providers %v, want p and q", got)
		}
		// The silent agents are what the circuit breaker counts: the
		// recovery candidates by their tags, whatever state they are in.
		for _, p := range []string{"p", "q"} {
			var silent int64
			for _, c := range snap.States {
				if c.Provider == p {
					silent += c.SilentAgents
				}
			}
			want, err := db.CountMatching(t.Context(), bmdb.RecoveryCandidates(p, timeouts[0], timeouts[1]))
			if err != nil {
				t.Fatal(err)
			}
			if silent != want || want == 0 {
				t.Errorf("timeouts %v, provider %s: %d silent agents in the snapshot, %d recovery candidates by tags", timeouts, p, silent, want)
			}
		}
	}

	snap, err := db.FleetSnapshot(t.Context(), 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	var locations []string
	for _, s := range snap.States {
		if s.Provider == "p" && !slices.Contains(locations, s.Location) {
			locations = append(locations, s.Location)
		}
	}
	sort.Strings(locations)
	if !slices.Equal(locations, []string{"rack-1", "rack-2", "rack-3"}) {
		t.Errorf("locations of p in the snapshot: %v", locations)
	}
	wantWork := map[bmdb.Process]int64{bmdb.ProcessAgentStart: 1, bmdb.ProcessRecovery: 1}
	if diff := cmp.Diff(wantWork, snap.LiveWork); diff != "" {
		t.Errorf("live work (-want +got):\n%s", diff)
	}
	wantBackoffs := []bmdb.BackoffCount{
		{Process: bmdb.ProcessAgentStart, Quarantined: true, Machines: 1},
		{Process: bmdb.ProcessRecovery, Quarantined: false, Machines: 1},
	}
	if diff := cmp.Diff(wantBackoffs, snap.Backoffs); diff != "" {
		t.Errorf("backoffs (-want +got):\n%s", diff)
	}
	// Hardware: every heartbeating machine but the decommissioned one
	// reported 16 threads and 64 GiB.
	var hw = map[string]bmdb.HardwareTotals{}
	for _, h := range snap.Hardware {
		hw[h.Provider+" "+h.Location] = h
	}
	reported := bmdbtest.Scalar[int64](t, db, `SELECT count(*) FROM machine_hardware_report r JOIN machine_provided p USING (machine_id) WHERE p.provider = 'q'`)
	if h := hw["q fr/fr2"]; h.Machines != reported || h.CPUThreads != float64(16*reported) || h.MemoryBytes != float64(reported*64<<30) {
		t.Errorf("hardware of q: %+v, want %d machines with 16 threads and 64 GiB each", h, reported)
	}
	if h := hw["p rack-3"]; h.Machines != 3 {
		t.Errorf("hardware of p in rack-3: %+v, want its 3 heartbeating machines (the decommissioned one is not counted)", h)
	}
	if diff := cmp.Diff(map[string]int64{"p": 1}, snap.Decommissioned); diff != "" {
		t.Errorf("decommissioned (-want +got):\n%s", diff)
	}
}

// TestFleetSnapshotAtScale reads the fleet gauges of a fleet of 100,000
// machines in 100 racks and checks them against what the tables hold. How
// long the read takes (SPEC §3.6: the janitor runs every 30 s in every
// process that runs it) is for `make bench` to measure, not for a test on a
// shared machine to assert.
func TestFleetSnapshotAtScale(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "p", Healthy: 94_000, Stale: 2000, Installed: 1000, AwaitingAgent: 2000, NeverHeartbeat: 1000})
	db.Exec(t, "UPDATE machine_provided SET provider_location = 'rack-' || (get_byte(decode(md5(machine_id::text), 'hex'), 0) % 100)")
	db.Exec(t, `INSERT INTO machine_hardware_report (machine_id, hardware_report_raw, cpu_threads, memory_bytes)
		SELECT machine_id, '\x00', 64, 256::bigint << 30 FROM machine_agent_heartbeat`)
	holder := bmdbtest.Session(t, db, "holder", time.Minute)
	db.Exec(t, `INSERT INTO work (machine_id, process, machine_exclusive, session_id)
		SELECT machine_id, 'AgentStart', true, $1 FROM machine_provided WHERE agent_phase = 'AwaitingAgent' LIMIT 500`, holder.ID())
	db.Exec(t, `INSERT INTO work_backoff (machine_id, process, backoff_until, cause, last_interval_ms, attempts, quarantined_at)
		SELECT machine_id, 'Recovery', now() + (CASE WHEN random() < 0.1 THEN interval '1 hour' ELSE interval '-1 hour' END),
		       'old', 60000, 1, CASE WHEN random() < 0.01 THEN now() END
		FROM machine_provided ORDER BY md5(machine_id::text) LIMIT 20000`)
	db.Exec(t, `INSERT INTO machine_decommission_request (machine_id)
		SELECT machine_id FROM machine_provided ORDER BY md5(machine_id::text) DESC LIMIT 200`)
	db.Exec(t, "VACUUM ANALYZE")

	snap, err := db.FleetSnapshot(t.Context(), 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	var total, hwMachines int64
	var threads, memory float64
	for _, s := range snap.States {
		total += s.Machines
	}
	for _, h := range snap.Hardware {
		hwMachines += h.Machines
		threads += h.CPUThreads
		memory += h.MemoryBytes
	}
	if total != 100_000 || hwMachines != 97_000 || len(snap.Hardware) != 100 {
		t.Errorf("snapshot counts %d machines, %d with hardware in %d locations; want 100,000, 97,000 and 100", total, hwMachines, len(snap.Hardware))
	}
	if threads != 64*97_000 || memory != 97_000*float64(256<<30) {
		t.Errorf("snapshot totals %v threads and %v bytes of memory, want 64 and 256 GiB for each of 97,000 machines", threads, memory)
	}
	// The set-based snapshot tells the same as FleetStates.
	states, err := db.FleetStates(t.Context(), "p", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(map[string]map[bmdb.MachineState]int64{"p": states}, statesByProvider(snap)); diff != "" {
		t.Errorf("snapshot states differ from FleetStates (-FleetStates +snapshot):\n%s", diff)
	}
	if diff := cmp.Diff(map[bmdb.Process]int64{bmdb.ProcessAgentStart: 500}, snap.LiveWork); diff != "" {
		t.Errorf("live work (-want +got):\n%s", diff)
	}
	var active, quarantined int64
	if err := db.Pool.QueryRow(t.Context(), `SELECT count(*) FILTER (WHERE quarantined_at IS NULL AND backoff_until > now()),
		count(*) FILTER (WHERE quarantined_at IS NOT NULL) FROM work_backoff`).Scan(&active, &quarantined); err != nil {
		t.Fatal(err)
	}
	wantBackoffs := []bmdb.BackoffCount{
		{Process: bmdb.ProcessRecovery, Quarantined: false, Machines: active},
		{Process: bmdb.ProcessRecovery, Quarantined: true, Machines: quarantined},
	}
	if diff := cmp.Diff(wantBackoffs, snap.Backoffs); diff != "" {
		t.Errorf("backoffs (-want +got):\n%s", diff)
	}
	if len(snap.Decommissioned) != 0 {
		t.Errorf("decommissioned %v, want none (200 requests, none carried out)", snap.Decommissioned)
	}
}
