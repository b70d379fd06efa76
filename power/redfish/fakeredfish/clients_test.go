package fakeredfish_test

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"github.com/shepherd/shepherd/power/redfish/fakeredfish"
)

// The fake is checked against real Redfish clients written by others,
// Debian's python3-sushy (OpenStack Ironic's library) and redfishtool (the
// DMTF's), so that it is faithful to the protocol and not only to our
// driver. They are required: scripts/require-redfish-clients installs them
// (make test and CI run it), and a missing one fails the test rather than
// skipping it, so the check cannot silently vanish.

// debianPython is Debian's interpreter, which has python3-sushy; a python3
// on PATH (pyenv, a venv) may not.
const debianPython = "/usr/bin/python3"

const installHint = "run scripts/require-redfish-clients (as root it installs python3-sushy and redfishtool)"

func requireSushy(t *testing.T) {
	t.Helper()
	out, err := exec.Command(debianPython, "-c", "import sushy").CombinedOutput()
	if err != nil {
		t.Fatalf("python3-sushy is missing (%s -c 'import sushy': %v: %s); %s", debianPython, err, out, installHint)
	}
}

func requireRedfishtool(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("redfishtool")
	if err != nil {
		t.Fatalf("redfishtool is missing (%v); %s", err, installHint)
	}
	return p
}

func start(t *testing.T, cfg fakeredfish.Config) *fakeredfish.BMC {
	t.Helper()
	b, err := fakeredfish.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	return b
}

// clientEnv keeps proxies from the environment away from 127.0.0.1, and
// drops REQUESTS_CA_BUNDLE and CURL_CA_BUNDLE: requests lets them override
// the CA file a Session was given (sushy's verify=), so with them set sushy
// would check the fake against the system's roots.
func clientEnv() []string {
	env := slices.DeleteFunc(os.Environ(), func(kv string) bool {
		return strings.HasPrefix(kv, "REQUESTS_CA_BUNDLE=") || strings.HasPrefix(kv, "CURL_CA_BUNDLE=")
	})
	return append(env, "NO_PROXY=127.0.0.1,localhost", "no_proxy=127.0.0.1,localhost")
}

// sushyScript connects with sushy, verifying the certificate against the
// CA file, reads the system, resets it, sets a one-time PXE boot, reads it
// again and logs out; it prints what it saw as JSON.
const sushyScript = `
import json, sys
import sushy
from sushy import auth as sushy_auth

url, user, password, ca, mode, reset = sys.argv[1:7]
auth = (sushy_auth.SessionAuth if mode == "session" else
        sushy_auth.BasicAuth if mode == "basic" else
        sushy_auth.SessionOrBasicAuth)(username=user, password=password)
try:
    root = sushy.Sushy(url, auth=auth, verify=ca)
    system = root.get_system()
    out = {
        "vendor": root.json.get("Vendor"),
        "before": system.power_state.value,
        "allowed": sorted(v.value for v in system.get_allowed_reset_system_values()),
    }
    system.reset_system(sushy.ResetType(reset))
    system.set_system_boot_options(sushy.BootSource.PXE,
                                   enabled=sushy.BootSourceOverrideEnabled.ONCE)
    system.refresh()
    out["after"] = system.power_state.value
    out["boot"] = [system.boot.enabled.value, system.boot.target.value]
finally:
    auth.close()
print(json.dumps(out))
`

type sushyResult struct {
	Vendor  string
	Before  string
	After   string
	Allowed []string
	Boot    []string
}

func runSushy(t *testing.T, b *fakeredfish.BMC, password, mode, reset string) (sushyResult, string, error) {
	t.Helper()
	dir := t.TempDir()
	script, ca := filepath.Join(dir, "client.py"), filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(script, []byte(sushyScript), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := b.WriteCAFile(ca); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, debianPython, script, b.URL(), b.Username(), password, ca, mode, reset)
	cmd.Env = clientEnv()
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	var res sushyResult
	if err == nil {
		if jerr := json.Unmarshal(out, &res); jerr != nil {
			t.Fatalf("sushy script printed %q: %v", out, jerr)
		}
	}
	return res, stderr.String(), err
}

