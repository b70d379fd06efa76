// Package sim is an in-process simulated fleet (SPEC §5.4). It backs
// `shepherd dev` and the scale benchmarks, and lets tests inject faults.
//
// The simulation sits below Shepherd's real code paths, never beside them:
// the initializer reaches a simulated machine over a real SSH connection
// (golang.org/x/crypto/ssh over an in-process connection instead of TCP),
// uploads the agent with real SFTP and runs the takeover with a real
// TakeoverInit on stdin; the simulated agent then sends real heartbeat RPCs
// over TLS to the callback server the TakeoverInit names, and reacts to its
// answers (interval, installation requests) like the real daemon (§4.3).
// An installation runs the real agent's installation code (download,
// SHA-256 check, write, read-back) against a simulated disk, a file per
// machine and disk made only when an installation writes it (see
// Config.DiskDir), so a wrong digest or a missing image fails as in
// production.
// The simulated machines have no shell: a command run over SSH is the
// takeover, except Config.RebootCommand, which reboots the machine as a
// static inventory's reboot_command does; SFTP keeps file names and sizes,
// never contents.
//
// Chaos: besides the failure rates of Config, a test driver can kill,
// silence, hang and revive machines, make their reboots fail or hang
// (SetRebootFault), cut their heartbeats off (Partition), and learn what
// really happened through Config.Observer. ServeSSH serves a machine's SSH
// server on a real TCP listener, so that other processes reach it as they
// would a real machine, e.g. through the static provider after Provision.
//
// Out-of-band power: with Config.BMC, machines get simulated BMCs (the
// Fleet is a provider.PowerController) whose power state drives the
// machine: off ends its system, on boots it as a reboot does. Their faults
// are those of real BMCs (busy, wrong credentials, hung, dropped commands,
// power-on refused after power-off). Hang freezes machines so that only a
// power cycle brings them back: their agents fall silent, their SSH servers
// do not answer, and in-band reboots cannot reach them.
//
// Scale: a slot is a small struct in one slice, so 100,000 machines cost a
// few megabytes until they are used. There is no goroutine per machine: SSH
// connections exist only while a takeover runs, reboots are deadlines, and
// one scheduler goroutine hands due heartbeats to a fixed pool of workers.
// With SharedAgentKey, agents share a few TLS connections instead of owning
// one each.
package sim

import (
	"cmp"
	"context"
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.yaml.in/yaml/v3"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/provider"
)

// maxMachines bounds the fleet so that every slot id has the same width
// ("sim-" and six digits) and every slot gets a distinct 10.x.y.z address.
const maxMachines = 999_999

// machinesPerRack is how many slots share a Location.
const machinesPerRack = 100

// idPrefix starts every slot id. Ids are not UUIDs on purpose: the
// provider contract says ids are opaque strings.
const idPrefix = "sim-"

// idWidth is the length of every slot id.
const idWidth = len(idPrefix) + 6

// defaultMaxImageBytes is Config.MaxImageBytes's default: 1 GiB.
const defaultMaxImageBytes = 1 << 30

