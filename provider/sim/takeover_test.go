package sim_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"os"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/pkg/sftp"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/sshx"
	"github.com/shepherd/shepherd/provider"
	"github.com/shepherd/shepherd/provider/sim"
)

// TestTakeover takes a machine over through the in-process SSH transport
// as the initializer does (SFTP upload, exec with a TakeoverInit) and
// checks that its agent heartbeats to a real callback server.
func TestTakeover(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 200*time.Millisecond)
	f := startFleet(t, sim.Config{Machines: 3, SSHLatency: 10 * time.Millisecond, TakeoverLatency: 50 * time.Millisecond})
	id := slotID(2)
	create(t, f, id)
	machine := e.addMachine(t, f, id)

	c, seen := mustDial(t, f, id)
	if want, err := f.HostKey(id); err != nil || !bytes.Equal(seen.Marshal(), want.Marshal()) {
		t.Errorf("host key seen on first use is not the machine's (%v)", err)
	}
	upload(t, c, 1<<20)
	init := e.init(machine)
	raw, err := proto.Marshal(init)
	if err != nil {
		t.Fatal(err)
	}
	resp := execTakeover(t, c, raw)
	ok := resp.GetSuccess()
	if ok == nil {
		t.Fatalf("takeover answered %v, want success", resp)
	}
	if !proto.Equal(ok.GetInitMessage(), init) {
		t.Errorf("takeover echoed %v, want %v", ok.GetInitMessage(), init)
	}
	if len(ok.GetPublicKey()) != 32 {
		t.Fatalf("takeover answered a %d-byte key, want 32", len(ok.GetPublicKey()))
	}
	e.setAgentStarted(t, machine, ok.GetPublicKey())

	bmdbtest.WaitFor(t, 30*time.Second, "the agent's heartbeat is recorded", func(ctx context.Context) (bool, error) {
		_, err := e.db.GetAgentHeartbeat(ctx, machine)
		return err == nil, err
	})
	hw, err := e.db.GetHardwareReport(t.Context(), machine)
	if err != nil {
		t.Fatalf("hardware report: %v", err)
	}
	if hw.CPUThreads != 16 || hw.MemoryBytes != 64<<30 || hw.DiskCount != 2 {
		t.Errorf("hardware report: %d threads, %d bytes, %d disks; want 16, 64 GiB, 2", hw.CPUThreads, hw.MemoryBytes, hw.DiskCount)
	}
	var report agentv1.HardwareReport
	if err := proto.Unmarshal(hw.Raw, &report); err != nil || report.GetDmi().GetProductSerial() != id {
		t.Errorf("stored hardware report: serial %q, %v; want %q", report.GetDmi().GetProductSerial(), err, id)
	}
	// The heartbeats go on at the server's interval.
	first := f.LastHeartbeat(id)
	waitHeartbeat(t, f, id, first, "a later heartbeat")
	st := f.Stats()
	if st.Takeovers != 1 || st.AgentsRunning != 1 || st.HeartbeatsOK < 2 {
		t.Errorf("Stats() = %+v, want 1 takeover, 1 agent, >= 2 heartbeats", st)
	}
	c.Close()
	bmdbtest.WaitFor(t, 10*time.Second, "SSH connections are gone after the client closed", func(context.Context) (bool, error) {
		return f.Stats().SSHConnections == 0, nil
	})
}

