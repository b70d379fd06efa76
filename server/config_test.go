package server_test

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/devpki"
	"github.com/shepherd/shepherd/server"
)

// Every bad field is refused by name, with its value; zero means the
// default and is fine.
func TestConfigValidate(t *testing.T) {
	t.Parallel()
	ok := server.Config{DataDir: "/var/lib/shepherd"}
	if err := ok.Validate(); err != nil {
		t.Fatalf("all defaults: %v", err)
	}
	if err := (server.Config{CertFile: "s.crt", KeyFile: "s.key"}).Validate(); err != nil {
		t.Fatalf("certificate files without a data directory: %v", err)
	}
	for _, tc := range []struct {
		name string
		edit func(*server.Config)
		want string
	}{
		{"certificate without key", func(c *server.Config) { c.CertFile = "s.crt" }, "CertFile and KeyFile must be given together"},
		{"key without certificate", func(c *server.Config) { c.KeyFile = "s.key" }, "CertFile and KeyFile must be given together"},
		{"neither certificate nor data directory", func(c *server.Config) { c.DataDir = "" }, "DataDir is required"},
		{"negative heartbeat interval", func(c *server.Config) { c.HeartbeatInterval = -time.Second }, "HeartbeatInterval must be >= 0 (0 = default), got -1s"},
		{"negative request size", func(c *server.Config) { c.MaxRequestBytes = -1 }, "MaxRequestBytes must be >= 0 (0 = default), got -1"},
		{"negative batch", func(c *server.Config) { c.MaxBatch = -1 }, "MaxBatch must be >= 0 (0 = default), got -1"},
		{"negative flushers", func(c *server.Config) { c.Flushers = -1 }, "Flushers must be >= 0 (0 = default), got -1"},
		{"negative flush timeout", func(c *server.Config) { c.FlushTimeout = -time.Second }, "FlushTimeout must be >= 0 (0 = default), got -1s"},
		{"negative retry pushback", func(c *server.Config) { c.RetryPushback = -time.Second }, "RetryPushback must be >= 0 (0 = default), got -1s"},
		{"negative connections", func(c *server.Config) { c.MaxConnections = -1 }, "MaxConnections must be >= 0 (0 = default), got -1"},
		{"negative connections per IP", func(c *server.Config) { c.MaxConnectionsPerIP = -1 }, "MaxConnectionsPerIP must be >= 0 (0 = default), got -1"},
		{"datagram address without port", func(c *server.Config) { c.DatagramListen = "127.0.0.1" }, `DatagramListen "127.0.0.1" is not a host:port`},
		{"datagram address with datagrams off", func(c *server.Config) { c.DatagramListen = ":7443"; c.NoDatagrams = true }, `DatagramListen ":7443" and NoDatagrams contradict each other`},
		{"negative streams per connection", func(c *server.Config) { c.MaxStreamsPerConnection = -1 }, "MaxStreamsPerConnection must be >= 0 (0 = default), got -1"},
	} {
		cfg := ok
		tc.edit(&cfg)
		if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Validate() = %v, want an error saying %q", tc.name, err, tc.want)
		}
	}
}

// A server configured with nothing but a data directory tells agents to
// send a heartbeat every 30 s.
func TestDefaultHeartbeatInterval(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{})
	id, key := e.machine()
	resp, err := e.heartbeat(e.client(id, key), &agentv1.HeartbeatRequest{MachineId: id.String()})
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.GetNextHeartbeatIn().AsDuration(); got != 30*time.Second {
		t.Errorf("next_heartbeat_in = %s, want the default 30s", got)
	}
}

// The development certificate covers the names agents may be given for the
// server by default: localhost, the loopback addresses and the hostname.
func TestDevelopmentCertificateNames(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{})
	hostname, err := os.Hostname()
	if err != nil || hostname == "" {
		t.Fatalf("the test needs the machine's hostname: %q, %v", hostname, err)
	}
	ca, err := x509.ParseCertificate(e.srv.CA())
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca)
	for _, name := range []string{"localhost", "127.0.0.1", "::1", hostname} {
		c, err := tls.DialWithDialer(&net.Dialer{Timeout: 10 * time.Second}, "tcp", e.endpoint,
			&tls.Config{RootCAs: roots, ServerName: name, NextProtos: []string{"h2"}})
		if err != nil {
			t.Errorf("connecting as %q: %v", name, err)
			continue
		}
		c.Close()
	}
}

// With certificate files, the server presents them and hands agents the CA
// of CAFile; without CAFile, agents are told to use their system roots.
// Broken files are refused by New, naming the file.
func TestCertificateFiles(t *testing.T) {
	t.Parallel()
	pki, err := devpki.LoadOrCreate(t.TempDir(), []string{"127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	write := func(name string, blocks ...*pem.Block) string {
		t.Helper()
		var b []byte
		for _, blk := range blocks {
			b = append(b, pem.EncodeToMemory(blk)...)
		}
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	var chain []*pem.Block
	for _, der := range pki.Certificate.Certificate {
		chain = append(chain, &pem.Block{Type: "CERTIFICATE", Bytes: der})
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(pki.Certificate.PrivateKey)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile := write("server.crt", chain...), write("server.key", &pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
	caFile := write("ca.crt", &pem.Block{Type: "CERTIFICATE", Bytes: pki.CA})

	e := start(t, server.Config{CertFile: certFile, KeyFile: keyFile, CAFile: caFile})
	if string(e.srv.CA()) != string(pki.CA) {
		t.Error("CA() is not the certificate of CAFile")
	}
	id, key := e.machine()
	if _, err := e.heartbeat(e.client(id, key), &agentv1.HeartbeatRequest{MachineId: id.String()}); err != nil {
		t.Errorf("heartbeat of an agent verifying the server against CAFile: %v", err)
	}

	db := bmdbtest.New(t)
	noCA, err := server.New(server.Config{CertFile: certFile, KeyFile: keyFile}, db.DB)
	if err != nil {
		t.Fatal(err)
	}
	if noCA.CA() != nil {
		t.Error("without CAFile, CA() is not nil: agents would not use their system roots")
	}
	for _, tc := range []struct {
		name, caFile, want string
	}{
		{"missing", filepath.Join(dir, "missing.crt"), "reading CA " + filepath.Join(dir, "missing.crt")},
		{"not PEM", write("garbage.crt"), "garbage.crt holds no PEM certificate"},
		{"a key", write("key.crt", &pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), "key.crt holds no PEM certificate"},
		{"a broken certificate", write("broken.crt", &pem.Block{Type: "CERTIFICATE", Bytes: []byte("not DER")}), "parsing CA " + filepath.Join(dir, "broken.crt")},
	} {
		_, err := server.New(server.Config{CertFile: certFile, KeyFile: keyFile, CAFile: tc.caFile}, db.DB)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("CAFile %s: New() = %v, want an error saying %q", tc.name, err, tc.want)
		}
	}
}
