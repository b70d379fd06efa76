package hostile

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/binary"
	"fmt"
	"io"
	"math/big"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"github.com/google/uuid"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/api/agent/v1/agentv1connect"
)

// heartbeatPath is the gRPC path of the Heartbeat RPC.
const heartbeatPath = agentv1connect.AgentCallbackServiceHeartbeatProcedure

// keyType is the kind of client key a kind presents.
type keyType int

const (
	keyEd25519 keyType = iota
	keyECDSA
	keyNone
)

// tlsKey is the TLS configuration of one hostile identity.
type tlsKey struct {
	cfg *tls.Config
}

// newTLSKey makes a fresh key of type kt and a self-signed client
// certificate for it (none for keyNone).
func (h *hostile) newTLSKey(kt keyType) (*tlsKey, error) {
	cfg := &tls.Config{
		RootCAs:    h.roots,
		ServerName: h.serverName,
		MinVersion: tls.VersionTLS13,
		NextProtos: []string{"h2"},
	}
	var signer crypto.Signer
	switch kt {
	case keyEd25519:
		_, k, err := ed25519.GenerateKey(rand.Reader)
		if err != nil {
			return nil, fmt.Errorf("hostile: generating a key: %w", err)
		}
		signer = k
	case keyECDSA:
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return nil, fmt.Errorf("hostile: generating a key: %w", err)
		}
		signer = k
	case keyNone:
		return &tlsKey{cfg: cfg}, nil
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(now.UnixNano()),
		Subject:      pkix.Name{CommonName: uuid.NewString()},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, signer.Public(), signer)
	if err != nil {
		return nil, fmt.Errorf("hostile: creating a client certificate: %w", err)
	}
	cfg.Certificates = []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: signer}}
	return &tlsKey{cfg: cfg}, nil
}

// dial opens a TLS connection with k from local (nil: any address),
// bounded by ctx and the request timeout.
func (h *hostile) dial(ctx context.Context, k *tlsKey, local net.Addr) (*tls.Conn, error) {
	d := &tls.Dialer{NetDialer: &net.Dialer{Timeout: h.cfg.RequestTimeout, LocalAddr: local}, Config: k.cfg}
	ctx, cancel := context.WithTimeout(ctx, h.cfg.RequestTimeout)
	defer cancel()
	c, err := d.DialContext(ctx, "tcp", h.cfg.Endpoint)
	if err != nil {
		return nil, fmt.Errorf("hostile: dialing %s: %w", h.cfg.Endpoint, err)
	}
	return c.(*tls.Conn), nil
}

// request is one HTTP request of a kind.
type request struct {
	// variant names the request among its kind's ("": the kind has one).
	variant     string
	contentType string
	body        []byte
}

// requestKind is a kind sent by the request workers.
type requestKind struct {
	name   string
	client *http.Client
	// next returns the kind's i-th request.
	next func(i int64) request
	seq  atomic.Int64
}

func (h *hostile) requestKinds() ([]*requestKind, error) {
	targets := h.cfg.Targets
	target := func(i int64) string {
		if len(targets) == 0 {
			return uuid.NewString()
		}
		return targets[int(i%int64(len(targets)))]
	}
	oversized, err := oversizedBody(h.cfg.OversizeBytes, target(0))
	if err != nil {
		return nil, err
	}
	type spec struct {
		name string
		key  keyType
		next func(i int64) request
	}
	specs := []spec{
		{KindMalformed, keyEd25519, func(i int64) request { return malformed(i, target(i)) }},
		{KindOversized, keyEd25519, func(i int64) request {
			if i%2 == 0 {
				return request{"report", grpcProto, oversized}
			}
			// A prefix claiming 1 GiB, and a few bytes.
			return request{"claims_1GiB", grpcProto, framePrefix(0, 1<<30, []byte("\x0a\x24"))}
		}},
		{KindUnknownID, keyEd25519, func(int64) request {
			return request{"", grpcProto, frame(mustMarshal(fullRequest(uuid.NewString())))}
		}},
		{KindInvalidID, keyEd25519, func(i int64) request { return invalidID(i, target(i)) }},
		{KindInvalidText, keyEd25519, func(i int64) request { return invalidText(i, target(i)) }},
		{KindNoCertificate, keyNone, func(i int64) request {
			return request{"", grpcProto, frame(mustMarshal(fullRequest(target(i))))}
		}},
		{KindWrongKeyType, keyECDSA, func(i int64) request {
			return request{"", grpcProto, frame(mustMarshal(fullRequest(target(i))))}
		}},
	}
	if len(targets) > 0 {
		specs = append(specs, spec{KindForeignID, keyEd25519, func(i int64) request {
			return request{"", grpcProto, frame(mustMarshal(fullRequest(target(i))))}
		}})
	}
	kinds := make([]*requestKind, 0, len(specs))
	for _, s := range specs {
		k, err := h.newTLSKey(s.key)
		if err != nil {
			return nil, err
		}
		kinds = append(kinds, &requestKind{name: s.name, client: h.httpClient(k), next: s.next})
	}
	return kinds, nil
}

