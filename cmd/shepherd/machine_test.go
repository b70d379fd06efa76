package main

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"encoding/json"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/ladder"
)

// quarantine claims a machine for agent start and fails it once under a
// policy that quarantines at the first failure, as the initializer would
// after many: history Started, Failed, Quarantined.
func quarantine(t *testing.T, db *bmdbtest.DB, s *bmdb.Session, provider string) uuid.UUID {
	t.Helper()
	w, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates(provider))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Fail(t.Context(), bmdb.BackoffPolicy{Initial: time.Hour, MaxAttempts: 1}, "ssh: connection refused"); err != nil {
		t.Fatal(err)
	}
	return w.MachineID
}

// runWithInput is run with in as the command's standard input, so that a
// confirmation prompt reads the answer from it.
func runWithInput(t *testing.T, in string, args ...string) (string, error) {
	t.Helper()
	cmd := newRootCommand()
	var out bytes.Buffer
	cmd.SetIn(strings.NewReader(in))
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(args)
	err := cmd.ExecuteContext(t.Context())
	return out.String(), err
}

func historyCount(t *testing.T, db *bmdbtest.DB) int64 {
	t.Helper()
	return bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work_history")
}

func TestMachineListJSON(t *testing.T) {
	db := bmdbtest.New(t)
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "p", Healthy: 20, Stale: 6, AwaitingAgent: 3, NeverHeartbeat: 2, Installed: 2})
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "q", Healthy: 2, Stale: 1})
	db.Exec(t, "UPDATE machine_provided SET provider_ip_address = '10.9.0.1', provider_location = 'fra' WHERE provider = 'q'")

	// The silent machines, straight from the tags: agents whose last
	// heartbeat is older than the heartbeat timeout, or which never sent one.
	rows, err := db.Pool.Query(t.Context(), `
		SELECT machine_id FROM machine_agent_heartbeat
		WHERE watched AND agent_heartbeat_at < now() - interval '10 minutes'
		UNION
		SELECT machine_id FROM machine_provided WHERE agent_phase = 'AwaitingFirstHeartbeat'
		ORDER BY machine_id`)
	if err != nil {
		t.Fatal(err)
	}
	var silent []string
	for rows.Next() {
		var id uuid.UUID
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		silent = append(silent, id.String())
	}
	if rows.Err() != nil || len(silent) != 9 {
		t.Fatalf("the fleets have %d silent machines (%v), want 9", len(silent), rows.Err())
	}

	out, err := run(t, "machine", "list", "--state", "Silent", "--output", "json", "--database-url", db.URL)
	if err != nil {
		t.Fatalf("machine list: %v\n%s", err, out)
	}
	var listed []map[string]any
	if err := json.Unmarshal([]byte(out), &listed); err != nil {
		t.Fatalf("machine list --output json is not a JSON array: %v\n%s", err, out)
	}
	var got []string
	wantKeys := []string{"address", "agent_started_at", "decommissioned_at", "last_heartbeat_at", "location", "machine_id",
		"provider", "provider_id", "provider_status", "state"}
	for _, m := range listed {
		keys := make([]string, 0, len(m))
		for k := range m {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		if !slices.Equal(keys, wantKeys) {
			t.Fatalf("keys %v, want %v", keys, wantKeys)
		}
		id := m["machine_id"].(string)
		got = append(got, id)
		// Each object says what the database says.
		var providerID, status string
		if err := db.Pool.QueryRow(t.Context(), "SELECT provider_id, provider_status FROM machine_provided WHERE machine_id = $1", id).
			Scan(&providerID, &status); err != nil {
			t.Fatal(err)
		}
		if m["state"] != "Silent" || m["provider_id"] != providerID || m["provider_status"] != status || m["agent_started_at"] == nil {
			t.Errorf("machine %s listed as %v; the database has provider id %s, status %s", id, m, providerID, status)
		}
	}
	if !slices.Equal(got, silent) {
		t.Errorf("listed silent machines %v, the database has %v", got, silent)
	}

	// --limit follows pages up to N; filters combine.
	out, err = run(t, "machine", "list", "--limit", "3", "-o", "json", "--database-url", db.URL)
	if err != nil || strings.Count(out, `"machine_id"`) != 3 {
		t.Errorf("machine list --limit 3: %v\n%s", err, out)
	}
	out, err = run(t, "machine", "list", "--provider", "q", "--location", "fra", "--search", "10.9.", "--database-url", db.URL)
	if err != nil || !strings.Contains(out, "MACHINE ID") || !strings.Contains(out, "3 of 3 matching machines") || !strings.Contains(out, "10.9.0.1") {
		t.Errorf("machine list --provider q --location fra --search 10.9.: %v\n%s", err, out)
	}
	out, err = run(t, "machine", "list", "--state", "Quarantined", "-o", "json", "--database-url", db.URL)
	if err != nil || strings.TrimSpace(out) != "[]" {
		t.Errorf("machine list --state Quarantined on a fleet without any = %q, %v; want []", out, err)
	}
}

