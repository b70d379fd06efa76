package agent

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"time"

	"connectrpc.com/connect"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/api/agent/v1/agentv1connect"
)

// ClientCertificate makes the self-signed client certificate an agent
// presents to the callback server: the server checks its key against the
// BMDB, not its chain, so there is no CA to ask.
func ClientCertificate(machineID string, key ed25519.PrivateKey) (tls.Certificate, error) {
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(now.UnixNano()),
		Subject:      pkix.Name{CommonName: machineID},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(100 * 365 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("creating client certificate: %w", err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}

// ClientTLS is the TLS configuration of an agent's heartbeat connection: its
// client certificate, and the server verified against caDER if given, else
// the system roots.
func ClientTLS(machineID, endpoint string, caDER []byte, key ed25519.PrivateKey) (*tls.Config, error) {
	cert, err := ClientCertificate(machineID, key)
	if err != nil {
		return nil, err
	}
	host, _, err := net.SplitHostPort(endpoint)
	if err != nil {
		return nil, fmt.Errorf("server endpoint %q: %w", endpoint, err)
	}
	cfg := &tls.Config{
		Certificates: []tls.Certificate{cert},
		ServerName:   host,
		MinVersion:   tls.VersionTLS13,
		NextProtos:   []string{"h2"},
	}
	if len(caDER) > 0 {
		ca, err := x509.ParseCertificate(caDER)
		if err != nil {
			return nil, fmt.Errorf("parsing the server CA: %w", err)
		}
		cfg.RootCAs = x509.NewCertPool()
		cfg.RootCAs.AddCert(ca)
	}
	return cfg, nil
}

// HTTPClient is the HTTP/2 client heartbeats travel on, with tlsCfg. It
// keeps its one connection to the server between heartbeats (for up to
// IdleConnTimeout), so that a heartbeat costs no TLS handshake; the daemon
// closes it after each TLS heartbeat while the server lets it send
// datagrams instead.
func HTTPClient(tlsCfg *tls.Config) *http.Client { return HTTPClientDialer(tlsCfg, Dialer()) }

// Dialer is the dialer of an agent's connection to the callback server.
func Dialer() *net.Dialer { return &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second} }

// HTTPClientDialer is HTTPClient connecting with d instead of Dialer(). The
// benchmark's load generator uses it to make each simulated agent's
// connection exactly as an agent does, from loopback source addresses of
// its choosing (d.LocalAddr).
func HTTPClientDialer(tlsCfg *tls.Config, d *net.Dialer) *http.Client {
	return &http.Client{Transport: &http.Transport{
		TLSClientConfig:     tlsCfg,
		ForceAttemptHTTP2:   true,
		DialContext:         d.DialContext,
		TLSHandshakeTimeout: 10 * time.Second,
		IdleConnTimeout:     5 * time.Minute,
	}}
}

// NewCallbackClient returns a client of the callback service at endpoint
// that speaks the gRPC protocol over HTTP/2 with tlsCfg.
func NewCallbackClient(endpoint string, tlsCfg *tls.Config) agentv1connect.AgentCallbackServiceClient {
	return agentv1connect.NewAgentCallbackServiceClient(HTTPClient(tlsCfg), "https://"+endpoint, connect.WithGRPC())
}

// newClient returns the daemon's callback client and the HTTP client it
// travels on, whose idle connection the daemon closes while it holds a
// datagram grant.
func newClient(init *agentv1.TakeoverInit, key ed25519.PrivateKey) (agentv1connect.AgentCallbackServiceClient, *http.Client, error) {
	tlsCfg, err := ClientTLS(init.GetMachineId(), init.GetServerEndpoint(), init.GetCaCertificate(), key)
	if err != nil {
		return nil, nil, err
	}
	hc := HTTPClient(tlsCfg)
	return agentv1connect.NewAgentCallbackServiceClient(hc, "https://"+init.GetServerEndpoint(), connect.WithGRPC()), hc, nil
}
