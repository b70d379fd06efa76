package main

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"os"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/api/agent/v1/agentv1connect"
	"github.com/shepherd/shepherd/internal/devpki"
)

// transportCeiling is P1's limit: the heartbeats per second the same load
// generator gets from a server with the callback server's transport (TLS
// 1.3 asking for the agent's certificate, grpc-go with the same buffer
// settings, the request decoded) that answers every heartbeat at once,
// without authenticating it or touching the BMDB. P1 is measured against
// 0.8 of it, so the figure says how much of the transport's rate the real
// server keeps, on this machine, in this run. It also returns the CPU this
// process (the transport-only server) spent per answered heartbeat: what the
// transport alone costs the server, against which P1's server_cpu_us reads.
func transportCeiling(ctx context.Context, ids []uuid.UUID) (perSecond, serverCPUus float64, err error) {
	dir, err := os.MkdirTemp("", "shepherd-bench-p1-transport-")
	if err != nil {
		return 0, 0, err
	}
	defer os.RemoveAll(dir)
	pki, err := devpki.LoadOrCreate(dir, []string{"127.0.0.1"})
	if err != nil {
		return 0, 0, err
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, 0, err
	}
	var answered atomic.Int64
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
			Handler: func(_ any, _ context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
				var req agentv1.HeartbeatRequest
				if err := dec(&req); err != nil {
					return nil, err
				}
				answered.Add(1)
				return &agentv1.HeartbeatResponse{}, nil
			},
		}},
		Metadata: "agent/v1/agent.proto",
	}, struct{}{})
	served := make(chan error, 1)
	go func() { served <- gs.Serve(ln) }()
	defer func() {
		gs.Stop()
		<-served
	}()

	lg, err := startLoadgen(ctx, dir, ln.Addr().String(), pki.CA, ids)
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
	n0, cpu0, start := answered.Load(), processCPU(), time.Now()
	sleepCtx(ctx, 5*time.Second)
	n1, cpu1, elapsed := answered.Load(), processCPU(), time.Since(start)
	if err := lg.finish(); err != nil {
		return 0, 0, err
	}
	if n1 == n0 {
		return 0, 0, errors.New("the transport-only server answered no heartbeat in the measuring window")
	}
	n := float64(n1 - n0)
	return n / elapsed.Seconds(), float64((cpu1 - cpu0).Microseconds()) / n, nil
}
