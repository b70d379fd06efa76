package chaos

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/internal/devpki"
	"github.com/shepherd/shepherd/internal/localport"
	"github.com/shepherd/shepherd/internal/pgserver"
	"github.com/shepherd/shepherd/internal/sshtest"
	"github.com/shepherd/shepherd/internal/sshx"
	"github.com/shepherd/shepherd/internal/tcpproxy"
	"github.com/shepherd/shepherd/provider/sim"
)

// The soak's timing, shared by the processes' flags and the checks.
const (
	heartbeatInterval     = 2 * time.Second
	heartbeatTimeout      = 10 * time.Second
	firstHeartbeatTimeout = 30 * time.Second
	lease                 = 10 * time.Second // bmdb.DefaultLease: shepherd run has no flag for it
	workTimeout           = 60 * time.Second
	rebootWindow          = 2 * time.Minute
	rebootBudget          = 40
	providerName          = "lab"
	rebootCommand         = "sudo systemctl reboot"
	databaseName          = "shepherd"
)

// soak is one run: its servers, processes, fleet and record.
type soak struct {
	t    testing.TB
	cfg  config
	dir  string
	bins string
	log  *os.File // the soak's own log: faults applied, healed, failed

	pgMu    sync.Mutex // one PostgreSQL operation (restart, failover) at a time
	primary *pgserver.Server
	standby *pgserver.Server // nil while a failover rebuilds it
	pgGen   int              // names the directories of rebuilt standbys
	// proxies stand between Shepherd and PostgreSQL: proxies[i] leads to
	// whichever server is at position i of the multi-host URL.
	proxies [2]*tcpproxy.Proxy
	// primaryAt is the index of the proxy that leads to the primary.
	primaryAt int

	fleet    *sim.Fleet
	truth    *Truth
	simIDs   []string // provider ids of simulated machines, by index
	simPorts []int    // their SSH ports on 127.0.0.1, by index
	hosts    []*sshtest.Host
	hostMu   []sync.Mutex // one key rotation or agent kill per real host at a time
	agents   string       // the real agents' directory
	procs    []*proc
	servers  []string // callback server endpoints, by server index
	caPEM    []byte

	rec record // what the checks use besides the BMDB and the truth
}

// proc is one `shepherd run` process, restarted after kills.
type proc struct {
	name string
	args []string
	bin  string
	logf *os.File

	mu      sync.Mutex
	cmd     *exec.Cmd
	done    chan struct{}
	killed  bool // we killed it: its exit is expected
	stopped bool // SIGSTOPped by us
	closed  bool // terminated for good: never restarted
	crashes []string
}

// dsn is the multi-host connection string every process uses: both
// proxies, the primary found by target_session_attrs.
func (s *soak) dsn() string {
	return fmt.Sprintf("host=127.0.0.1,127.0.0.1 port=%s,%s user=%s dbname=%s sslmode=disable target_session_attrs=read-write connect_timeout=5",
		port(s.proxies[0].Addr()), port(s.proxies[1].Addr()), s.primary.User(), databaseName)
}

func port(addr string) string {
	_, p, _ := net.SplitHostPort(addr)
	return p
}

// directURL is the current primary's URL without the proxies, for checks.
func (s *soak) directURL() string {
	s.pgMu.Lock()
	defer s.pgMu.Unlock()
	return s.primary.TCPURL(databaseName)
}

func (s *soak) logf(format string, args ...any) {
	fmt.Fprintf(s.log, "%s "+format+"\n", append([]any{time.Now().Format("15:04:05.000")}, args...)...)
}

// start brings everything up and waits until the whole fleet is Healthy.
func (s *soak) start(ctx context.Context) {
	t := s.t
	var err error
	if s.log, err = os.Create(filepath.Join(s.dir, "soak.log")); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.log.Close() })
	s.startPostgres(ctx)
	dataDir := filepath.Join(s.dir, "data")
	if err := os.MkdirAll(dataDir, 0o700); err != nil {
		t.Fatal(err)
	}
	signer, err := sshx.LoadOrCreateKey(filepath.Join(dataDir, "ssh_key"))
	if err != nil {
		t.Fatal(err)
	}
	// The processes share the development CA; made here, before any of
	// them starts, so that they do not race to create it.
	if _, err := devpki.LoadOrCreate(filepath.Join(dataDir, "pki"), []string{"127.0.0.1", "localhost"}); err != nil {
		t.Fatal(err)
	}
	if s.caPEM, err = os.ReadFile(filepath.Join(dataDir, "pki", devpki.CACertFile)); err != nil {
		t.Fatal(err)
	}
	s.startFleet(ctx)
	s.hosts = sshtest.Start(t, s.cfg.realHosts, sshtest.Config{AuthorizedKeys: []ssh.PublicKey{signer.PublicKey()}, AllHostKeyTypes: true})
	s.hostMu = make([]sync.Mutex, len(s.hosts))
	s.agents = filepath.Join(s.dir, "agents")
	t.Cleanup(func() { stopRealAgents(s.agents) })
	cfgPath := s.writeInventory()
	s.startProcesses(dataDir, cfgPath)
	// Every machine heard from since the soak began: the zero time.
	if _, _, err := s.waitAllHealthy(ctx, s.cfg.startBound, time.Time{}); err != nil {
		t.Fatalf("the whole fleet Healthy before the first fault, within %s: %v", s.cfg.startBound, err)
	}
}