// TestSushy: sushy logs in (by session where offered, falling back to
// basic where not, as it does with real BMCs), verifies the fake's
// certificate against its CA file, reads the power state and the allowed
// reset types, resets, sets a one-time PXE boot, and logs out.
func TestSushy(t *testing.T) {
	t.Parallel()
	requireSushy(t)
	for _, tc := range []struct {
		profile fakeredfish.Profile
		mode    string
	}{
		{fakeredfish.OpenBMC(), "session"},
		{fakeredfish.IDRAC(), "auto"}, // TLS 1.2 only
		{fakeredfish.BasicOnly(), "auto"},
		{fakeredfish.NoForceOff(), "basic"},
	} {
		t.Run(tc.profile.Name, func(t *testing.T) {
			t.Parallel()
			b := start(t, fakeredfish.Config{Profile: tc.profile})
			res, stderr, err := runSushy(t, b, b.Password(), tc.mode, "On")
			if err != nil {
				t.Fatalf("sushy: %v\n%s", err, stderr)
			}
			want := sushyResult{
				Vendor: tc.profile.Vendor, Before: "Off", After: "On",
				Allowed: sortedCopy(tc.profile.ResetTypes), Boot: []string{"Once", "Pxe"},
			}
			if diff := cmp.Diff(want, res); diff != "" {
				t.Errorf("what sushy saw (-want +got):\n%s", diff)
			}
			if got := b.PowerState(); got != fakeredfish.On {
				t.Errorf("BMC power state after sushy's reset: %s", got)
			}
			if diff := cmp.Diff(map[string]int{"On": 1}, b.Resets()); diff != "" {
				t.Errorf("resets (-want +got):\n%s", diff)
			}
			wantSessions := 0
			if tc.profile.SessionService && tc.mode != "basic" {
				wantSessions = 1
			}
			if n := b.SessionsCreated(); n != wantSessions {
				t.Errorf("sushy created %d sessions, want %d", n, wantSessions)
			}
			if n := b.OpenSessions(); n != 0 {
				t.Errorf("%d sessions open after sushy logged out", n)
			}
		})
	}
	t.Run("wrong password", func(t *testing.T) {
		t.Parallel()
		b := start(t, fakeredfish.Config{Profile: fakeredfish.OpenBMC()})
		_, stderr, err := runSushy(t, b, "not-the-password", "session", "On")
		if err == nil || !strings.Contains(stderr, "401") {
			t.Fatalf("sushy with a wrong password: err %v, stderr:\n%s\nwant a failure with HTTP 401", err, stderr)
		}
		if b.SessionsCreated() != 0 || len(b.Resets()) != 0 {
			t.Fatalf("wrong password created %d sessions and sent resets %v", b.SessionsCreated(), b.Resets())
		}
	})
	t.Run("reset type not allowed", func(t *testing.T) {
		t.Parallel()
		b := start(t, fakeredfish.Config{Profile: fakeredfish.NoForceOff(), PowerState: fakeredfish.On})
		_, stderr, err := runSushy(t, b, b.Password(), "session", "ForceOff")
		// sushy checks the allowable values itself before sending.
		if err == nil || !strings.Contains(stderr, "InvalidParameterValueError") || !strings.Contains(stderr, "PushPowerButton") {
			t.Fatalf("sushy ForceOff on a BMC that does not allow it: err %v, stderr:\n%s", err, stderr)
		}
		if len(b.Resets()) != 0 || b.PowerState() != fakeredfish.On {
			t.Fatalf("resets %v, power %s; want none and On", b.Resets(), b.PowerState())
		}
		if n := b.OpenSessions(); n != 0 {
			t.Errorf("%d sessions open after sushy logged out", n)
		}
	})
}

func sortedCopy(s []string) []string {
	c := slices.Clone(s)
	slices.Sort(c)
	return c
}

// runRedfishtool runs redfishtool against b and returns its stdout.
// redfishtool does not verify certificates (it always passes verify=False
// to requests), so it checks the protocol, not the TLS trust.
func runRedfishtool(t *testing.T, tool string, b *fakeredfish.BMC, auth, password string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	full := append([]string{"-r", "127.0.0.1:" + strconv.Itoa(b.Port()), "-u", b.Username(), "-p", password,
		"-S", "Always", "-A", auth}, args...)
	cmd := exec.CommandContext(ctx, tool, full...)
	cmd.Env = clientEnv()
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out), &toolError{err: err, stderr: stderr.String()}
	}
	return string(out), nil
}

