package server

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/internal/devpki"
	"github.com/shepherd/shepherd/internal/ratelog"
)

// Config configures the callback server. Zero values mean defaults.
type Config struct {
	// Listen is the TCP address to listen on; default ":7443".
	Listen string
	// DatagramListen is the UDP address heartbeat datagrams are received
	// on (package pulse); default: Listen's host and port, over UDP (with
	// port 0 each socket gets a port of its own). Agents learn the port
	// from their TLS heartbeat's reply and send to the host of their
	// server endpoint. A socket bound to every address (as with the
	// default) answers each datagram from the address it was sent to.
	DatagramListen string
	// NoDatagrams opens no UDP socket and grants no agent datagrams, for
	// networks that cannot pass UDP between agents and the server: every
	// heartbeat then comes over TLS.
	NoDatagrams bool
	// CertFile and KeyFile hold the server's certificate (chain) and key in
	// PEM. Both empty: use the development CA in DataDir.
	CertFile, KeyFile string
	// CAFile is the PEM CA certificate agents should verify the server
	// against (put into TakeoverInit); with certificate files and no CAFile,
	// agents use their system roots.
	CAFile string
	// DataDir keeps the development CA and server certificate between runs;
	// required unless CertFile and KeyFile are set.
	DataDir string
	// Hosts are the DNS names and IP addresses the development server
	// certificate covers; default localhost, 127.0.0.1, ::1 and the hostname.
	Hosts []string
	// HeartbeatInterval is how often agents are told to send heartbeats;
	// default 30s.
	HeartbeatInterval time.Duration
	// MaxRequestBytes bounds one heartbeat request; larger ones are rejected
	// with ResourceExhausted. Default 1 MiB.
	MaxRequestBytes int
	// MaxBatch bounds how many heartbeats share one transaction; default 1000.
	MaxBatch int
	// Flushers is how many batch transactions may run at once; default 4.
	Flushers int
	// FlushTimeout bounds one batch write; a database that stops answering
	// fails the batch (its agents are told to retry) instead of holding it
	// and the server's shutdown for as long as TCP takes to give up.
	// Default 10s.
	FlushTimeout time.Duration
	// RetryPushback is how soon an agent told Unavailable (the database
	// failed, or the server is busy) should try again; default 1s. Agents
	// add jitter.
	RetryPushback time.Duration
	// MaxConnections bounds open client connections; further ones are
	// closed at once. Default: the process's open-file limit less 1,024
	// (for database connections, logs and the rest), at least 64.
	MaxConnections int
	// MaxConnectionsPerIP bounds open connections from one IP address, so
	// that one client cannot take every slot; default 4,096, which leaves
	// room for whole racks behind one NAT address.
	MaxConnectionsPerIP int
	// MaxStreamsPerConnection bounds concurrent RPCs on one HTTP/2
	// connection (an agent has one at a time); default 16.
	MaxStreamsPerConnection int
	// Unbatched writes every heartbeat in its own transaction. It exists as
	// the baseline `make bench` compares batching against.
	Unbatched bool
	// Registerer receives the server's metrics; nil keeps them private.
	Registerer prometheus.Registerer
	// Logger receives the server's logs; nil discards them.
	Logger *slog.Logger
}

// Validate reports the first problem with the configuration. It changes nothing.
func (c Config) Validate() error {
	if (c.CertFile == "") != (c.KeyFile == "") {
		return errors.New("server: CertFile and KeyFile must be given together")
	}
	if c.CertFile == "" && c.DataDir == "" {
		return errors.New("server: DataDir is required for the development CA when no CertFile and KeyFile are given")
	}
	if c.DatagramListen != "" {
		if c.NoDatagrams {
			return fmt.Errorf("server: DatagramListen %q and NoDatagrams contradict each other", c.DatagramListen)
		}
		if _, _, err := net.SplitHostPort(c.DatagramListen); err != nil {
			return fmt.Errorf("server: DatagramListen %q is not a host:port: %w", c.DatagramListen, err)
		}
	}
	if c.HeartbeatInterval < 0 {
		return fmt.Errorf("server: HeartbeatInterval must be >= 0 (0 = default), got %s", c.HeartbeatInterval)
	}
	if c.MaxRequestBytes < 0 {
		return fmt.Errorf("server: MaxRequestBytes must be >= 0 (0 = default), got %d", c.MaxRequestBytes)
	}
	if c.MaxBatch < 0 {
		return fmt.Errorf("server: MaxBatch must be >= 0 (0 = default), got %d", c.MaxBatch)
	}
	if c.Flushers < 0 {
		return fmt.Errorf("server: Flushers must be >= 0 (0 = default), got %d", c.Flushers)
	}
	if c.FlushTimeout < 0 {
		return fmt.Errorf("server: FlushTimeout must be >= 0 (0 = default), got %s", c.FlushTimeout)
	}
	if c.RetryPushback < 0 {
		return fmt.Errorf("server: RetryPushback must be >= 0 (0 = default), got %s", c.RetryPushback)
	}
	if c.MaxConnections < 0 {
		return fmt.Errorf("server: MaxConnections must be >= 0 (0 = default), got %d", c.MaxConnections)
	}
	if c.MaxConnectionsPerIP < 0 {
		return fmt.Errorf("server: MaxConnectionsPerIP must be >= 0 (0 = default), got %d", c.MaxConnectionsPerIP)
	}
	if c.MaxStreamsPerConnection < 0 {
		return fmt.Errorf("server: MaxStreamsPerConnection must be >= 0 (0 = default), got %d", c.MaxStreamsPerConnection)
	}
	return nil
}

