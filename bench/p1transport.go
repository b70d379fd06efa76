package main

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"

	"github.com/shepherd/shepherd/api/agent/pulse"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/api/agent/v1/agentv1connect"
	"github.com/shepherd/shepherd/internal/devpki"
)

// transportCeiling is P1's limit: the heartbeats per second the same load
// generator gets from a server with the callback server's transport that
// answers every heartbeat at once, without touching the BMDB. P1 is
// measured against 0.8 of it, so the figure says how much of the
// transport's rate the real server keeps, on this machine, in this run. It
// also returns the CPU this process (the transport-only server) spent per
// answered heartbeat: what the transport alone costs the server, against
// which P1's server_cpu_us reads.
//
// The transport is TLS 1.3 asking for the agent's certificate and grpc-go
// with the same buffer settings, the request decoded; with transport
// datagram, that TLS heartbeat answers with a datagram grant (the key
// derived from a secret of this run, the machine and the agent key of the
// client certificate, as the callback server derives it), and the
// heartbeats measured are datagrams that a UDP server parses, derives the
// key of, verifies and answers with "recorded" at once (pulseEcho).
func transportCeiling(ctx context.Context, ids []uuid.UUID, transport string) (perSecond, serverCPUus float64, err error) {
	dir, err := os.MkdirTemp("", "shepherd-bench-p1-transport-")
	if err != nil {
		return 0, 0, err
	}
	defer os.RemoveAll(dir)
	srv, err := startTransportOnly(dir, transport)
	if err != nil {
		return 0, 0, err
	}
	defer srv.close()
	lg, err := startLoadgen(ctx, dir, srv.addr, srv.ca, ids, transport)
	if err != nil {
		return 0, 0, err
	}
	defer lg.stop()
	if err := lg.start(); err != nil {
		return 0, 0, err
	}
	// Shorter than P1's windows: a server that does nothing reaches its
	// steady rate at once, and make bench has 10 minutes in all.
	sleepCtx(ctx, time.Second)
	n0, cpu0, start := srv.answered(), processCPU(), time.Now()
	sleepCtx(ctx, 5*time.Second)
	n1, cpu1, elapsed := srv.answered(), processCPU(), time.Since(start)
	if _, err := lg.finish(); err != nil {
		return 0, 0, err
	}
	if n1 == n0 {
		return 0, 0, errors.New("the transport-only server answered no heartbeat in the measuring window")
	}
	n := float64(n1 - n0)
	return n / elapsed.Seconds(), float64((cpu1 - cpu0).Microseconds()) / n, nil
}

// transportOnly is the running transport-only server of transportCeiling.
type transportOnly struct {
	addr  string // of the TLS server; the UDP port is in the grants
	ca    []byte // DER certificate of the CA that signed the TLS server's
	tls   atomic.Int64
	echo  *pulseEcho
	close func()
}

// answered is how many heartbeats the server answered, over TLS and by
// datagram.
func (t *transportOnly) answered() int64 { return t.tls.Load() + t.echo.answered.Load() }

// startTransportOnly starts the transport-only server, its PKI in dir.
// With transport datagram, its TLS heartbeats answer with a datagram grant
// (floor 0) for the UDP server.
func startTransportOnly(dir, transport string) (*transportOnly, error) {
	pki, err := devpki.LoadOrCreate(dir, []string{"127.0.0.1"})
	if err != nil {
		return nil, err
	}
	secret := make([]byte, pulse.SecretSize)
	if _, err := rand.Read(secret); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	echo, err := newPulseEcho("127.0.0.1:0", secret, time.Second)
	if err != nil {
		ln.Close()
		return nil, err
	}
	t := &transportOnly{addr: ln.Addr().String(), ca: pki.CA, echo: echo}
	gs := grpc.NewServer(
		grpc.Creds(credentials.NewTLS(&tls.Config{
			Certificates: []tls.Certificate{pki.Certificate},
			ClientAuth:   tls.RequestClientCert,
			MinVersion:   tls.VersionTLS13,
		})),
		grpc.ReadBufferSize(0),
	)
	gs.RegisterService(&grpc.ServiceDesc{
		ServiceName: agentv1connect.AgentCallbackServiceName,
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{
			MethodName: "Heartbeat",
			Handler: func(_ any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
				var req agentv1.HeartbeatRequest
				if err := dec(&req); err != nil {
					return nil, err
				}
				t.tls.Add(1)
				if transport != transportDatagram {
					return &agentv1.HeartbeatResponse{}, nil
				}
				grant, err := echo.grant(ctx, &req)
				if err != nil {
					return nil, err
				}
				return &agentv1.HeartbeatResponse{DatagramGrant: grant}, nil
			},
		}},
		Metadata: "agent/v1/agent.proto",
	}, struct{}{})
	var wg sync.WaitGroup
	wg.Go(echo.serve)
	wg.Go(func() { _ = gs.Serve(ln) })
	t.close = func() {
		gs.Stop()
		echo.close()
		wg.Wait()
	}
	return t, nil
}

