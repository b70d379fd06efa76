// Package web is Shepherd's operator web UI (SPEC §6): server-rendered HTML
// from embedded html/template files and a style sheet, no JavaScript and no
// build step. It shows the fleet overview (machines per derived state and
// provider, the recovery circuit breaker, quarantines), a filtered and
// paginated machine list, a page per machine (tags, hardware report, live
// work, backoffs, history) and the sessions.
//
// It is read-only by default: every request but GET and HEAD is refused with
// 405, and no page carries a form that changes anything. With
// Config.Actions, operators can reset a backoff, request a decommission,
// request an OS installation, accept the SSH host key a machine presented
// instead of its recorded one, and read or switch a machine's power through
// its BMC (with Config.Power); each goes through a confirmation page and
// needs the operator token (Config.OperatorToken) typed into it, a per-form
// CSRF token and a same-origin request.
//
// Every value from the BMDB is untrusted (hostnames, provider ids and
// hardware strings come from machines and provider APIs): html/template
// escapes all of it, and the Content-Security-Policy forbids scripts.
package web

import (
	"cmp"
	"context"
	"crypto/rand"
	"crypto/tls"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/provider"
)

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// Config configures the web UI. Zero values mean defaults.
type Config struct {
	// Listen is the TCP address Listen and Run serve on; required for them
	// (Handler works without it).
	Listen string
	// TLSCertFile and TLSKeyFile are the PEM certificate (chain) and
	// private key Run serves HTTPS with; both or neither. Without them Run
	// serves plain HTTP, and then Actions are refused on a Listen address
	// that is not loopback: the operator token would cross the network in
	// clear.
	TLSCertFile, TLSKeyFile string
	// Providers are shown on the overview even while they have no machines
	// (typically the provider this process runs); the providers that have
	// machines in the BMDB are always shown.
	Providers []string
	// Breaker reads the recovery circuit breaker of a provider for the
	// overview, judging silence by timeouts (those the recoverers recorded
	// in the BMDB, which decide Silent on every page: the UI has no
	// timeouts of its own); nil leaves the breaker off the overview.
	Breaker func(ctx context.Context, provider string, timeouts bmdb.SilenceTimeouts) (BreakerState, error)
	// PageSize is the number of machines per list page; default 50, at most 1000.
	PageSize int
	// Refresh is how often the overview, machine and sessions pages reload
	// themselves; default 10s; negative turns reloading off.
	Refresh time.Duration
	// Actions enables the reset, decommission, install, host key accept
	// and power actions. They need OperatorToken.
	Actions bool
	// OperatorToken authorizes actions; required with Actions.
	OperatorToken Token
	// Power returns the out-of-band power control (SPEC §5.5) of the named
	// provider as this process runs it, or nil if it runs none: the
	// machine page shows the BMC of such a provider's machines and, with
	// Actions, offers their power actions, which do what `shepherd machine
	// power` does (package poweraction). nil: no provider's.
	Power func(provider string) provider.PowerController
	// PowerTimeout bounds the BMC calls of one power action, as `shepherd
	// machine power --timeout` does; default 5m.
	PowerTimeout time.Duration
	// Registerer receives the web server's metrics; nil keeps them private.
	Registerer prometheus.Registerer
	// Logger receives request and action logs; nil discards them.
	Logger *slog.Logger
}

// Validate reports the first problem with the configuration. It changes nothing.
func (c Config) Validate() error {
	switch {
	case c.PageSize < 0 || c.PageSize > maxPageSize:
		return fmt.Errorf("web: PageSize must be within [0, %d] (0 = default 50), got %d", maxPageSize, c.PageSize)
	case c.PowerTimeout < 0:
		return fmt.Errorf("web: PowerTimeout must be >= 0 (0 = default 5m), got %s", c.PowerTimeout)
	case c.Actions && c.OperatorToken.Empty():
		return errors.New("web: Actions need an OperatorToken")
	case (c.TLSCertFile == "") != (c.TLSKeyFile == ""):
		return errors.New("web: TLSCertFile and TLSKeyFile must be given together")
	case c.Listen != "":
		return c.checkClearActions(c.Listen)
	}
	return nil
}

// checkClearActions refuses Actions over plain HTTP on the listen address
// addr unless it is a loopback one: the operator token would cross the
// network in clear. Validate checks Config.Listen, Run the listener it
// really serves on (UseListener's).
func (c Config) checkClearActions(addr string) error {
	if c.Actions && c.TLSCertFile == "" && !LoopbackAddr(addr) {
		return fmt.Errorf("web: Actions on %s, which is not a loopback address, need TLSCertFile and TLSKeyFile: "+
			"the operator token would cross the network in clear", addr)
	}
	return nil
}

