// Package devpki creates the development PKI of the callback server: a CA
// and a server certificate signed by it, kept in a directory and reused on
// restart, so that agents taken over earlier keep trusting the server. It is
// for `shepherd dev` and for installations without certificates of their own;
// production installations give the server certificate files instead.
package devpki

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/shepherd/shepherd/internal/atomicfile"
)

// File names inside the directory.
const (
	CACertFile     = "ca.crt"
	caKeyFile      = "ca.key"
	serverCertFile = "server.crt"
	serverKeyFile  = "server.key"
)

const (
	caValidity     = 10 * 365 * 24 * time.Hour
	serverValidity = 365 * 24 * time.Hour
	// renewBefore reissues a server certificate this long before it expires.
	renewBefore = 30 * 24 * time.Hour
)

// Server is the loaded (or created) development PKI.
type Server struct {
	// Certificate is the server's certificate chain and key, for tls.Config.
	Certificate tls.Certificate
	// CA is the DER of the CA certificate, for TakeoverInit.ca_certificate.
	CA []byte
}

// LoadOrCreate returns the development CA and a server certificate for
// hosts (DNS names or IP addresses) from dir, creating what is missing: the
// CA once, the server certificate whenever it is missing, expires soon, or
// does not cover hosts. Keys are written with mode 0600.
func LoadOrCreate(dir string, hosts []string) (*Server, error) {
	if len(hosts) == 0 {
		return nil, errors.New("devpki: at least one host name is required")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("devpki: creating %s: %w", dir, err)
	}
	caCert, caKey, err := loadOrCreateCA(dir)
	if err != nil {
		return nil, err
	}
	cert, err := loadServer(dir, caCert, hosts)
	if err != nil {
		if cert, err = createServer(dir, caCert, caKey, hosts); err != nil {
			return nil, err
		}
	}
	return &Server{Certificate: cert, CA: caCert.Raw}, nil
}

func loadOrCreateCA(dir string) (*x509.Certificate, crypto.Signer, error) {
	certPath, keyPath := filepath.Join(dir, CACertFile), filepath.Join(dir, caKeyFile)
	pair, err := tls.LoadX509KeyPair(certPath, keyPath)
	if err == nil {
		cert, err := x509.ParseCertificate(pair.Certificate[0])
		if err != nil {
			return nil, nil, fmt.Errorf("devpki: parsing %s: %w", certPath, err)
		}
		signer, ok := pair.PrivateKey.(crypto.Signer)
		if !ok || !cert.IsCA {
			return nil, nil, fmt.Errorf("devpki: %s is not a CA certificate with a signing key", certPath)
		}
		return cert, signer, nil
	}
	if !errors.Is(err, os.ErrNotExist) {
		return nil, nil, fmt.Errorf("devpki: loading the development CA from %s: %w", dir, err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "Shepherd development CA"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(caValidity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, nil, fmt.Errorf("devpki: creating the development CA: %w", err)
	}
	if err := writePair(certPath, keyPath, der, key); err != nil {
		return nil, nil, err
	}
	cert, err := x509.ParseCertificate(der)
	return cert, key, err
}

// loadServer returns the stored server certificate if it is signed by ca,
// covers hosts and is not about to expire.
func loadServer(dir string, ca *x509.Certificate, hosts []string) (tls.Certificate, error) {
	pair, err := tls.LoadX509KeyPair(filepath.Join(dir, serverCertFile), filepath.Join(dir, serverKeyFile))
	if err != nil {
		return tls.Certificate{}, err
	}
	leaf, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		return tls.Certificate{}, err
	}
	if err := leaf.CheckSignatureFrom(ca); err != nil {
		return tls.Certificate{}, err
	}
	if time.Until(leaf.NotAfter) < renewBefore {
		return tls.Certificate{}, errors.New("expires soon")
	}
	for _, h := range hosts {
		if err := leaf.VerifyHostname(h); err != nil {
			return tls.Certificate{}, err
		}
	}
	pair.Leaf = leaf
	pair.Certificate = append(pair.Certificate[:1:1], ca.Raw)
	return pair, nil
}

func createServer(dir string, ca *x509.Certificate, caKey crypto.Signer, hosts []string) (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: hosts[0]},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(serverValidity),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	for _, h := range slices.Compact(slices.Sorted(slices.Values(hosts))) {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, key.Public(), caKey)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("devpki: creating the server certificate: %w", err)
	}
	if err := writePair(filepath.Join(dir, serverCertFile), filepath.Join(dir, serverKeyFile), der, key); err != nil {
		return tls.Certificate{}, err
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der, ca.Raw}, PrivateKey: key, Leaf: leaf}, nil
}

// writePair writes a certificate and its key; the key file is created 0600
// and both are replaced atomically, so a crash never leaves half a pair.
func writePair(certPath, keyPath string, der []byte, key crypto.Signer) error {
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return err
	}
	if err := atomicfile.Write(keyPath, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		return err
	}
	return atomicfile.Write(certPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	return n
}
