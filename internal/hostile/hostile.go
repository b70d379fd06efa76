// Package hostile is a hostile client of the agent callback server (package
// server), for chaos soaks: for as long as it runs it sends what no honest
// agent sends — malformed and oversized requests, heartbeats naming other
// machines, unknown and invalid machine ids, text PostgreSQL cannot store,
// requests without a client certificate or with a key of the wrong type —
// and floods the server with connections and concurrent streams.
//
// Every request it makes is one a correct server refuses: Result.Accepted
// counts the OK answers, and any of them is a breach.
package hostile

import (
	"cmp"
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"maps"
	"net"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// The kinds of abuse, the keys of Result.Sent and Result.Answers.
const (
	// KindMalformed: bodies that are no HeartbeatRequest — garbage bytes
	// with the protobuf content type, truncated protobuf, a wrong content
	// type, gRPC length prefixes that lie, a compressed flag without an
	// encoding, no message and two messages.
	KindMalformed = "malformed"
	// KindOversized: a heartbeat whose hardware report is
	// Config.OversizeBytes long, and a length prefix claiming 1 GiB.
	KindOversized = "oversized"
	// KindForeignID: a valid heartbeat, with reports, naming one of
	// Config.Targets, from the hostile key.
	KindForeignID = "foreign_id"
	// KindUnknownID: a valid heartbeat naming a random UUID.
	KindUnknownID = "unknown_id"
	// KindInvalidID: machine ids that are no UUID, and other spellings of
	// a target's id that a UUID parser may accept (braces, urn:uuid:,
	// upper case, no dashes).
	KindInvalidID = "invalid_id"
	// KindInvalidText: NUL bytes and invalid UTF-8 in the machine id, the
	// agent version and the reports.
	KindInvalidText = "invalid_text"
	// KindNoCertificate: a heartbeat naming a target over TLS without a
	// client certificate.
	KindNoCertificate = "no_certificate"
	// KindWrongKeyType: a heartbeat naming a target with an ECDSA client
	// certificate (agents have ed25519 keys).
	KindWrongKeyType = "wrong_key_type"
	// KindFlood: unknown-id heartbeats sent in bursts of
	// Config.FloodStreams concurrent streams on one HTTP/2 connection,
	// more than the server allows, as fast as the rate allows.
	KindFlood = "flood"
	// KindConnFlood: connections opened (TLS handshake and HTTP/2 preface)
	// and held for Config.HoldTime, Config.HeldConnections at a time.
	KindConnFlood = "conn_flood"
)

// Kinds lists every kind of abuse Run sends (KindForeignID only with
// Config.Targets).
func Kinds() []string {
	return []string{KindMalformed, KindOversized, KindForeignID, KindUnknownID, KindInvalidID,
		KindInvalidText, KindNoCertificate, KindWrongKeyType, KindFlood, KindConnFlood}
}

// Config configures Run. Zero values mean defaults.
type Config struct {
	// Endpoint is the host:port of the callback server.
	Endpoint string
	// CA is the PEM (or DER) certificate of the CA the server's
	// certificate chains to. Empty: the system roots.
	CA []byte
	// ServerName is the name the server's certificate is verified for;
	// default the host of Endpoint.
	ServerName string
	// Targets are machine ids (UUIDs) of real machines, named by the
	// foreign-id heartbeats and by the requests without or with a wrong
	// client certificate. Empty: those name random UUIDs, and no
	// KindForeignID is sent.
	Targets []string
	// Connections is how many workers send the request kinds (all but the
	// floods), each one request at a time; default 8.
	Connections int
	// FloodConnections is how many HTTP/2 connections send KindFlood
	// bursts; default 2.
	FloodConnections int
	// FloodStreams is how many streams a flood connection opens at once;
	// default 64, four times the server's default limit of concurrent
	// streams per connection.
	FloodStreams int
	// HeldConnections is how many connections KindConnFlood holds open at
	// a time; default 128. To exceed the server's per-IP connection limit
	// (default 4,096) set it above that limit.
	HeldConnections int
	// HoldTime is how long KindConnFlood holds each connection before
	// opening a new one, and waits after a refused one; default 500ms.
	HoldTime time.Duration
	// ConnFloodFrom is the local IP address KindConnFlood dials from;
	// default the system's choice. Connections over the server's per-IP
	// limit are refused whoever opens them, so a connection flood from the
	// address the other kinds use keeps most of those from the server;
	// on loopback, another 127.0.0.0/8 address keeps them apart.
	ConnFloodFrom string
	// Rate bounds the requests (each flood stream counts) and connection
	// attempts per second, across all kinds; default 1,000. The floods
	// take most of it. Measured on a 2-core machine with the other
	// defaults, the callback server and this client together used about
	// 0.4 of a core (PostgreSQL apart): heavy, but not by itself starving
	// the machine.
	Rate float64
	// OversizeBytes is the size of the oversized heartbeats' hardware
	// report; default 4 MiB, four times the server's default request
	// limit.
	OversizeBytes int
	// RequestTimeout bounds every request, dial and TLS handshake; default
	// 5s. Run returns at most about this long after ctx ends, even when
	// the server answers nothing.
	RequestTimeout time.Duration
}

// Defaults of Config.
const (
	DefaultConnections      = 8
	DefaultFloodConnections = 2
	DefaultFloodStreams     = 64
	DefaultHeldConnections  = 128
	DefaultHoldTime         = 500 * time.Millisecond
	DefaultRate             = 1000
	DefaultOversizeBytes    = 4 << 20
	DefaultRequestTimeout   = 5 * time.Second
)

func (c Config) withDefaults() Config {
	c.Connections = cmp.Or(c.Connections, DefaultConnections)
	c.FloodConnections = cmp.Or(c.FloodConnections, DefaultFloodConnections)
	c.FloodStreams = cmp.Or(c.FloodStreams, DefaultFloodStreams)
	c.HeldConnections = cmp.Or(c.HeldConnections, DefaultHeldConnections)
	c.HoldTime = cmp.Or(c.HoldTime, DefaultHoldTime)
	c.Rate = cmp.Or(c.Rate, DefaultRate)
	c.OversizeBytes = cmp.Or(c.OversizeBytes, DefaultOversizeBytes)
	c.RequestTimeout = cmp.Or(c.RequestTimeout, DefaultRequestTimeout)
	return c
}

func (c Config) validate() error {
	switch {
	case c.Endpoint == "":
		return errors.New("hostile: Endpoint is required")
	case c.Connections < 0, c.FloodConnections < 0, c.FloodStreams < 0, c.HeldConnections < 0:
		return errors.New("hostile: Connections, FloodConnections, FloodStreams and HeldConnections must be >= 0 (0 = default)")
	case c.HoldTime < 0, c.RequestTimeout < 0:
		return errors.New("hostile: HoldTime and RequestTimeout must be >= 0 (0 = default)")
	case c.Rate < 0, c.OversizeBytes < 0:
		return errors.New("hostile: Rate and OversizeBytes must be >= 0 (0 = default)")
	}
	if _, _, err := net.SplitHostPort(c.Endpoint); err != nil {
		return fmt.Errorf("hostile: Endpoint %q: %w", c.Endpoint, err)
	}
	if c.ConnFloodFrom != "" && net.ParseIP(c.ConnFloodFrom) == nil {
		return fmt.Errorf("hostile: ConnFloodFrom %q is not an IP address", c.ConnFloodFrom)
	}
	return nil
}

// Result counts what Run sent and what the server answered.
type Result struct {
	// Sent counts requests (flood: streams; conn_flood: connection
	// attempts) by kind.
	Sent map[string]int64
	// Accepted counts OK answers. Every request Run sends must be refused:
	// for a correct server it is 0, and anything else is a breach.
	Accepted int64
	// Codes counts the server's answers: the gRPC status as a connect code
	// name ("unauthenticated", "invalid_argument", ..., "ok"), "http_N" for
	// an HTTP status other than 200, "no_status" for a 200 without
	// grpc-status, "rst_CODE" for a stream the server reset, "goaway_CODE"
	// for a GOAWAY on a flood connection, and "conn_held" for a flood
	// connection the server kept.
	Codes map[string]int64
	// Answers is Codes by kind.
	Answers map[string]map[string]int64
	// Variants is Codes by kind and variant ("malformed/truncated", ...),
	// for the kinds that have variants.
	Variants map[string]map[string]int64
	// Errors counts transport errors and timeouts (a flood counts each
	// stream left unanswered): expected during floods and faults.
	Errors int64
	// KindErrors is Errors by kind, and LastErrors the last error of each.
	KindErrors map[string]int64
	LastErrors map[string]string
	// Refused counts connections the server closed before answering
	// anything (over its connection limits).
	Refused int64
}

// tally is the Result being counted, safe for the workers.
type tally struct {
	mu sync.Mutex
	r  Result
}

func newTally() *tally {
	return &tally{r: Result{Sent: map[string]int64{}, Codes: map[string]int64{},
		Answers: map[string]map[string]int64{}, Variants: map[string]map[string]int64{},
		KindErrors: map[string]int64{}, LastErrors: map[string]string{}}}
}

func (t *tally) sent(kind string, n int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.r.Sent[kind] += int64(n)
}

// answer counts an answer to a request of kind and variant ("": none).
func (t *tally) answer(kind, variant, code string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.r.Codes[code]++
	inc := func(m map[string]map[string]int64, k string) {
		if m[k] == nil {
			m[k] = map[string]int64{}
		}
		m[k][code]++
	}
	inc(t.r.Answers, kind)
	if variant != "" {
		inc(t.r.Variants, kind+"/"+variant)
	}
	if code == codeOK {
		t.r.Accepted++
	}
}

func (t *tally) error(kind string, err error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.r.Errors++
	t.r.KindErrors[kind]++
	if err != nil {
		t.r.LastErrors[kind] = err.Error()
	}
}

func (t *tally) refused() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.r.Refused++
}

