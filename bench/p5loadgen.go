package main

import (
	"bufio"
	"context"
	"crypto/ed25519"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/google/uuid"

	"github.com/shepherd/shepherd/agent"
	"github.com/shepherd/shepherd/api/agent/pulse"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/api/agent/v1/agentv1connect"
)

// p5AgentsPerLoadgen is the most agents one load generator process
// simulates: each holds a UDP socket, and for a moment a TLS connection,
// and this machine allows 20,000 descriptors per process.
const p5AgentsPerLoadgen = 15_000

// p5Loadgens are P5's running load generator processes, each with its
// share of the agents.
type p5Loadgens []*p5Loadgen

// startP5Loadgens starts the load generators for the agents of ids (agent
// i has agentKey(i)) against the server at endpoint, whose CA `shepherd
// run` keeps in dir, the agents dealt out in turn, and waits for their
// READY. Agent i makes its first heartbeat at i/len(ids) of ramp.
func startP5Loadgens(ctx context.Context, dir, endpoint string, ids []string, ramp time.Duration) (p5Loadgens, error) {
	n := (len(ids) + p5AgentsPerLoadgen - 1) / p5AgentsPerLoadgen
	var lgs p5Loadgens
	for s := range n {
		var lines strings.Builder
		for i := s; i < len(ids); i += n {
			fmt.Fprintf(&lines, "%d %s\n", i, ids[i])
		}
		path := filepath.Join(dir, fmt.Sprintf("agents-%d", s))
		if err := os.WriteFile(path, []byte(lines.String()), 0o600); err != nil {
			lgs.stop()
			return nil, err
		}
		lg, err := startP5Loadgen(ctx, endpoint, filepath.Join(dir, "data", "pki", "ca.crt"), path, len(ids), ramp)
		if err != nil {
			lgs.stop()
			return nil, err
		}
		lgs = append(lgs, lg)
	}
	return lgs, nil
}

// send writes line to every load generator.
func (lgs p5Loadgens) send(line string) error {
	for _, lg := range lgs {
		if err := lg.send(line); err != nil {
			return err
		}
	}
	return nil
}

// expect waits for every load generator's next line, which must start
// with word.
func (lgs p5Loadgens) expect(ctx context.Context, word string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for _, lg := range lgs {
		if _, err := lg.expect(ctx, word, time.Until(deadline)); err != nil {
			return err
		}
	}
	return nil
}

// cpu is the CPU time the load generators have used.
func (lgs p5Loadgens) cpu() time.Duration {
	var d time.Duration
	for _, lg := range lgs {
		d += pidCPUOrZero(lg.cmd.Process.Pid)
	}
	return d
}

// p5Done is what P5's load generators counted, summed.
type p5Done struct {
	failures, connected, noReply, callTLS, retryLater int64
	first                                             string
}

// finish stops the load generators and sums their DONE lines.
func (lgs p5Loadgens) finish(ctx context.Context) (p5Done, error) {
	for _, lg := range lgs {
		lg.stdin.Close()
	}
	var sum p5Done
	for _, lg := range lgs {
		line, err := lg.expect(ctx, "DONE", time.Minute)
		if err != nil {
			return sum, err
		}
		var d p5Done
		if _, err := fmt.Sscanf(line, "DONE failures=%d connected=%d no_reply=%d call_tls=%d retry_later=%d first=%q",
			&d.failures, &d.connected, &d.noReply, &d.callTLS, &d.retryLater, &d.first); err != nil {
			return sum, fmt.Errorf("load generator: %q: %w", line, err)
		}
		sum.failures += d.failures
		sum.connected += d.connected
		sum.noReply += d.noReply
		sum.callTLS += d.callTLS
		sum.retryLater += d.retryLater
		if sum.first == "" {
			sum.first = d.first
		}
	}
	return sum, nil
}

func (lgs p5Loadgens) stop() {
	for _, lg := range lgs {
		lg.stop()
	}
}

// p5Loadgen is one running load generator process.
type p5Loadgen struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	lines chan string
	done  chan struct{}
}