// Config configures a simulated fleet. Zero values mean defaults.
type Config struct {
	// Name is the provider name recorded in the BMDB; default "sim".
	Name string
	// Machines is the fleet size (slots); default 50, at most 999,999.
	Machines int
	// SSHLatency is added when an SSH connection is opened (Dial).
	SSHLatency time.Duration
	// TakeoverLatency is how long the takeover command takes once its
	// stdin is read.
	TakeoverLatency time.Duration
	// RebootLatency is how long a rebooting machine is unreachable over SSH.
	RebootLatency time.Duration
	// InstallLatency is the least time an OS installation takes: its
	// report goes out no earlier, even if the real installation code (see
	// DiskDir) finished sooner.
	InstallLatency time.Duration
	// DiskDir is where the simulated disks live that installations write
	// to: the fleet makes a directory of its own in it when the first
	// installation starts, with a file per machine and disk an
	// installation wrote, and removes it when Run returns. Default
	// os.TempDir().
	DiskDir string
	// MaxImageBytes is the largest image an installation accepts (a
	// larger one fails, as on a real agent); default 1 GiB, so that a
	// development fleet does not fill the disk.
	MaxImageBytes int64
	// InstallConcurrency bounds the installations that download and
	// write at once, and with them the buffers and staging files they
	// take; the others wait (and are reported running meanwhile).
	// Default 8.
	InstallConcurrency int
	// HangEvery, if set, hangs one running machine (picked by the seed;
	// see Hang) every HangEvery while the fleet runs, so that a
	// development fleet keeps climbing the recovery ladder to its BMCs.
	HangEvery time.Duration
	// TakeoverFailureRate is the share (0..1) of takeovers that answer with
	// a TakeoverError although their input was valid.
	TakeoverFailureRate float64
	// RebootFailureRate is the share (0..1) of reboots and reinstalls the
	// provider refuses, and of reboot commands (RebootCommand) that fail.
	RebootFailureRate float64
	// SSHFailureRate is the share (0..1) of SSH dials that fail.
	SSHFailureRate float64
	// SharedAgentKey makes every agent use one fleet-wide key and share
	// Connections TLS connections, so 100,000 agents cost kilobytes each
	// instead of a TLS connection each. By default every takeover generates
	// a fresh key and the agent has its own connection, like a real agent.
	SharedAgentKey bool
	// Connections is the number of TLS connections agents share in
	// SharedAgentKey mode; default 4.
	Connections int
	// HeartbeatConcurrency bounds the heartbeats in flight at once; default 64.
	HeartbeatConcurrency int
	// Seed makes host keys, the shared agent key and failure injection
	// reproducible. Every value, 0 included, is a valid seed: the same seed
	// gives the same host keys on every run, as real machines keep theirs.
	Seed int64
	// Logger receives the fleet's logs; nil discards them.
	Logger *slog.Logger
	// Registerer receives the fleet's metrics; nil keeps them private.
	Registerer prometheus.Registerer
	// RebootCommand, if set, is the command that reboots a machine when
	// run over SSH, as a static inventory's reboot_command: it answers
	// exit status 0 and the machine goes down (see RebootMachine), and the
	// connection closes. Subject to SetRebootFault and RebootFailureRate.
	// Every other command is the takeover.
	RebootCommand string
	// Observer, if set, is told what really happens (heartbeats answered,
	// reboots, agents started). It is not part of the YAML configuration.
	Observer Observer
	// BMC gives machines simulated BMCs (see BMCConfig); nil, the default,
	// gives none, and BMC answers provider.ErrNoBMC for every machine. A
	// pointer so that Config stays comparable.
	BMC *BMCConfig
}

// Validate names the first bad field and its value. It changes nothing.
func (c Config) Validate() error {
	switch {
	case c.Machines < 0 || c.Machines > maxMachines:
		return fmt.Errorf("sim: Machines must be 0 (default 50) to %d, got %d", maxMachines, c.Machines)
	case c.SSHLatency < 0:
		return fmt.Errorf("sim: SSHLatency must be >= 0, got %s", c.SSHLatency)
	case c.TakeoverLatency < 0:
		return fmt.Errorf("sim: TakeoverLatency must be >= 0, got %s", c.TakeoverLatency)
	case c.RebootLatency < 0:
		return fmt.Errorf("sim: RebootLatency must be >= 0, got %s", c.RebootLatency)
	case c.InstallLatency < 0:
		return fmt.Errorf("sim: InstallLatency must be >= 0, got %s", c.InstallLatency)
	case c.MaxImageBytes < 0:
		return fmt.Errorf("sim: MaxImageBytes must be >= 0 (0 = default), got %d", c.MaxImageBytes)
	case c.InstallConcurrency < 0:
		return fmt.Errorf("sim: InstallConcurrency must be >= 0 (0 = default), got %d", c.InstallConcurrency)
	case c.DiskDir != "" && !filepath.IsAbs(c.DiskDir):
		return fmt.Errorf("sim: DiskDir must be an absolute path, got %q", c.DiskDir)
	case c.HangEvery < 0:
		return fmt.Errorf("sim: HangEvery must be >= 0 (0 = never), got %s", c.HangEvery)
	case c.Connections < 0:
		return fmt.Errorf("sim: Connections must be >= 0 (0 = default), got %d", c.Connections)
	case c.HeartbeatConcurrency < 0:
		return fmt.Errorf("sim: HeartbeatConcurrency must be >= 0 (0 = default), got %d", c.HeartbeatConcurrency)
	case c.Name != "" && !validName(c.Name):
		return fmt.Errorf("sim: Name must be letters, digits, '-' and '_', got %q", c.Name)
	}
	for _, r := range []struct {
		name string
		v    float64
	}{
		{"TakeoverFailureRate", c.TakeoverFailureRate},
		{"RebootFailureRate", c.RebootFailureRate},
		{"SSHFailureRate", c.SSHFailureRate},
	} {
		if math.IsNaN(r.v) || r.v < 0 || r.v > 1 {
			return fmt.Errorf("sim: %s must be between 0 and 1, got %v", r.name, r.v)
		}
	}
	if c.BMC != nil {
		return c.BMC.validate(cmp.Or(c.Machines, 50), c.Seed)
	}
	return nil
}

