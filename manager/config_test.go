package manager_test

import (
	"context"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/internal/sshtest"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/provider"
)

// configCase is a configuration and the error a constructor must return for
// it: "" means it must be accepted, else the error must contain want.
type configCase[C any] struct {
	cfg  C
	want string
}

// checkConfigs runs construct on every case; a refusal must also start with
// prefix, so that the operator knows which component refused.
func checkConfigs[C any](t *testing.T, prefix string, cases []configCase[C], construct func(C) error) {
	t.Helper()
	for _, tt := range cases {
		err := construct(tt.cfg)
		switch {
		case tt.want == "" && err != nil:
			t.Errorf("%+v: %v, want it accepted", tt.cfg, err)
		case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want) || !strings.HasPrefix(err.Error(), prefix)):
			t.Errorf("%+v: %v, want an error starting %q and containing %q", tt.cfg, err, prefix, tt.want)
		}
	}
}

// testLoop is a loop that processes nothing, for constructors.
func testLoop() manager.Loop {
	return manager.Loop{
		Process:    bmdb.ProcessAgentStart,
		Candidates: func() bmdb.Candidates { return bmdb.AgentStartCandidates("lab") },
		Backoff:    bmdb.BackoffPolicy{Initial: time.Minute},
		Do:         func(context.Context, *manager.Task) (manager.FinishFunc, error) { return nil, nil },
	}
}

// loopCases are the LoopConfig cases every loop's configuration embeds:
// each field may be zero (its default) but not negative.
func loopCases() []configCase[manager.LoopConfig] {
	return []configCase[manager.LoopConfig]{
		{manager.LoopConfig{}, ""},
		{manager.LoopConfig{Parallelism: 1, IdleSleep: 1, Lease: time.Second, WorkTimeout: 1, QueryLimit: manager.Limit{Every: 1, Burst: 1}}, ""},
		{manager.LoopConfig{Parallelism: -1}, "Parallelism must be >= 0 (0 = default), got -1"},
		{manager.LoopConfig{IdleSleep: -time.Second}, "IdleSleep must be >= 0 (0 = default), got -1s"},
		{manager.LoopConfig{Lease: -time.Second}, "Lease must be >= 0 (0 = default), got -1s"},
		{manager.LoopConfig{WorkTimeout: -time.Second}, "WorkTimeout must be >= 0 (0 = default 30m0s), got -1s"},
		{manager.LoopConfig{QueryLimit: manager.Limit{Every: -1}}, "limit -1ns,0 must not be negative"},
		{manager.LoopConfig{QueryLimit: manager.Limit{Burst: -1}}, "limit 0s,-1 must not be negative"},
	}
}

func TestRunnerConfig(t *testing.T) {
	t.Parallel()
	checkConfigs(t, "test-loop: ", loopCases(), func(c manager.LoopConfig) error {
		_, err := manager.NewRunner("test-loop", c, testLoop(), nil, nil, nil)
		return err
	})
	for _, tt := range []struct {
		name string
		edit func(*manager.Loop)
		want string
	}{
		{"no Do", func(l *manager.Loop) { l.Do = nil }, "test-loop: a loop needs Do and Candidates"},
		{"no Candidates", func(l *manager.Loop) { l.Candidates = nil }, "test-loop: a loop needs Do and Candidates"},
		{"unknown process", func(l *manager.Loop) { l.Process = "Dancing" }, `unknown process "Dancing"`},
		{"bad backoff", func(l *manager.Loop) { l.Backoff = bmdb.BackoffPolicy{} }, "test-loop: bmdb: backoff Initial must be > 0"},
	} {
		l := testLoop()
		tt.edit(&l)
		if _, err := manager.NewRunner("test-loop", manager.LoopConfig{}, l, nil, nil, nil); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: NewRunner() = %v, want %q", tt.name, err, tt.want)
		}
	}
	// Two loops of one process cannot share a registry: their series would
	// be the same.
	reg := prometheus.NewRegistry()
	if _, err := manager.NewRunner("a", manager.LoopConfig{}, testLoop(), nil, reg, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := manager.NewRunner("b", manager.LoopConfig{}, testLoop(), nil, reg, nil); err == nil || !strings.HasPrefix(err.Error(), "b: registering metrics: ") {
		t.Errorf("a second loop of the same process on one registry: %v, want a registration error", err)
	}
}