// pulseEcho is the datagram half of the transport-only server: for each
// datagram it does what the callback server does before the BMDB (parse,
// derive the key, verify the MAC) and answers "recorded" at once. Bad
// datagrams get no answer, as from the callback server.
type pulseEcho struct {
	conn     *net.UDPConn
	secret   []byte
	interval time.Duration
	// answered counts the datagrams answered (the replies sent).
	answered atomic.Int64
	// rejected counts the datagrams that got no answer.
	rejected atomic.Int64
}

// newPulseEcho listens on the UDP address addr; its replies tell agents to
// send the next heartbeat after interval.
func newPulseEcho(addr string, secret []byte, interval time.Duration) (*pulseEcho, error) {
	ua, err := net.ResolveUDPAddr("udp", addr)
	if err != nil {
		return nil, err
	}
	conn, err := net.ListenUDP("udp", ua)
	if err != nil {
		return nil, fmt.Errorf("listening for datagrams on %s: %w", addr, err)
	}
	// The callback server's receive buffer (server.datagramReadBuffer), so
	// that both drop datagrams under the same bursts.
	if err := conn.SetReadBuffer(4 << 20); err != nil {
		conn.Close()
		return nil, fmt.Errorf("sizing the datagram receive buffer: %w", err)
	}
	return &pulseEcho{conn: conn, secret: secret, interval: interval}, nil
}

// port is the UDP port the server listens on.
func (p *pulseEcho) port() int { return p.conn.LocalAddr().(*net.UDPAddr).Port }

// grant is the datagram grant of the TLS heartbeat req made on the
// connection of ctx: the key of its machine and client certificate.
func (p *pulseEcho) grant(ctx context.Context, req *agentv1.HeartbeatRequest) (*agentv1.DatagramGrant, error) {
	pr, ok := peer.FromContext(ctx)
	if !ok {
		return nil, errors.New("no peer in the heartbeat's context")
	}
	info, ok := pr.AuthInfo.(credentials.TLSInfo)
	if !ok || len(info.State.PeerCertificates) == 0 {
		return nil, errors.New("the agent sent no client certificate")
	}
	key, ok := info.State.PeerCertificates[0].PublicKey.(ed25519.PublicKey)
	if !ok {
		return nil, errors.New("the agent's certificate has no ed25519 key")
	}
	machine, err := uuid.Parse(req.GetMachineId())
	if err != nil {
		return nil, fmt.Errorf("machine id %q: %w", req.GetMachineId(), err)
	}
	k := pulse.DeriveKey(p.secret, machine, key)
	return &agentv1.DatagramGrant{Key: k[:], Port: uint32(p.port())}, nil
}

// pulseEchoReaders is the callback server's number of datagram readers
// (server.datagramReaders).
const pulseEchoReaders = 2

// serve answers datagrams until close.
func (p *pulseEcho) serve() {
	var wg sync.WaitGroup
	for range pulseEchoReaders {
		wg.Go(p.read)
	}
	wg.Wait()
}

func (p *pulseEcho) read() {
	in := make([]byte, pulse.RequestSize+1) // one more: a longer datagram is not a request
	out := make([]byte, 0, pulse.ReplySize)
	for {
		n, from, err := p.conn.ReadFromUDPAddrPort(in)
		if errors.Is(err, net.ErrClosed) {
			return
		} else if err != nil {
			continue
		}
		req, err := pulse.ParseRequest(in[:n])
		if err != nil {
			p.rejected.Add(1)
			continue
		}
		k := pulse.DeriveKey(p.secret, req.MachineID, req.AgentKey)
		if err := pulse.VerifyRequest(in[:n], &k); err != nil {
			p.rejected.Add(1)
			continue
		}
		rep := pulse.Reply{Counter: req.Counter, Status: pulse.StatusRecorded, NextIn: p.interval}
		out = rep.Seal(out[:0], &k)
		p.answered.Add(1) // before the reply, which may end the agent's wait
		_, _ = p.conn.WriteToUDPAddrPort(out, from)
	}
}

// close stops serve.
func (p *pulseEcho) close() error { return p.conn.Close() }