func validName(s string) bool {
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_') {
			return false
		}
	}
	return len(s) <= 64
}

// slot is one simulated machine. It is kept small because a fleet holds
// 100,000 of them in one slice: everything that only exists while a machine
// is busy (its agent, its files, its SSH connections) lives elsewhere.
type slot struct {
	agent *daemon // the running agent; nil if none
	// rebootUntil is when a rebooting machine answers SSH again, as an
	// offset from Fleet.start; 0 if it is not rebooting.
	rebootUntil time.Duration
	// lastReboot is when the provider last rebooted the machine (offset
	// from Fleet.start); lastHeartbeat when its agent last got an answer.
	lastReboot    time.Duration
	lastHeartbeat time.Duration
	// installed is the highest installation generation an agent of this
	// machine started, like the real agent's state file: a generation is
	// never installed twice, not even by the agent of a later takeover.
	installed int64
	// boot counts everything that ends the machine's running system
	// (reboot, reinstall, kill), so a takeover that raced with one does
	// not start an agent on a system that is gone.
	boot       uint32
	reboots    uint32
	reinstalls uint32 // mixed into the host key: a reinstall changes it
	used       bool
	killed     bool
	// partitioned drops the heartbeats of the machine's agents (Partition).
	partitioned bool
	rebootFault uint8 // a RebootFault (SetRebootFault)
	// hung: the running system froze (Hang) until it ends (power cycle,
	// Kill, release) or Revive.
	hung bool
	// off: the last power command its BMC carried out was Off. powerAt is
	// when that command's state shows at the BMC (offset from Fleet.start);
	// the machine itself goes down at once.
	off     bool
	powerAt time.Duration
}

// Fleet is a simulated fleet. It implements provider.Provider,
// provider.Recoverer, provider.Releaser, provider.SSHAccessor,
// provider.PowerController (see Config.BMC) and provider.Runner. Create
// it with New and run its heartbeats with Run.
type Fleet struct {
	cfg     Config
	log     *slog.Logger
	metrics *metrics
	start   time.Time // the origin of every time offset in slots and agents
	ids     string    // every slot id, idWidth bytes each: ID() slices it, allocating nothing
	hostKey [32]byte  // seeds every host key
	// agentKey is the fleet-wide agent key in SharedAgentKey mode.
	agentKey ed25519.PrivateKey

	mu    sync.Mutex
	slots []slot
	rng   *rand.Rand // failure injection; guarded by mu
	// files are the SFTP file systems of machines that were uploaded to
	// since they last booted; few machines have one at a time.
	files map[int32]*memFS
	// conns are the open SSH connections by machine; they exist only
	// while a takeover runs.
	conns map[int32]map[net.Conn]struct{}
	// holes are the TCP connections ServeSSH accepted for killed machines
	// and holds without answering, by machine.
	holes map[int32]map[net.Conn]struct{}
	// kept are the installation reports of machines whose agent stopped
	// before the server acknowledged them, for the next agent to send, by
	// machine (see stopAgentLocked); few machines have one at a time.
	kept    map[int32]*agentv1.OSInstallationReport
	queue   agentQueue             // agents waiting for their next heartbeat
	pools   map[string]*sharedPool // shared-key clients by endpoint and CA
	stats   Stats
	running bool // Run was called
	stopped bool // Run returned: nothing may start any more

	wake  chan struct{}  // tells the scheduler the queue's head changed
	conWG sync.WaitGroup // goroutines serving SSH connections

	// bmc says which machines have a BMC, and which faults; nil without
	// Config.BMC.
	bmc *bmcPlan
	// bmcs are the BMCs handed out, by machine: one controller each, kept
	// so that its pacing holds across callers; guarded by mu.
	bmcs map[int32]*simBMC

	// disks is the directory of the simulated disks, "" until the first
	// installation makes it; guarded by mu.
	disks string
	// installs are the installation goroutines; installSlots holds a
	// token for each that downloads or writes (InstallConcurrency).
	installs     sync.WaitGroup
	installSlots chan struct{}
}