// Server is the callback server. Create it with New and run it with Run.
type Server struct {
	cfg     Config
	db      *bmdb.DB
	log     *slog.Logger
	metrics *metrics
	tls     *tls.Config
	ca      []byte
	batch   *batcher
	// verified are the keys whose heartbeats are served first.
	verified *verifiedKeys
	// throttle bounds the log lines about rejected requests and failures:
	// one line per key every 10 s, then one with the count held back
	// (internal/ratelog): a client sending bad requests as fast as it can,
	// or a database outage failing every heartbeat, cannot flood the log.
	throttle *ratelog.Logger
	// recorder tells recovery when this server could not record
	// heartbeats, so that silence it caused does not count.
	recorder *bmdb.HeartbeatRecorder

	// datagrams serves heartbeat datagrams; nil with NoDatagrams.
	datagrams *datagramServer
	// secret is the BMDB's datagram secret (bmdb.DB.DatagramSecret), nil
	// until read: until then no grant is handed out and no datagram
	// answered.
	secret atomic.Pointer[datagramSecret]

	mu       sync.Mutex
	listener net.Listener
	udp      *net.UDPConn
}

// New validates cfg, loads or creates the server's TLS certificate and
// returns a server that is not yet listening.
func New(cfg Config, db *bmdb.DB) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Listen = cmp.Or(cfg.Listen, ":7443")
	if !cfg.NoDatagrams {
		cfg.DatagramListen = cmp.Or(cfg.DatagramListen, cfg.Listen)
	}
	cfg.HeartbeatInterval = cmp.Or(cfg.HeartbeatInterval, 30*time.Second)
	cfg.MaxRequestBytes = cmp.Or(cfg.MaxRequestBytes, 1<<20)
	cfg.MaxBatch = cmp.Or(cfg.MaxBatch, 1000)
	cfg.Flushers = cmp.Or(cfg.Flushers, 4)
	cfg.FlushTimeout = cmp.Or(cfg.FlushTimeout, 10*time.Second)
	cfg.RetryPushback = cmp.Or(cfg.RetryPushback, time.Second)
	cfg.MaxConnections = cmp.Or(cfg.MaxConnections, defaultMaxConnections())
	cfg.MaxConnectionsPerIP = cmp.Or(cfg.MaxConnectionsPerIP, 4096)
	cfg.MaxStreamsPerConnection = cmp.Or(cfg.MaxStreamsPerConnection, 16)
	if len(cfg.Hosts) == 0 {
		cfg.Hosts = []string{"localhost", "127.0.0.1", "::1"}
		if h, err := os.Hostname(); err == nil && h != "" {
			cfg.Hosts = append(cfg.Hosts, h)
		}
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	reg := cfg.Registerer
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	m, err := newMetrics(reg)
	if err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, db: db, log: log.With("component", "server"), metrics: m, verified: newVerifiedKeys()}
	s.throttle = ratelog.New(s.log, 10*time.Second)
	if err := s.loadTLS(); err != nil {
		return nil, err
	}
	s.recorder = db.NewHeartbeatRecorder(s.log)
	s.batch = newBatcher(db, cfg.MaxBatch, cfg.Flushers, cfg.FlushTimeout, m, s.recorder.Failed)
	if !cfg.NoDatagrams {
		s.datagrams = newDatagramServer(s)
	}
	return s, nil
}