const (
	maxPageSize = 1000
	// requestTimeout bounds the BMDB reads of one page, so that a slow
	// database answers a page with an error rather than piling up requests.
	requestTimeout = 15 * time.Second
)

// BreakerState is a provider's recovery circuit breaker (SPEC §3.4), as the
// overview shows it.
type BreakerState struct {
	// Started machines have an agent that should heartbeat; Silent ones
	// are recovery candidates.
	Started, Silent int64
	// SilentFraction is the threshold: above it, no machine is rebooted.
	SilentFraction float64
	// RebootsInWindow were issued within Window; Budget is the most allowed.
	RebootsInWindow, Budget int64
	Window                  time.Duration
	// Paused is "" while reboots are allowed, else why they are held back
	// ("silent_fraction" or "reboot_budget").
	Paused string
}

// Server is the web UI. Create it with New; serve Handler yourself or call
// Run.
type Server struct {
	cfg     Config
	db      *bmdb.DB
	log     *slog.Logger
	pages   map[string]*pageTemplate
	handler http.Handler
	csrf    csrfKey
	metrics *metrics
	jobs    *jobs       // power actions running after their response
	tls     *tls.Config // nil: plain HTTP

	mu       sync.Mutex
	listener net.Listener
}

// New validates cfg, parses the templates and returns the server, not yet
// listening.
func New(cfg Config, db *bmdb.DB) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if db == nil {
		return nil, errors.New("web: no BMDB")
	}
	cfg.PageSize = cmp.Or(cfg.PageSize, 50)
	cfg.Refresh = cmp.Or(cfg.Refresh, 10*time.Second)
	cfg.PowerTimeout = cmp.Or(cfg.PowerTimeout, 5*time.Minute)
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
	pages, err := parsePages()
	if err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, db: db, log: log.With("component", "web"), pages: pages, metrics: m, jobs: newJobs()}
	if _, err := rand.Read(s.csrf[:]); err != nil {
		return nil, fmt.Errorf("web: generating the CSRF key: %w", err)
	}
	s.handler = s.routes()
	if cfg.TLSCertFile != "" {
		if s.tls, err = loadTLS(cfg.TLSCertFile, cfg.TLSKeyFile); err != nil {
			return nil, err
		}
		s.handler = strictTransport(s.handler)
	}
	return s, nil
}

// getMachine reads a machine with its state judged by the heartbeat
// timeouts in force (bmdb.SilenceTimeouts: those the recoverers recorded),
// which it returns too.
func (s *Server) getMachine(ctx context.Context, id uuid.UUID) (bmdb.MachineDetail, bmdb.SilenceTimeouts, error) {
	t, err := s.db.SilenceTimeouts(ctx)
	if err != nil {
		return bmdb.MachineDetail{}, t, err
	}
	m, err := s.db.GetMachineWithTimeouts(ctx, id, t.FirstHeartbeat, t.Heartbeat)
	return m, t, err
}

// Handler returns the UI's HTTP handler. A caller that serves it itself
// calls Close when done.
func (s *Server) Handler() http.Handler { return s.handler }

// Close stops the power actions still running after their response and
// waits for them; later ones are refused. A stopped action's BMC calls are
// cancelled, as Ctrl-C cancels `shepherd machine power`: its hold ends and
// history says how far it got (a cycle stopped half way leaves the machine
// off). Run calls Close when it stops.
func (s *Server) Close() { s.jobs.close() }

func (s *Server) routes() http.Handler {
	mux := http.NewServeMux()
	static, _ := fs.Sub(staticFS, "static")
	mux.Handle("GET /static/", s.instrument("static", cacheFor(time.Hour, http.StripPrefix("/static/", http.FileServerFS(static)))))
	mux.Handle("GET /{$}", s.page("overview", s.overview))
	mux.Handle("GET /machines", s.page("machines", s.machineList))
	mux.Handle("GET /machines/{id}", s.page("machine", s.machine))
	mux.Handle("GET /sessions", s.page("sessions", s.sessions))
	mux.Handle("GET /", s.page("error", func(_ http.ResponseWriter, r *http.Request) (*view, error) {
		return nil, notFound("there is no page %s", r.URL.Path)
	}))
	if s.cfg.Actions {
		for _, a := range actions {
			mux.Handle("GET /machines/{id}/"+a.name, s.page("confirm", s.confirm(a)))
			mux.Handle("POST /machines/{id}/"+a.name, s.instrument("action", s.act(a)))
		}
	}
	var h http.Handler = mux
	if s.cfg.Actions {
		// The same-origin check: browsers say where a request comes from
		// (Sec-Fetch-Site, Origin), and a cross-origin POST is refused
		// before any handler sees it. Forms also carry a CSRF token.
		cop := http.NewCrossOriginProtection()
		cop.SetDenyHandler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			s.log.WarnContext(r.Context(), "refused a cross-origin request", "method", r.Method, "path", r.URL.Path,
				"remote_addr", r.RemoteAddr)
			http.Error(w, "cross-origin request refused", http.StatusForbidden)
		}))
		h = cop.Handler(h)
	}
	return s.readOnly(securityHeaders(h))
}