// New validates cfg and returns a fleet of cfg.Machines unused slots.
func New(cfg Config) (*Fleet, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Name = cmp.Or(cfg.Name, "sim")
	cfg.Machines = cmp.Or(cfg.Machines, 50)
	cfg.Connections = cmp.Or(cfg.Connections, 4)
	cfg.HeartbeatConcurrency = cmp.Or(cfg.HeartbeatConcurrency, 64)
	cfg.DiskDir = cmp.Or(cfg.DiskDir, os.TempDir())
	cfg.MaxImageBytes = cmp.Or(cfg.MaxImageBytes, defaultMaxImageBytes)
	cfg.InstallConcurrency = cmp.Or(cfg.InstallConcurrency, 8)
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	reg := cfg.Registerer
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	m, err := newMetrics(reg, cfg.Name)
	if err != nil {
		return nil, err
	}
	var ids strings.Builder
	ids.Grow(cfg.Machines * idWidth)
	for i := range cfg.Machines {
		fmt.Fprintf(&ids, "%s%06d", idPrefix, i+1)
	}
	var seed [8]byte
	binary.BigEndian.PutUint64(seed[:], uint64(cfg.Seed))
	f := &Fleet{
		cfg:      cfg,
		log:      log.With("component", "sim", "provider", cfg.Name),
		metrics:  m,
		start:    time.Now(),
		ids:      ids.String(),
		hostKey:  sha256.Sum256(append([]byte("shepherd-sim host keys\x00"), seed[:]...)),
		slots:    make([]slot, cfg.Machines),
		rng:      rand.New(rand.NewPCG(uint64(cfg.Seed), 0x5368657068657264)), // "Shepherd"
		files:    map[int32]*memFS{},
		kept:     map[int32]*agentv1.OSInstallationReport{},
		conns:    map[int32]map[net.Conn]struct{}{},
		holes:    map[int32]map[net.Conn]struct{}{},
		pools:    map[string]*sharedPool{},
		wake:     make(chan struct{}, 1),
		agentKey: ed25519.NewKeyFromSeed(sha256Of("shepherd-sim agent key\x00", seed[:])),
		bmcs:     map[int32]*simBMC{},

		installSlots: make(chan struct{}, cfg.InstallConcurrency),
	}
	if cfg.BMC != nil {
		f.bmc = newBMCPlan(*cfg.BMC, cfg.Machines, cfg.Seed)
	}
	f.stats.Slots = cfg.Machines
	return f, nil
}

func sha256Of(parts ...any) []byte {
	h := sha256.New()
	for _, p := range parts {
		switch p := p.(type) {
		case string:
			io.WriteString(h, p)
		case []byte:
			h.Write(p)
		}
	}
	return h.Sum(nil)
}

// now is the time since the fleet started: monotonic, and 8 bytes where a
// time.Time would take 24 in every slot.
func (f *Fleet) now() time.Duration { return time.Since(f.start) }

// at turns an offset from f.start back into a time; 0 is the zero time.
func (f *Fleet) at(d time.Duration) time.Time {
	if d == 0 {
		return time.Time{}
	}
	return f.start.Add(d)
}

// id returns slot i's provider id without allocating.
func (f *Fleet) id(i int32) string { return f.ids[int(i)*idWidth : int(i+1)*idWidth] }

// index parses a slot id; ok is false for anything New did not hand out.
func (f *Fleet) index(id string) (int32, bool) {
	if len(id) != idWidth || !strings.HasPrefix(id, idPrefix) {
		return 0, false
	}
	n, err := strconv.Atoi(id[len(idPrefix):])
	if err != nil || n < 1 || n > len(f.slots) || f.id(int32(n-1)) != id {
		return 0, false
	}
	return int32(n - 1), true
}

// lookup returns the index of slot id or an error wrapping
// provider.ErrNotFound.
func (f *Fleet) lookup(id string) (int32, error) {
	i, ok := f.index(id)
	if !ok {
		return 0, fmt.Errorf("sim: machine %q: %w", id, provider.ErrNotFound)
	}
	return i, nil
}

// chance draws from the seeded generator; f.mu must be held.
func (f *Fleet) chance(rate float64) bool {
	return rate > 0 && f.rng.Float64() < rate
}

// Name returns the provider name.
func (f *Fleet) Name() string { return f.cfg.Name }

// machine is a slot as ListMachines and GetMachine report it: a small value
// computed from the slot, so listing 100,000 slots allocates little.
type machine struct {
	id     string
	index  int32
	used   bool
	killed bool
	off    bool
}

var _ provider.Described = (*machine)(nil)

// ID returns the slot id, "sim-000001" and up.
func (m *machine) ID() string { return m.id }

// Addr is a fake address unique per slot, 10.x.y.z:22. Nothing dials it:
// SSH goes through SSHAccess.Dial.
func (m *machine) Addr() netip.AddrPort {
	n := uint32(m.index) + 1
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, byte(n >> 16), byte(n >> 8), byte(n)}), 22)
}

