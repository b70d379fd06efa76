package sim

import (
	"container/heap"
	"context"
	"crypto/ed25519"
	"crypto/tls"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/google/uuid"

	"github.com/shepherd/shepherd/agent"
	"github.com/shepherd/shepherd/agent/install"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/api/agent/v1/agentv1connect"
)

const (
	// heartbeatTimeout bounds one heartbeat RPC, as the real daemon's does.
	heartbeatTimeout = 15 * time.Second
	// defaultInterval is the heartbeat interval until the server names one.
	defaultInterval = 30 * time.Second
	// maxInterval caps what a server may ask for, as the real daemon does.
	maxInterval = 24 * time.Hour
	// minBackoff and maxBackoff bound the exponential backoff after
	// failed heartbeats.
	minBackoff = 100 * time.Millisecond
	maxBackoff = 30 * time.Second
	// agentVersion is what simulated agents report as their version.
	agentVersion = "shepherd-sim"
	// sharedCommonName names the shared key's client certificate; the
	// server checks the key, not the name.
	sharedCommonName = "shepherd-sim"
)

// heartbeatClient is an RPC client and the HTTP client under it, whose
// idle connections are closed when no agent needs it any more.
type heartbeatClient struct {
	rpc  agentv1connect.AgentCallbackServiceClient
	http *http.Client
}

func newHeartbeatClient(machineID, endpoint string, caDER []byte, key ed25519.PrivateKey) (*heartbeatClient, error) {
	tlsCfg, err := agent.ClientTLS(machineID, endpoint, caDER, key)
	if err != nil {
		return nil, err
	}
	return clientOf(endpoint, tlsCfg), nil
}

// clientOf returns a heartbeat client to endpoint with the real agent's
// HTTP client, limited to dialing one connection at a time: the transport
// learns that a server speaks HTTP/2 only once a TLS handshake is done, and
// until then it would dial a connection for every waiting heartbeat (tens
// of handshakes when a shared client starts), to keep only one of them.
func clientOf(endpoint string, tlsCfg *tls.Config) *heartbeatClient {
	hc := agent.HTTPClient(tlsCfg)
	if t, ok := hc.Transport.(*http.Transport); ok {
		t.MaxConnsPerHost = 1
	}
	return &heartbeatClient{
		rpc:  agentv1connect.NewAgentCallbackServiceClient(hc, "https://"+endpoint, connect.WithGRPC()),
		http: hc,
	}
}

// sharedPool is the Connections clients agents of one callback server share
// in SharedAgentKey mode; each client holds one HTTP/2 connection, on which
// many heartbeats travel at once.
type sharedPool struct {
	clients []*heartbeatClient
	next    int
}

// daemon is a simulated agent daemon: the state the real daemon keeps, and
// its place in the heartbeat queue. It costs about 150 bytes, and no
// goroutine: workers run its heartbeats when they are due (an
// installation runs in a goroutine of its own while it lasts).
type daemon struct {
	machineID string
	client    *heartbeatClient
	report    *agentv1.OSInstallationReport // to deliver with the next heartbeat
	// inst is the installation started and not yet reported; nil if none.
	inst *installation
	// due is when the next heartbeat is due (an offset from Fleet.start).
	due         time.Duration
	backoff     time.Duration // after the last failed heartbeat; 0 after a success
	slot        int32
	index       int32 // position in the queue; -1 if not queued
	own         bool  // client is the agent's own: close it when the agent stops
	inflight    bool  // a worker runs its heartbeat
	stopped     bool  // the agent is gone (replaced, rebooted, killed, fleet stopped)
	silenced    bool
	hwRecorded  bool // the server said it recorded the hardware report
	dropped     bool // the last heartbeat was dropped by a Partition
	rebootAfter bool // reboot once the successful report is delivered
}

// agentQueue is a min-heap of agents by due time. Only agents that are
// neither running a heartbeat nor silenced are in it.
type agentQueue []*daemon