// readOnly refuses every method but GET and HEAD with 405, and POST too
// unless actions are enabled.
func (s *Server) readOnly(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.Method == http.MethodGet || r.Method == http.MethodHead:
		case r.Method == http.MethodPost && s.cfg.Actions:
		default:
			allow, msg := "GET, HEAD", "method not allowed: the web UI is read-only"
			if s.cfg.Actions {
				allow, msg = "GET, HEAD, POST", "method not allowed"
			}
			w.Header().Set("Allow", allow)
			securityHeaders(nil).ServeHTTP(w, r)
			http.Error(w, msg, http.StatusMethodNotAllowed)
			s.metrics.requests.WithLabelValues("other", "405").Inc()
			return
		}
		next.ServeHTTP(w, r)
	})
}

// contentSecurityPolicy allows the page's own style sheet and images and
// nothing else: no script at all, no framing, forms only to this origin.
const contentSecurityPolicy = "default-src 'none'; style-src 'self'; img-src 'self'; " +
	"form-action 'self'; frame-ancestors 'none'; base-uri 'none'"

// securityHeaders sets the headers every response carries, then calls next
// (if any).
func securityHeaders(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", contentSecurityPolicy)
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Referrer-Policy", "same-origin")
		h.Set("Cross-Origin-Opener-Policy", "same-origin")
		h.Set("Cross-Origin-Resource-Policy", "same-origin")
		if next != nil {
			next.ServeHTTP(w, r)
		}
	})
}

func cacheFor(d time.Duration, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", fmt.Sprintf("public, max-age=%d", int(d.Seconds())))
		next.ServeHTTP(w, r)
	})
}

// Listen opens the listener, so that Addr is known before Run. Run calls it
// if it has not been called.
func (s *Server) Listen() (net.Addr, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.listener == nil {
		if s.cfg.Listen == "" {
			return nil, errors.New("web: Config.Listen is required to listen")
		}
		ln, err := net.Listen("tcp", s.cfg.Listen)
		if err != nil {
			return nil, fmt.Errorf("web: listening on %s: %w", s.cfg.Listen, err)
		}
		s.listener = ln
	}
	return s.listener.Addr(), nil
}

// UseListener makes Run serve on ln instead of listening on Config.Listen.
// Call it before Run.
func (s *Server) UseListener(ln net.Listener) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.listener = ln
}

// Run serves until ctx ends, then stops accepting connections, lets
// in-flight requests finish (at most 5 s) and returns nil. It serves HTTPS
// with Config.TLSCertFile, else HTTP; with Actions and no TLS it refuses to
// serve on a listener that is not loopback.
func (s *Server) Run(ctx context.Context) error {
	addr, err := s.Listen()
	if err != nil {
		return err
	}
	if err := s.cfg.checkClearActions(addr.String()); err != nil {
		_ = s.listener.Close()
		s.Close()
		return err
	}
	hs := &http.Server{
		Handler:           s.handler,
		ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout:       30 * time.Second,
		WriteTimeout:      2 * requestTimeout,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    64 << 10,
		ErrorLog:          slog.NewLogLogger(s.log.Handler(), slog.LevelWarn),
	}
	serveErr := make(chan error, 1)
	if s.tls != nil {
		hs.TLSConfig = s.tls
		go func() { serveErr <- hs.ServeTLS(s.listener, "", "") }()
	} else {
		go func() { serveErr <- hs.Serve(s.listener) }()
	}
	s.log.InfoContext(ctx, "web UI listening", "addr", addr.String(), "tls", s.tls != nil, "actions", s.cfg.Actions)

	var runErr error
	select {
	case <-ctx.Done():
	case err := <-serveErr:
		s.Close()
		return fmt.Errorf("web: serving: %w", err)
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := hs.Shutdown(sctx); err != nil {
		// In-flight requests outlived the grace period: cut them off.
		_ = hs.Close()
	}
	if err := <-serveErr; err != nil && !errors.Is(err, http.ErrServerClosed) {
		runErr = fmt.Errorf("web: serving: %w", err)
	}
	s.Close()
	s.log.InfoContext(ctx, "web UI stopped")
	return runErr
}