// TestSilenceKillRevive injects the faults and checks what the initializer
// and the recoverer would see.
func TestSilenceKillRevive(t *testing.T) {
	t.Parallel()
	const interval = 100 * time.Millisecond
	e := newEnv(t, interval)
	f := startFleet(t, sim.Config{Machines: 2, RebootLatency: time.Millisecond})
	a, b := slotID(1), slotID(2)
	for _, id := range []string{a, b} {
		create(t, f, id)
		e.takeover(t, f, id, e.addMachine(t, f, id))
		waitHeartbeat(t, f, id, time.Time{}, "first heartbeat of "+id)
	}

	silencedAt := time.Now()
	if err := f.Silence(a); err != nil {
		t.Fatal(err)
	}
	// Once b has heartbeated well after the silence, a heartbeat of a that
	// was in flight then has ended too.
	waitHeartbeat(t, f, b, silencedAt.Add(2*interval), "b heartbeats after a was silenced")
	lastA := f.LastHeartbeat(a)
	waitHeartbeat(t, f, b, time.Now().Add(5*interval), "b keeps heartbeating")
	if got := f.LastHeartbeat(a); !got.Equal(lastA) {
		t.Errorf("silenced machine %s heartbeated at %v (last before: %v)", a, got, lastA)
	}
	if st := f.Stats(); st.AgentsSilenced != 1 || st.AgentsRunning != 2 {
		t.Errorf("Stats() = %+v, want 2 agents, 1 silenced", st)
	}
	if _, _, err := dial(t, f, a); err != nil {
		t.Errorf("a silenced machine must stay reachable over SSH: %v", err)
	}

	if err := f.Kill(a); err != nil {
		t.Fatal(err)
	}
	if _, _, err := dial(t, f, a); !errors.Is(err, sim.ErrUnreachable) {
		t.Errorf("dialing a killed machine: %v, want ErrUnreachable", err)
	}
	if err := f.RebootMachine(t.Context(), a); err == nil {
		t.Error("rebooting a killed machine succeeded")
	}
	m, err := f.GetMachine(t.Context(), a)
	if err != nil || m.(provider.Described).Status() != provider.StatusStopped {
		t.Errorf("a killed machine: %v, %v; want status Stopped", m, err)
	}
	if st := f.Stats(); st.AgentsRunning != 1 || st.Killed != 1 || st.AgentsSilenced != 0 {
		t.Errorf("Stats() after the kill = %+v, want 1 agent, 1 killed, none silenced", st)
	}

	if err := f.Revive(a); err != nil {
		t.Fatal(err)
	}
	if _, _, err := dial(t, f, a); err != nil {
		t.Errorf("dialing a revived machine: %v", err)
	}
	if err := f.RebootMachine(t.Context(), a); err != nil {
		t.Errorf("rebooting a revived machine: %v", err)
	}
	if _, n := f.Rebooted(a); n != 1 {
		t.Errorf("Rebooted(%s) counts %d reboots, want 1 (the refused one does not count)", a, n)
	}
}

// TestSilenceRevive checks that Revive makes a silenced agent heartbeat again.
func TestSilenceRevive(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 100*time.Millisecond)
	f := startFleet(t, sim.Config{Machines: 1})
	id := slotID(1)
	create(t, f, id)
	e.takeover(t, f, id, e.addMachine(t, f, id))
	waitHeartbeat(t, f, id, time.Time{}, "first heartbeat")
	if err := f.Silence(id); err != nil {
		t.Fatal(err)
	}
	revived := time.Now()
	if err := f.Revive(id); err != nil {
		t.Fatal(err)
	}
	waitHeartbeat(t, f, id, revived, "heartbeat after Revive")
	if err := f.Silence(slotID(1)); err != nil {
		t.Fatal(err)
	}
	if err := f.Kill(id); err != nil {
		t.Fatal(err)
	}
	if err := f.Silence(id); err == nil {
		t.Error("silencing a machine without an agent succeeded")
	}
}

// TestRetakeover checks that a second takeover replaces the agent with one
// of a new key.
func TestRetakeover(t *testing.T) {
	t.Parallel()
	const interval = 100 * time.Millisecond
	e := newEnv(t, interval)
	f := startFleet(t, sim.Config{Machines: 1})
	id := slotID(1)
	create(t, f, id)
	machine := e.addMachine(t, f, id)
	key1 := e.takeover(t, f, id, machine)
	waitHeartbeat(t, f, id, time.Time{}, "first agent heartbeats")

	key2 := e.takeover(t, f, id, machine)
	if bytes.Equal(key1, key2) {
		t.Fatal("the second takeover answered the first one's key")
	}
	if st := f.Stats(); st.AgentsRunning != 1 || st.Takeovers != 2 {
		t.Errorf("Stats() = %+v, want 1 agent after 2 takeovers", st)
	}
	// AgentStarted has the new key now: the new agent's heartbeats are
	// accepted, and the old agent, if it still ran, would fail every one.
	last := waitHeartbeat(t, f, id, time.Now(), "second agent heartbeats")
	failed := f.Stats().HeartbeatsFailed
	for range 3 {
		last = waitHeartbeat(t, f, id, last, "second agent keeps heartbeating")
	}
	if st := f.Stats(); st.HeartbeatsFailed != failed {
		t.Errorf("%d heartbeats failed while the new agent ran: the old agent still runs", st.HeartbeatsFailed-failed)
	}
	_, key, err := e.db.GetAgentStarted(t.Context(), machine)
	if err != nil || !bytes.Equal(key, key2) {
		t.Errorf("AgentStarted key: %v, want the second one", err)
	}
}