func TestJanitorConfig(t *testing.T) {
	t.Parallel()
	checkConfigs(t, "janitor: ", []configCase[manager.JanitorConfig]{
		{manager.JanitorConfig{}, ""},
		{manager.JanitorConfig{Period: 1, SessionRetention: 1, FirstHeartbeatTimeout: 1, HeartbeatTimeout: 1, Lease: time.Second}, ""},
		{manager.JanitorConfig{Period: -time.Second}, "Period must be >= 0 (0 = default 30s), got -1s"},
		{manager.JanitorConfig{SessionRetention: -time.Hour}, "SessionRetention must be >= 0 (0 = default 168h0m0s), got -1h0m0s"},
		{manager.JanitorConfig{FirstHeartbeatTimeout: -1}, "heartbeat timeouts must be >= 0"},
		{manager.JanitorConfig{HeartbeatTimeout: -1}, "heartbeat timeouts must be >= 0"},
		{manager.JanitorConfig{Lease: -time.Second}, "Lease must be >= 0 (0 = default), got -1s"},
	}, func(c manager.JanitorConfig) error {
		_, err := manager.NewJanitor(c, nil, nil, nil)
		return err
	})
	reg := prometheus.NewRegistry()
	if _, err := manager.NewJanitor(manager.JanitorConfig{}, nil, reg, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := manager.NewJanitor(manager.JanitorConfig{}, nil, reg, nil); err == nil || !strings.HasPrefix(err.Error(), "janitor: registering metrics: ") {
		t.Errorf("a second janitor on one registry: %v, want a registration error", err)
	}
}

func TestProvisionerConfig(t *testing.T) {
	t.Parallel()
	p := newScripted("lab")
	checkConfigs(t, "provisioner: ", []configCase[manager.ProvisionerConfig]{
		{manager.ProvisionerConfig{}, ""},
		{manager.ProvisionerConfig{Period: 1, Lease: time.Second, MaxMachines: 1, ChunkSize: 1, CreateLimit: manager.Limit{Every: 1, Burst: 1}}, ""},
		{manager.ProvisionerConfig{Period: -1}, "durations must be >= 0"},
		{manager.ProvisionerConfig{Lease: -1}, "durations must be >= 0"},
		{manager.ProvisionerConfig{MaxMachines: -1}, "MaxMachines must be >= 0 (0 = no limit), got -1"},
		{manager.ProvisionerConfig{ChunkSize: -1}, "ChunkSize must be >= 0 (0 = default), got -1"},
		{manager.ProvisionerConfig{CreateLimit: manager.Limit{Burst: -1}}, "must not be negative"},
	}, func(c manager.ProvisionerConfig) error {
		_, err := manager.NewProvisioner(c, nil, p, nil, nil)
		return err
	})
	reg := prometheus.NewRegistry()
	if _, err := manager.NewProvisioner(manager.ProvisionerConfig{}, nil, p, reg, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := manager.NewProvisioner(manager.ProvisionerConfig{}, nil, p, reg, nil); err == nil || !strings.HasPrefix(err.Error(), "provisioner: registering metrics: ") {
		t.Errorf("a second provisioner of one provider on one registry: %v, want a registration error", err)
	}
}

func TestUpdaterConfig(t *testing.T) {
	t.Parallel()
	p := newCatalog("lab")
	checkConfigs(t, "updater: ", []configCase[manager.UpdaterConfig]{
		{manager.UpdaterConfig{}, ""},
		{manager.UpdaterConfig{ChangingPeriod: time.Minute, StablePeriod: time.Minute, Lease: time.Second}, ""},
		{manager.UpdaterConfig{ChangingPeriod: 5 * time.Minute}, ""},
		{manager.UpdaterConfig{StablePeriod: 10 * time.Second}, ""},
		{manager.UpdaterConfig{ChangingPeriod: -time.Second}, "ChangingPeriod must be >= 0 (0 = default 10s), got -1s"},
		{manager.UpdaterConfig{StablePeriod: -time.Second}, "StablePeriod must be >= 0 (0 = default 5m0s), got -1s"},
		{manager.UpdaterConfig{Lease: -time.Second}, "Lease must be >= 0 (0 = default), got -1s"},
		{manager.UpdaterConfig{ChangingPeriod: time.Minute + 1, StablePeriod: time.Minute}, "ChangingPeriod (1m0.000000001s) must not be longer than StablePeriod (1m0s)"},
		{manager.UpdaterConfig{ChangingPeriod: 6 * time.Minute}, "ChangingPeriod (6m0s) must not be longer than StablePeriod (5m0s)"},
		{manager.UpdaterConfig{StablePeriod: 9 * time.Second}, "ChangingPeriod (10s) must not be longer than StablePeriod (9s)"},
	}, func(c manager.UpdaterConfig) error {
		_, err := manager.NewUpdater(c, nil, p, nil, nil)
		return err
	})
	reg := prometheus.NewRegistry()
	if _, err := manager.NewUpdater(manager.UpdaterConfig{}, nil, p, reg, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := manager.NewUpdater(manager.UpdaterConfig{}, nil, p, reg, nil); err == nil || !strings.HasPrefix(err.Error(), "updater: registering metrics: ") {
		t.Errorf("a second updater of one provider on one registry: %v, want a registration error", err)
	}
}

// rebooter is a provider whose reboots a test scripts.
type rebooter struct {
	*scripted
	reboot func(id string) error
}

func (r *rebooter) RebootMachine(_ context.Context, id string) error {
	if r.reboot == nil {
		return nil
	}
	return r.reboot(id)
}

func (r *rebooter) ReinstallMachine(context.Context, string) error { return provider.ErrUnsupported }

func TestRecovererConfig(t *testing.T) {
	t.Parallel()
	p := &rebooter{scripted: newScripted("lab")}
	cases := []configCase[manager.RecovererConfig]{
		{manager.RecovererConfig{}, ""},
		{manager.RecovererConfig{FirstHeartbeatTimeout: 1, HeartbeatTimeout: 1, Window: bmdb.MaxRecoveryWindow, RebootTimeout: 1,
			MaxRebootsPerWindow: 1, MaxRebootsWithoutHeartbeat: 1, SilentFraction: 1}, ""},
		{manager.RecovererConfig{SilentFraction: math.SmallestNonzeroFloat64}, ""},
		{manager.RecovererConfig{FirstHeartbeatTimeout: -1}, "durations must be >= 0"},
		{manager.RecovererConfig{HeartbeatTimeout: -1}, "durations must be >= 0"},
		{manager.RecovererConfig{Window: -1}, "durations must be >= 0"},
		{manager.RecovererConfig{RebootTimeout: -1}, "durations must be >= 0"},
		{manager.RecovererConfig{Window: bmdb.MaxRecoveryWindow + 1}, "Window must be at most 24h0m0s (reboots are kept that long), got 24h0m0.000000001s"},
		{manager.RecovererConfig{MaxRebootsPerWindow: -1}, "MaxRebootsPerWindow must be >= 0 (0 = 5% of the fleet), got -1"},
		{manager.RecovererConfig{MaxRebootsWithoutHeartbeat: -1}, "MaxRebootsWithoutHeartbeat must be >= 0 (0 = default 3), got -1"},
		{manager.RecovererConfig{SilentFraction: -0.1}, "SilentFraction must be within [0, 1] (0 = default 0.25), got -0.1"},
		{manager.RecovererConfig{SilentFraction: 1.0000001}, "SilentFraction must be within [0, 1] (0 = default 0.25), got 1.0000001"},
		{manager.RecovererConfig{SilentFraction: math.NaN()}, "got NaN"},
	}
	for _, lc := range loopCases() {
		cases = append(cases, configCase[manager.RecovererConfig]{manager.RecovererConfig{Loop: lc.cfg}, lc.want})
	}
	checkConfigs(t, "recoverer: ", cases, func(c manager.RecovererConfig) error {
		_, err := manager.NewRecoverer(c, nil, p, nil, nil)
		return err
	})
	if _, err := manager.NewRecoverer(manager.RecovererConfig{Backoff: bmdb.BackoffPolicy{Maximum: time.Hour}}, nil, p, nil, nil); err == nil ||
		!strings.Contains(err.Error(), "backoff Initial must be > 0") {
		t.Errorf("a recoverer with a bad backoff: %v, want it refused", err)
	}
	if _, err := manager.NewRecoverer(manager.RecovererConfig{}, nil, newScripted("lab"), nil, nil); err == nil ||
		err.Error() != "recoverer: provider lab cannot reboot machines" {
		t.Errorf("a recoverer of a provider that cannot reboot: %v", err)
	}
	// The breaker's gauges and the loop's series are registered once.
	reg := prometheus.NewRegistry()
	if _, err := manager.NewRecoverer(manager.RecovererConfig{}, nil, p, reg, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := manager.NewRecoverer(manager.RecovererConfig{}, nil, p, reg, nil); err == nil || !strings.HasPrefix(err.Error(), "recoverer: registering metrics: ") {
		t.Errorf("a second recoverer of one provider on one registry: %v, want a registration error", err)
	}
	loopOnly := prometheus.NewRegistry()
	if _, err := manager.NewRunner("other", manager.LoopConfig{}, manager.Loop{
		Process: bmdb.ProcessRecovery, Candidates: testLoop().Candidates, Backoff: testLoop().Backoff, Do: testLoop().Do,
	}, nil, loopOnly, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := manager.NewRecoverer(manager.RecovererConfig{}, nil, p, loopOnly, nil); err == nil || !strings.HasPrefix(err.Error(), "recoverer: registering metrics: ") {
		t.Errorf("a recoverer whose loop's series are registered already: %v, want a registration error", err)
	}
}

func TestInitializerConfig(t *testing.T) {
	t.Parallel()
	p := newScripted("lab")
	dir := t.TempDir()
	agent := filepath.Join(dir, "agent")
	if err := os.WriteFile(agent, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	key := sshtest.NewKey(t)
	ok := manager.InitializerConfig{SSHKey: key, AgentPath: agent, ServerEndpoint: "server:443"}
	with := func(edit func(*manager.InitializerConfig)) manager.InitializerConfig {
		c := ok
		edit(&c)
		return c
	}
	cases := []configCase[manager.InitializerConfig]{
		{ok, ""},
		{with(func(c *manager.InitializerConfig) { c.ConnectTimeout, c.ExecTimeout, c.AgentDir = 1, 1, "/opt/agent" }), ""},
		{with(func(c *manager.InitializerConfig) { c.ConnectTimeout = -1 }), "timeouts must be >= 0"},
		{with(func(c *manager.InitializerConfig) { c.ExecTimeout = -1 }), "timeouts must be >= 0"},
		{with(func(c *manager.InitializerConfig) { c.SSHKey = nil }), "SSHKey is required"},
		{with(func(c *manager.InitializerConfig) { c.AgentPath = "" }), "AgentPath (the local agent binary) is required"},
		{with(func(c *manager.InitializerConfig) { c.ServerEndpoint = "" }), "ServerEndpoint (where agents send heartbeats) is required"},
		{with(func(c *manager.InitializerConfig) { c.AgentDir = "opt/agent" }), ""}, // under the SSH user's home
		{with(func(c *manager.InitializerConfig) { c.ServerEndpoint = "server" }), `ServerEndpoint "server" is not host:port`},
		{with(func(c *manager.InitializerConfig) { c.AgentPath = filepath.Join(dir, "nothing") }), "agent binary: "},
		{with(func(c *manager.InitializerConfig) { c.AgentPath = dir }), "agent binary " + dir + " is not a regular file"},
		{with(func(c *manager.InitializerConfig) { c.Backoff = bmdb.BackoffPolicy{Maximum: time.Hour} }), "backoff Initial must be > 0"},
	}
	for _, lc := range loopCases() {
		cases = append(cases, configCase[manager.InitializerConfig]{with(func(c *manager.InitializerConfig) { c.Loop = lc.cfg }), lc.want})
	}
	checkConfigs(t, "", cases, func(c manager.InitializerConfig) error {
		_, err := manager.NewInitializer(c, nil, p, nil, nil)
		if err != nil && !strings.HasPrefix(err.Error(), "initializer: ") && !strings.HasPrefix(err.Error(), "bmdb: ") {
			t.Errorf("%v does not say it is the initializer's", err)
		}
		return err
	})
}

func TestDecommissionerConfig(t *testing.T) {
	t.Parallel()
	p := newScripted("lab")
	key := sshtest.NewKey(t)
	cases := []configCase[manager.DecommissionerConfig]{
		{manager.DecommissionerConfig{}, ""},
		{manager.DecommissionerConfig{ReleaseTimeout: 1, AgentStop: &manager.AgentStopConfig{SSHKey: key, AgentDir: "/opt/agent", Timeout: 1}}, ""},
		{manager.DecommissionerConfig{AgentStop: &manager.AgentStopConfig{SSHKey: key}}, ""},
		{manager.DecommissionerConfig{ReleaseTimeout: -time.Second}, "ReleaseTimeout must be >= 0 (0 = default 5m), got -1s"},
		{manager.DecommissionerConfig{AgentStop: &manager.AgentStopConfig{}}, "AgentStop.SSHKey is required"},
		{manager.DecommissionerConfig{AgentStop: &manager.AgentStopConfig{SSHKey: key, AgentDir: "agent"}}, ""}, // under the SSH user's home
		{manager.DecommissionerConfig{AgentStop: &manager.AgentStopConfig{SSHKey: key, Timeout: -time.Second}}, "AgentStop.Timeout must be >= 0 (0 = default 1m), got -1s"},
		{manager.DecommissionerConfig{Backoff: bmdb.BackoffPolicy{Maximum: time.Hour}}, "backoff Initial must be > 0"},
	}
	for _, lc := range loopCases() {
		cases = append(cases, configCase[manager.DecommissionerConfig]{manager.DecommissionerConfig{Loop: lc.cfg}, lc.want})
	}
	checkConfigs(t, "", cases, func(c manager.DecommissionerConfig) error {
		_, err := manager.NewDecommissioner(c, nil, p, nil, nil)
		if err != nil && !strings.HasPrefix(err.Error(), "decommissioner: ") && !strings.HasPrefix(err.Error(), "bmdb: ") {
			t.Errorf("%v does not say it is the decommissioner's", err)
		}
		return err
	})
	reg := prometheus.NewRegistry()
	if _, err := manager.NewDecommissioner(manager.DecommissionerConfig{}, nil, p, reg, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := manager.NewDecommissioner(manager.DecommissionerConfig{}, nil, p, reg, nil); err == nil || !strings.HasPrefix(err.Error(), "decommissioner: registering metrics: ") {
		t.Errorf("a second decommissioner of one provider on one registry: %v, want a registration error", err)
	}
}

func TestLimitFlag(t *testing.T) {
	t.Parallel()
	var l manager.Limit
	if err := l.Set("250ms,8"); err != nil || l != (manager.Limit{Every: 250 * time.Millisecond, Burst: 8}) {
		t.Errorf("Set(250ms,8): %v, %+v", err, l)
	}
	if got := l.String(); got != "250ms,8" {
		t.Errorf("String() = %q, want 250ms,8", got)
	}
	if err := l.Set("fast"); err == nil || l != (manager.Limit{Every: 250 * time.Millisecond, Burst: 8}) {
		t.Errorf("Set(fast): %v, and the limit became %+v; want an error and the limit unchanged", err, l)
	}
	if got := l.Type(); got != "duration,burst" {
		t.Errorf("Type() = %q", got)
	}
	if got := manager.DefaultLimit(); got != (manager.Limit{Every: 100 * time.Millisecond, Burst: 10}) {
		t.Errorf("DefaultLimit() = %+v, want 100ms,10", got)
	}
}