// httpClient is an HTTP/2 client with k whose connections h can close.
func (h *hostile) httpClient(k *tlsKey) *http.Client {
	d := &net.Dialer{Timeout: h.cfg.RequestTimeout}
	tr := &http.Transport{
		TLSClientConfig:   k.cfg,
		ForceAttemptHTTP2: true,
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			c, err := d.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return h.conns.add(c), nil
		},
		TLSHandshakeTimeout:    h.cfg.RequestTimeout,
		ResponseHeaderTimeout:  h.cfg.RequestTimeout,
		IdleConnTimeout:        time.Minute,
		MaxResponseHeaderBytes: 64 << 10,
	}
	tr.Protocols = new(http.Protocols)
	tr.Protocols.SetHTTP2(true)
	return &http.Client{Transport: tr, Timeout: h.cfg.RequestTimeout}
}

// requests is worker w of the request kinds: it sends them in turn, one at
// a time, until ctx ends.
func (h *hostile) requests(ctx context.Context, w int) {
	for i := w; ; i++ {
		if err := h.limiter.Wait(ctx); err != nil {
			return
		}
		k := h.kinds[i%len(h.kinds)]
		req := k.next(k.seq.Add(1) - 1)
		h.tally.sent(k.name, 1)
		code, err := h.send(ctx, k.client, req)
		switch {
		case err == nil:
			h.tally.answer(k.name, req.variant, code)
		case ctx.Err() != nil:
			return
		default:
			h.tally.error(k.name, err)
		}
	}
}

// maxResponseBody bounds what is read of an answer.
const maxResponseBody = 1 << 20

// send makes one request and returns the server's answer as a code (see
// Result.Codes).
func (h *hostile) send(ctx context.Context, c *http.Client, r request) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, h.cfg.RequestTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "https://"+h.cfg.Endpoint+heartbeatPath, bytes.NewReader(r.body))
	if err != nil {
		return "", fmt.Errorf("hostile: making a request: %w", err)
	}
	req.Header.Set("Content-Type", r.contentType)
	req.Header.Set("Te", "trailers")
	resp, err := c.Do(req)
	if err != nil {
		return "", fmt.Errorf("hostile: sending: %w", err)
	}
	defer resp.Body.Close()
	// The trailers come after the body.
	_, rerr := io.Copy(io.Discard, io.LimitReader(resp.Body, maxResponseBody))
	if resp.StatusCode != http.StatusOK {
		return "http_" + strconv.Itoa(resp.StatusCode), nil
	}
	s := resp.Trailer.Get("Grpc-Status")
	if s == "" {
		s = resp.Header.Get("Grpc-Status")
	}
	if s == "" {
		if rerr != nil {
			return "", fmt.Errorf("hostile: reading the answer: %w", rerr)
		}
		return "no_status", nil
	}
	return grpcCode(s), nil
}

// grpcCode names a grpc-status value.
func grpcCode(s string) string {
	n, err := strconv.ParseUint(s, 10, 32)
	switch {
	case err != nil:
		return "bad_status"
	case n == 0:
		return codeOK
	}
	return connect.Code(n).String()
}

const (
	grpcProto = "application/grpc+proto"
	grpcPlain = "application/grpc"
)

// frame is msg as one gRPC message.
func frame(msg []byte) []byte { return framePrefix(0, uint32(len(msg)), msg) }

// framePrefix is a gRPC length prefix with flags and length, then body.
func framePrefix(flags byte, length uint32, body []byte) []byte {
	b := make([]byte, 5, 5+len(body))
	b[0] = flags
	binary.BigEndian.PutUint32(b[1:], length)
	return append(b, body...)
}

func mustMarshal(m proto.Message) []byte {
	b, err := proto.Marshal(m)
	if err != nil {
		// Only valid messages built here are marshalled.
		panic(fmt.Sprintf("hostile: marshalling %T: %v", m, err))
	}
	return b
}

// fullRequest is a valid heartbeat naming id with both reports, as an
// agent's first heartbeat after an installation carries.
func fullRequest(id string) *agentv1.HeartbeatRequest {
	return &agentv1.HeartbeatRequest{
		MachineId:    id,
		AgentVersion: "hostile",
		HardwareReport: &agentv1.HardwareReport{
			Cpu:          &agentv1.CPU{Model: "forged", Threads: 4096},
			MemoryBytes:  1 << 50,
			BlockDevices: []*agentv1.BlockDevice{{Name: "forged", SizeBytes: 1 << 50}},
			Dmi:          &agentv1.DMI{SystemVendor: "hostile"},
		},
		InstallationReport: &agentv1.OSInstallationReport{Generation: 1,
			Result: &agentv1.OSInstallationReport_Success{Success: &agentv1.InstallationSuccess{}}},
	}
}