// TestInstallation requests an OS installation through the BMDB and waits
// for the simulated agent to carry it out, report it and reboot.
func TestInstallation(t *testing.T) {
	t.Parallel()
	e := newEnv(t, 100*time.Millisecond)
	image := testImage()
	sum := sha256.Sum256(image)
	srv := imageServer(t, image)
	f := startFleet(t, sim.Config{Machines: 1, InstallLatency: 200 * time.Millisecond, RebootLatency: time.Hour, DiskDir: t.TempDir()})
	id := slotID(1)
	create(t, f, id)
	machine := e.addMachine(t, f, id)
	e.takeover(t, f, id, machine)
	waitHeartbeat(t, f, id, time.Time{}, "first heartbeat")

	req, err := proto.Marshal(&agentv1.OSInstallationRequest{
		ImageUrl:     srv.URL + "/os.img",
		ImageSha256:  hex.EncodeToString(sum[:]),
		TargetDevice: "/dev/nvme0n1",
		RebootAfter:  true,
	})
	if err != nil {
		t.Fatal(err)
	}
	gen, err := e.db.RequestInstallation(t.Context(), machine, "test", req)
	if err != nil {
		t.Fatal(err)
	}
	bmdbtest.WaitFor(t, 30*time.Second, "the installation is reported", func(ctx context.Context) (bool, error) {
		in, err := e.db.GetInstallation(ctx, machine)
		return err == nil && in.Installed(), err
	})
	in, err := e.db.GetInstallation(t.Context(), machine)
	if err != nil || in.Report.Generation != gen {
		t.Fatalf("installation: %+v, %v; want generation %d", in, err, gen)
	}
	// reboot_after: once the report is delivered the machine reboots, and
	// its agent is gone.
	bmdbtest.WaitFor(t, 10*time.Second, "the machine reboots after the installation", func(context.Context) (bool, error) {
		return f.Stats().AgentsRunning == 0, nil
	})
	if _, _, err := dial(t, f, id); !errors.Is(err, sim.ErrUnreachable) {
		t.Errorf("dialing a machine rebooting after its installation: %v, want ErrUnreachable", err)
	}
	if st := f.Stats(); st.Installations != 1 || st.Reboots != 0 {
		t.Errorf("Stats() = %+v, want 1 installation and no provider reboot", st)
	}
}

// TestTakeoverFailures checks the answers to bad input and injected faults.
func TestTakeoverFailures(t *testing.T) {
	t.Parallel()
	valid, err := proto.Marshal(&agentv1.TakeoverInit{MachineId: uuid.NewString(), ServerEndpoint: "127.0.0.1:1"})
	if err != nil {
		t.Fatal(err)
	}
	badEndpoint, err := proto.Marshal(&agentv1.TakeoverInit{MachineId: uuid.NewString(), ServerEndpoint: "nowhere"})
	if err != nil {
		t.Fatal(err)
	}
	notUUID, err := proto.Marshal(&agentv1.TakeoverInit{MachineId: "sim-000001", ServerEndpoint: "127.0.0.1:1"})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name  string
		cfg   sim.Config
		stdin []byte
	}{
		{"garbage on stdin", sim.Config{}, []byte("\xff\xff\xff not a protobuf")},
		{"empty stdin", sim.Config{}, []byte{}},
		{"oversized stdin", sim.Config{}, make([]byte, 65<<10)},
		{"endpoint without port", sim.Config{}, badEndpoint},
		{"machine id not a UUID", sim.Config{}, notUUID},
		{"injected takeover failure", sim.Config{TakeoverFailureRate: 1}, valid},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			tt.cfg.Machines = 1
			f := startFleet(t, tt.cfg)
			create(t, f, slotID(1))
			for range 3 {
				c, _ := mustDial(t, f, slotID(1))
				resp := execTakeover(t, c, tt.stdin)
				if resp.GetError() == nil || resp.GetError().GetMessage() == "" {
					t.Fatalf("takeover answered %v, want a TakeoverError", resp)
				}
				t.Logf("TakeoverError: %s", resp.GetError().GetMessage())
			}
			if st := f.Stats(); st.TakeoversFailed != 3 || st.Takeovers != 0 || st.AgentsRunning != 0 {
				t.Errorf("Stats() = %+v, want 3 failed takeovers and no agent", st)
			}
		})
	}
	t.Run("injected SSH failure", func(t *testing.T) {
		t.Parallel()
		f := startFleet(t, sim.Config{Machines: 1, SSHFailureRate: 1})
		create(t, f, slotID(1))
		for range 3 {
			if _, _, err := dial(t, f, slotID(1)); !errors.Is(err, sim.ErrUnreachable) {
				t.Fatalf("dial: %v, want ErrUnreachable", err)
			}
		}
	})
	t.Run("unprovisioned slot", func(t *testing.T) {
		t.Parallel()
		f := startFleet(t, sim.Config{Machines: 1})
		if _, _, err := dial(t, f, slotID(1)); !errors.Is(err, sim.ErrUnreachable) {
			t.Fatalf("dialing a free slot: %v, want ErrUnreachable", err)
		}
	})
	t.Run("dial honours its context", func(t *testing.T) {
		t.Parallel()
		f := startFleet(t, sim.Config{Machines: 1, SSHLatency: time.Hour})
		create(t, f, slotID(1))
		access, err := f.SSHAccess(t.Context(), slotID(1))
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
		defer cancel()
		if _, err := access.Dial(ctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Dial with an expiring context: %v, want DeadlineExceeded", err)
		}
	})
}

