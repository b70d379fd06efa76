package manager_test

import (
	"context"
	"errors"
	"log/slog"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/logtest"
	"github.com/shepherd/shepherd/internal/metricstest"
	"github.com/shepherd/shepherd/internal/tcpproxy"
	"github.com/shepherd/shepherd/manager"
)

// TestJanitorExpiresAndDeletes: a pass expires the work of a dead session
// (history Expired, naming it) and deletes sessions that ended before the
// retention period, and only those.
func TestJanitorExpiresAndDeletes(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	setup := bmdbtest.Session(t, db, "setup", time.Minute)
	id := bmdbtest.AddMachine(t, db, setup, "lab")

	// A process claims the machine and crashes: its session's deadline
	// passes with the work still held.
	// (Its next renewal, a third of the lease later, finds it expired.)
	crashed := bmdbtest.Session(t, db, "initializer", time.Minute)
	if _, err := crashed.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("lab")); err != nil {
		t.Fatal(err)
	}
	db.Exec(t, "UPDATE sessions SET deadline = now() - interval '1 second' WHERE session_id = $1", crashed.ID())
	// Sessions that ended long ago, and one that ended recently.
	old := bmdbtest.Session(t, db, "old", time.Minute)
	if err := old.Close(t.Context()); err != nil {
		t.Fatal(err)
	}
	db.Exec(t, "UPDATE sessions SET closed_at = now() - interval '8 days' WHERE session_id = $1", old.ID())
	oldExpired := bmdbtest.Session(t, db, "old-expired", time.Minute)
	db.Exec(t, "UPDATE sessions SET deadline = now() - interval '8 days' WHERE session_id = $1", oldExpired.ID())
	recent := bmdbtest.Session(t, db, "recent", time.Minute)
	if err := recent.Close(t.Context()); err != nil {
		t.Fatal(err)
	}

	j, err := manager.NewJanitor(manager.JanitorConfig{}, db.DB, prometheus.NewRegistry(), nil)
	if err != nil {
		t.Fatal(err)
	}
	res, err := j.Pass(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if res.Expired != 1 || res.SessionsDeleted != 2 {
		t.Errorf("Pass() = %+v, want 1 work item expired and the 2 old sessions deleted", res)
	}
	h := events(t, db, id)
	last := h[len(h)-1]
	if last.Event != bmdb.EventExpired || last.Process != bmdb.ProcessAgentStart || last.SessionID == nil ||
		*last.SessionID != crashed.ID() || !strings.Contains(last.Cause, crashed.ID().String()) {
		t.Errorf("last history row %+v, want Expired naming session %s", last, crashed.ID())
	}
	var left []string
	rows, err := db.Pool.Query(t.Context(), "SELECT component FROM sessions ORDER BY component")
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var c string
		if err := rows.Scan(&c); err != nil {
			t.Fatal(err)
		}
		left = append(left, c)
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	// The crashed session ended a second ago: it is kept for the retention
	// period like the recently closed one.
	if want := []string{"initializer", "recent", "setup"}; !cmp.Equal(left, want) {
		t.Errorf("sessions left %v, want %v", left, want)
	}
	// The machine is free again.
	if n, err := db.CountCandidates(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("lab")); err != nil || n != 1 {
		t.Errorf("agent start candidates after the pass: %d, %v; want the machine", n, err)
	}
	// Nothing left to do: a second pass changes nothing.
	if res, err := j.Pass(t.Context()); err != nil || res.Expired != 0 || res.SessionsDeleted != 0 {
		t.Errorf("second Pass() = %+v, %v; want nothing done", res, err)
	}
}

// gauges returns the series of the fleet gauge name in reg, by their
// labels (name=value, sorted, comma-separated).
func gauges(t *testing.T, reg *prometheus.Registry, name string) map[string]float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			out[labelString(m)] = m.GetGauge().GetValue()
		}
	}
	return out
}

func labelString(m *dto.Metric) string {
	var ls []string
	for _, l := range m.GetLabel() {
		ls = append(ls, l.GetName()+"="+l.GetValue())
	}
	sort.Strings(ls)
	return strings.Join(ls, ",")
}