func (s *Server) loadTLS() error {
	var cert tls.Certificate
	if s.cfg.CertFile != "" {
		var err error
		cert, err = tls.LoadX509KeyPair(s.cfg.CertFile, s.cfg.KeyFile)
		if err != nil {
			return fmt.Errorf("server: loading certificate %s: %w", s.cfg.CertFile, err)
		}
		if s.cfg.CAFile != "" {
			if s.ca, err = readPEMCertificate(s.cfg.CAFile); err != nil {
				return err
			}
		}
	} else {
		pki, err := devpki.LoadOrCreate(s.cfg.DataDir, s.cfg.Hosts)
		if err != nil {
			return fmt.Errorf("server: %w", err)
		}
		cert, s.ca = pki.Certificate, pki.CA
	}
	s.tls = &tls.Config{
		Certificates: []tls.Certificate{cert},
		// The client certificate is checked against the BMDB, not a chain:
		// ask for one, verify possession of its key (TLS does), and let the
		// handler decide, so that a missing one gets an RPC status.
		ClientAuth: tls.RequestClientCert,
		MinVersion: tls.VersionTLS13,
	}
	return nil
}

// CA is the DER CA certificate agents should verify the server against (for
// TakeoverInit.ca_certificate), or nil if they should use system roots.
func (s *Server) CA() []byte { return s.ca }

// Listen opens the TCP listener and, unless NoDatagrams, the UDP socket,
// so that their addresses are known before Run. It returns the TCP
// address (DatagramAddr has the other). Run calls it if it has not been
// called.
func (s *Server) Listen() (net.Addr, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.udp == nil && s.datagrams != nil {
		udp, err := listenUDP(s.cfg.DatagramListen)
		if err != nil {
			return nil, err
		}
		s.udp = udp
		s.datagrams.port.Store(uint32(udp.LocalAddr().(*net.UDPAddr).Port))
	}
	if s.listener == nil {
		ln, err := net.Listen("tcp", s.cfg.Listen)
		if err != nil {
			if s.udp != nil {
				_ = s.udp.Close()
				s.udp = nil
			}
			return nil, fmt.Errorf("server: listening on %s: %w", s.cfg.Listen, err)
		}
		s.listener = newLimitListener(ln, s.cfg.MaxConnections, s.cfg.MaxConnectionsPerIP, func(reason string) {
			s.metrics.connsRefused.WithLabelValues(reason).Inc()
			s.throttle.Log(context.Background(), slog.LevelWarn, "connections_"+reason, "refusing a connection over the limit", "limit", reason)
		}, func(err error) {
			// One line per 10 s however often the accept is retried:
			// the counter has every failure.
			s.metrics.acceptErrors.WithLabelValues("descriptors").Inc()
			s.throttle.Log(context.Background(), slog.LevelError, "accept_descriptors",
				"out of file descriptors: serving the open connections, accepting new ones once descriptors are free", "err", err)
		})
	}
	return s.listener.Addr(), nil
}

// DatagramAddr is the UDP address heartbeat datagrams are received on,
// nil with NoDatagrams or before Listen.
func (s *Server) DatagramAddr() net.Addr {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.udp == nil {
		return nil
	}
	return s.udp.LocalAddr()
}