// Availability is KnownUnused for free slots and KnownUsed for slots turned
// into machines of ours.
func (m *machine) Availability() provider.Availability {
	if m.used {
		return provider.KnownUsed
	}
	return provider.KnownUnused
}

// Failed is always false: simulated machines fail through Kill, which a
// provider reports as a stopped machine, not as given up on.
func (m *machine) Failed() bool { return false }

// Location is the machine's rack, 100 machines per rack.
func (m *machine) Location() string {
	return fmt.Sprintf("sim-rack-%02d", int(m.index)/machinesPerRack+1)
}

// ReservationID is empty: simulated slots have no reservations.
func (m *machine) ReservationID() string { return "" }

// Status is Running, or Stopped while the machine is killed or its BMC
// powered it off.
func (m *machine) Status() provider.Status {
	if m.killed || m.off {
		return provider.StatusStopped
	}
	return provider.StatusRunning
}

// machineLocked describes slot i; f.mu must be held.
func (f *Fleet) machineLocked(i int32) machine {
	s := &f.slots[i]
	return machine{id: f.id(i), index: i, used: s.used, killed: s.killed, off: s.off}
}

// ListMachines returns every slot, sorted by id.
func (f *Fleet) ListMachines(ctx context.Context) ([]provider.Machine, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	ms := make([]machine, len(f.slots))
	out := make([]provider.Machine, len(f.slots))
	f.mu.Lock()
	for i := range ms {
		ms[i] = f.machineLocked(int32(i))
	}
	f.mu.Unlock()
	for i := range ms {
		out[i] = &ms[i]
	}
	return out, nil
}

// GetMachine returns slot id, or an error wrapping provider.ErrNotFound.
func (f *Fleet) GetMachine(ctx context.Context, id string) (provider.Machine, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	i, err := f.lookup(id)
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	m := f.machineLocked(i)
	f.mu.Unlock()
	return &m, nil
}

// CreateMachine marks the slot req.From names as used and returns it.
// Creating from a slot that is already used returns the same machine, so
// a retried or concurrent create never makes a second one.
func (f *Fleet) CreateMachine(ctx context.Context, req provider.CreateRequest) (provider.Machine, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	if req.From == nil {
		return nil, errors.New("sim: CreateRequest.From is required")
	}
	i, err := f.lookup(req.From.ID())
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	if !f.slots[i].used {
		f.slots[i].used = true
		f.stats.Used++
	}
	m := f.machineLocked(i)
	f.mu.Unlock()
	f.log.DebugContext(ctx, "machine created", "provider_id", m.id)
	return &m, nil
}

// RebootMachine reboots a machine: its agent stops at once and it does not
// answer SSH for RebootLatency; then it is reachable again, without an
// agent, like a machine rebooted into a rescue system. It fails for a
// killed, hung (Hang), powered off or unused machine (an error wrapping
// provider.ErrNotReached: like an in-band reboot, it needs a live system),
// with RebootFailureRate (an injected failure) and as SetRebootFault says:
// RebootFails returns an error, RebootHangs blocks until ctx ends and
// returns its error, wrapped.
func (f *Fleet) RebootMachine(ctx context.Context, id string) error {
	return f.reboot(ctx, id, false)
}

// ReinstallMachine is a reboot that also changes the machine's SSH host
// key, as reinstalling its operating system would.
func (f *Fleet) ReinstallMachine(ctx context.Context, id string) error {
	return f.reboot(ctx, id, true)
}