func (s *soak) startPostgres(ctx context.Context) {
	t := s.t
	pgDir := filepath.Join(s.dir, "pg")
	if err := os.MkdirAll(pgDir, 0o755); err != nil {
		t.Fatal(err)
	}
	// The postgres OS user must traverse the soak's directory.
	if err := os.Chmod(s.dir, 0o755); err != nil {
		t.Fatal(err)
	}
	var err error
	s.primary, s.standby, err = pgserver.StartSyncPair(ctx, pgDir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.closePostgres() })
	if err := s.createDatabase(ctx); err != nil {
		t.Fatal(err)
	}
	for i, srv := range []*pgserver.Server{s.primary, s.standby} {
		if s.proxies[i], err = tcpproxy.Start(fmt.Sprintf("127.0.0.1:%d", srv.Port())); err != nil {
			t.Fatal(err)
		}
		p := s.proxies[i]
		t.Cleanup(func() { p.Close() })
	}
}

func (s *soak) closePostgres() {
	s.pgMu.Lock()
	defer s.pgMu.Unlock()
	for _, srv := range []*pgserver.Server{s.primary, s.standby} {
		if srv != nil {
			_ = srv.Close()
		}
	}
}

func (s *soak) createDatabase(ctx context.Context) error {
	conn, err := pgx.Connect(ctx, s.primary.TCPURL("postgres"))
	if err != nil {
		return fmt.Errorf("connecting to the primary: %w", err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "CREATE DATABASE "+databaseName); err != nil {
		return fmt.Errorf("creating the BMDB: %w", err)
	}
	return nil
}

// newStandby builds a synchronous standby of the primary and waits until
// the primary's commits wait for it. s.pgMu must be held.
func (s *soak) newStandby(ctx context.Context) (*pgserver.Server, error) {
	s.pgGen++
	sb, err := pgserver.StartStandby(ctx, s.primary, pgserver.Config{
		Dir: filepath.Join(s.dir, "pg", fmt.Sprintf("standby-%d", s.pgGen)), TCP: true,
		Settings: map[string]string{"synchronous_commit": "on"},
	})
	if err != nil {
		return nil, err
	}
	if err := s.primary.SetSynchronousStandby(ctx, pgserver.DefaultStandbyName); err != nil {
		return nil, errors.Join(err, sb.Close())
	}
	if err := s.primary.WaitSynchronous(ctx, pgserver.DefaultStandbyName); err != nil {
		return nil, errors.Join(err, sb.Close())
	}
	return sb, nil
}

// startFleet starts the simulated machines, each with its own SSH server
// on a TCP port of 127.0.0.1.
func (s *soak) startFleet(ctx context.Context) {
	t := s.t
	s.truth = NewTruth()
	var err error
	s.fleet, err = sim.New(sim.Config{
		Name:            "hardware",
		Machines:        s.cfg.machines,
		RebootLatency:   2 * time.Second,
		TakeoverLatency: 50 * time.Millisecond,
		RebootCommand:   rebootCommand,
		Seed:            s.cfg.seed,
		Observer:        s.truth,
		Logger:          slog.New(slog.DiscardHandler),
	})
	if err != nil {
		t.Fatal(err)
	}
	ms, err := s.fleet.ListMachines(ctx)
	if err != nil {
		t.Fatal(err)
	}
	fctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { stop(); wg.Wait() })
	wg.Go(func() {
		if err := s.fleet.Run(fctx); err != nil {
			s.logf("sim fleet stopped: %v", err)
		}
	})
	s.simIDs = make([]string, len(ms))
	for i, m := range ms {
		s.simIDs[i] = m.ID()
	}
	if err := s.fleet.Provision(s.simIDs...); err != nil {
		t.Fatal(err)
	}
	s.simPorts = make([]int, len(ms))
	for i, id := range s.simIDs {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		s.simPorts[i] = ln.Addr().(*net.TCPAddr).Port
		wg.Go(func() {
			if err := s.fleet.ServeSSH(fctx, id, ln); err != nil {
				s.logf("SSH server of %s stopped: %v", id, err)
			}
		})
	}
}