type toolError struct {
	err    error
	stderr string
}

func (e *toolError) Error() string { return e.err.Error() + ": " + e.stderr }

// TestRedfishtool: redfishtool lists the Systems collection, reads the
// system, resets it and sets a one-time PXE boot, with session login (and
// its logout at exit) where offered and basic authentication where not.
func TestRedfishtool(t *testing.T) {
	t.Parallel()
	tool := requireRedfishtool(t)
	for _, tc := range []struct {
		profile fakeredfish.Profile
		auth    string
	}{
		{fakeredfish.OpenBMC(), "Session"},
		{fakeredfish.IDRAC(), "Session"},
		{fakeredfish.BasicOnly(), "Basic"},
	} {
		t.Run(tc.profile.Name, func(t *testing.T) {
			t.Parallel()
			b := start(t, fakeredfish.Config{Profile: tc.profile, PowerState: fakeredfish.On})
			systemPath := "/redfish/v1/Systems/" + tc.profile.SystemID

			out, err := runRedfishtool(t, tool, b, tc.auth, b.Password(), "Systems")
			if err != nil {
				t.Fatalf("redfishtool Systems: %v", err)
			}
			var coll struct {
				Members []map[string]string
			}
			if err := json.Unmarshal([]byte(out), &coll); err != nil || len(coll.Members) != 1 || coll.Members[0]["@odata.id"] != systemPath {
				t.Fatalf("redfishtool Systems printed %q (decode error %v), want the one member %s", out, err, systemPath)
			}

			out, err = runRedfishtool(t, tool, b, tc.auth, b.Password(), "Systems", "-1", "get")
			if err != nil {
				t.Fatalf("redfishtool Systems -1 get: %v", err)
			}
			var sys struct{ PowerState string }
			if err := json.Unmarshal([]byte(out), &sys); err != nil || sys.PowerState != "On" {
				t.Fatalf("redfishtool Systems -1 get printed %q (decode error %v), want PowerState On", out, err)
			}

			if _, err := runRedfishtool(t, tool, b, tc.auth, b.Password(), "Systems", "-1", "reset", "ForceOff"); err != nil {
				t.Fatalf("redfishtool reset ForceOff: %v", err)
			}
			if got := b.PowerState(); got != fakeredfish.Off {
				t.Errorf("power state after redfishtool's ForceOff: %s", got)
			}
			if diff := cmp.Diff(map[string]int{"ForceOff": 1}, b.Resets()); diff != "" {
				t.Errorf("resets (-want +got):\n%s", diff)
			}

			if _, err := runRedfishtool(t, tool, b, tc.auth, b.Password(), "Systems", "-1", "setBootOverride", "Once", "Pxe"); err != nil {
				t.Fatalf("redfishtool setBootOverride: %v", err)
			}
			if enabled, target := b.BootOverride(); enabled != "Once" || target != "Pxe" {
				t.Errorf("boot override after redfishtool: %s/%s, want Once/Pxe", enabled, target)
			}

			wantSessions := 0
			if tc.auth == "Session" {
				wantSessions = 4 // one per run
			}
			if n := b.SessionsCreated(); n != wantSessions {
				t.Errorf("redfishtool created %d sessions, want %d", n, wantSessions)
			}
			if n := b.OpenSessions(); n != 0 {
				t.Errorf("%d sessions open after redfishtool exited", n)
			}
		})
	}
	t.Run("wrong password", func(t *testing.T) {
		t.Parallel()
		b := start(t, fakeredfish.Config{Profile: fakeredfish.OpenBMC()})
		if _, err := runRedfishtool(t, tool, b, "Session", "not-the-password", "Systems"); err == nil {
			t.Fatal("redfishtool with a wrong password succeeded")
		}
		if _, err := runRedfishtool(t, tool, b, "Basic", "not-the-password", "Systems"); err == nil {
			t.Fatal("redfishtool with a wrong basic password succeeded")
		}
		if n := b.SessionsCreated(); n != 0 {
			t.Fatalf("wrong password created %d sessions", n)
		}
	})
}