func (q agentQueue) Len() int           { return len(q) }
func (q agentQueue) Less(i, j int) bool { return q[i].due < q[j].due }
func (q agentQueue) Swap(i, j int) {
	q[i], q[j] = q[j], q[i]
	q[i].index, q[j].index = int32(i), int32(j)
}
func (q *agentQueue) Push(x any) {
	a := x.(*daemon)
	a.index = int32(len(*q))
	*q = append(*q, a)
}
func (q *agentQueue) Pop() any {
	old := *q
	a := old[len(old)-1]
	old[len(old)-1] = nil
	*q = old[:len(old)-1]
	a.index = -1
	return a
}

// remove takes a out of the queue if it is in it.
func (q *agentQueue) remove(a *daemon) {
	if a.index >= 0 {
		heap.Remove(q, int(a.index))
	}
}

// scheduleLocked queues a for a heartbeat at due, or earlier when its
// finished installation may be reported then: the real daemon reports at
// once. f.mu must be held.
func (f *Fleet) scheduleLocked(a *daemon, due time.Duration) {
	if in := a.inst; in != nil && in.report != nil && in.done < due {
		due = in.done
	}
	a.due = due
	if a.index >= 0 {
		heap.Fix(&f.queue, int(a.index))
	} else {
		heap.Push(&f.queue, a)
	}
	if a.index == 0 {
		select {
		case f.wake <- struct{}{}:
		default:
		}
	}
}

// newAgent makes machine i's agent for init with key, and its heartbeat
// client: its own in per-key mode (a TLS connection of its own, like a
// real agent), one of the shared ones otherwise.
func (f *Fleet) newAgent(i int32, init *agentv1.TakeoverInit, key ed25519.PrivateKey) (*daemon, error) {
	a := &daemon{machineID: init.GetMachineId(), slot: i, index: -1}
	var err error
	if f.cfg.SharedAgentKey {
		var p *sharedPool
		if p, err = f.sharedPool(init.GetServerEndpoint(), init.GetCaCertificate()); err == nil {
			f.mu.Lock()
			a.client = p.pick()
			f.mu.Unlock()
		}
	} else {
		a.client, err = newHeartbeatClient(a.machineID, init.GetServerEndpoint(), init.GetCaCertificate(), key)
		a.own = true
	}
	if err != nil {
		return nil, err
	}
	return a, nil
}

// pick returns the next client, round robin; f.mu must be held.
func (p *sharedPool) pick() *heartbeatClient {
	c := p.clients[p.next%len(p.clients)]
	p.next++
	return c
}