// TestJanitorGauges: the fleet gauges match FleetStates for a built fleet,
// and series of states, locations and providers that emptied are gone
// after the next pass, not left at their last value.
func TestJanitorGauges(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "p", Healthy: 30, Stale: 5, Installed: 3, AwaitingAgent: 4, NeverHeartbeat: 2})
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "q", AwaitingAgent: 6})
	db.Exec(t, "UPDATE machine_provided SET provider_location = CASE WHEN agent_phase = 'AwaitingAgent' THEN 'rack-a' ELSE 'rack-b' END")
	db.Exec(t, `INSERT INTO machine_hardware_report (machine_id, hardware_report_raw, cpu_threads, memory_bytes)
		SELECT machine_id, '\x00', 32, 128::bigint << 30 FROM machine_agent_heartbeat`)
	holder := bmdbtest.Session(t, db, "holder", time.Minute)
	db.Exec(t, `INSERT INTO work (machine_id, process, machine_exclusive, session_id)
		SELECT machine_id, 'AgentStart', true, $1 FROM machine_provided WHERE provider = 'q' LIMIT 2`, holder.ID())
	db.Exec(t, `INSERT INTO work_backoff (machine_id, process, backoff_until, cause, last_interval_ms, attempts, quarantined_at)
		SELECT machine_id, 'AgentStart', now() + interval '1 hour', 'test', 60000, 1, NULL FROM machine_provided WHERE provider = 'p' AND agent_phase = 'AwaitingAgent' LIMIT 1`)

	reg := prometheus.NewRegistry()
	j, err := manager.NewJanitor(manager.JanitorConfig{}, db.DB, reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := gauges(t, reg, "shepherd_fleet_machines"); len(got) != 0 {
		t.Errorf("fleet gauges before the first pass: %v, want none", got)
	}
	if _, err := j.Pass(t.Context()); err != nil {
		t.Fatal(err)
	}
	check := func(when string) {
		t.Helper()
		byProvider := map[string]map[bmdb.MachineState]int64{}
		for labels, v := range gauges(t, reg, "shepherd_fleet_machines") {
			l := parseLabels(labels)
			if byProvider[l["provider"]] == nil {
				byProvider[l["provider"]] = map[bmdb.MachineState]int64{}
			}
			byProvider[l["provider"]][bmdb.MachineState(l["state"])] += int64(v)
			if v == 0 {
				t.Errorf("%s: series %s is zero; emptied series must be dropped", when, labels)
			}
		}
		for _, p := range []string{"p", "q"} {
			want, err := db.FleetStates(t.Context(), p, 0, 0)
			if err != nil {
				t.Fatal(err)
			}
			if len(want) == 0 {
				want = nil
			}
			if diff := cmp.Diff(want, byProvider[p]); diff != "" {
				t.Errorf("%s: gauges of %s differ from FleetStates (-FleetStates +gauges):\n%s", when, p, diff)
			}
		}
	}
	check("first pass")
	machines := gauges(t, reg, "shepherd_fleet_machines")
	for labels, want := range map[string]float64{
		"location=rack-b,provider=p,state=Healthy":       30,
		"location=rack-b,provider=p,state=Silent":        7,
		"location=rack-b,provider=p,state=Installed":     3,
		"location=rack-a,provider=p,state=Provided":      3,
		"location=rack-a,provider=p,state=BackedOff":     1,
		"location=rack-a,provider=q,state=AgentStarting": 2,
		"location=rack-a,provider=q,state=Provided":      4,
	} {
		if machines[labels] != want {
			t.Errorf("shepherd_fleet_machines{%s} = %v, want %v (all: %v)", labels, machines[labels], want, machines)
		}
	}
	if got := gauges(t, reg, "shepherd_fleet_live_work"); got["process=AgentStart"] != 2 || got["process=Recovery"] != 0 || len(got) != len(bmdb.Processes()) {
		t.Errorf("shepherd_fleet_live_work = %v, want AgentStart 2 and every process reported", got)
	}
	if got := gauges(t, reg, "shepherd_fleet_backoffs"); got["process=AgentStart,quarantined=false"] != 1 || got["process=AgentStart,quarantined=true"] != 0 {
		t.Errorf("shepherd_fleet_backoffs = %v, want one active AgentStart backoff", got)
	}
	hw := map[string]float64{}
	for _, name := range []string{"shepherd_fleet_hardware_machines", "shepherd_fleet_memory_bytes", "shepherd_fleet_cpu_threads"} {
		for labels, v := range gauges(t, reg, name) {
			hw[name+"{"+labels+"}"] = v
		}
	}
	if diff := cmp.Diff(map[string]float64{
		"shepherd_fleet_hardware_machines{location=rack-b,provider=p}": 38,
		"shepherd_fleet_memory_bytes{location=rack-b,provider=p}":      38 * 128 << 30,
		"shepherd_fleet_cpu_threads{location=rack-b,provider=p}":       38 * 32,
	}, hw); diff != "" {
		t.Errorf("hardware gauges (-want +got):\n%s", diff)
	}

	// Every silent machine heartbeats again, q's machines move to another
	// rack, and the backoff ends: their series must go.
	db.Exec(t, "UPDATE machine_agent_heartbeat SET agent_heartbeat_at = now() WHERE watched")
	db.Exec(t, `INSERT INTO machine_agent_heartbeat (machine_id, agent_heartbeat_at)
		SELECT machine_id, now() FROM machine_provided WHERE agent_phase = 'AwaitingFirstHeartbeat'`)
	db.Exec(t, "UPDATE machine_provided SET provider_location = 'rack-c' WHERE provider = 'q'")
	db.Exec(t, "DELETE FROM work_backoff")
	db.Exec(t, "DELETE FROM machine_hardware_report")
	if _, err := j.Pass(t.Context()); err != nil {
		t.Fatal(err)
	}
	check("second pass")
	machines = gauges(t, reg, "shepherd_fleet_machines")
	for labels := range machines {
		if strings.Contains(labels, "state=Silent") || strings.Contains(labels, "provider=q") && strings.Contains(labels, "rack-a") ||
			strings.Contains(labels, "state=BackedOff") {
			t.Errorf("series %s = %v is still reported after it emptied", labels, machines[labels])
		}
	}
	if machines["location=rack-c,provider=q,state=Provided"] != 4 {
		t.Errorf("q's machines in rack-c: %v", machines)
	}
	if got := gauges(t, reg, "shepherd_fleet_hardware_machines"); len(got) != 0 {
		t.Errorf("hardware series after every report went: %v, want none", got)
	}
	if got := gauges(t, reg, "shepherd_fleet_backoffs"); got["process=AgentStart,quarantined=false"] != 0 {
		t.Errorf("shepherd_fleet_backoffs = %v after the backoff ended, want 0", got)
	}
}

