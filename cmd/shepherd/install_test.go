package main

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/google/uuid"
	"google.golang.org/protobuf/proto"

	"github.com/shepherd/shepherd/agent"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/devpki"
)

func TestInstallRequest(t *testing.T) {
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	m := bmdbtest.AddMachine(t, db, s, "p")
	sha := strings.Repeat("AB", 32)
	args := func(machine, url, sum, target string) []string {
		return []string{"install", "request", "--database-url", db.URL, "--machine", machine,
			"--image-url", url, "--sha256", sum, "--target-device", target}
	}
	unknown := uuid.NewString()
	// Each refusal names what is wrong and where, as the operator reads it
	// after "shepherd: ".
	for name, c := range map[string]struct {
		args []string
		want string
	}{
		"machine not a uuid": {args("m1", "https://img.example/os.img", sha, "/dev/sda"), `--machine: no machine has the id or provider id "m1"`},
		"unknown machine":    {args(unknown, "https://img.example/os.img", sha, "/dev/sda"), "machine " + unknown + " does not exist or is not provided"},
		"ftp url":            {args(m.String(), "ftp://img.example/os.img", sha, "/dev/sda"), `image_url must be an http or https URL, got scheme "ftp"`},
		"short sha256":       {args(m.String(), "https://img.example/os.img", "abc", "/dev/sda"), "image_sha256 must be 64 hexadecimal characters, got 3 characters"},
		"relative target":    {args(m.String(), "https://img.example/os.img", sha, "sda"), `target_device must be an absolute path, got "sda"`},
		"missing flag": {[]string{"install", "request", "--database-url", db.URL, "--machine", m.String()},
			`required flag(s) "image-url", "sha256", "target-device" not set`},
	} {
		if out, err := run(t, c.args...); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error saying %q:\n%s", name, err, c.want, out)
		}
	}
	// Targets that cannot be a device, refused with what is wrong.
	for target, want := range map[string]string{
		"/sda":               "not a device under /dev",
		"/var/lib/disk.img":  "not a device under /dev",
		"/dev//sda":          `did you mean "/dev/sda"`,
		"/dev/../etc/passwd": "not a clean path",
	} {
		out, err := run(t, args(m.String(), "https://img.example/os.img", sha, target)...)
		if err == nil || !strings.Contains(err.Error(), "target_device") || !strings.Contains(err.Error(), want) {
			t.Errorf("target %s: %v, want an error mentioning %q:\n%s", target, err, want, out)
		}
	}
	if in, err := db.GetInstallation(t.Context(), m); err != nil || in.RequestGeneration != 0 {
		t.Fatalf("bad requests changed the installation: %+v, %v", in, err)
	}
	for gen := 1; gen <= 2; gen++ {
		out, err := run(t, append(args(m.String(), "https://img.example/os.img", sha, "/dev/sda"), "--reboot")...)
		if err != nil || !strings.Contains(out, fmt.Sprintf("generation %d", gen)) {
			t.Fatalf("request %d: %v\n%s", gen, err, out)
		}
	}
	in, err := db.GetInstallation(t.Context(), m)
	if err != nil {
		t.Fatal(err)
	}
	var req agentv1.OSInstallationRequest
	if err := proto.Unmarshal(in.Request, &req); err != nil {
		t.Fatal(err)
	}
	if in.RequestGeneration != 2 || req.GetImageSha256() != strings.ToLower(sha) || !req.GetRebootAfter() || req.GetTargetDevice() != "/dev/sda" ||
		in.RequestedBy != operator() {
		t.Errorf("stored request generation %d by %q: %v", in.RequestGeneration, in.RequestedBy, &req)
	}
	out, err := run(t, "install", "status", "--database-url", db.URL, "--machine", m.String())
	if err != nil || !strings.Contains(out, "generation 2") || !strings.Contains(out, "pending") || !strings.Contains(out, " by "+operator()+":") {
		t.Errorf("status: %v\n%s", err, out)
	}

	// A file target only when asked for explicitly.
	out, err = run(t, append(args(m.String(), "https://img.example/os.img", sha, "/var/lib/shepherd/disk.img"), "--file-target")...)
	if err != nil || !strings.Contains(out, "generation 3") {
		t.Fatalf("request with --file-target: %v\n%s", err, out)
	}
	if in, err = db.GetInstallation(t.Context(), m); err != nil || proto.Unmarshal(in.Request, &req) != nil || req.GetTargetDevice() != "/var/lib/shepherd/disk.img" {
		t.Errorf("stored request with --file-target: %v, %v", &req, err)
	}

	// A machine leaving the fleet is named as such, not as unknown.
	if err := db.RequestDecommission(t.Context(), m, "alice", "disk failed"); err != nil {
		t.Fatal(err)
	}
	out, err = run(t, args(m.String(), "https://img.example/os.img", sha, "/dev/sda")...)
	if want := "machine " + m.String() + " is being decommissioned: it takes no installations"; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("request on a machine being decommissioned: %v, want an error saying %q:\n%s", err, want, out)
	}
	err = s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		_, err := tx.Decommission(ctx, m, true)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	out, err = run(t, args(m.String(), "https://img.example/os.img", sha, "/dev/sda")...)
	if want := "machine " + m.String() + " was decommissioned: it takes no installations"; err == nil || !strings.Contains(err.Error(), want) {
		t.Errorf("request on a decommissioned machine: %v, want an error saying %q:\n%s", err, want, out)
	}
}

func TestRunServer(t *testing.T) {
	db := bmdbtest.New(t)
	addr := freeAddr(t)
	dataDir := t.TempDir()
	cmd := startCommand(t, "run", "--components", "server", "--database-url", db.URL,
		"--server-listen", addr, "--data-dir", dataDir, "--log-level", "warn")
	// Wait for the development CA, then for the listener.
	caPath := filepath.Join(dataDir, "pki", devpki.CACertFile)
	var ca *x509.Certificate
	bmdbtest.WaitFor(t, 20*time.Second, "server up", func(ctx context.Context) (bool, error) {
		cmd.running(t)
		data, err := os.ReadFile(caPath)
		if err != nil {
			return false, err
		}
		b, _ := pem.Decode(data)
		if b == nil {
			return false, errors.New("no PEM in the CA file yet")
		}
		if ca, err = x509.ParseCertificate(b.Bytes); err != nil {
			return false, err
		}
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
		}
		return err == nil, err
	})
	_, key, _ := ed25519.GenerateKey(rand.Reader)
	id := uuid.NewString()
	tlsCfg, err := agent.ClientTLS(id, addr, ca.Raw, key)
	if err != nil {
		t.Fatal(err)
	}
	_, err = agent.NewCallbackClient(addr, tlsCfg).Heartbeat(t.Context(), connect.NewRequest(&agentv1.HeartbeatRequest{MachineId: id}))
	if connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Errorf("heartbeat of an unknown machine: %v, want Unauthenticated", err)
	}
	cmd.stop(t)
}