// result returns a copy of the counts.
func (t *tally) result() Result {
	t.mu.Lock()
	defer t.mu.Unlock()
	nested := func(m map[string]map[string]int64) map[string]map[string]int64 {
		c := make(map[string]map[string]int64, len(m))
		for k, v := range m {
			c[k] = maps.Clone(v)
		}
		return c
	}
	return Result{Sent: maps.Clone(t.r.Sent), Accepted: t.r.Accepted, Codes: maps.Clone(t.r.Codes),
		Answers: nested(t.r.Answers), Variants: nested(t.r.Variants), Errors: t.r.Errors,
		KindErrors: maps.Clone(t.r.KindErrors), LastErrors: maps.Clone(t.r.LastErrors), Refused: t.r.Refused}
}

const codeOK = "ok"

// Run abuses the callback server at cfg.Endpoint until ctx ends, then
// returns the counts. It returns an error only for a bad configuration;
// whatever the server does (refuse, reset, black-hole, answer garbage) is
// counted, never returned. Every goroutine it starts has ended when it
// returns.
func Run(ctx context.Context, cfg Config) (Result, error) {
	if err := cfg.validate(); err != nil {
		return Result{}, err
	}
	cfg = cfg.withDefaults()
	h, err := newHostile(cfg)
	if err != nil {
		return Result{}, err
	}
	defer h.close()

	var wg sync.WaitGroup
	for w := range cfg.Connections {
		wg.Go(func() { h.requests(ctx, w) })
	}
	for range cfg.FloodConnections {
		wg.Go(func() { h.flood(ctx) })
	}
	for range cfg.HeldConnections {
		wg.Go(func() { h.holdConnections(ctx) })
	}
	wg.Wait()
	return h.tally.result(), nil
}

