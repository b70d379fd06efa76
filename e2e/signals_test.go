package e2e

import (
	"context"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/sshtest"
)

// proxiedDatabase puts a proxy in front of the test database and returns
// the proxy and a URL that connects through it.
func proxiedDatabase(t *testing.T, db *bmdbtest.DB) (*sshtest.Proxy, string) {
	t.Helper()
	u, err := url.Parse(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	q := u.Query()
	network, target := "tcp", u.Host
	if sock := q.Get("host"); strings.HasPrefix(sock, "/") {
		// The harness's own cluster listens on a unix socket.
		network, target = "unix", filepath.Join(sock, ".s.PGSQL."+q.Get("port"))
		q.Del("host")
		q.Del("port")
	}
	p := sshtest.StartProxyTo(t, network, target)
	u.Host, u.RawQuery = p.Addr.String(), q.Encode()
	return p, u.String()
}

// TestSecondSignalExitsAtOnce stops shepherd run while its database has
// gone silent, so that the clean shutdown hangs on closing the session:
// the first SIGTERM starts the clean shutdown and says so, the second
// exits at once with 128+SIGTERM and one line saying so.
func TestSecondSignalExitsAtOnce(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	proxy, dbURL := proxiedDatabase(t, db)
	p := startShepherd(t, "run", "--components", "janitor", "--database-url", dbURL, "--data-dir", t.TempDir(), "--log-level", "info")
	bmdbtest.WaitFor(t, time.Minute, "the janitor's session is open", func(ctx context.Context) (bool, error) {
		n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM sessions WHERE closed_at IS NULL")
		return n > 0, nil
	})
	proxy.Silence()
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	waitOutput(t, p, regexp.MustCompile(regexp.QuoteMeta("shutting down cleanly")), time.Minute)
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	_ = p.wait(t, time.Minute, "after the second SIGTERM")
	if code := p.cmd.ProcessState.ExitCode(); code != 128+int(syscall.SIGTERM) {
		t.Errorf("exit status %d, want %d", code, 128+int(syscall.SIGTERM))
	}
	if out := p.output(); strings.Count(out, "exiting at once") != 1 {
		t.Errorf("output does not say once that it exits at once:\n%s", out)
	}
}

// TestSIGHUPReloadsInventory adds a machine to a static inventory that
// shepherd run re-reads only every hour, and sends SIGHUP: the provisioner
// records the machine. A broken inventory on SIGHUP is reported with
// FILE:LINE and changes nothing; the process keeps running throughout.
func TestSIGHUPReloadsInventory(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	dir := t.TempDir()
	inv, cfg := filepath.Join(dir, "inventory.yaml"), filepath.Join(dir, "static.yaml")
	write := func(path, content string) {
		t.Helper()
		tmp := path + ".tmp"
		if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, path); err != nil {
			t.Fatal(err)
		}
	}
	one := "machines:\n  - {id: m1, address: 192.0.2.1}\n"
	write(inv, one)
	write(cfg, "inventory: "+inv+"\nname: lab\nreload_interval: 1h\n")
	p := startShepherd(t, "run", "--components", "provisioner", "--database-url", db.URL, "--data-dir", filepath.Join(dir, "data"),
		"--provider", "static", "--provider-config", cfg, "--provisioner-period", "200ms", "--log-level", "info")
	machines := func(n int64) func(context.Context) (bool, error) {
		return func(ctx context.Context) (bool, error) {
			return bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM machine_provided WHERE provider = 'lab'") == n, nil
		}
	}
	bmdbtest.WaitFor(t, time.Minute, "m1 recorded", machines(1))

	write(inv, "machines:\n  - {id: m1, address: 192.0.2.1}\n  - {id: m2, address: 192.0.2.2}\n")
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitOutput(t, p, regexp.MustCompile(regexp.QuoteMeta("SIGHUP: provider reloaded")), time.Minute)
	bmdbtest.WaitFor(t, time.Minute, "m2 recorded after SIGHUP", machines(2))

	write(inv, "machines:\n  - {id: m1, address: 192.0.2.1}\n  - {id: m2, adress: 192.0.2.2}\n")
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	waitOutput(t, p, regexp.MustCompile(regexp.QuoteMeta("SIGHUP: reload failed")), time.Minute)
	if out := p.output(); !strings.Contains(out, inv+`:3: machine \"m2\": unknown field \"adress\"`) {
		t.Errorf("the failed reload does not name FILE:LINE:\n%s", out)
	}
	p.exitedEarly(t)
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM machine_provided WHERE provider = 'lab' AND provider_status = 'Missing'"); n != 0 {
		t.Errorf("%d machines marked Missing after a broken inventory", n)
	}
}
