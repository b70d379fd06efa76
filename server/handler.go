package server

import (
	"context"
	"crypto/ed25519"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"unicode/utf8"

	"github.com/google/uuid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/stats"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/shepherd/shepherd/agent/hwreport"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/api/agent/v1/agentv1connect"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/internal/safetext"
)

// Rejection reasons, the values of the reason label of
// shepherd_server_heartbeats_rejected_total.
const (
	reasonNoCertificate   = "no_client_certificate"
	reasonUnsupportedKey  = "unsupported_key"
	reasonUnauthenticated = "unauthenticated"
	reasonInvalid         = "invalid_argument"
	reasonTooLarge        = "too_large"
	reasonUnavailable     = "unavailable"
	// reasonBusy: the queue of heartbeats of unverified keys was full.
	reasonBusy = "busy"
	// reasonThrottled: the connection had too many requests of unverified
	// keys in flight.
	reasonThrottled = "throttled"
	// reasonRetired: the agent of a decommissioned machine, told to stop.
	reasonRetired = "retired"
	// reasonReplayed: an authentic heartbeat datagram whose counter was
	// not above the machine's stored one (a replay, or a copy delayed in
	// the network).
	reasonReplayed = "replayed"
	// reasonBadMAC: a heartbeat datagram whose MAC does not match; it is
	// not answered.
	reasonBadMAC = "bad_mac"
	reasonOther  = "other"
)

var rejectReasons = []string{
	reasonNoCertificate, reasonUnsupportedKey, reasonUnauthenticated, reasonInvalid,
	reasonTooLarge, reasonUnavailable, reasonBusy, reasonThrottled, reasonRetired,
	reasonReplayed, reasonBadMAC, reasonOther,
}

// retryPushbackKey is the gRPC trailer that tells a client when to retry
// (gRPC's retry pushback, in milliseconds). The agent retries an Unavailable
// that carries it promptly, as told, instead of backing off as if the
// network were down.
const retryPushbackKey = "grpc-retry-pushback-ms"

// errUnauthenticated is the one answer for an unknown machine and for a key
// that is not the machine's: telling them apart would let anyone probe which
// machine ids exist.
var errUnauthenticated = status.Error(codes.Unauthenticated, "unknown machine or wrong agent key")

// errRetired tells the agent of a decommissioned machine (authenticated by
// its last key) that it is no longer wanted: the agent stops instead of
// retrying for ever.
var errRetired = status.Error(codes.PermissionDenied, "machine decommissioned: the agent is retired and should stop")

// peerAddr is the client's address, for log lines.
func peerAddr(ctx context.Context) string {
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		return p.Addr.String()
	}
	return ""
}

// heartbeatService describes the AgentCallbackService of agent.proto to
// grpc-go. It is written here rather than generated so that the handler
// receives the request undecoded: grpc-go would answer a request it cannot
// decode with Internal, and SPEC §4.5 wants InvalidArgument.
var heartbeatService = grpc.ServiceDesc{
	ServiceName: agentv1connect.AgentCallbackServiceName,
	HandlerType: (*any)(nil),
	Methods: []grpc.MethodDesc{{
		MethodName: "Heartbeat",
		Handler: func(srv any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
			var body rawMessage
			if err := dec(&body); err != nil {
				return nil, err
			}
			return srv.(*heartbeatHandler).heartbeat(ctx, body)
		},
	}},
	Metadata: "agent/v1/agent.proto",
}

// rawMessage is a request body as it came off the wire.
type rawMessage []byte

// codec is the server's message codec: protobuf for responses, and the raw
// bytes for requests, which the handler decodes itself.
type codec struct{}

var _ encoding.CodecV2 = codec{}

func (codec) Name() string { return "proto" }

func (codec) Marshal(v any) (mem.BufferSlice, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("server: cannot marshal %T", v)
	}
	b, err := proto.Marshal(m)
	if err != nil {
		return nil, err
	}
	return mem.BufferSlice{mem.SliceBuffer(b)}, nil
}

func (codec) Unmarshal(data mem.BufferSlice, v any) error {
	switch m := v.(type) {
	case *rawMessage:
		*m = data.Materialize()
		return nil
	case proto.Message:
		return proto.Unmarshal(data.Materialize(), m)
	}
	return fmt.Errorf("server: cannot unmarshal into %T", v)
}

type ctxKey int

const (
	outcomeKey ctxKey = iota
	connStateKey
)

// outcome is what the handler decided about one RPC, for the metrics; it
// stays empty when the request never reached the handler.
type outcome struct {
	reached bool
	reason  string // empty: accepted
}

// observer is a grpc-go stats handler that counts every heartbeat RPC,
// including those refused before the handler (too large), and times it.
type observer struct {
	m *metrics
}