// writeInventory writes the static provider's inventory (every simulated
// machine with its pinned host key and rack, and the real hosts) and its
// configuration, and returns the configuration's path.
func (s *soak) writeInventory() string {
	t := s.t
	var inv strings.Builder
	inv.WriteString("defaults:\n  ssh_user: root\n  reboot_command: \"" + rebootCommand + "\"\nmachines:\n")
	for i, id := range s.simIDs {
		key, err := s.fleet.HostKey(id)
		if err != nil {
			t.Fatal(err)
		}
		pm, err := s.fleet.GetMachine(t.Context(), id)
		if err != nil {
			t.Fatal(err)
		}
		m, ok := pm.(interface{ Location() string })
		if !ok {
			t.Fatalf("simulated machine %s has no location", id)
		}
		fmt.Fprintf(&inv, "  - id: %s\n    address: 127.0.0.1\n    port: %d\n    location: %s\n    host_key: %q\n",
			id, s.simPorts[i], m.Location(), strings.TrimSpace(string(ssh.MarshalAuthorizedKey(key))))
	}
	for i, h := range s.hosts {
		id := realID(i)
		// A "reboot" kills the machine's agent and restarts its sshd.
		reboot := fmt.Sprintf("kill $(cat %s) 2>/dev/null; kill -HUP $(cat %s)", agentPIDFile(s.agents, id), h.PIDFile())
		fmt.Fprintf(&inv, "  - id: %s\n    address: %s\n    port: %d\n    location: real-rack\n    ssh_user: %s\n    reboot_command: %q\n",
			id, h.Addr.Addr(), h.Addr.Port(), h.User, reboot)
	}
	invPath, cfgPath := filepath.Join(s.dir, "inventory.yaml"), filepath.Join(s.dir, "static.yaml")
	if err := os.WriteFile(invPath, []byte(inv.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(cfgPath, []byte("inventory: "+invPath+"\nname: "+providerName+"\nssh_timeout: 10s\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return cfgPath
}

func realID(i int) string { return fmt.Sprintf("real-%d", i+1) }

func agentPIDFile(agents, id string) string { return filepath.Join(agents, id, "state", "agent.pid") }

// startProcesses starts the shepherd processes with the components spread
// over them: two run a callback server, every one an initializer and a
// recoverer, and the provisioner, updater and janitor run in two each.
func (s *soak) startProcesses(dataDir, cfgPath string) {
	t := s.t
	common := []string{"run", "--database-url", s.dsn(), "--data-dir", dataDir,
		"--provider", "static", "--provider-config", cfgPath,
		"--agent", filepath.Join(s.bins, "shepherd-agent"), "--agent-dir", filepath.Join(s.agents, "{provider_id}"),
		"--heartbeat-interval", heartbeatInterval.String(), "--heartbeat-timeout", heartbeatTimeout.String(),
		"--first-heartbeat-timeout", firstHeartbeatTimeout.String(),
		"--max-reboots-per-window", strconv.Itoa(rebootBudget), "--reboot-window", rebootWindow.String(),
		"--janitor-period", "2s", "--provisioner-period", "3s", "--updater-changing-period", "3s", "--updater-stable-period", "20s",
		"--initializer-backoff", "3s,30s,1.5,0", "--recoverer-backoff", "3s,30s,1.5,0",
		"--initializer-work-timeout", workTimeout.String(), "--recoverer-work-timeout", workTimeout.String(),
		"--ssh-connect-timeout", "5s", "--ssh-exec-timeout", "40s",
		"--initializer-parallelism", "8", "--recoverer-parallelism", "8", "--log-level", "info"}
	s.servers = []string{freeAddr(t), freeAddr(t)}
	spread := [][]string{
		{"--components", "server,provisioner,initializer,recoverer,janitor", "--server-listen", s.servers[0]},
		{"--components", "server,initializer,recoverer,updater,janitor", "--server-listen", s.servers[1]},
		{"--components", "initializer,recoverer,provisioner,updater", "--agent-endpoint", s.servers[0],
			"--agent-ca", filepath.Join(dataDir, "pki", devpki.CACertFile)},
	}
	for i, extra := range spread[:s.cfg.processes] {
		f, err := os.Create(filepath.Join(s.dir, fmt.Sprintf("shepherd-%d.log", i+1)))
		if err != nil {
			t.Fatal(err)
		}
		p := &proc{name: fmt.Sprintf("process %d", i+1), bin: filepath.Join(s.bins, "shepherd"),
			args: append(append([]string{}, common...), extra...), logf: f}
		if err := p.start(); err != nil {
			t.Fatal(err)
		}
		s.procs = append(s.procs, p)
		t.Cleanup(func() { p.terminate(); f.Close() })
	}
}

func freeAddr(t testing.TB) string {
	// A killed process listens on it again: below the ephemeral range.
	port, err := localport.Free(localport.Low, localport.High)
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("127.0.0.1:%d", port)
}

func (p *proc) start() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.startLocked()
}

// startLocked starts the process; p.mu must be held.
func (p *proc) startLocked() error {
	cmd := exec.Command(p.bin, p.args...)
	cmd.Stdout, cmd.Stderr = p.logf, p.logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("starting %s: %w", p.name, err)
	}
	done := make(chan struct{})
	p.cmd, p.done, p.killed, p.stopped = cmd, done, false, false
	go func() {
		err := cmd.Wait()
		p.mu.Lock()
		crashed := !p.killed
		if crashed {
			// Nobody asked it to go: a crash, or an exit on an error it
			// should have lived through. It counts as a violation; like a
			// supervisor, the soak starts it again so the run goes on.
			p.crashes = append(p.crashes, fmt.Sprintf("%s exited on its own at %s: %v", p.name, time.Now().Format("15:04:05.000"), err))
		}
		p.mu.Unlock()
		close(done)
		if crashed {
			time.AfterFunc(2*time.Second, func() {
				p.mu.Lock()
				defer p.mu.Unlock()
				if p.done == done && !p.closed {
					_ = p.startLocked()
				}
			})
		}
	}()
	return nil
}

// kill sends SIGKILL and waits for the exit.
func (p *proc) kill() {
	p.mu.Lock()
	p.killed = true
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	_ = cmd.Process.Kill()
	<-done
}

// running reports whether the process runs (stopped or not).
func (p *proc) running() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return !p.exitedLocked()
}

// exitedLocked reports whether the current process has exited; p.mu must
// be held.
func (p *proc) exitedLocked() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// signal sends sig if the process runs and records stops.
func (p *proc) signal(sig syscall.Signal) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.exitedLocked() {
		return false
	}
	if sig == syscall.SIGSTOP && p.stopped || sig == syscall.SIGCONT && !p.stopped {
		return false
	}
	if err := p.cmd.Process.Signal(sig); err != nil {
		return false
	}
	p.stopped = sig == syscall.SIGSTOP
	return true
}

