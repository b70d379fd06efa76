package server

import (
	"context"
	"crypto/ed25519"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strconv"
	"time"

	"connectrpc.com/connect"
	"github.com/google/uuid"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/shepherd/shepherd/agent/hwreport"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb"
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
	reasonOther           = "other"
)

var rejectReasons = []string{
	reasonNoCertificate, reasonUnsupportedKey, reasonUnauthenticated, reasonInvalid,
	reasonTooLarge, reasonUnavailable, reasonOther,
}

// errUnauthenticated is the one answer for an unknown machine and for a key
// that is not the machine's: telling them apart would let anyone probe which
// machine ids exist.
var errUnauthenticated = connect.NewError(connect.CodeUnauthenticated, errors.New("unknown machine or wrong agent key"))

type ctxKey int

const outcomeKey ctxKey = iota

// outcome carries a request's client certificates to the handler, and what
// the handler decided back to the metrics middleware (nothing, if the
// request never reached the handler).
type outcome struct {
	peerCerts []*x509.Certificate
	reached   bool
	reason    string // empty: accepted
}

// observe wraps the RPC handler with the request metrics: latency, and
// accepted or rejected with a reason. Requests rejected before the handler
// (too large, malformed) are classified by the RPC status of the response.
func (s *Server) observe(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		o := &outcome{}
		if r.TLS != nil {
			o.peerCerts = r.TLS.PeerCertificates
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), outcomeKey, o)))
		s.metrics.latency.Observe(time.Since(start).Seconds())
		reason := o.reason
		if !o.reached {
			reason = reasonFromResponse(w)
		}
		if reason == "" {
			s.metrics.accepted.Inc()
		} else {
			s.metrics.rejected.WithLabelValues(reason).Inc()
		}
	})
}

// reasonFromResponse classifies a response the handler did not produce by
// its gRPC status (header or trailer) or, for the Connect protocol, its HTTP
// status.
func reasonFromResponse(w http.ResponseWriter) string {
	h := w.Header()
	st := h.Get("Grpc-Status")
	if st == "" {
		st = h.Get(http.TrailerPrefix + "Grpc-Status")
	}
	if code, err := strconv.Atoi(st); err == nil {
		switch connect.Code(code) {
		case connect.CodeResourceExhausted:
			return reasonTooLarge
		case connect.CodeInvalidArgument, connect.CodeInternal:
			return reasonInvalid
		}
		return reasonOther
	}
	return reasonOther
}

// heartbeatHandler implements the AgentCallbackService.
type heartbeatHandler struct {
	s *Server
}

// Heartbeat authenticates the agent, records its heartbeat and reports in
// the next batch, and returns any pending installation request.
func (h *heartbeatHandler) Heartbeat(ctx context.Context, req *connect.Request[agentv1.HeartbeatRequest]) (*connect.Response[agentv1.HeartbeatResponse], error) {
	o, _ := ctx.Value(outcomeKey).(*outcome)
	if o == nil {
		o = &outcome{}
	}
	o.reached = true
	key, err := clientKey(o.peerCerts)
	if err != nil {
		o.reason = err.reason
		return nil, err.err
	}
	hb, verr := parseHeartbeat(req.Msg, key)
	if verr != nil {
		o.reason = reasonInvalid
		return nil, connect.NewError(connect.CodeInvalidArgument, verr)
	}
	res, err2 := h.s.batch.submit(ctx, hb, h.s.cfg.Unbatched)
	if err2 != nil {
		o.reason = reasonUnavailable
		if ctx.Err() != nil {
			return nil, connect.NewError(connect.CodeCanceled, ctx.Err())
		}
		h.s.log.ErrorContext(ctx, "recording heartbeat", "machine_id", hb.MachineID.String(), "err", err2)
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("recording heartbeat failed; try again"))
	}
	if !res.Accepted {
		o.reason = reasonUnauthenticated
		return nil, errUnauthenticated
	}
	resp := &agentv1.HeartbeatResponse{NextHeartbeatIn: durationpb.New(h.s.cfg.HeartbeatInterval)}
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
	return connect.NewResponse(resp), nil
}

type rejection struct {
	reason string
	err    error
}

// clientKey returns the ed25519 key of the client certificate the request
// came with. Possession of the key was proven by the TLS handshake; whose
// key it is, the BMDB decides.
func clientKey(certs []*x509.Certificate) (ed25519.PublicKey, *rejection) {
	if len(certs) == 0 {
		return nil, &rejection{reasonNoCertificate, connect.NewError(connect.CodeUnauthenticated, errors.New("no client certificate"))}
	}
	key, ok := certs[0].PublicKey.(ed25519.PublicKey)
	if !ok {
		return nil, &rejection{reasonUnsupportedKey, connect.NewError(connect.CodeUnauthenticated, errors.New("client certificate key is not ed25519"))}
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
			in.Error = truncate(res.Error.GetMessage(), 4096)
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

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
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