// sharedPool returns the clients for endpoint and caDER, creating them on
// first use.
func (f *Fleet) sharedPool(endpoint string, caDER []byte) (*sharedPool, error) {
	key := endpoint + "\x00" + string(caDER)
	f.mu.Lock()
	p := f.pools[key]
	f.mu.Unlock()
	if p != nil {
		return p, nil
	}
	tlsCfg, err := agent.ClientTLS(sharedCommonName, endpoint, caDER, f.agentKey)
	if err != nil {
		return nil, err
	}
	p = &sharedPool{}
	for range f.cfg.Connections {
		// A configuration each: the HTTP/2 setup of a transport edits
		// its TLS configuration.
		p.clients = append(p.clients, clientOf(endpoint, tlsCfg.Clone()))
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.stopped {
		return nil, errors.New("the simulated fleet has stopped")
	}
	if q := f.pools[key]; q != nil {
		return q, nil // another takeover was faster; ours never connected
	}
	f.pools[key] = p
	return p, nil
}

// startAgent makes a machine i's agent, replacing the one before, unless
// the machine rebooted (or died) since boot: then the takeover raced with
// the end of the system it ran on.
func (f *Fleet) startAgent(a *daemon, boot uint32) error {
	f.mu.Lock()
	s := &f.slots[a.slot]
	var err error
	var old *http.Client
	now := f.now()
	switch {
	case f.stopped:
		err = errors.New("the simulated fleet has stopped")
	case s.boot != boot:
		err = errors.New("the machine rebooted during the takeover")
	case s.hung:
		err = errors.New("the machine hung during the takeover")
	default:
		if s.agent != nil {
			old = f.stopAgentLocked(s.agent)
		}
		f.addAgentLocked(a)
		f.stats.Takeovers++
	}
	f.mu.Unlock()
	closeIdle(old)
	if o := f.cfg.Observer; err == nil && o != nil {
		o.AgentStarted(f.id(a.slot), a.machineID, f.at(now))
	}
	return err
}

// addAgentLocked makes a the running agent of its slot and queues its
// first heartbeat, which is due at once. f.mu must be held.
func (f *Fleet) addAgentLocked(a *daemon) {
	f.slots[a.slot].agent = a
	if r := f.kept[a.slot]; r != nil {
		delete(f.kept, a.slot)
		a.report = r
	}
	f.stats.AgentsRunning++
	f.metrics.agents.Set(float64(f.stats.AgentsRunning))
	f.scheduleLocked(a, f.now())
}

// stopAgentLocked stops a. It returns the HTTP client whose connections
// the caller must close once f.mu is released, or nil: a shared client
// stays, and a worker running a's heartbeat closes a's own client itself.
func (f *Fleet) stopAgentLocked(a *daemon) *http.Client {
	a.stopped = true
	f.queue.remove(a)
	// What the real agent keeps in its state directory goes to the
	// machine's next agent, which sends it at once: for an installation
	// that had not finished (in simulated time: its InstallLatency had not
	// passed), a report that it was interrupted; else a report the server
	// had not acknowledged yet. (The reboot an installation asked for is
	// not carried over: the machine just restarted anyway.)
	switch {
	case a.inst != nil:
		// The installation ends with the system the agent ran on; the
		// goroutine sees its context cancelled and ends.
		a.inst.cancel()
		f.kept[a.slot] = install.InterruptedReport(a.inst.generation)
		a.inst = nil
	case a.report != nil:
		f.kept[a.slot] = a.report
	}
	if s := &f.slots[a.slot]; s.agent == a {
		s.agent = nil
	}
	f.stats.AgentsRunning--
	if a.silenced {
		f.stats.AgentsSilenced--
	}
	f.metrics.agents.Set(float64(f.stats.AgentsRunning))
	if a.own && !a.inflight {
		return a.client.http
	}
	return nil
}

func closeIdle(c *http.Client) {
	if c != nil {
		c.CloseIdleConnections()
	}
}

// Adoption names a machine Adopt starts an agent for: the slot (provider
// id) and the BMDB machine the agent heartbeats as.
type Adoption struct{ ProviderID, MachineID string }

// Adopt starts agents for machines already recorded in a BMDB, for
// benchmarks that preload a fleet instead of taking 100,000 machines over
// through SSH. Each slot ProviderID becomes used, and its agent (replacing
// any earlier one) heartbeats as BMDB machine MachineID to endpoint,
// verifying the server against caDER (nil: system roots). It needs
// SharedAgentKey and returns the shared public key, which the caller
// records as the machines' AgentStarted key. Nothing is adopted if any
// entry is invalid.
func (f *Fleet) Adopt(endpoint string, caDER []byte, machines []Adoption) (ed25519.PublicKey, error) {
	if !f.cfg.SharedAgentKey {
		return nil, errors.New("sim: Adopt needs SharedAgentKey")
	}
	if err := agent.ValidateEndpoint(endpoint, caDER); err != nil {
		return nil, fmt.Errorf("sim: adopting: %w", err)
	}
	idx := make([]int32, len(machines))
	for n, m := range machines {
		i, err := f.lookup(m.ProviderID)
		if err != nil {
			return nil, fmt.Errorf("sim: adopting: %w", err)
		}
		if _, err := uuid.Parse(m.MachineID); err != nil {
			return nil, fmt.Errorf("sim: adopting %s: machine id %q is not a UUID", m.ProviderID, m.MachineID)
		}
		idx[n] = i
	}
	p, err := f.sharedPool(endpoint, caDER)
	if err != nil {
		return nil, fmt.Errorf("sim: adopting: %w", err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.stopped {
		return nil, errors.New("sim: adopting: the simulated fleet has stopped")
	}
	for n, i := range idx {
		switch s := &f.slots[i]; {
		case s.killed:
			return nil, fmt.Errorf("sim: adopting %s: the machine is killed", machines[n].ProviderID)
		case s.off:
			return nil, fmt.Errorf("sim: adopting %s: the machine is powered off", machines[n].ProviderID)
		case s.hung:
			return nil, fmt.Errorf("sim: adopting %s: the machine is hung", machines[n].ProviderID)
		}
	}
	for n, i := range idx {
		s := &f.slots[i]
		if !s.used {
			s.used = true
			f.stats.Used++
		}
		if s.agent != nil {
			f.stopAgentLocked(s.agent) // shared mode: no client of its own to close
		}
		f.addAgentLocked(&daemon{machineID: machines[n].MachineID, client: p.pick(), slot: i, index: -1})
	}
	return f.agentKey.Public().(ed25519.PublicKey), nil
}

// Run sends the agents' heartbeats until ctx ends: one scheduler goroutine
// hands due agents to HeartbeatConcurrency workers. Then it stops every
// agent, closes every SSH and TLS connection, waits for its goroutines and
// returns nil. The fleet cannot be used again.
func (f *Fleet) Run(ctx context.Context) error {
	f.mu.Lock()
	if f.running {
		f.mu.Unlock()
		return errors.New("sim: Run called twice")
	}
	f.running = true
	f.mu.Unlock()
	f.log.InfoContext(ctx, "simulated fleet running", "machines", len(f.slots), "shared_agent_key", f.cfg.SharedAgentKey)

	work := make(chan *daemon)
	var workers sync.WaitGroup
	for range f.cfg.HeartbeatConcurrency {
		workers.Go(func() {
			for {
				select {
				case <-ctx.Done():
					return
				case a := <-work:
					f.heartbeat(ctx, a)
				}
			}
		})
	}
	if f.cfg.HangEvery > 0 {
		workers.Go(func() { f.hangEvery(ctx, f.cfg.HangEvery) })
	}
	f.schedule(ctx, work)
	workers.Wait()
	f.shutdown()
	f.log.InfoContext(context.WithoutCancel(ctx), "simulated fleet stopped")
	return nil
}

// schedule hands every agent to a worker when its heartbeat is due, until
// ctx ends.
func (f *Fleet) schedule(ctx context.Context, work chan<- *daemon) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		var due *daemon
		wait := time.Hour
		f.mu.Lock()
		if len(f.queue) > 0 {
			if d := f.queue[0].due - f.now(); d <= 0 {
				due = heap.Pop(&f.queue).(*daemon)
				due.inflight = true
			} else {
				wait = d
			}
		}
		f.mu.Unlock()
		if due != nil {
			select {
			case work <- due:
				continue
			case <-ctx.Done():
				f.drop(due)
				return
			}
		}
		timer.Reset(wait)
		select {
		case <-ctx.Done():
			return
		case <-f.wake:
		case <-timer.C:
		}
	}
}

// drop gives up a's heartbeat, which no worker will run; if a was stopped
// meanwhile, nobody else closes its connection.
func (f *Fleet) drop(a *daemon) {
	f.mu.Lock()
	a.inflight = false
	var c *http.Client
	if a.stopped && a.own {
		c = a.client.http
	}
	f.mu.Unlock()
	closeIdle(c)
}

// heartbeat sends a's heartbeat and acts on the answer as the real daemon
// does (SPEC §4.3): the next one after the server's interval, or after an
// exponential backoff with jitter if it failed; the reports resent until
// the server says it recorded them; installations; the reboot an
// installation asks for. A heartbeat of a partitioned machine fails at
// once, as if it had timed out, without holding the worker.
func (f *Fleet) heartbeat(ctx context.Context, a *daemon) {
	f.mu.Lock()
	if a.stopped || a.silenced {
		f.mu.Unlock()
		f.drop(a)
		return
	}
	sent := f.now()
	if in := a.inst; in != nil && in.report != nil && in.done <= sent {
		a.inst = nil
		a.report = in.report
	}
	if f.slots[a.slot].partitioned {
		// Dropped on the way: the agent would see its RPC time out after
		// heartbeatTimeout, then back off. The worker does not wait: the
		// timeout is added to the next due time instead.
		a.inflight = false
		a.dropped = true
		f.stats.HeartbeatsFailed++
		f.stats.HeartbeatsDropped++
		wait := f.retryLocked(a, sent+heartbeatTimeout)
		f.mu.Unlock()
		f.metrics.heartbeats.WithLabelValues("error").Inc()
		f.log.DebugContext(ctx, "heartbeat dropped by a partition, retrying", "machine_id", a.machineID,
			"retry_in", (heartbeatTimeout + wait).Round(time.Millisecond))
		return
	}
	a.dropped = false
	// The reports go with every heartbeat until the server says it stored
	// them, as the real daemon sends them.
	req := &agentv1.HeartbeatRequest{MachineId: a.machineID, AgentVersion: agentVersion, InstallationReport: a.report}
	if !a.hwRecorded {
		req.HardwareReport = hardwareReport(a.slot, f.id(a.slot))
	}
	client := a.client
	f.mu.Unlock()

	rctx, cancel := context.WithTimeout(ctx, heartbeatTimeout)
	resp, err := client.rpc.Heartbeat(rctx, connect.NewRequest(req))
	cancel()
	f.observeHeartbeat(a, req, sent, resp, err)

	f.mu.Lock()
	if ctx.Err() != nil || a.stopped {
		// The fleet stops (and cleans up after the workers), or the agent
		// was stopped while its heartbeat ran: its connection is idle now.
		f.mu.Unlock()
		f.drop(a)
		return
	}
	a.inflight = false
	now := f.now()
	if err != nil {
		f.stats.HeartbeatsFailed++
		wait := f.retryLocked(a, now)
		f.mu.Unlock()
		f.metrics.heartbeats.WithLabelValues("error").Inc()
		f.log.DebugContext(ctx, "heartbeat failed, retrying", "machine_id", a.machineID, "err", err, "retry_in", wait.Round(time.Millisecond))
		return
	}
	f.stats.HeartbeatsOK++
	f.metrics.heartbeats.WithLabelValues("ok").Inc()
	a.backoff = 0
	if req.HardwareReport != nil && resp.Msg.GetHardwareReportRecorded() {
		a.hwRecorded = true
	}
	f.slots[a.slot].lastHeartbeat = now
	if delivered := req.InstallationReport; delivered != nil && delivered == a.report &&
		resp.Msg.GetInstallationReportRecorded() == delivered.GetGeneration() {
		a.report = nil
		reboot := a.rebootAfter && delivered.GetSuccess() != nil
		a.rebootAfter = false
		if reboot {
			closeAfter := f.rebootByAgentLocked(a.slot, now)
			f.mu.Unlock()
			closeAfter()
			return
		}
	}
	if ir := resp.Msg.GetInstallationRequest(); ir != nil {
		f.maybeInstallLocked(ctx, a, ir, now)
	}
	interval := defaultInterval
	if n := resp.Msg.GetNextHeartbeatIn(); n != nil && n.AsDuration() > 0 {
		interval = min(n.AsDuration(), maxInterval)
	}
	if !a.silenced {
		f.scheduleLocked(a, now+interval)
	}
	f.mu.Unlock()
}

// retryLocked doubles a's backoff after a failed heartbeat and queues the
// next one a jittered backoff after after; it returns the wait. f.mu must
// be held.
func (f *Fleet) retryLocked(a *daemon, after time.Duration) time.Duration {
	a.backoff = min(max(2*a.backoff, minBackoff), maxBackoff)
	wait := jitter(a.backoff)
	if !a.silenced {
		f.scheduleLocked(a, after+wait)
	}
	return wait
}

// observeHeartbeat tells the observer, if any, how the server answered
// req, a's heartbeat sent at sent: OK, an error the server sent, or no
// answer. f.mu must not be held.
func (f *Fleet) observeHeartbeat(a *daemon, req *agentv1.HeartbeatRequest, sent time.Duration,
	resp *connect.Response[agentv1.HeartbeatResponse], err error) {
	o := f.cfg.Observer
	switch {
	case o == nil:
	case err == nil:
		hw := req.HardwareReport != nil && resp.Msg.GetHardwareReportRecorded()
		o.HeartbeatAcked(f.id(a.slot), a.machineID, f.at(sent), f.at(f.now()), hw)
	case connect.IsWireError(err):
		o.HeartbeatRefused(f.id(a.slot), a.machineID, f.at(sent), connect.CodeOf(err))
	default:
		o.HeartbeatFailed(f.id(a.slot), a.machineID, f.at(sent))
	}
}

// maybeInstallLocked starts the installation ir asks for unless its
// generation was handled on this machine already or another one runs: it
// runs the real installation code (see install.go) in a goroutine of its
// own, which ctx or the agent's end cancels. f.mu must be held.
func (f *Fleet) maybeInstallLocked(ctx context.Context, a *daemon, ir *agentv1.OSInstallationRequest, now time.Duration) {
	s := &f.slots[a.slot]
	if ir.GetGeneration() <= s.installed || a.inst != nil {
		return
	}
	s.installed = ir.GetGeneration()
	ictx, cancel := context.WithCancel(ctx)
	in := &installation{generation: ir.GetGeneration(), done: now + f.cfg.InstallLatency, cancel: cancel}
	a.inst = in
	a.rebootAfter = ir.GetRebootAfter()
	f.installs.Add(1)
	f.log.Info("installing", "machine_id", a.machineID, "provider_id", f.id(a.slot), "generation", in.generation,
		"image_url", ir.GetImageUrl(), "target", ir.GetTargetDevice())
	go f.runInstall(ictx, a, in, ir)
}

// rebootByAgentLocked reboots machine i after an installation: the agent
// is gone and SSH is unreachable for RebootLatency. f.mu must be held; the
// returned func closes what must be closed after it is released.
func (f *Fleet) rebootByAgentLocked(i int32, now time.Duration) func() {
	f.slots[i].rebootUntil = now + f.cfg.RebootLatency
	f.log.Info("machine rebooting after its installation", "provider_id", f.id(i))
	return f.shutdownLocked(i)
}

// shutdown stops every agent and closes every connection once the
// scheduler and the workers are gone.
func (f *Fleet) shutdown() {
	f.mu.Lock()
	f.stopped = true
	var clients []*http.Client
	for i := range f.slots {
		if a := f.slots[i].agent; a != nil {
			f.stopAgentLocked(a)
			if a.own {
				clients = append(clients, a.client.http)
			}
		}
	}
	for _, p := range f.pools {
		for _, c := range p.clients {
			clients = append(clients, c.http)
		}
	}
	var conns []net.Conn
	for _, cs := range f.conns {
		for c := range cs {
			conns = append(conns, c)
		}
	}
	for _, hs := range f.holes {
		for c := range hs {
			conns = append(conns, c)
		}
	}
	f.holes = map[int32]map[net.Conn]struct{}{}
	f.pools, f.queue, f.files = map[string]*sharedPool{}, nil, map[int32]*memFS{}
	f.mu.Unlock()
	for _, c := range conns {
		c.Close()
	}
	f.conWG.Wait()
	for _, c := range clients {
		c.CloseIdleConnections()
	}
	f.installs.Wait() // stopping the agents cancelled them
	f.removeDisks()
}

// jitter spreads d by ±20 %, so agents that failed together retry apart.
func jitter(d time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
}

// hardwareReport is a small synthetic report: 16 threads, 64 GiB, two
// disks, with the slot in the serial numbers and the MAC address.
func hardwareReport(i int32, id string) *agentv1.HardwareReport {
	n := uint32(i) + 1
	return &agentv1.HardwareReport{
		Cpu:         &agentv1.CPU{Model: "Simulated CPU @ 3.00GHz", Sockets: 1, Cores: 8, Threads: 16},
		MemoryBytes: 64 << 30,
		NetworkInterfaces: []*agentv1.NetworkInterface{{
			Name: "eth0", Driver: "sim", LinkUp: true, SpeedMbps: 25000,
			MacAddress: fmt.Sprintf("02:53:%02x:%02x:%02x:%02x", byte(n>>24), byte(n>>16), byte(n>>8), byte(n)),
		}},
		BlockDevices: []*agentv1.BlockDevice{
			{Name: simDisks[0], SizeBytes: 960_197_124_096, Model: "SimNVMe 960GB", Serial: id + "-0"},
			{Name: simDisks[1], SizeBytes: 960_197_124_096, Model: "SimNVMe 960GB", Serial: id + "-1"},
		},
		Dmi:          &agentv1.DMI{SystemVendor: "Shepherd", ProductName: "Simulated Server", ProductSerial: id},
		FirmwareMode: agentv1.FirmwareMode_FIRMWARE_MODE_EFI,
	}
}
