package web_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/devpki"
	"github.com/shepherd/shepherd/web"
)

// webCert creates a development PKI (internal/devpki) in a fresh directory,
// with a server certificate for 127.0.0.1, and returns the certificate and
// key files and a pool trusting its CA.
func webCert(t *testing.T) (certFile, keyFile string, pool *x509.CertPool) {
	t.Helper()
	dir := t.TempDir()
	pki, err := devpki.LoadOrCreate(dir, []string{"127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	ca, err := x509.ParseCertificate(pki.CA)
	if err != nil {
		t.Fatal(err)
	}
	pool = x509.NewCertPool()
	pool.AddCert(ca)
	return filepath.Join(dir, "server.crt"), filepath.Join(dir, "server.key"), pool
}

// runServer starts cfg's web UI with Run and returns its address and a
// function that stops it and returns Run's error.
func runServer(t *testing.T, cfg web.Config, ln net.Listener) (addr string, stop func() error) {
	t.Helper()
	cfg.Registerer = prometheus.NewRegistry()
	s, err := web.New(cfg, bmdbtest.New(t).DB)
	if err != nil {
		t.Fatal(err)
	}
	if ln != nil {
		s.UseListener(ln)
	}
	a, err := s.Listen()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	var once bool
	var runErr error
	stop = func() error {
		if !once {
			once = true
			cancel()
			runErr = <-done
		}
		return runErr
	}
	t.Cleanup(func() { _ = stop() })
	return a.String(), stop
}

// TestTLS serves the UI, with actions, over real HTTPS on loopback: a
// client that trusts the certificate gets the overview (and is told to
// stay on HTTPS), one that does not fails its handshake, and a plain HTTP
// request gets no page.
func TestTLS(t *testing.T) {
	certFile, keyFile, pool := webCert(t)
	addr, stop := runServer(t, web.Config{Listen: "127.0.0.1:0", TLSCertFile: certFile, TLSKeyFile: keyFile,
		Actions: true, OperatorToken: mustToken(t)}, nil)

	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
	resp, err := client.Get("https://" + addr + "/")
	if err != nil {
		t.Fatalf("GET over HTTPS: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "· Shepherd</title>") {
		t.Errorf("GET over HTTPS: %s, want 200 and the overview; body:\n%s", resp.Status, body)
	}
	if resp.TLS == nil {
		t.Error("the HTTPS response came without TLS")
	}
	if got := resp.Header.Get("Strict-Transport-Security"); !strings.HasPrefix(got, "max-age=") {
		t.Errorf("Strict-Transport-Security = %q, want max-age=...", got)
	}

	untrusting := &http.Client{Timeout: 10 * time.Second}
	if resp, err := untrusting.Get("https://" + addr + "/"); err == nil {
		resp.Body.Close()
		t.Error("a client that does not trust the certificate got a response")
	}

	plain := &http.Client{Timeout: 10 * time.Second}
	resp, err = plain.Get("http://" + addr + "/")
	if err == nil {
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK || strings.Contains(string(body), "· Shepherd</title>") {
			t.Errorf("plain HTTP to the HTTPS UI: %s, want it refused; body:\n%s", resp.Status, body)
		}
	}
	if err := stop(); err != nil {
		t.Errorf("Run: %v", err)
	}
}

// TestTLSConfig checks that the certificate and key go together and that
// unreadable ones fail New, naming the files.
func TestTLSConfig(t *testing.T) {
	certFile, keyFile, _ := webCert(t)
	for _, cfg := range []web.Config{{TLSCertFile: certFile}, {TLSKeyFile: keyFile}} {
		if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), "TLSCertFile and TLSKeyFile must be given together") {
			t.Errorf("Validate(%+v) = %v, want the pair error", cfg, err)
		}
	}
	db := bmdbtest.New(t).DB
	missing := filepath.Join(t.TempDir(), "missing.crt")
	_, err := web.New(web.Config{TLSCertFile: missing, TLSKeyFile: keyFile}, db)
	if err == nil || !strings.Contains(err.Error(), missing) {
		t.Errorf("New with a missing certificate = %v, want an error naming %s", err, missing)
	}
	// The key of another certificate.
	_, otherKey, _ := webCert(t)
	if _, err := web.New(web.Config{TLSCertFile: certFile, TLSKeyFile: otherKey}, db); err == nil {
		t.Error("New with a key that does not match the certificate succeeded")
	}
}

// TestActionsNeedTLSOffLoopback: actions send the operator token, so
// without TLS they are only allowed where it cannot leave the host.
func TestActionsNeedTLSOffLoopback(t *testing.T) {
	tok := mustToken(t)
	for _, listen := range []string{"0.0.0.0:8080", ":8080", "[::]:8080", "10.1.2.3:8080", "shepherd.example:8080", "127.0.0.1"} {
		err := web.Config{Listen: listen, Actions: true, OperatorToken: tok}.Validate()
		if err == nil || !strings.Contains(err.Error(), "not a loopback address") || !strings.Contains(err.Error(), "TLSCertFile") {
			t.Errorf("actions without TLS on %s: Validate = %v, want a refusal naming TLSCertFile", listen, err)
		}
		if err := (web.Config{Listen: listen, Actions: true, OperatorToken: tok, TLSCertFile: "c", TLSKeyFile: "k"}).Validate(); err != nil {
			t.Errorf("actions with TLS on %s: Validate = %v", listen, err)
		}
		if err := (web.Config{Listen: listen}).Validate(); err != nil {
			t.Errorf("read-only on %s: Validate = %v", listen, err)
		}
	}
	for _, listen := range []string{"127.0.0.1:8080", "127.3.2.1:0", "[::1]:8080", "localhost:8080", ""} {
		if err := (web.Config{Listen: listen, Actions: true, OperatorToken: tok}).Validate(); err != nil {
			t.Errorf("actions without TLS on loopback %q: Validate = %v", listen, err)
		}
	}
}

// TestActionsOnLoopbackWithoutTLS serves actions over plain HTTP on
// loopback, which stays allowed.
func TestActionsOnLoopbackWithoutTLS(t *testing.T) {
	addr, stop := runServer(t, web.Config{Listen: "127.0.0.1:0", Actions: true, OperatorToken: mustToken(t)}, nil)
	client := &http.Client{Timeout: 10 * time.Second}
	resp, err := client.Get("http://" + addr + "/")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("GET over HTTP on loopback: %s", resp.Status)
	}
	if resp.Header.Get("Strict-Transport-Security") != "" {
		t.Error("plain HTTP sent Strict-Transport-Security")
	}
	if err := stop(); err != nil {
		t.Errorf("Run: %v", err)
	}
}

// TestRunRefusesActionsOnNonLoopbackListener: the check holds for the
// listener Run really serves on, not only the configured address.
func TestRunRefusesActionsOnNonLoopbackListener(t *testing.T) {
	ln, err := net.Listen("tcp", ":0")
	if err != nil {
		t.Fatal(err)
	}
	_, stop := runServer(t, web.Config{Actions: true, OperatorToken: mustToken(t)}, ln)
	err = stop()
	if err == nil || !strings.Contains(err.Error(), "not a loopback address") {
		t.Fatalf("Run on %s with actions and no TLS = %v, want a refusal", ln.Addr(), err)
	}
	// It closed the listener rather than leave connections unanswered.
	if c, err := net.DialTimeout("tcp", ln.Addr().String(), 5*time.Second); err == nil {
		c.Close()
		t.Error("the refused listener still accepts connections")
	}
}