func parseLabels(s string) map[string]string {
	out := map[string]string{}
	for _, kv := range strings.Split(s, ",") {
		k, v, _ := strings.Cut(kv, "=")
		out[k] = v
	}
	return out
}

// TestJanitorRun runs the janitor loop: it holds a session while it runs,
// makes passes until it is stopped, and closes the session.
func TestJanitorRun(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	setup := bmdbtest.Session(t, db, "setup", time.Minute)
	bmdbtest.AddMachine(t, db, setup, "lab")
	reg := prometheus.NewRegistry()
	j, err := manager.NewJanitor(manager.JanitorConfig{Period: 50 * time.Millisecond}, db.DB, reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- j.Run(ctx) }()
	bmdbtest.WaitFor(t, time.Minute, "janitor passes and gauges", func(ctx context.Context) (bool, error) {
		passes := metricstest.Value(t, reg, "shepherd_janitor_passes_total", "result", "ok")
		g := gauges(t, reg, "shepherd_fleet_machines")
		return passes >= 3 && g["location=,provider=lab,state=Provided"] == 1, nil
	})
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM sessions WHERE component = 'janitor' AND closed_at IS NULL"); n != 1 {
		t.Errorf("%d open janitor sessions while it runs, want 1", n)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run() = %v", err)
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM sessions WHERE component = 'janitor' AND closed_at IS NULL"); n != 0 {
		t.Errorf("%d open janitor sessions after it stopped, want 0", n)
	}
}