func (f *Fleet) reboot(ctx context.Context, id string, reinstall bool) error {
	what := "rebooting"
	if reinstall {
		what = "reinstalling"
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("sim: %s %s: %w (%w)", what, id, err, provider.ErrNotReached)
	}
	i, err := f.lookup(id)
	if err != nil {
		return fmt.Errorf("%w (%w)", err, provider.ErrNotReached)
	}
	f.mu.Lock()
	s := &f.slots[i]
	outcome := RebootWorks
	switch {
	case !s.used:
		err = fmt.Errorf("sim: %s %s: the machine is not provisioned (%w)", what, id, provider.ErrNotReached)
	case s.killed:
		err = fmt.Errorf("sim: %s %s: the machine does not respond (killed) (%w)", what, id, provider.ErrNotReached)
	case s.off:
		err = fmt.Errorf("sim: %s %s: the machine is powered off (%w)", what, id, provider.ErrNotReached)
	case s.hung:
		err = fmt.Errorf("sim: %s %s: the machine does not respond (hung) (%w)", what, id, provider.ErrNotReached)
	default:
		outcome = f.rebootOutcomeLocked(i)
		if outcome == RebootFails {
			err = fmt.Errorf("sim: %s %s: injected failure", what, id)
		}
	}
	if outcome == RebootHangs {
		f.stats.RebootsHung++
		f.mu.Unlock()
		f.metrics.reboots.WithLabelValues("error").Inc()
		f.log.InfoContext(ctx, "reboot hangs", "provider_id", id, "reinstall", reinstall)
		<-ctx.Done()
		return fmt.Errorf("sim: %s %s: no answer (the reboot hangs): %w", what, id, ctx.Err())
	}
	if err != nil {
		f.stats.RebootsFailed++
		f.mu.Unlock()
		f.metrics.reboots.WithLabelValues("error").Inc()
		return err
	}
	at, closeAfter := f.rebootLocked(i, reinstall, outcome)
	f.mu.Unlock()
	closeAfter()
	f.rebooted(ctx, i, at, reinstall)
	return nil
}

// rebootLocked reboots slot i now, as the provider or the reboot command
// does: it counts the reboot and ends the running system; with outcome
// RebootStaysDown the machine does not come up again. f.mu must be
// held; it returns when the reboot happened and a func that closes what
// must be closed once f.mu is released. The caller then calls rebooted.
func (f *Fleet) rebootLocked(i int32, reinstall bool, outcome RebootFault) (at time.Duration, closeAfter func()) {
	now := f.now()
	if reinstall {
		f.slots[i].reinstalls++
	}
	closeAfter = f.restartLocked(i, now, now+f.cfg.RebootLatency)
	if outcome == RebootStaysDown {
		// The system that ended took its hang with it; the one that
		// boots hangs.
		f.slots[i].hung = true
		f.stats.Hung++
	}
	return now, closeAfter
}

// restartLocked is every reboot's core, a BMC's power-on included: at now
// the running system ends (agent, files, SSH connections), and the machine
// answers SSH again from up, without an agent and with the same host key.
// It counts a reboot. f.mu must be held; the returned func closes what must
// be closed once it is released. The caller then calls rebooted.
func (f *Fleet) restartLocked(i int32, now, up time.Duration) func() {
	s := &f.slots[i]
	s.reboots++
	s.lastReboot = now
	s.rebootUntil = up
	f.stats.Reboots++
	return f.shutdownLocked(i)
}

// rebooted reports a reboot rebootLocked did at at: metrics, log and the
// observer. f.mu must not be held.
func (f *Fleet) rebooted(ctx context.Context, i int32, at time.Duration, reinstall bool) {
	f.metrics.reboots.WithLabelValues("ok").Inc()
	f.log.InfoContext(ctx, "machine rebooted", "provider_id", f.id(i), "reinstall", reinstall)
	f.observeRebooted(i, at)
}

// ReleaseMachine gives a machine of ours back, like deleting a cloud
// device: its agent stops at once (its heartbeats end), its SSH
// connections close, and the slot becomes free capacity again
// (KnownUnused, not reachable over SSH). A killed machine can be released
// too; a device made from the slot later is a fresh install (a new host
// key, nothing installed). Releasing a free slot does nothing.
func (f *Fleet) ReleaseMachine(ctx context.Context, id string) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("sim: releasing %s: %w", id, err)
	}
	i, err := f.lookup(id)
	if err != nil {
		return err
	}
	f.mu.Lock()
	s := &f.slots[i]
	if !s.used {
		f.mu.Unlock()
		return nil
	}
	closeAfter := f.shutdownLocked(i)
	s.used = false
	f.stats.Used--
	if s.killed {
		s.killed = false
		f.stats.Killed--
	}
	s.rebootUntil, s.installed = 0, 0
	delete(f.kept, i)           // a fresh device's agent has nothing to report
	s.off, s.powerAt = false, 0 // a fresh device is powered on
	s.reinstalls++
	f.stats.Releases++
	f.mu.Unlock()
	closeAfter()
	f.wipeDisks(i)
	f.log.InfoContext(ctx, "machine released", "provider_id", id)
	return nil
}

// shutdownLocked ends slot i's running system: its agent, its files and
// its SSH connections, and a hang with it. f.mu must be held; the returned
// func closes what must be closed outside the lock.
func (f *Fleet) shutdownLocked(i int32) func() {
	s := &f.slots[i]
	s.boot++
	if s.hung {
		s.hung = false
		f.stats.Hung--
	}
	var client *http.Client
	if s.agent != nil {
		client = f.stopAgentLocked(s.agent)
	}
	delete(f.files, i)
	conns := f.conns[i]
	delete(f.conns, i)
	return func() {
		closeIdle(client)
		for c := range conns {
			c.Close()
		}
	}
}