// startP5Loadgen starts one load generator for the agents of agentsPath
// and waits for its READY.
func startP5Loadgen(ctx context.Context, endpoint, caPath, agentsPath string, total int, ramp time.Duration) (*p5Loadgen, error) {
	cmd, stdin, stdout, err := startSelf(ctx, p5LoadgenMode, "-endpoint", endpoint, "-ca", caPath, "-agents", agentsPath,
		"-total", strconv.Itoa(total), "-interval", p5Interval.String(), "-ramp", ramp.String())
	if err != nil {
		return nil, err
	}
	lg := &p5Loadgen{cmd: cmd, stdin: stdin, lines: make(chan string, 16), done: make(chan struct{})}
	go func() {
		defer close(lg.done)
		out := bufio.NewScanner(stdout)
		for out.Scan() {
			lg.lines <- out.Text()
		}
		close(lg.lines)
	}()
	if _, err := lg.expect(ctx, "READY", 5*time.Minute); err != nil {
		lg.stop()
		return nil, err
	}
	return lg, nil
}

func (lg *p5Loadgen) send(line string) error {
	_, err := io.WriteString(lg.stdin, line+"\n")
	return err
}

// expect waits for the load generator's next line, which must start with word.
func (lg *p5Loadgen) expect(ctx context.Context, word string, timeout time.Duration) (string, error) {
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case line, ok := <-lg.lines:
		if !ok {
			return "", fmt.Errorf("load generator ended early (waiting for %s)", word)
		}
		if !strings.HasPrefix(line, word) {
			return "", fmt.Errorf("load generator (waiting for %s): %s", word, line)
		}
		return line, nil
	case <-t.C:
		return "", fmt.Errorf("load generator: no %s after %s", word, timeout)
	case <-ctx.Done():
		return "", ctx.Err()
	}
}

func (lg *p5Loadgen) stop() {
	lg.stdin.Close()
	for range lg.lines {
	}
	<-lg.done
	_ = lg.cmd.Wait()
}

// p5Agent is one simulated agent of P5's load generator, behaving as the
// agent daemon does: a heartbeat over TLS (the first with its hardware
// report) gets a datagram grant, after which the agent closes its
// connection and heartbeats by datagram every interval from its own UDP
// socket; it calls over TLS again when the server says so or no datagram
// got a reply.
type p5Agent struct {
	index     int
	id        string
	machine   uuid.UUID
	endpoint  string
	host      string
	ca        []byte
	local     netip.Addr
	reported  bool        // the hardware report was acknowledged
	connected bool        // a first heartbeat was accepted
	counter   uint64      // the highest datagram counter sent
	pulse     *pulseAgent // nil: heartbeat over TLS
	// answeredAt is when the server last answered; dgBackoff the back-off
	// of datagrams sent again after no answer (as the agent daemon's).
	answeredAt time.Time
	dgBackoff  time.Duration
}

// tlsBeat makes one heartbeat over a new TLS connection, which it closes
// after, and takes the grant of the reply.
func (a *p5Agent) tlsBeat(ctx context.Context) error {
	tlsCfg, err := agent.ClientTLS(a.id, a.endpoint, a.ca, agentKey(a.index))
	if err != nil {
		return err
	}
	d := agent.Dialer()
	d.LocalAddr = &net.TCPAddr{IP: a.local.AsSlice()}
	hc := agent.HTTPClientDialer(tlsCfg, d)
	defer hc.Transport.(*http.Transport).CloseIdleConnections()
	client := agentv1connect.NewAgentCallbackServiceClient(hc, "https://"+a.endpoint, connect.WithGRPC())
	req := &agentv1.HeartbeatRequest{MachineId: a.id, AgentVersion: "bench"}
	if !a.reported {
		req.HardwareReport = benchHardwareReport()
	}
	rctx, cancel := context.WithTimeout(ctx, 30*time.Second) // the agent's heartbeat timeout
	defer cancel()
	resp, err := client.Heartbeat(rctx, connect.NewRequest(req))
	if err != nil {
		return err
	}
	a.reported = true
	a.answeredAt, a.dgBackoff = time.Now(), 0
	p, err := newPulseAgent(a.machine, agentKey(a.index).Public().(ed25519.PublicKey), resp.Msg.GetDatagramGrant(), a.host, a.local)
	if err != nil {
		return err
	}
	a.pulse = p
	// The floor can be below a counter this agent already sent: a
	// datagram still queued at the server when the TLS heartbeat was
	// recorded raises the stored counter after the grant. A counter is
	// never used twice under one key, so the agent goes on from the
	// higher of the two.
	p.counter = max(p.counter, a.counter)
	return nil
}