func (o *observer) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context {
	return context.WithValue(ctx, outcomeKey, &outcome{})
}

func (o *observer) HandleRPC(ctx context.Context, s stats.RPCStats) {
	end, ok := s.(*stats.End)
	if !ok {
		return
	}
	o.m.latency.Observe(end.EndTime.Sub(end.BeginTime).Seconds())
	out, _ := ctx.Value(outcomeKey).(*outcome)
	reason := ""
	switch {
	case out != nil && out.reached:
		reason = out.reason
	case end.Error == nil:
	default:
		switch status.Code(end.Error) {
		case codes.ResourceExhausted:
			reason = reasonTooLarge
		case codes.InvalidArgument:
			reason = reasonInvalid
		default:
			reason = reasonOther
		}
	}
	if reason == "" {
		o.m.accepted.Inc()
	} else {
		o.m.rejected.WithLabelValues(reason).Inc()
	}
}

// TagConn gives every connection its state; grpc-go derives the contexts of
// the connection's RPCs from the context returned here.
func (o *observer) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context {
	return context.WithValue(ctx, connStateKey, &connState{})
}

func (o *observer) HandleConn(context.Context, stats.ConnStats) {}

// heartbeatHandler implements the AgentCallbackService.
type heartbeatHandler struct {
	s *Server
}