// Silence makes the machine's agent stop sending heartbeats while the
// machine stays up, like a hung agent. Revive, a reboot or a new takeover
// ends it.
func (f *Fleet) Silence(id string) error {
	i, err := f.lookup(id)
	if err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	a := f.slots[i].agent
	if a == nil {
		return fmt.Errorf("sim: silencing %s: no agent runs on it", id)
	}
	if !a.silenced {
		a.silenced = true
		f.queue.remove(a)
		f.stats.AgentsSilenced++
	}
	return nil
}

// Kill makes the machine die: it does not answer SSH, its agent is gone,
// and reboots fail, until Revive.
func (f *Fleet) Kill(id string) error {
	i, err := f.lookup(id)
	if err != nil {
		return err
	}
	f.mu.Lock()
	s := &f.slots[i]
	if s.killed {
		f.mu.Unlock()
		return nil
	}
	s.killed = true
	f.stats.Killed++
	closeAfter := f.shutdownLocked(i)
	f.mu.Unlock()
	closeAfter()
	f.log.Info("machine killed", "provider_id", id)
	return nil
}

// Revive undoes Kill: the machine is powered on again and boots without an
// agent; the connections ServeSSH held unanswered while it was dead are
// reset (closed). On a machine that was only silenced or hung (Hang), it
// makes the agent resume its heartbeats and, if hung, SSH answer again. A
// machine its BMC powered off stays off.
func (f *Fleet) Revive(id string) error {
	i, err := f.lookup(id)
	if err != nil {
		return err
	}
	f.mu.Lock()
	s := &f.slots[i]
	if s.killed {
		s.killed = false
		f.stats.Killed--
	}
	if s.hung {
		s.hung = false
		f.stats.Hung--
	}
	if a := s.agent; a != nil && a.silenced {
		a.silenced = false
		f.stats.AgentsSilenced--
		if !a.inflight {
			f.scheduleLocked(a, f.now())
		}
	}
	holes := f.holes[i]
	delete(f.holes, i)
	f.mu.Unlock()
	for c := range holes {
		c.Close()
	}
	f.log.Info("machine revived", "provider_id", id)
	return nil
}

// Stats counts what the fleet holds and did.
type Stats struct {
	Slots          int // machines in the fleet
	Used           int // slots turned into machines of ours (CreateMachine, Adopt)
	Killed         int // machines killed and not revived
	AgentsRunning  int // agents started and not stopped, silenced ones included
	AgentsSilenced int // running agents that send no heartbeats, those of hung machines included
	SSHConnections int // SSH connections open now
	Hung           int // machines hung (Hang) whose system did not end or revive since

	HeartbeatsOK     int64 // heartbeats the server answered
	HeartbeatsFailed int64 // heartbeats that failed (network, TLS, rejected, dropped)
	// HeartbeatsDropped counts the heartbeats a Partition dropped; they
	// are counted in HeartbeatsFailed too.
	HeartbeatsDropped int64
	Takeovers         int64 // takeovers that started an agent
	TakeoversFailed   int64 // takeovers that answered with a TakeoverError
	Reboots           int64 // reboots and reinstalls through the provider or RebootCommand, and BMC power-ons
	RebootsFailed     int64 // reboots and reinstalls refused, and reboot commands that failed
	RebootsHung       int64 // reboots, reinstalls and reboot commands that hung (RebootHangs)
	Installations     int64 // installations that succeeded
	// InstallationsFailed counts the installations that failed (a bad
	// image, digest or target); interrupted ones are not counted.
	InstallationsFailed int64
	Releases            int64 // machines released (ReleaseMachine) and free again
	PowerOffs           int64 // Off commands a simulated BMC carried out (not dropped)
	PowerOns            int64 // On commands a simulated BMC carried out (not dropped or refused); each boots the machine
}

// Stats returns the fleet's counts.
func (f *Fleet) Stats() Stats {
	f.mu.Lock()
	defer f.mu.Unlock()
	st := f.stats
	for _, cs := range f.conns {
		st.SSHConnections += len(cs)
	}
	return st
}

