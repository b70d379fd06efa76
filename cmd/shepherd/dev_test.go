package main

import (
	"net/http/httptest"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/shepherd/shepherd/provider/equinix/fakemetal"
)

// TestDevHelp: no flag of `shepherd dev --help` says it is off by default
// while showing a default value (run's wording of --web-listen did).
func TestDevHelp(t *testing.T) {
	out, err := run(t, "dev", "--help")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(line, "default: off") && strings.Contains(line, `(default "`) {
			t.Errorf("help contradicts itself: %s", strings.TrimSpace(line))
		}
	}
	if !regexp.MustCompile(`--web-listen string +address to serve the web UI on; "" turns it off .*\(default "127\.0\.0\.1:8080"\)`).MatchString(out) {
		t.Errorf("--web-listen's help does not say how to turn it off and its default:\n%s", out)
	}
}

// TestDevEquinixConfig: the token file and CLI configuration `shepherd dev
// --provider=equinix` writes for its fake Metal API are private and work:
// `shepherd equinix --config` reads the dev project's devices through
// them (a wrong token would be refused with 401).
func TestDevEquinixConfig(t *testing.T) {
	t.Parallel()
	const token = "dev-token-never-printed"
	fake, err := fakemetal.New(fakemetal.Config{Token: token, Budget: 50, Burst: 10})
	if err != nil {
		t.Fatal(err)
	}
	fake.AddProject(devProject)
	fake.AddDevice(devProject, fakemetal.DeviceSpec{Hostname: "shepherd-dev-1"})
	srv := httptest.NewServer(fake)
	t.Cleanup(srv.Close)
	dir := t.TempDir() + "/equinix"
	// A token file left by an earlier run, readable by all: it is
	// replaced by a private one.
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dir+"/token", []byte("old-token\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	var api devEquinixAPI
	if err := writeDevEquinixConfig(dir, srv.URL+"/metal/v1", token, &api); err != nil {
		t.Fatal(err)
	}
	if api.URL != srv.URL+"/metal/v1" {
		t.Errorf("API URL %q, want %q", api.URL, srv.URL+"/metal/v1")
	}
	for _, f := range []string{api.TokenFile, api.ConfigFile} {
		fi, err := os.Stat(f)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 {
			t.Errorf("%s has mode %v, want 0600", f, fi.Mode().Perm())
		}
	}
	out, err := run(t, "equinix", "--config", api.ConfigFile, "devices", "list")
	if err != nil || !strings.Contains(out, "shepherd-dev-1") {
		t.Errorf("shepherd equinix --config %s devices list: %v\n%s", api.ConfigFile, err, out)
	}
	if strings.Contains(out, token) {
		t.Error("the token appears in the CLI's output")
	}
}