// TestJanitorLogsAndFailures: a pass that changed something says so at
// Info, with what it did; a pass that changed nothing logs at Debug only. A
// pass whose steps fail runs every step and reports each failure, counts an
// error pass, and keeps the gauges of the last snapshot it read.
func TestJanitorLogsAndFailures(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	setup := bmdbtest.Session(t, db, "setup", time.Minute)
	bmdbtest.AddMachine(t, db, setup, "lab")
	crashed := bmdbtest.Session(t, db, "initializer", time.Minute)
	if _, err := crashed.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("lab")); err != nil {
		t.Fatal(err)
	}
	db.Exec(t, "UPDATE sessions SET deadline = now() - interval '1 second' WHERE session_id = $1", crashed.ID())
	reg := prometheus.NewRegistry()
	logs := logtest.New()
	j, err := manager.NewJanitor(manager.JanitorConfig{}, db.DB, reg, logs.Logger())
	if err != nil {
		t.Fatal(err)
	}
	before := time.Now()
	if _, err := j.Pass(t.Context()); err != nil {
		t.Fatal(err)
	}
	after := time.Now()
	lines := logs.With("janitor pass")
	if len(lines) != 1 || lines[0].Level != slog.LevelInfo || lines[0].Attr("expired_work") != "1" {
		t.Errorf("lines of a pass that expired work: %+v, want one at Info saying so", lines)
	}
	snapshot := func() float64 {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() == "shepherd_fleet_snapshot_timestamp_seconds" {
				return mf.GetMetric()[0].GetGauge().GetValue()
			}
		}
		return -1
	}
	at := snapshot()
	if at < float64(before.UnixNano())/1e9 || at > float64(after.UnixNano())/1e9 {
		t.Errorf("snapshot timestamp %f, want within the pass (%f to %f)", at, float64(before.UnixNano())/1e9, float64(after.UnixNano())/1e9)
	}

	logs.Reset()
	if _, err := j.Pass(t.Context()); err != nil {
		t.Fatal(err)
	}
	if lines := logs.With("janitor pass"); len(lines) != 1 || lines[0].Level != slog.LevelDebug {
		t.Errorf("lines of a pass that changed nothing: %+v, want one at Debug", lines)
	}

	// Every step fails: each failure is reported, none hides another.
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	gaugesBefore := gauges(t, reg, "shepherd_fleet_machines")
	at = snapshot()
	_, err = j.Pass(ctx)
	var joined interface{ Unwrap() []error }
	if err == nil || !strings.HasPrefix(err.Error(), "janitor: ") || !errors.As(err, &joined) || len(joined.Unwrap()) != 6 {
		t.Fatalf("a pass whose every step fails: %v, want the 6 failures joined", err)
	}
	for _, what := range []string{"expiring work", "deleting old sessions", "sweeping tags", "releasing recovery backoffs", "reboot admissions", "fleet"} {
		if !strings.Contains(err.Error(), what) {
			t.Errorf("the failed pass's error does not mention %q: %v", what, err)
		}
	}
	if got := metricstest.Value(t, reg, "shepherd_janitor_passes_total", "result", "error"); got != 1 {
		t.Errorf("error passes %v, want 1", got)
	}
	if got := metricstest.Value(t, reg, "shepherd_janitor_passes_total", "result", "ok"); got != 2 {
		t.Errorf("ok passes %v, want 2", got)
	}
	if got := gauges(t, reg, "shepherd_fleet_machines"); !cmp.Equal(got, gaugesBefore) || snapshot() != at {
		t.Errorf("after a failed pass the fleet gauges are %v at %f, want the last snapshot's %v at %f", got, snapshot(), gaugesBefore, at)
	}
}

// TestJanitorRunThroughOutage: while the database is unreachable, the
// janitor's passes fail and say so, and it goes on passing once the
// database is back; a run without failures logs none.
func TestJanitorRunThroughOutage(t *testing.T) {
	t.Parallel()
	db, proxy := bmdbtest.NewBehindProxy(t, bmdb.Config{})
	reg := prometheus.NewRegistry()
	logs := logtest.New()
	j, err := manager.NewJanitor(manager.JanitorConfig{Period: 20 * time.Millisecond, Lease: 30 * time.Second}, db.DB, reg, logs.Logger())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- j.Run(ctx) }()
	passes := func(result string) float64 {
		return metricstest.Value(t, reg, "shepherd_janitor_passes_total", "result", result)
	}
	bmdbtest.WaitFor(t, 60*time.Second, "two passes", func(context.Context) (bool, error) { return passes("ok") >= 2, nil })
	if got := logs.With("janitor pass failed"); len(got) != 0 {
		t.Errorf("failures logged while the database answered: %+v", got)
	}
	proxy.SetMode(tcpproxy.Reset)
	bmdbtest.WaitFor(t, 60*time.Second, "a failed pass, logged", func(context.Context) (bool, error) {
		return passes("error") >= 1 && len(logs.With("janitor pass failed")) >= 1, nil
	})
	proxy.SetMode(tcpproxy.Pass)
	ok := passes("ok")
	bmdbtest.WaitFor(t, 60*time.Second, "passes once the database is back", func(context.Context) (bool, error) { return passes("ok") > ok, nil })
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run() = %v", err)
	}
	if l := logs.With("janitor pass failed")[0]; l.Level != slog.LevelError || l.Attr("err") == "" {
		t.Errorf("failure line %+v, want an error with the cause", l)
	}
}
