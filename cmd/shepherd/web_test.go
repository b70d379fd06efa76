package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/devpki"
)

// TestWebFlagsValidate checks that each refusal of the web UI's flags names
// the flag to fix.
func TestWebFlagsValidate(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		cfg  webConfig
		want string // "" = valid
	}{
		{webConfig{TLSCert: "c", TLSKey: "k"}, "--web-tls-cert and --web-tls-key are only used with --web-listen"},
		{webConfig{Actions: true}, ""},
		{webConfig{Listen: "127.0.0.1:8080", TLSCert: "c"}, "--web-tls-cert needs --web-tls-key"},
		{webConfig{Listen: "127.0.0.1:8080", TLSKey: "k"}, "--web-tls-key needs --web-tls-cert"},
		{webConfig{Listen: "0.0.0.0:8080", Actions: true}, "--web-actions on --web-listen 0.0.0.0:8080, which is not a loopback address, needs --web-tls-cert and --web-tls-key"},
		{webConfig{Listen: ":8080", Actions: true}, "needs --web-tls-cert and --web-tls-key"},
		{webConfig{Listen: "shepherd.example:8080", Actions: true}, "needs --web-tls-cert and --web-tls-key"},
		{webConfig{Listen: "0.0.0.0:8080", Actions: true, TLSCert: "c", TLSKey: "k"}, ""},
		{webConfig{Listen: "0.0.0.0:8080"}, ""},
		{webConfig{Listen: "127.0.0.1:8080", Actions: true}, ""},
		{webConfig{Listen: "[::1]:8080", Actions: true}, ""},
		{webConfig{Listen: "localhost:8080", Actions: true}, ""},
	} {
		err := tt.cfg.validate()
		switch {
		case tt.want == "" && err != nil:
			t.Errorf("%+v: %v, want valid", tt.cfg, err)
		case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
			t.Errorf("%+v: %v, want an error containing %q", tt.cfg, err, tt.want)
		}
	}
}

// TestRunWebTLS runs `shepherd run` with the web UI's actions over HTTPS,
// and checks that without TLS it refuses them on an address other hosts
// reach, before it starts anything.
func TestRunWebTLS(t *testing.T) {
	db := bmdbtest.New(t)
	dir := t.TempDir()
	pki, err := devpki.LoadOrCreate(filepath.Join(dir, "pki"), []string{"127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	ca, err := x509.ParseCertificate(pki.CA)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca)
	tokenFile := filepath.Join(dir, "operator-token")
	if err := os.WriteFile(tokenFile, []byte("web-tls-operator-token-0123\n"), 0o600); err != nil {
		t.Fatal(err)
	}

	_, err = run(t, "run", "--components=janitor", "--database-url", db.URL, "--data-dir", dir, "--log-level", "error",
		"--web-listen", "0.0.0.0:0", "--web-actions", "--web-operator-token-file", tokenFile)
	if err == nil || !strings.Contains(err.Error(), "needs --web-tls-cert and --web-tls-key") {
		t.Fatalf("shepherd run with --web-actions on 0.0.0.0 without TLS: %v, want a refusal naming the TLS flags", err)
	}

	webAddr := freeAddr(t)
	cmd := startCommand(t, "run", "--components=janitor", "--database-url", db.URL, "--data-dir", dir, "--log-level", "error",
		"--web-listen", webAddr, "--web-actions", "--web-operator-token-file", tokenFile,
		"--web-tls-cert", filepath.Join(dir, "pki", "server.crt"), "--web-tls-key", filepath.Join(dir, "pki", "server.key"))
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}}
	var page string
	bmdbtest.WaitFor(t, 30*time.Second, "the web UI answers over HTTPS", func(ctx context.Context) (bool, error) {
		cmd.running(t)
		resp, err := client.Get("https://" + webAddr + "/")
		if err != nil {
			return false, nil
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		page = string(body)
		return err == nil && resp.StatusCode == http.StatusOK, err
	})
	if !strings.Contains(page, "Fleet overview") {
		t.Errorf("the overview over HTTPS:\n%s", page)
	}
	if resp, err := (&http.Client{Timeout: 10 * time.Second}).Get("http://" + webAddr + "/"); err == nil {
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			t.Errorf("plain HTTP to the HTTPS web UI: %s\n%s", resp.Status, body)
		}
	}
	cmd.stop(t)
	if got := webURL("0.0.0.0:8443", true); got != "https://localhost:8443/" {
		t.Errorf("webURL with TLS = %q", got)
	}
}