// TestKillDuringTakeover checks that a takeover whose machine dies fails
// and starts no agent.
func TestKillDuringTakeover(t *testing.T) {
	t.Parallel()
	f := startFleet(t, sim.Config{Machines: 1, TakeoverLatency: time.Hour})
	id := slotID(1)
	create(t, f, id)
	c, _ := mustDial(t, f, id)
	init, err := proto.Marshal(&agentv1.TakeoverInit{MachineId: uuid.NewString(), ServerEndpoint: "127.0.0.1:1"})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := sshx.Run(t.Context(), c, agentPath+" takeover", init, 1<<20)
		done <- err
	}()
	if err := f.Kill(id); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err == nil {
		t.Error("the takeover of a machine killed meanwhile succeeded")
	}
	if st := f.Stats(); st.AgentsRunning != 0 || st.Takeovers != 0 || st.SSHConnections != 0 {
		t.Errorf("Stats() = %+v, want no agent, no takeover, no connection", st)
	}
}

// TestSFTPFiles checks the simulated file system beyond the upload: listing,
// reading (zeros), removing, and that files are gone after a reboot.
func TestSFTPFiles(t *testing.T) {
	t.Parallel()
	f := startFleet(t, sim.Config{Machines: 1})
	id := slotID(1)
	create(t, f, id)
	c, _ := mustDial(t, f, id)
	upload(t, c, 100_000)
	sc, err := sftp.NewClient(c)
	if err != nil {
		t.Fatal(err)
	}
	defer sc.Close()
	infos, err := sc.ReadDir("/usr/local/bin")
	if err != nil || len(infos) != 1 || infos[0].Name() != "shepherd-agent" || infos[0].Size() != 100_000 {
		t.Fatalf("ReadDir = %v, %v; want the agent", infos, err)
	}
	if fi, err := sc.Stat("/usr"); err != nil || !fi.IsDir() {
		t.Errorf("Stat(/usr) = %v, %v; want a directory", fi, err)
	}
	r, err := sc.Open(agentPath)
	if err != nil {
		t.Fatal(err)
	}
	data, err := io.ReadAll(r)
	r.Close()
	if err != nil || len(data) != 100_000 || bytes.Count(data, []byte{0}) != len(data) {
		t.Errorf("reading the agent: %d bytes, %v; want 100000 zeros", len(data), err)
	}
	if err := sc.Remove(agentPath); err != nil {
		t.Fatal(err)
	}
	if _, err := sc.Stat(agentPath); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Stat after Remove: %v, want ErrNotExist", err)
	}
	if _, err := sc.Open("/no/such/file"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("opening a missing file: %v, want ErrNotExist", err)
	}
	if err := sc.Symlink(agentPath, "/link"); err == nil {
		t.Error("Symlink succeeded")
	}

	upload(t, c, 10)
	if err := f.RebootMachine(t.Context(), id); err != nil {
		t.Fatal(err)
	}
	c2, _ := mustDial(t, f, id)
	sc2, err := sftp.NewClient(c2)
	if err != nil {
		t.Fatal(err)
	}
	defer sc2.Close()
	if _, err := sc2.Stat(agentPath); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("Stat of the agent after a reboot: %v, want ErrNotExist (the rescue system starts empty)", err)
	}
}