func TestMachineReset(t *testing.T) {
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "initializer", time.Minute)
	m := bmdbtest.AddMachine(t, db, s, "p")
	if got := quarantine(t, db, s, "p"); got != m {
		t.Fatalf("claimed %s, want %s", got, m)
	}
	candidates := func() []uuid.UUID {
		ids, err := db.ListCandidates(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"), 10)
		if err != nil {
			t.Fatal(err)
		}
		return ids
	}
	if ids := candidates(); len(ids) != 0 {
		t.Fatalf("a quarantined machine is a candidate: %v", ids)
	}

	before := historyCount(t, db)
	unknown := uuid.NewString()
	for name, c := range map[string]struct {
		args []string
		want string // in the error the operator is shown
	}{
		"not a uuid":      {[]string{"machine", "reset", "m-1", "--process", "AgentStart"}, `no machine has the id or provider id "m-1"`},
		"unknown process": {[]string{"machine", "reset", m.String(), "--process", "Reboot"}, `--process "Reboot" is not a process: use one of AgentStart, Decommission, Power, ProviderUpdate, Recovery, Reinstall`},
		"no process":      {[]string{"machine", "reset", m.String()}, "--process is required"},
		"unknown machine": {[]string{"machine", "reset", unknown, "--process", "AgentStart"}, "machine " + unknown + " does not exist"},
		"no backoff":      {[]string{"machine", "reset", m.String(), "--process", "Recovery"}, "machine " + m.String() + " has no backoff for Recovery: nothing to reset"},
	} {
		out, err := run(t, append(c.args, "--database-url", db.URL)...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error saying %q\n%s", name, err, c.want, out)
		}
	}
	if n := historyCount(t, db); n != before {
		t.Fatalf("refused resets wrote %d history rows", n-before)
	}

	out, err := run(t, "machine", "reset", m.String(), "--process", "AgentStart", "--reason", "cable replaced", "--database-url", db.URL)
	if err != nil || !strings.Contains(out, "quarantine") || !strings.Contains(out, "may work on it again") {
		t.Fatalf("machine reset: %v\n%s", err, out)
	}
	if ids := candidates(); !slices.Equal(ids, []uuid.UUID{m}) {
		t.Errorf("after the reset, candidates are %v, want %s", ids, m)
	}
	events, err := db.History(t.Context(), bmdb.HistoryFilter{MachineID: m})
	if err != nil {
		t.Fatal(err)
	}
	last := events[len(events)-1]
	if last.Event != bmdb.EventReset || last.Process != bmdb.ProcessAgentStart ||
		!strings.Contains(last.Cause, "shepherd CLI") || !strings.Contains(last.Cause, "cable replaced") {
		t.Errorf("last history row %+v, want Reset by the CLI with the reason", last)
	}
	_, err = run(t, "machine", "reset", m.String(), "--process", "AgentStart", "--database-url", db.URL)
	if want := "machine " + m.String() + " has no backoff for AgentStart: nothing to reset"; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("a second reset: %v, want an error saying %q", err, want)
	}
}

