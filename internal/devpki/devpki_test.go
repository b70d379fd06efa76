package devpki

import (
	"bytes"
	"crypto/x509"
	"os"
	"path/filepath"
	"testing"
)

func TestLoadOrCreate(t *testing.T) {
	dir := t.TempDir()
	first, err := LoadOrCreate(dir, []string{"localhost", "127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{caKeyFile, serverKeyFile} {
		st, err := os.Stat(filepath.Join(dir, f))
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != 0o600 {
			t.Errorf("%s has mode %v, want 0600", f, st.Mode().Perm())
		}
	}
	verify := func(s *Server, host string) {
		t.Helper()
		ca, err := x509.ParseCertificate(s.CA)
		if err != nil {
			t.Fatal(err)
		}
		roots := x509.NewCertPool()
		roots.AddCert(ca)
		if _, err := s.Certificate.Leaf.Verify(x509.VerifyOptions{DNSName: host, Roots: roots}); err != nil {
			t.Errorf("server certificate does not verify for %s: %v", host, err)
		}
	}
	verify(first, "localhost")
	verify(first, "127.0.0.1")

	// A restart reuses everything.
	again, err := LoadOrCreate(dir, []string{"127.0.0.1", "localhost"})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(again.CA, first.CA) || !bytes.Equal(again.Certificate.Certificate[0], first.Certificate.Certificate[0]) {
		t.Error("restart did not reuse the CA and server certificate")
	}
	// A new host name gets a new server certificate from the same CA.
	grown, err := LoadOrCreate(dir, []string{"localhost", "127.0.0.1", "shepherd.example"})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(grown.CA, first.CA) {
		t.Error("a new host name replaced the CA")
	}
	if bytes.Equal(grown.Certificate.Certificate[0], first.Certificate.Certificate[0]) {
		t.Error("a new host name kept the old server certificate")
	}
	verify(grown, "shepherd.example")

	// A broken CA file is an error, not a silent new CA that strands agents.
	if err := os.WriteFile(filepath.Join(dir, CACertFile), []byte("garbage"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadOrCreate(dir, []string{"localhost"}); err == nil {
		t.Error("a corrupt CA certificate was accepted")
	}
	if _, err := LoadOrCreate(t.TempDir(), nil); err == nil {
		t.Error("no host names accepted")
	}
}
