package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strings"
	"syscall"

	"github.com/spf13/pflag"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/provider"
	"github.com/shepherd/shepherd/web"
)

// webConfig is the web UI's part of stackConfig: any component serves it
// with --web-listen (SPEC §6).
type webConfig struct {
	Listen    string // --web-listen; "" means no web UI
	Actions   bool   // --web-actions
	TokenFile string // --web-operator-token-file
	TLSCert   string // --web-tls-cert
	TLSKey    string // --web-tls-key
	// FallbackPort listens on a free port of Listen's host when Listen's
	// port is taken (shepherd dev, whose default port may be in use).
	FallbackPort bool
}

func (c *webConfig) bind(fl *pflag.FlagSet) {
	fl.StringVar(&c.Listen, "web-listen", "", "address to serve the web UI on, e.g. 127.0.0.1:8080 (default: off)")
	fl.BoolVar(&c.Actions, "web-actions", false, "web UI: offer reset, decommission, install, host key and power actions (needs --web-operator-token-file)")
	fl.StringVar(&c.TokenFile, "web-operator-token-file", "", "web UI: file holding the operator token that authorizes actions (at least 16 characters)")
	fl.StringVar(&c.TLSCert, "web-tls-cert", "", "web UI: PEM certificate (chain) to serve HTTPS with (needs --web-tls-key; required for --web-actions off loopback)")
	fl.StringVar(&c.TLSKey, "web-tls-key", "", "web UI: PEM private key of --web-tls-cert")
}

// validate checks the web UI's flags, what web.Config.Validate checks
// included, and says which flag is wrong. build calls it whether or not
// the web UI runs.
func (c *webConfig) validate() error {
	switch {
	case c.Listen == "" && (c.TLSCert != "" || c.TLSKey != ""):
		return errors.New("--web-tls-cert and --web-tls-key are only used with --web-listen")
	case c.TLSCert != "" && c.TLSKey == "":
		return errors.New("--web-tls-cert needs --web-tls-key")
	case c.TLSKey != "" && c.TLSCert == "":
		return errors.New("--web-tls-key needs --web-tls-cert")
	case c.Listen != "" && c.Actions && c.TLSCert == "" && !web.LoopbackAddr(c.Listen):
		return fmt.Errorf("--web-actions on --web-listen %s, which is not a loopback address, needs --web-tls-cert and --web-tls-key: "+
			"the operator token would cross the network in clear", c.Listen)
	}
	return nil
}

// readOperatorToken reads the token file, warning if others may read it.
// Neither the token nor the file's contents ever reach an error message.
func readOperatorToken(path string, log *slog.Logger) (web.Token, error) {
	if path == "" {
		return web.Token{}, errors.New("--web-actions needs --web-operator-token-file")
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return web.Token{}, fmt.Errorf("--web-operator-token-file: %w", err)
	}
	if fi, err := os.Stat(path); err == nil && fi.Mode().Perm()&0o077 != 0 {
		log.Warn("the operator token file is readable by others; make it 0600", "file", path, "mode", fi.Mode().Perm().String())
	}
	t, err := web.NewToken(strings.TrimSpace(string(data)))
	if err != nil {
		return web.Token{}, fmt.Errorf("--web-operator-token-file %s: %w", path, err)
	}
	return t, nil
}

// buildWeb builds the web UI and opens its listener, so that s.webAddr is
// known and a taken port fails the start, and adds the component that
// serves it.
func (s *stack) buildWeb(b *parts) error {
	wc := s.cfg.Web
	rc := s.cfg.Recoverer
	cfg := web.Config{
		Listen:      wc.Listen,
		TLSCertFile: wc.TLSCert,
		TLSKeyFile:  wc.TLSKey,
		Actions:     wc.Actions,
		Registerer:  s.reg,
		Logger:      s.log,
		Power:       s.powerController,
		// The breaker's state lives in the BMDB, so this process shows what
		// every recoverer sees, with the same thresholds (the shared flags)
		// and the heartbeat timeouts the recoverers recorded there.
		Breaker: func(ctx context.Context, provider string, t bmdb.SilenceTimeouts) (web.BreakerState, error) {
			rc := rc
			rc.FirstHeartbeatTimeout, rc.HeartbeatTimeout = t.FirstHeartbeat, t.Heartbeat
			b, err := manager.ReadBreaker(ctx, s.db, provider, rc)
			return web.BreakerState{
				Started: b.Started, Silent: b.Silent, SilentFraction: b.SilentFraction,
				RebootsInWindow: b.RebootsInWindow, Budget: b.Budget, Window: b.Window, Paused: b.Paused,
			}, err
		},
	}
	if s.cfg.Provider != "" {
		cfg.Providers = []string{s.cfg.Provider}
	}
	if wc.Actions {
		var err error
		if cfg.OperatorToken, err = readOperatorToken(wc.TokenFile, s.log); err != nil {
			return err
		}
	} else if wc.TokenFile != "" {
		return errors.New("--web-operator-token-file is only used with --web-actions")
	}
	ws, err := web.New(cfg, s.db)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", wc.Listen)
	if err != nil && wc.FallbackPort && errors.Is(err, syscall.EADDRINUSE) {
		host, _, _ := net.SplitHostPort(wc.Listen)
		ln, err = net.Listen("tcp", net.JoinHostPort(host, "0"))
	}
	if err != nil {
		return fmt.Errorf("--web-listen: %w", err)
	}
	b.onAbandon(func() { ln.Close() })
	ws.UseListener(ln)
	s.webAddr = ln.Addr().String()
	b.add("web", ws.Run)
	return nil
}

// powerController returns the out-of-band power control of the provider
// this process runs, for the web UI's power actions and the BMCs on its
// machine pages, if that provider is named name and has one. build creates
// the provider after the web UI, and before anything runs; a process that
// runs no provider offers no power.
func (s *stack) powerController(name string) provider.PowerController {
	if s.provider == nil || s.provider.Name() != name {
		return nil
	}
	pc, _ := s.provider.(provider.PowerController)
	return pc
}

// webURL is the address of the web UI as a browser reaches it, https with
// TLS: a wildcard host becomes localhost.
func webURL(addr string, tls bool) string {
	scheme := "http://"
	if tls {
		scheme = "https://"
	}
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return scheme + addr
	}
	if ip := net.ParseIP(host); host == "" || (ip != nil && ip.IsUnspecified()) {
		host = "localhost"
	}
	return scheme + net.JoinHostPort(host, port) + "/"
}