// heartbeat authenticates the agent, records its heartbeat and reports in
// the next batch, and returns any pending installation request.
func (h *heartbeatHandler) heartbeat(ctx context.Context, body rawMessage) (*agentv1.HeartbeatResponse, error) {
	o, _ := ctx.Value(outcomeKey).(*outcome)
	if o == nil {
		o = &outcome{}
	}
	o.reached = true
	key, rej := clientKey(ctx)
	if rej != nil {
		o.reason = rej.reason
		return nil, rej.err
	}
	var req agentv1.HeartbeatRequest
	if err := proto.Unmarshal(body, &req); err != nil {
		o.reason = reasonInvalid
		return nil, status.Errorf(codes.InvalidArgument, "malformed HeartbeatRequest: %v", err)
	}
	hb, err := parseHeartbeat(&req, key)
	if err != nil {
		o.reason = reasonInvalid
		h.s.throttle.Log(ctx, slog.LevelWarn, reasonInvalid, "invalid heartbeat request", "err", err)
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	verified := h.s.verified.has(hb.MachineID, key)
	if cs, _ := ctx.Value(connStateKey).(*connState); !verified && cs != nil {
		if !cs.acquire() {
			o.reason = reasonThrottled
			h.s.throttle.Log(ctx, slog.LevelWarn, reasonThrottled, "connection sends requests of unverified keys in parallel; refusing",
				"peer", peerAddr(ctx))
			return nil, status.Error(codes.ResourceExhausted, "too many requests in flight on this connection")
		}
		defer cs.release()
	}
	res, err := h.s.batch.submit(ctx, hb, verified, h.s.cfg.Unbatched)
	switch {
	case err == nil:
	case ctx.Err() != nil:
		o.reason = reasonUnavailable
		return nil, status.FromContextError(ctx.Err()).Err()
	case errors.Is(err, errBusy):
		o.reason = reasonBusy
		h.s.throttle.Log(ctx, slog.LevelWarn, reasonBusy, "too many heartbeats of unverified keys queued; refusing")
		return nil, h.s.unavailable(ctx, "busy; try again")
	default:
		o.reason = reasonUnavailable
		h.s.throttle.Log(ctx, slog.LevelError, reasonUnavailable, "recording heartbeats failed",
			"machine_id", hb.MachineID.String(), "err", err)
		return nil, h.s.unavailable(ctx, "recording heartbeat failed; try again")
	}
	h.s.verified.learn(hb.MachineID, key, res.Accepted)
	switch {
	case res.Err != nil:
		o.reason = reasonInvalid
		h.s.throttle.Log(ctx, slog.LevelWarn, reasonInvalid, "the database refused a heartbeat",
			"machine_id", hb.MachineID.String(), "err", res.Err)
		return nil, status.Error(codes.InvalidArgument, "the heartbeat's content cannot be stored")
	case res.Retired:
		o.reason = reasonRetired
		h.s.throttle.Log(ctx, slog.LevelInfo, reasonRetired, "telling the agent of a decommissioned machine to stop",
			"machine_id", hb.MachineID.String())
		return nil, errRetired
	case !res.Accepted:
		o.reason = reasonUnauthenticated
		return nil, errUnauthenticated
	}
	resp := &agentv1.HeartbeatResponse{
		NextHeartbeatIn:            durationpb.New(h.s.cfg.HeartbeatInterval),
		HardwareReportRecorded:     res.HardwareRecorded,
		InstallationReportRecorded: res.InstallationRecorded,
		DatagramGrant:              h.s.grant(hb.MachineID, key, res.Counter),
	}
	if p := res.Pending; p != nil {
		var ir agentv1.OSInstallationRequest
		if err := proto.Unmarshal(p.Request, &ir); err != nil {
			// Only Shepherd writes requests; a corrupt one is our bug, and
			// the agent can do nothing about it.
			h.s.log.ErrorContext(ctx, "stored installation request is corrupt", "machine_id", hb.MachineID.String(),
				"generation", p.Generation, "err", err)
		} else {
			ir.Generation = p.Generation
			resp.InstallationRequest = &ir
		}
	}
	return resp, nil
}

type rejection struct {
	reason string
	err    error
}

// clientKey returns the ed25519 key of the client certificate the RPC came
// with. Possession of the key was proven by the TLS handshake; whose key it
// is, the BMDB decides.
func clientKey(ctx context.Context) (ed25519.PublicKey, *rejection) {
	var certs []*x509.Certificate
	if p, ok := peer.FromContext(ctx); ok {
		if info, ok := p.AuthInfo.(credentials.TLSInfo); ok {
			certs = info.State.PeerCertificates
		}
	}
	if len(certs) == 0 {
		return nil, &rejection{reasonNoCertificate, status.Error(codes.Unauthenticated, "no client certificate")}
	}
	key, ok := certs[0].PublicKey.(ed25519.PublicKey)
	if !ok {
		return nil, &rejection{reasonUnsupportedKey, status.Error(codes.Unauthenticated, "client certificate key is not ed25519")}
	}
	return key, nil
}

// parseHeartbeat validates a request and turns it into a BMDB heartbeat.
// Everything an agent sends is checked here, before anything is written.
func parseHeartbeat(m *agentv1.HeartbeatRequest, key ed25519.PublicKey) (bmdb.Heartbeat, error) {
	id, err := uuid.Parse(m.GetMachineId())
	if err != nil {
		return bmdb.Heartbeat{}, fmt.Errorf("machine_id %q is not a UUID", truncate(m.GetMachineId(), 64))
	}
	if len(m.GetAgentVersion()) > 256 {
		return bmdb.Heartbeat{}, errors.New("agent_version is longer than 256 bytes")
	}
	hb := bmdb.Heartbeat{MachineID: id, AgentKey: key}
	if r := m.GetHardwareReport(); r != nil {
		raw, err := proto.Marshal(r)
		if err != nil {
			return bmdb.Heartbeat{}, fmt.Errorf("hardware_report: %w", err)
		}
		t := hwreport.TotalsOf(r)
		hb.Hardware = &bmdb.HardwareReport{Raw: raw, CPUThreads: t.CPUThreads, MemoryBytes: t.MemoryBytes, DiskCount: int32(t.DiskCount), DiskBytes: t.DiskBytes}
	}
	if r := m.GetInstallationReport(); r != nil {
		if r.GetGeneration() <= 0 {
			return bmdb.Heartbeat{}, fmt.Errorf("installation_report.generation must be > 0, got %d", r.GetGeneration())
		}
		in := &bmdb.InstallationReport{Generation: r.GetGeneration()}
		switch res := r.GetResult().(type) {
		case *agentv1.OSInstallationReport_Success:
			in.Success = true
		case *agentv1.OSInstallationReport_Error:
			in.Error = safetext.Cut(res.Error.GetMessage(), maxErrorText)
		default:
			return bmdb.Heartbeat{}, errors.New("installation_report has neither success nor error")
		}
		if in.Raw, err = proto.Marshal(r); err != nil {
			return bmdb.Heartbeat{}, fmt.Errorf("installation_report: %w", err)
		}
		hb.Installation = in
	}
	return hb, nil
}

// maxErrorText bounds an installation error as stored (the report's raw
// protobuf keeps the whole text).
const maxErrorText = 4096

// truncate cuts s to at most n bytes on a character boundary, ending in
// "..." if it was cut.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	const mark = "..."
	cut := max(n-len(mark), 0)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + mark
}

func readPEMCertificate(path string) ([]byte, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("server: reading CA %s: %w", path, err)
	}
	b, _ := pem.Decode(data)
	if b == nil || b.Type != "CERTIFICATE" {
		return nil, fmt.Errorf("server: %s holds no PEM certificate", path)
	}
	if _, err := x509.ParseCertificate(b.Bytes); err != nil {
		return nil, fmt.Errorf("server: parsing CA %s: %w", path, err)
	}
	return b.Bytes, nil
}
