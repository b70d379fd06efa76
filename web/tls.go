package web

import (
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
)

// LoopbackAddr reports whether the listen address addr (host:port) only
// accepts connections from this host: its host is "localhost" or a
// loopback IP address. An empty host or a wildcard address listens on
// every interface, and any other name may resolve to one that is reachable
// from the network, so neither counts.
func LoopbackAddr(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// loadTLS reads the certificate (chain) and key Run serves HTTPS with.
func loadTLS(certFile, keyFile string) (*tls.Config, error) {
	cert, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return nil, fmt.Errorf("web: loading the TLS certificate %s and key %s: %w", certFile, keyFile, err)
	}
	return &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{cert}}, nil
}

// strictTransport tells browsers to reach the UI over HTTPS only, for a
// year, once they have reached it over HTTPS.
func strictTransport(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Strict-Transport-Security", "max-age=31536000")
		next.ServeHTTP(w, r)
	})
}