func TestMachineDecommission(t *testing.T) {
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	m := bmdbtest.AddMachine(t, db, s, "p")
	requested := func() bool {
		return bmdbtest.Scalar[bool](t, db, "SELECT EXISTS (SELECT 1 FROM machine_decommission_request WHERE machine_id = $1)", m)
	}
	unknown := uuid.NewString()
	for name, c := range map[string]struct {
		args []string
		want string // in the error the operator is shown
	}{
		"no reason":       {[]string{"machine", "decommission", m.String(), "--yes"}, "--reason is required: say why the machine should go"},
		"blank reason":    {[]string{"machine", "decommission", m.String(), "--reason", "  ", "--yes"}, "--reason is required: say why the machine should go"},
		"not a uuid":      {[]string{"machine", "decommission", "m-1", "--reason", "x", "--yes"}, `no machine has the id or provider id "m-1"`},
		"unknown machine": {[]string{"machine", "decommission", unknown, "--reason", "x", "--yes"}, "machine " + unknown + " does not exist"},
	} {
		out, err := run(t, append(c.args, "--database-url", db.URL)...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error saying %q\n%s", name, err, c.want, out)
		}
	}
	for _, answer := range []string{"", "n\n", "nope\n"} {
		out, err := runWithInput(t, answer, "machine", "decommission", m.String(), "--reason", "disk failed", "--database-url", db.URL)
		if err == nil || !strings.Contains(err.Error(), "not confirmed") || !strings.Contains(out, "Proceed?") {
			t.Errorf("answer %q: %v\n%s", answer, err, out)
		}
	}
	if requested() {
		t.Fatal("a refused decommission recorded a request")
	}

	out, err := run(t, "machine", "decommission", m.String(), "--reason", "disk  failed", "--yes", "--database-url", db.URL)
	if err != nil || !strings.Contains(out, "decommission requested") {
		t.Fatalf("machine decommission --yes: %v\n%s", err, out)
	}
	other := bmdbtest.AddMachine(t, db, s, "p")
	out, err = runWithInput(t, "y\n", "machine", "decommission", other.String(), "--reason", "rack move", "--database-url", db.URL)
	if err != nil || !strings.Contains(out, "decommission requested") {
		t.Errorf("machine decommission answered y: %v\n%s", err, out)
	}
	d, err := db.GetMachine(t.Context(), m)
	if err != nil {
		t.Fatal(err)
	}
	if d.State != bmdb.StateDecommissioning || d.DecommissionRequested == nil || d.DecommissionRequested.Reason != "disk failed" ||
		d.DecommissionRequested.RequestedBy == "" {
		t.Errorf("after the request: state %s, request %+v", d.State, d.DecommissionRequested)
	}
	out, err = run(t, "machine", "decommission", m.String(), "--reason", "again", "--yes", "--database-url", db.URL)
	if err != nil || !strings.Contains(out, "already") {
		t.Errorf("second decommission: %v\n%s", err, out)
	}
	if d, _ := db.GetMachine(t.Context(), m); d.DecommissionRequested.Reason != "disk failed" {
		t.Errorf("the second request replaced the first: %+v", d.DecommissionRequested)
	}
}