// hostile is one Run's state.
type hostile struct {
	cfg     Config
	tally   *tally
	limiter *rate.Limiter
	roots   *x509.CertPool
	// serverName is what the server's certificate is verified for.
	serverName string
	kinds      []*requestKind
	// floodTLS and connTLS are the TLS settings of the two floods.
	floodTLS, connTLS *tlsKey
	// connFrom is the local address of the connection flood (nil: any).
	connFrom net.Addr
	// conns are the connections the request kinds' transports dialed, to
	// close at the end.
	conns *connSet
}

func newHostile(cfg Config) (*hostile, error) {
	h := &hostile{cfg: cfg, tally: newTally(), conns: newConnSet()}
	h.limiter = rate.NewLimiter(rate.Limit(cfg.Rate), max(cfg.FloodStreams, 1))
	if len(cfg.CA) > 0 {
		der := cfg.CA
		if b, _ := pem.Decode(cfg.CA); b != nil {
			der = b.Bytes
		}
		ca, err := x509.ParseCertificate(der)
		if err != nil {
			return nil, fmt.Errorf("hostile: parsing CA: %w", err)
		}
		h.roots = x509.NewCertPool()
		h.roots.AddCert(ca)
	}
	h.serverName = cfg.ServerName
	if h.serverName == "" {
		host, _, _ := net.SplitHostPort(cfg.Endpoint)
		h.serverName = host
	}
	if cfg.ConnFloodFrom != "" {
		h.connFrom = &net.TCPAddr{IP: net.ParseIP(cfg.ConnFloodFrom)}
	}
	var err error
	if h.floodTLS, err = h.newTLSKey(keyEd25519); err != nil {
		return nil, err
	}
	if h.connTLS, err = h.newTLSKey(keyEd25519); err != nil {
		return nil, err
	}
	if h.kinds, err = h.requestKinds(); err != nil {
		return nil, err
	}
	return h, nil
}

func (h *hostile) close() {
	for _, k := range h.kinds {
		k.client.CloseIdleConnections()
	}
	h.conns.closeAll()
}

// connSet holds open connections so that they can all be closed.
type connSet struct {
	mu    sync.Mutex
	conns map[net.Conn]struct{}
}

func newConnSet() *connSet { return &connSet{conns: map[net.Conn]struct{}{}} }

func (s *connSet) add(c net.Conn) net.Conn {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.conns[c] = struct{}{}
	return &trackedConn{Conn: c, set: s}
}

func (s *connSet) remove(c net.Conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.conns, c)
}

func (s *connSet) closeAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for c := range s.conns {
		c.Close()
	}
	clear(s.conns)
}

// trackedConn leaves its set when closed.
type trackedConn struct {
	net.Conn
	set *connSet
}

func (c *trackedConn) Close() error {
	c.set.remove(c.Conn)
	return c.Conn.Close()
}