// Run serves until ctx ends, then stops accepting connections, lets
// in-flight heartbeats finish (at most 10 s) and returns nil.
func (s *Server) Run(ctx context.Context) error {
	defer s.throttle.Flush()
	addr, err := s.Listen()
	if err != nil {
		return err
	}
	gs := grpc.NewServer(
		grpc.Creds(credentials.NewTLS(s.tls)),
		grpc.ForceServerCodecV2(codec{}),
		grpc.MaxRecvMsgSize(s.cfg.MaxRequestBytes),
		grpc.StatsHandler(&observer{m: s.metrics}),
		grpc.ConnectionTimeout(10*time.Second),
		grpc.MaxConcurrentStreams(uint32(s.cfg.MaxStreamsPerConnection)),
		// No read buffer of grpc-go's own (32 KiB per connection by
		// default, for as long as the connection is open): the HTTP/2
		// framer reads from the TLS connection, which already holds the
		// decrypted record it reads from. See "Memory per connection" in
		// doc.go.
		grpc.ReadBufferSize(0),
	)
	gs.RegisterService(&heartbeatService, &heartbeatHandler{s: s})

	// The fleet's keys are read first, so that a restarted server serves
	// its agents first from the start; without them (the database is down)
	// it learns them from the heartbeats it records.
	lctx, cancel := context.WithTimeout(ctx, s.cfg.FlushTimeout)
	if err := s.verified.load(lctx, s.db); err != nil {
		s.log.WarnContext(ctx, "reading the fleet's agent keys; learning them from heartbeats instead", "err", err)
	}
	cancel()
	// The datagram readers and the secret's background read end with ctx,
	// or when serving fails.
	runCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	// The datagram secret is read first too, so that the first TLS
	// heartbeats already carry grants; without it (the database is down)
	// it is read in the background, and until then agents keep to TLS.
	secretDone := make(chan struct{})
	if s.datagrams != nil {
		lctx, cancel := context.WithTimeout(ctx, s.cfg.FlushTimeout)
		err := s.loadSecret(lctx)
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				s.log.WarnContext(ctx, "reading the heartbeat datagram secret; no datagrams until it is read", "err", err)
			}
			go func() {
				defer close(secretDone)
				s.retrySecret(runCtx)
			}()
		} else {
			close(secretDone)
		}
	} else {
		close(secretDone)
	}

	batchCtx, stopBatch := context.WithCancel(context.WithoutCancel(ctx))
	batchDone := make(chan struct{})
	go func() {
		defer close(batchDone)
		s.batch.run(batchCtx)
	}()
	// The recorder's session ends with the server: once the server stops,
	// its agents' silence is no longer its own doing but real.
	recorderDone := make(chan struct{})
	go func() {
		defer close(recorderDone)
		if err := s.recorder.Run(batchCtx); err != nil {
			s.log.ErrorContext(ctx, "heartbeat recorder stopped", "err", err)
		}
	}()
	// Datagram readers stop with ctx; their heartbeats in flight are
	// answered by the batcher's flushers, which end after them.
	readersDone := make(chan struct{})
	if s.datagrams != nil {
		go func() {
			defer close(readersDone)
			s.datagrams.run(runCtx, s.udp)
		}()
	} else {
		close(readersDone)
	}
	// Serve returns nil once stopped, or early with the error that made
	// the listener fail.
	var serveErr error
	served := make(chan struct{})
	go func() {
		defer close(served)
		serveErr = gs.Serve(s.listener)
	}()
	if s.udp != nil {
		s.log.InfoContext(ctx, "callback server listening", "addr", addr.String(), "datagram_addr", s.udp.LocalAddr().String())
	} else {
		s.log.InfoContext(ctx, "callback server listening", "addr", addr.String())
	}

	select {
	case <-ctx.Done():
	case <-served:
	}
	stopRun()
	stopped := make(chan struct{})
	go func() {
		gs.GracefulStop()
		close(stopped)
	}()
	grace := time.NewTimer(10 * time.Second)
	defer grace.Stop()
	select {
	case <-stopped:
	case <-grace.C:
		gs.Stop()
		<-stopped
	}
	<-readersDone
	// Handlers and readers have returned: nothing more is submitted to
	// the batcher, which finishes what it holds (answering the datagrams
	// among it, so the socket closes only after it).
	stopBatch()
	<-batchDone
	if s.datagrams != nil {
		s.datagrams.wait()
		_ = s.udp.Close()
	}
	<-secretDone
	<-recorderDone
	<-served
	s.log.InfoContext(ctx, "callback server stopped")
	if serveErr != nil && !errors.Is(serveErr, grpc.ErrServerStopped) {
		return fmt.Errorf("server: serving: %w", serveErr)
	}
	return nil
}

// unavailable is the answer to a heartbeat that could not be recorded now:
// Unavailable, with gRPC's retry pushback telling the agent to try again
// soon rather than to back off as if the network were down.
func (s *Server) unavailable(ctx context.Context, msg string) error {
	_ = grpc.SetTrailer(ctx, metadata.Pairs(retryPushbackKey, strconv.FormatInt(s.cfg.RetryPushback.Milliseconds(), 10)))
	return status.Error(codes.Unavailable, msg)
}

// defaultMaxConnections leaves 1,024 descriptors of the process's limit for
// everything but client connections.
func defaultMaxConnections() int {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil {
		return 1 << 20
	}
	return maxConnectionsFor(rl.Cur)
}

// maxConnectionsFor is the default connection limit under an open-file
// limit of nofile: all but 1,024 descriptors, at least 64, and 1<<20 for a
// limit beyond int32 (RLIM_INFINITY), where the file table is not what runs
// out first.
func maxConnectionsFor(nofile uint64) int {
	if nofile > math.MaxInt32 {
		return 1 << 20
	}
	return max(int(nofile)-1024, 64)
}