// terminate ends the process for good: SIGCONT, SIGTERM, SIGKILL after 30 s.
func (p *proc) terminate() {
	p.signal(syscall.SIGCONT)
	p.mu.Lock()
	p.killed, p.closed = true, true
	cmd, done := p.cmd, p.done
	p.mu.Unlock()
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		_ = cmd.Process.Kill()
		<-done
	}
}

// ensureRunning restarts the process if it is gone and continues it if it
// is stopped (the end of every fault).
func (p *proc) ensureRunning() error {
	p.signal(syscall.SIGCONT)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.exitedLocked() {
		return p.startLocked()
	}
	return nil
}

// stopRealAgents ends the real agents started under dir.
func stopRealAgents(dir string) {
	files, _ := filepath.Glob(filepath.Join(dir, "*", "state", "agent.pid"))
	for _, f := range files {
		if pid := readPID(f); pid > 1 {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

func readPID(path string) int {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(data)))
	return pid
}

// openPool opens a pool on the current primary, directly (not through the
// proxies, whose faults are for Shepherd), retrying while a failover or a
// restart is under way.
func (s *soak) openPool(ctx context.Context) (*pgxpool.Pool, error) {
	var last error
	for range 60 {
		pool, err := pgxpool.New(ctx, s.directURL())
		if err == nil {
			if err = pool.Ping(ctx); err == nil {
				return pool, nil
			}
			pool.Close()
		}
		last = err
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(500 * time.Millisecond):
		}
	}
	return nil, fmt.Errorf("connecting to the primary: %w", last)
}

// buildBinaries builds shepherd and the static agent into a directory.
func buildBinaries(t testing.TB) string {
	dir := t.TempDir()
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, b := range []struct{ name, pkg string }{
		{"shepherd", "github.com/shepherd/shepherd/cmd/shepherd"},
		{"shepherd-agent", "github.com/shepherd/shepherd/cmd/shepherd-agent"},
	} {
		cmd := exec.Command("go", "build", "-ldflags=-s -w", "-o", filepath.Join(dir, b.name), b.pkg)
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		var out bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &out
		if err := cmd.Run(); err != nil {
			t.Fatalf("building %s: %v\n%s", b.name, err, out.String())
		}
	}
	return dir
}

// tail returns the last n lines of a file, for failure reports.
func tail(path string, n int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
