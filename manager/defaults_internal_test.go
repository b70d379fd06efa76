package manager

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"golang.org/x/crypto/ssh"
	"golang.org/x/time/rate"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/internal/sshtest"
	"github.com/shepherd/shepherd/ladder"
)

// rebootable is a provider that has a name and can reboot (nothing).
type rebootable struct{ named }

func (rebootable) RebootMachine(context.Context, string) error    { return nil }
func (rebootable) ReinstallMachine(context.Context, string) error { return nil }

// TestDefaults: a zero field of a component's configuration means the
// default its documentation names, and the caller's value is kept
// otherwise.
func TestDefaults(t *testing.T) {
	t.Parallel()
	loop := Loop{
		Process:    bmdb.ProcessAgentStart,
		Candidates: func() bmdb.Candidates { return bmdb.AgentStartCandidates("lab") },
		Backoff:    bmdb.BackoffPolicy{Initial: time.Minute},
		Do:         func(context.Context, *Task) (FinishFunc, error) { return nil, nil },
	}
	loopDefaults := LoopConfig{Parallelism: 10, IdleSleep: 5 * time.Second, Lease: bmdb.DefaultLease, WorkTimeout: 30 * time.Minute}
	r, err := NewRunner("test", LoopConfig{}, loop, nil, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(loopDefaults, r.cfg); diff != "" {
		t.Errorf("runner defaults (-want +got):\n%s", diff)
	}
	set := LoopConfig{Parallelism: 3, IdleSleep: time.Second, Lease: time.Minute, WorkTimeout: time.Hour, QueryLimit: Limit{Every: time.Second, Burst: 2}}
	if r, err = NewRunner("test", set, loop, nil, nil, nil); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(set, r.cfg); diff != "" {
		t.Errorf("runner with every field set (-want +got):\n%s", diff)
	}

	// A limit's zero fields are the default's: 100ms,10.
	for _, tt := range []struct {
		l     Limit
		every time.Duration
		burst int
	}{
		{Limit{}, 100 * time.Millisecond, 10},
		{Limit{Every: time.Second}, time.Second, 10},
		{Limit{Burst: 3}, 100 * time.Millisecond, 3},
		{Limit{Every: time.Minute, Burst: 1}, time.Minute, 1},
	} {
		l := tt.l.limiter(DefaultLimit())
		if l.Limit() != rate.Every(tt.every) || l.Burst() != tt.burst {
			t.Errorf("limiter of %+v: %v/s burst %d, want every %s burst %d", tt.l, l.Limit(), l.Burst(), tt.every, tt.burst)
		}
	}

	j, err := NewJanitor(JanitorConfig{}, nil, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	// The heartbeat timeouts stay zero: each pass reads those the
	// recoverers recorded in the BMDB.
	if diff := cmp.Diff(JanitorConfig{Period: 30 * time.Second, SessionRetention: 7 * 24 * time.Hour}, j.cfg); diff != "" {
		t.Errorf("janitor defaults (-want +got):\n%s", diff)
	}

	pr, err := NewProvisioner(ProvisionerConfig{}, nil, named{name: "lab"}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(ProvisionerConfig{Period: 30 * time.Second, ChunkSize: 50}, pr.cfg); diff != "" {
		t.Errorf("provisioner defaults (-want +got):\n%s", diff)
	}
	if pr.limiter.Limit() != rate.Every(100*time.Millisecond) || pr.limiter.Burst() != 10 {
		t.Errorf("provisioner's create limit %v/s burst %d, want 100ms,10", pr.limiter.Limit(), pr.limiter.Burst())
	}

	u, err := NewUpdater(UpdaterConfig{}, nil, named{name: "lab"}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(UpdaterConfig{ChangingPeriod: 10 * time.Second, StablePeriod: 5 * time.Minute}, u.cfg); diff != "" {
		t.Errorf("updater defaults (-want +got):\n%s", diff)
	}

	rc, err := NewRecoverer(RecovererConfig{}, nil, rebootable{named{name: "lab"}}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(RecovererConfig{FirstHeartbeatTimeout: 30 * time.Minute, HeartbeatTimeout: 10 * time.Minute,
		MaxRebootsWithoutHeartbeat: 3, Window: 10 * time.Minute, SilentFraction: 0.25, RebootTimeout: 5 * time.Minute,
		Backoff: bmdb.RecoveryBackoff(), Rungs: ladder.Default, SSHUser: "root", ConnectTimeout: 30 * time.Second,
		PowerTimeout: 5 * time.Minute, BootTimeout: 10 * time.Minute, BootPoll: 2 * time.Second}, rc.cfg); diff != "" {
		t.Errorf("recoverer defaults (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(loopDefaults, rc.runner.cfg); diff != "" {
		t.Errorf("recoverer's loop defaults (-want +got):\n%s", diff)
	}
	rset := RecovererConfig{Loop: set, FirstHeartbeatTimeout: time.Minute, HeartbeatTimeout: 2 * time.Minute, MaxRebootsPerWindow: 7,
		Window: time.Hour, MaxRebootsWithoutHeartbeat: 5, SilentFraction: 0.5, RebootTimeout: time.Second,
		Backoff: bmdb.BackoffPolicy{Initial: time.Second}, Rungs: []ladder.Rung{ladder.Reboot, ladder.Power}, SSHUser: "admin",
		ConnectTimeout: 3 * time.Second, PowerTimeout: 4 * time.Second, BootTimeout: 5 * time.Second, BootPoll: 6 * time.Second}
	if rc, err = NewRecoverer(rset, nil, rebootable{named{name: "lab"}}, nil, nil); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(rset, rc.cfg); diff != "" {
		t.Errorf("recoverer with every field set (-want +got):\n%s", diff)
	}

	agent := filepath.Join(t.TempDir(), "agent")
	if err := os.WriteFile(agent, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	key := sshtest.NewKey(t)
	in, err := NewInitializer(InitializerConfig{SSHKey: key, AgentPath: agent, ServerEndpoint: "server:443"}, nil, named{name: "lab"}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	cmpKeys := cmp.Comparer(func(a, b ssh.Signer) bool { return a == b })
	if diff := cmp.Diff(InitializerConfig{ConnectTimeout: 30 * time.Second, ExecTimeout: 2 * time.Minute, SSHUser: "root",
		SSHKey: key, AgentPath: agent, ServerEndpoint: "server:443",
		Backoff: bmdb.AgentStartBackoff()}, in.cfg, cmpKeys); diff != "" {
		t.Errorf("initializer defaults (-want +got):\n%s", diff)
	}
	// A failed takeover is retried within seconds at first, so that fixing
	// a configuration error (a key, --agent-dir, --ssh-user) shows at once;
	// the waits then grow to hours.
	var waits []time.Duration
	for last, i := time.Duration(0), 0; i < 14; i++ {
		last = in.cfg.Backoff.Next(last)
		waits = append(waits, last)
	}
	if want := []time.Duration{5 * time.Second, 10 * time.Second, 20 * time.Second, 40 * time.Second, 80 * time.Second}; !slices.Equal(waits[:5], want) {
		t.Errorf("the initializer's first waits after failed takeovers are %v, want %v", waits[:5], want)
	}
	if waits[13] != 4*time.Hour || in.cfg.Backoff.MaxAttempts != 20 {
		t.Errorf("the initializer's waits grow to %v and quarantine after %d failures, want 4h and 20", waits[13], in.cfg.Backoff.MaxAttempts)
	}
	iset := InitializerConfig{ConnectTimeout: time.Second, ExecTimeout: time.Minute, SSHUser: "admin", SSHKey: key, AgentPath: agent,
		AgentDir: "/opt/agent", ServerEndpoint: "server:443", Backoff: bmdb.BackoffPolicy{Initial: time.Second}}
	if in, err = NewInitializer(iset, nil, named{name: "lab"}, nil, nil); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(iset, in.cfg, cmpKeys, cmpopts.EquateEmpty()); diff != "" {
		t.Errorf("initializer with every field set (-want +got):\n%s", diff)
	}

	stop := &AgentStopConfig{SSHKey: key}
	d, err := NewDecommissioner(DecommissionerConfig{AgentStop: stop}, nil, named{name: "lab"}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(DecommissionerConfig{ReleaseTimeout: 5 * time.Minute, Backoff: bmdb.DecommissionBackoff(),
		AgentStop: &AgentStopConfig{SSHKey: key, SSHUser: "root", Timeout: time.Minute}}, d.cfg, cmpKeys); diff != "" {
		t.Errorf("decommissioner defaults (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(&AgentStopConfig{SSHKey: key}, stop, cmpKeys); diff != "" {
		t.Errorf("NewDecommissioner changed the caller's AgentStop (-want +got):\n%s", diff)
	}
	dset := DecommissionerConfig{ReleaseTimeout: time.Second, Backoff: bmdb.BackoffPolicy{Initial: time.Second},
		AgentStop: &AgentStopConfig{SSHKey: key, SSHUser: "admin", AgentDir: "/opt/agent", Timeout: time.Second}}
	if d, err = NewDecommissioner(dset, nil, named{name: "lab"}, nil, nil); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(dset, d.cfg, cmpKeys); diff != "" {
		t.Errorf("decommissioner with every field set (-want +got):\n%s", diff)
	}
	if d, err = NewDecommissioner(DecommissionerConfig{}, nil, named{name: "lab"}, nil, nil); err != nil || d.cfg.AgentStop != nil {
		t.Errorf("decommissioner without AgentStop: %+v, %v; want no agent stop", d, err)
	}
}