// oversizedBody is a framed heartbeat naming id whose hardware report is
// about n bytes.
func oversizedBody(n int, id string) ([]byte, error) {
	const chunk = 64 << 10
	warn := strings.Repeat("x", chunk)
	r := &agentv1.HardwareReport{}
	for size := 0; size < n; size += chunk {
		r.Warnings = append(r.Warnings, warn)
	}
	b, err := proto.Marshal(&agentv1.HeartbeatRequest{MachineId: id, HardwareReport: r})
	if err != nil {
		return nil, fmt.Errorf("hostile: marshalling the oversized request: %w", err)
	}
	return frame(b), nil
}

// malformed is the i-th malformed request.
func malformed(i int64, target string) request {
	valid := mustMarshal(fullRequest(target))
	switch i % 8 {
	case 0: // garbage with the protobuf content type
		g := make([]byte, 1+mrand.IntN(512))
		for j := range g {
			g[j] = byte(mrand.Uint32())
		}
		return request{"garbage", grpcProto, frame(g)}
	case 1: // truncated protobuf, correctly framed
		return request{"truncated", grpcPlain, frame(valid[:len(valid)/2])}
	case 2: // a wrong content type
		return request{"content_type_json", "application/json", []byte(`{"machineId":"` + target + `"}`)}
	case 3: // a prefix claiming more than is sent
		return request{"prefix_overstates", grpcProto, framePrefix(0, uint32(len(valid)+1000), valid)}
	case 4: // compressed, without a grpc-encoding
		return request{"compressed_flag", grpcProto, framePrefix(1, uint32(len(valid)), valid)}
	case 5: // no message at all
		return request{"no_message", grpcProto, nil}
	case 6: // two messages in a unary call
		return request{"two_messages", grpcProto, append(frame(valid), frame(valid)...)}
	default: // field 1 with the invalid wire type 7
		return request{"bad_wire_type", grpcProto, frame([]byte{0x0f, 0x01, 0x02})}
	}
}

// invalidID is the i-th heartbeat with an invalid or strangely spelled id.
func invalidID(i int64, target string) request {
	ids := [][2]string{
		{"empty", ""},
		{"word", "not-a-uuid"},
		{"sql", "' OR 1=1 --"},
		{"long", strings.Repeat("a", 10000)},
		{"nul", target + "\x00"},
		{"nil_uuid", "00000000-0000-0000-0000-000000000000"},
		// Other spellings of the target a UUID parser accepts: they must
		// be refused like the target itself.
		{"braces", "{" + target + "}"},
		{"urn", "urn:uuid:" + target},
		{"upper", strings.ToUpper(target)},
		{"no_dashes", strings.ReplaceAll(target, "-", "")},
	}
	id := ids[int(i%int64(len(ids)))]
	return request{id[0], grpcProto, frame(mustMarshal(fullRequest(id[1])))}
}

// invalidText is the i-th heartbeat with text PostgreSQL or protobuf
// refuses. proto.Marshal refuses invalid UTF-8, so these are written field
// by field.
func invalidText(i int64, target string) request {
	id := target
	if i%2 == 1 {
		id = uuid.NewString()
	}
	str := func(b []byte, num protowire.Number, s string) []byte {
		b = protowire.AppendTag(b, num, protowire.BytesType)
		return protowire.AppendString(b, s)
	}
	msg := func(b []byte, num protowire.Number, m []byte) []byte {
		b = protowire.AppendTag(b, num, protowire.BytesType)
		return protowire.AppendBytes(b, m)
	}
	installErr := func(text string) []byte {
		var e, r []byte
		e = str(e, 1, text)
		r = protowire.AppendTag(r, 1, protowire.VarintType)
		r = protowire.AppendVarint(r, 1)
		return msg(r, 3, e)
	}
	hwWarning := func(text string) []byte {
		var cpu, hw []byte
		cpu = str(cpu, 1, text)
		hw = msg(hw, 1, cpu)
		return str(hw, 7, text)
	}
	var b []byte
	var variant string
	switch (i / 2) % 6 {
	case 0:
		variant, b = "install_error_nul", msg(str(b, 1, id), 3, installErr("disk\x00gone"))
	case 1:
		variant, b = "install_error_utf8", msg(str(b, 1, id), 3, installErr("bad \xff\xfe text"))
	case 2:
		variant, b = "hardware_nul", msg(str(b, 1, id), 2, hwWarning("cpu\x00model"))
	case 3:
		variant, b = "hardware_utf8", msg(str(b, 1, id), 2, hwWarning("\xc3\x28"))
	case 4:
		variant, b = "agent_version", str(str(b, 1, id), 4, "v1\x00\xff")
	default:
		variant, b = "machine_id_utf8", str(b, 1, id[:8]+"\xff"+id[9:])
	}
	if id == target {
		variant += "_target"
	}
	return request{variant, grpcProto, frame(b)}
}