// dropGrant closes the agent's datagram socket: its next heartbeat goes
// over TLS.
func (a *p5Agent) dropGrant() {
	a.counter = max(a.counter, a.pulse.counter)
	a.pulse.close()
	a.pulse = nil
}

// p5LoadgenMain is P5's load generator: one p5Agent per line "index
// machine-id" of the agents file (agent index has key agentKey(index)). It
// prints READY; on GO it starts agent index at index/total of the ramp,
// prints CONNECTED once every agent's first heartbeat was accepted, and on
// the end of stdin stops and prints DONE with the failed heartbeats, the
// agents that connected, the datagram heartbeats that got no reply (the
// agent called over TLS instead), the replies that sent it to TLS or told
// it to retry later, and the first error. A failed TLS heartbeat is tried
// again as the agent daemon does.
func p5LoadgenMain(args []string) int {
	fs := flag.NewFlagSet(p5LoadgenMode, flag.ContinueOnError)
	endpoint := fs.String("endpoint", "", "callback server host:port")
	caPath := fs.String("ca", "", "PEM CA certificate of the server")
	agentsPath := fs.String("agents", "", `file of lines "index machine-id"; agent index uses agentKey(index)`)
	total := fs.Int("total", 0, "agents of all load generators: agent index starts at index/total of the ramp")
	interval := fs.Duration("interval", p5Interval, "heartbeat interval")
	ramp := fs.Duration("ramp", p5Interval, "agent index sends its first heartbeat at index/total of this")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	fail := func(err error) int {
		fmt.Println("ERROR", err)
		return 1
	}
	host, _, err := net.SplitHostPort(*endpoint)
	if err != nil {
		return fail(fmt.Errorf("endpoint %q: %w", *endpoint, err))
	}
	ca, err := readCAFile(*caPath)
	if err != nil {
		return fail(err)
	}
	data, err := os.ReadFile(*agentsPath)
	if err != nil {
		return fail(err)
	}
	var agents []*p5Agent
	for line := range strings.Lines(string(data)) {
		f := strings.Fields(line)
		if len(f) != 2 {
			return fail(fmt.Errorf("agents file line %q", line))
		}
		index, err := strconv.Atoi(f[0])
		if err != nil {
			return fail(err)
		}
		machine, err := uuid.Parse(f[1])
		if err != nil {
			return fail(err)
		}
		agents = append(agents, &p5Agent{index: index, id: f[1], machine: machine, endpoint: *endpoint, host: host, ca: ca,
			local: netip.AddrFrom4([4]byte{127, 0, 0, byte(2 + index%p5Sources)})})
	}
	if *total < len(agents) {
		return fail(fmt.Errorf("-total %d is below the %d agents of this load generator", *total, len(agents)))
	}
	if err := raiseFileLimit(len(agents) + 1000); err != nil {
		return fail(err)
	}
	defer func() {
		for _, a := range agents {
			if a.pulse != nil {
				a.pulse.close()
			}
		}
	}()
	fmt.Println("READY")
	in := bufio.NewScanner(os.Stdin)
	if !in.Scan() || in.Text() != "GO" {
		return fail(errors.New("no GO on stdin"))
	}
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		_, _ = io.Copy(io.Discard, os.Stdin) // until stdin closes
		cancel()
	}()
	var failures, connected, noReply, callTLS, retryLater, tlsBeats, datagrams atomic.Int64
	var firstErr atomic.Value
	// Progress on stderr every interval, to see a storm (agents falling
	// back to TLS faster than the server takes them) as it builds.
	go func() {
		tick := time.NewTicker(*interval)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
				fmt.Fprintf(os.Stderr, "bench: P5 load generator: connected=%d tls_heartbeats=%d datagrams=%d no_reply=%d call_tls=%d retry_later=%d failures=%d\n",
					connected.Load(), tlsBeats.Load(), datagrams.Load(), noReply.Load(), callTLS.Load(), retryLater.Load(), failures.Load())
			}
		}
	}()
	failed := func(err error) {
		failures.Add(1)
		firstErr.CompareAndSwap(nil, err.Error())
	}
	var wg sync.WaitGroup
	start := time.Now()
	for _, a := range agents {
		wg.Go(func() {
			next := start.Add(*ramp * time.Duration(a.index) / time.Duration(*total))
			var backoff time.Duration
			for {
				t := time.NewTimer(time.Until(next))
				select {
				case <-ctx.Done():
					t.Stop()
					return
				case <-t.C:
				}
				next = next.Add(*interval)
				if a.pulse == nil {
					tlsBeats.Add(1)
					err := a.tlsBeat(ctx)
					switch {
					case err != nil && ctx.Err() == nil:
						failed(err)
						// As the agent daemon retries: when the server
						// says (Unavailable with its 1 s pushback), else
						// backing off from 250 ms to a minute, with
						// ±20 % jitter.
						var cerr *connect.Error
						if errors.As(err, &cerr) && cerr.Code() == connect.CodeUnavailable && cerr.Meta().Get("grpc-retry-pushback-ms") != "" {
							backoff = 0
							next = time.Now().Add(time.Duration(float64(time.Second) * (0.8 + 0.4*rand.Float64())))
							continue
						}
						backoff = min(max(2*backoff, 250*time.Millisecond), time.Minute)
						next = time.Now().Add(time.Duration(float64(backoff) * (0.8 + 0.4*rand.Float64())))
					case err == nil:
						backoff = 0
						if !a.connected {
							a.connected = true
							if connected.Add(1) == int64(len(agents)) {
								fmt.Println("CONNECTED")
							}
						}
					}
					continue
				}
				datagrams.Add(1)
				rep, err := a.pulse.beat(ctx)
				switch {
				case ctx.Err() != nil:
				case errors.Is(err, agent.ErrNoDatagramReply) && time.Since(a.answeredAt) < 2*(*interval):
					// As the agent daemon does: the server answered
					// within two intervals, so the datagram goes again
					// after a back-off (1 s doubling up to the interval,
					// ±20 %) instead of a TLS handshake.
					noReply.Add(1)
					a.dgBackoff = min(max(2*a.dgBackoff, time.Second), *interval)
					next = time.Now().Add(time.Duration(float64(a.dgBackoff) * (0.8 + 0.4*rand.Float64())))
				case errors.Is(err, agent.ErrNoDatagramReply):
					noReply.Add(1)
					a.dropGrant()
					next = time.Now()
				case err != nil:
					failed(err)
				case rep.Status == pulse.StatusRetryLater:
					retryLater.Add(1)
					a.answeredAt, a.dgBackoff = time.Now(), 0
					next = time.Now().Add(rep.NextIn)
				case rep.Status == pulse.StatusCallTLS:
					callTLS.Add(1)
					a.dropGrant()
					next = time.Now()
				default:
					a.answeredAt, a.dgBackoff = time.Now(), 0
				}
			}
		})
	}
	wg.Wait()
	first, _ := firstErr.Load().(string)
	fmt.Printf("DONE failures=%d connected=%d no_reply=%d call_tls=%d retry_later=%d first=%q\n",
		failures.Load(), connected.Load(), noReply.Load(), callTLS.Load(), retryLater.Load(), first)
	return 0
}