// Rebooted returns when the provider (or RebootCommand, or a power-on
// through the machine's BMC) last rebooted (or reinstalled) the machine and
// how many times it did; the zero time and 0 if never or if id is unknown.
// Reboots an installation asks for are not counted: they are the agent's,
// not the provider's.
func (f *Fleet) Rebooted(id string) (at time.Time, n int) {
	i, ok := f.index(id)
	if !ok {
		return time.Time{}, 0
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	s := &f.slots[i]
	return f.at(s.lastReboot), int(s.reboots)
}

// LastHeartbeat returns when the machine's agent (the current one or an
// earlier one) last got a successful answer to a heartbeat; the zero time
// if never.
func (f *Fleet) LastHeartbeat(id string) time.Time {
	i, ok := f.index(id)
	if !ok {
		return time.Time{}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.at(f.slots[i].lastHeartbeat)
}

// yamlConfig is Config as the provider's YAML configuration spells it.
type yamlConfig struct {
	Name                 string        `yaml:"name"`
	Machines             int           `yaml:"machines"`
	SSHLatency           time.Duration `yaml:"ssh_latency"`
	TakeoverLatency      time.Duration `yaml:"takeover_latency"`
	RebootLatency        time.Duration `yaml:"reboot_latency"`
	InstallLatency       time.Duration `yaml:"install_latency"`
	DiskDir              string        `yaml:"disk_dir"`
	MaxImageBytes        int64         `yaml:"max_image_bytes"`
	InstallConcurrency   int           `yaml:"install_concurrency"`
	HangEvery            time.Duration `yaml:"hang_every"`
	TakeoverFailureRate  float64       `yaml:"takeover_failure_rate"`
	RebootFailureRate    float64       `yaml:"reboot_failure_rate"`
	SSHFailureRate       float64       `yaml:"ssh_failure_rate"`
	SharedAgentKey       bool          `yaml:"shared_agent_key"`
	Connections          int           `yaml:"connections"`
	HeartbeatConcurrency int           `yaml:"heartbeat_concurrency"`
	Seed                 int64         `yaml:"seed"`
	RebootCommand        string        `yaml:"reboot_command"`
	BMC                  yamlBMC       `yaml:",inline"`
}

// ParseConfig reads a fleet's YAML configuration: Config's fields in
// snake_case, durations like "10ms", and Config.BMC's as the bmc_* keys
// (see yamlBMC). Unknown keys are errors, so a typo does not silently
// leave a default in force. Empty input gives defaults.
func ParseConfig(data []byte) (Config, error) {
	var y yamlConfig
	dec := yaml.NewDecoder(strings.NewReader(string(data)))
	dec.KnownFields(true)
	if err := dec.Decode(&y); err != nil && !errors.Is(err, io.EOF) {
		return Config{}, fmt.Errorf("sim: parsing configuration: %w", err)
	}
	cfg := Config{
		Name:                 y.Name,
		Machines:             y.Machines,
		SSHLatency:           y.SSHLatency,
		TakeoverLatency:      y.TakeoverLatency,
		RebootLatency:        y.RebootLatency,
		InstallLatency:       y.InstallLatency,
		DiskDir:              y.DiskDir,
		MaxImageBytes:        y.MaxImageBytes,
		InstallConcurrency:   y.InstallConcurrency,
		HangEvery:            y.HangEvery,
		TakeoverFailureRate:  y.TakeoverFailureRate,
		RebootFailureRate:    y.RebootFailureRate,
		SSHFailureRate:       y.SSHFailureRate,
		SharedAgentKey:       y.SharedAgentKey,
		Connections:          y.Connections,
		HeartbeatConcurrency: y.HeartbeatConcurrency,
		Seed:                 y.Seed,
		RebootCommand:        y.RebootCommand,
		BMC:                  y.BMC.config(),
	}
	return cfg, cfg.Validate()
}

// Factory creates a fleet from its YAML configuration (see ParseConfig),
// with the logger and registerer of env. The process must run the fleet
// (it is a provider.Runner) for its agents to send heartbeats.
func Factory(ctx context.Context, env provider.Env, config []byte) (provider.Provider, error) {
	cfg, err := ParseConfig(config)
	if err != nil {
		return nil, err
	}
	cfg.Logger, cfg.Registerer = env.Logger, env.Registerer
	return New(cfg)
}

var (
	_ provider.Provider        = (*Fleet)(nil)
	_ provider.PowerController = (*Fleet)(nil)
	_ provider.Recoverer       = (*Fleet)(nil)
	_ provider.Releaser        = (*Fleet)(nil)
	_ provider.SSHAccessor     = (*Fleet)(nil)
	_ provider.Runner          = (*Fleet)(nil)
)