func TestMachineShowAndHistory(t *testing.T) {
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "initializer", time.Minute)
	m := bmdbtest.AddMachine(t, db, s, "p")
	quarantine(t, db, s, "p")
	key := ed25519.PublicKey(make([]byte, ed25519.PublicKeySize))
	key[31] = 1
	hw, err := proto.Marshal(&agentv1.HardwareReport{
		Cpu:          &agentv1.CPU{Model: "AMD EPYC 9654", Sockets: 2, Cores: 192, Threads: 384},
		MemoryBytes:  768 << 30,
		BlockDevices: []*agentv1.BlockDevice{{Name: "nvme0n1", SizeBytes: 4 << 40, Model: "PM1733", Serial: "S4X"}},
		NetworkInterfaces: []*agentv1.NetworkInterface{
			{Name: "eth0", MacAddress: "02:00:00:00:00:01", Driver: "mlx5_core", LinkUp: true, SpeedMbps: 100000}},
		FirmwareMode: agentv1.FirmwareMode_FIRMWARE_MODE_EFI,
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error { return tx.SetAgentStarted(ctx, m, key) }); err != nil {
		t.Fatal(err)
	}
	if _, err := db.RecordHeartbeats(t.Context(), []bmdb.Heartbeat{{MachineID: m, AgentKey: key,
		Hardware: &bmdb.HardwareReport{Raw: hw, CPUThreads: 384}}}); err != nil {
		t.Fatal(err)
	}
	req, err := proto.Marshal(&agentv1.OSInstallationRequest{ImageUrl: "https://img.example/os.img", ImageSha256: strings.Repeat("ab", 32), TargetDevice: "/dev/nvme0n1"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := db.RequestInstallation(t.Context(), m, "test", req); err != nil {
		t.Fatal(err)
	}

	out, err := run(t, "machine", "show", m.String(), "--database-url", db.URL)
	if err != nil {
		t.Fatalf("machine show: %v\n%s", err, out)
	}
	for _, want := range []string{m.String(), "Quarantined", "AMD EPYC 9654: 2 sockets, 192 cores, 384 threads", "768.0 GiB", "EFI",
		"nvme0n1", "mlx5_core", "QUARANTINED", "ssh: connection refused", "https://img.example/os.img", "Heartbeating", " by test: "} {
		if !strings.Contains(out, want) {
			t.Errorf("machine show lacks %q:\n%s", want, out)
		}
	}

	out, err = run(t, "machine", "show", m.String(), "-o", "json", "--database-url", db.URL)
	if err != nil {
		t.Fatalf("machine show -o json: %v\n%s", err, out)
	}
	var d struct {
		MachineID      uuid.UUID `json:"machine_id"`
		State          string    `json:"state"`
		AgentPublicKey string    `json:"agent_public_key"`
		HardwareReport struct {
			CPU struct {
				Model   string `json:"model"`
				Threads int    `json:"threads"`
			} `json:"cpu"`
		} `json:"hardware_report"`
		Installation struct {
			RequestGeneration int64  `json:"request_generation"`
			RequestedBy       string `json:"requested_by"`
			Request           struct {
				ImageURL string `json:"imageUrl"`
			} `json:"request"`
			Installed bool `json:"installed"`
		} `json:"installation"`
		Backoffs []struct {
			Process     string `json:"process"`
			Quarantined bool   `json:"quarantined"`
			Attempts    int    `json:"attempts"`
		} `json:"backoffs"`
		Work                []any `json:"work"`
		DecommissionRequest any   `json:"decommission_request"`
	}
	if err := json.Unmarshal([]byte(out), &d); err != nil {
		t.Fatalf("machine show -o json is not JSON: %v\n%s", err, out)
	}
	if d.MachineID != m || d.State != "Quarantined" || d.AgentPublicKey == "" || d.HardwareReport.CPU.Model != "AMD EPYC 9654" ||
		d.HardwareReport.CPU.Threads != 384 || d.Installation.RequestGeneration != 1 || d.Installation.RequestedBy != "test" || d.Installation.Installed ||
		d.Installation.Request.ImageURL != "https://img.example/os.img" || len(d.Backoffs) != 1 || !d.Backoffs[0].Quarantined ||
		d.Backoffs[0].Process != "AgentStart" || d.Work == nil || len(d.Work) != 0 || d.DecommissionRequest != nil {
		t.Errorf("machine show -o json: %+v\n%s", d, out)
	}

	out, err = run(t, "machine", "history", m.String(), "--database-url", db.URL)
	if err != nil {
		t.Fatalf("machine history: %v\n%s", err, out)
	}
	for _, want := range []string{"Started", "Failed", "Quarantined", "ssh: connection refused", s.ID().String()} {
		if !strings.Contains(out, want) {
			t.Errorf("machine history lacks %q:\n%s", want, out)
		}
	}
	out, err = run(t, "machine", "history", m.String(), "--process", "AgentStart", "--limit", "2", "-o", "json", "--database-url", db.URL)
	if err != nil {
		t.Fatalf("machine history -o json: %v\n%s", err, out)
	}
	var events []bmdb.HistoryEvent
	if err := json.Unmarshal([]byte(out), &events); err != nil {
		t.Fatalf("machine history -o json is not JSON: %v\n%s", err, out)
	}
	if len(events) != 2 || events[0].Event != bmdb.EventFailed || events[1].Event != bmdb.EventQuarantined || events[1].MachineID != m {
		t.Errorf("the last 2 events: %+v, want Failed and Quarantined", events)
	}
	out, err = run(t, "machine", "history", m.String(), "--process", "Recovery", "--database-url", db.URL)
	if err != nil || !strings.Contains(out, "no history") {
		t.Errorf("machine history --process Recovery: %v\n%s", err, out)
	}
}

func TestSessionList(t *testing.T) {
	db := bmdbtest.New(t)
	live := bmdbtest.Session(t, db, "initializer", time.Minute)
	bmdbtest.AddMachine(t, db, live, "p")
	if _, err := live.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p")); err != nil {
		t.Fatal(err)
	}
	closed, err := db.StartSession(t.Context(), bmdb.SessionConfig{Component: "recoverer"})
	if err != nil {
		t.Fatal(err)
	}
	if err := closed.Close(t.Context()); err != nil {
		t.Fatal(err)
	}

	out, err := run(t, "session", "list", "--database-url", db.URL)
	if err != nil || !strings.Contains(out, live.ID().String()) || strings.Contains(out, closed.ID().String()) || !strings.Contains(out, "alive") {
		t.Errorf("session list: %v\n%s", err, out)
	}
	out, err = run(t, "session", "list", "--all", "-o", "json", "--database-url", db.URL)
	if err != nil {
		t.Fatalf("session list --all -o json: %v\n%s", err, out)
	}
	var sessions []struct {
		SessionID uuid.UUID  `json:"session_id"`
		Component string     `json:"component"`
		Alive     bool       `json:"alive"`
		ClosedAt  *time.Time `json:"closed_at"`
		Work      int        `json:"work"`
		LeaseMs   int64      `json:"lease_ms"`
	}
	if err := json.Unmarshal([]byte(out), &sessions); err != nil {
		t.Fatalf("session list -o json is not JSON: %v\n%s", err, out)
	}
	if len(sessions) != 2 {
		t.Fatalf("session list --all: %+v", sessions)
	}
	for _, s := range sessions {
		switch s.SessionID {
		case live.ID():
			if !s.Alive || s.Work != 1 || s.ClosedAt != nil || s.LeaseMs != 60_000 || s.Component != "initializer" {
				t.Errorf("live session: %+v", s)
			}
		case closed.ID():
			if s.Alive || s.ClosedAt == nil || s.Work != 0 {
				t.Errorf("closed session: %+v", s)
			}
		default:
			t.Errorf("unexpected session %+v", s)
		}
	}
}

func TestMachineCommandErrors(t *testing.T) {
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	m := bmdbtest.AddMachine(t, db, s, "p")
	for _, c := range []struct {
		args []string
		flag string // the error names it
	}{
		{[]string{"machine", "list", "--output", "yaml"}, "--output"},
		{[]string{"machine", "list", "--state", "Sleepy"}, "--state"},
		{[]string{"machine", "list", "--limit", "0"}, "--limit"},
		{[]string{"machine", "show", "not-a-uuid"}, "not-a-uuid"},
		{[]string{"machine", "show", uuid.NewString()}, "does not exist"},
		{[]string{"machine", "show", m.String(), "-o", "xml"}, "--output"},
		{[]string{"machine", "history", m.String(), "--process", "Nap"}, "--process"},
		{[]string{"machine", "history", "42"}, "42"},
		{[]string{"machine", "history", uuid.NewString()}, "does not exist"},
		{[]string{"session", "list", "-o", "csv"}, "--output"},
	} {
		out, err := run(t, append(c.args, "--database-url", db.URL)...)
		if err == nil || !strings.Contains(err.Error(), c.flag) {
			t.Errorf("%v: error %v does not name %s\n%s", c.args, err, c.flag, out)
		}
	}
	t.Setenv("SHEPHERD_DATABASE_URL", "")
	if _, err := run(t, "machine", "list"); err == nil || !strings.Contains(err.Error(), "--database-url") {
		t.Errorf("machine list without a database: %v", err)
	}
}

// TestMachineShowRecoveryLadder: machine show lists the rungs of the
// recovery ladder taken since the agent last heartbeated, with what each
// returned, as text and JSON.
func TestMachineShowRecoveryLadder(t *testing.T) {
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "recoverer", time.Minute)
	m := bmdbtest.AddMachine(t, db, s, "p")
	if err := s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		return tx.SetAgentStarted(ctx, m, make(ed25519.PublicKey, ed25519.PublicKeySize))
	}); err != nil {
		t.Fatal(err)
	}
	db.Exec(t, "UPDATE machine_agent_started SET agent_started_at = now() - interval '2 hours' WHERE machine_id = $1", m)
	db.Exec(t, "UPDATE machine_provided SET agent_phase_since = now() - interval '2 hours' WHERE machine_id = $1", m)
	out, err := run(t, "machine", "show", m.String(), "--database-url", db.URL)
	if err != nil || strings.Contains(out, "Recovery ladder") {
		t.Fatalf("machine show before any rung: %v\n%s", err, out)
	}

	cands := bmdb.RecoveryCandidates("p", 0, 0)
	if _, err := s.Work(t.Context(), bmdb.ProcessRecovery, cands); err != nil {
		t.Fatal(err)
	}
	req := bmdb.RebootRequest{Provider: "p", MachineID: m, Candidates: cands, Window: time.Minute, Max: 10, StreakLimit: 3,
		Ladder: []ladder.Rung{ladder.Agent, ladder.Reboot, ladder.Power}}
	a, err := s.AdmitReboot(t.Context(), req)
	if err != nil || a.Rung != ladder.Agent {
		t.Fatalf("admitting the agent rung: %+v, %v", a, err)
	}
	if err := s.RebootFailed(t.Context(), a, false, "the machine does not answer SSH"); err != nil {
		t.Fatal(err)
	}
	req.After = ladder.Agent
	if a, err = s.AdmitReboot(t.Context(), req); err != nil || a.Rung != ladder.Reboot {
		t.Fatalf("admitting the reboot rung: %+v, %v", a, err)
	}

	out, err = run(t, "machine", "show", m.String(), "--database-url", db.URL)
	if err != nil {
		t.Fatalf("machine show: %v\n%s", err, out)
	}
	for _, want := range []string{"Recovery ladder (since the last heartbeat)",
		"(restart the agent over SSH): failed: the machine does not answer SSH", "(in-band reboot): done"} {
		if !strings.Contains(out, want) {
			t.Errorf("machine show lacks %q:\n%s", want, out)
		}
	}
	if strings.Index(out, "restart the agent") > strings.Index(out, "in-band reboot") {
		t.Errorf("machine show lists the rungs out of order:\n%s", out)
	}
	out, err = run(t, "machine", "show", m.String(), "--output", "json", "--database-url", db.URL)
	if err != nil {
		t.Fatal(err)
	}
	var j struct {
		Ladder []struct {
			Rung    string `json:"rung"`
			Failed  bool   `json:"failed"`
			Reached bool   `json:"reached"`
			Result  string `json:"result"`
		} `json:"recovery_ladder"`
	}
	if err := json.Unmarshal([]byte(out), &j); err != nil {
		t.Fatalf("machine show --output json: %v\n%s", err, out)
	}
	if len(j.Ladder) != 2 || j.Ladder[0].Rung != "agent" || !j.Ladder[0].Failed || j.Ladder[0].Reached ||
		j.Ladder[0].Result != "the machine does not answer SSH" || j.Ladder[1].Rung != "reboot" || j.Ladder[1].Failed {
		t.Errorf("recovery_ladder: %+v", j.Ladder)
	}
}
