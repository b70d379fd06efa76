package install

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// assertNoRequest fails the test if srv was asked for anything: a target
// that fails its check must be refused before the download.
func assertNoRequest(t *testing.T, srv *server) {
	t.Helper()
	if got := srv.requests.Load(); got != 0 {
		t.Errorf("the image server got %d requests, want none: the target was not checked before the download", got)
	}
}

// assertRefused installs img to target with file targets allowed under
// fileDirs, and checks that the target was refused before the download
// with an error naming it and mentioning each of wants. It returns the
// error message.
func assertRefused(t *testing.T, img []byte, sum, target string, fileDirs []string, wants ...string) string {
	t.Helper()
	srv := newServer(t, serveImage(img))
	report := Install(t.Context(), newConfig(t, fileDirs...), request(srv.URL, sum, target))
	msg := assertError(t, report, 7, append([]string{"checking target " + target}, wants...)...)
	assertNoRequest(t, srv)
	return msg
}

// refusal is a case of a target to refuse: what to install to, where
// files are allowed, and what the error must say.
type refusal struct {
	name     string
	target   string
	fileDirs []string
	want     string
}

// assertMissing fails the test if anything exists at path.
func assertMissing(t *testing.T, path string) {
	t.Helper()
	if _, err := os.Lstat(path); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("%s exists after the installation (Lstat: %v), want nothing created", path, err)
	}
}

// TestInstallRefusesMissingTarget is issue 10 item 21: a mistyped device
// name became a regular file in /dev, reported installed. A missing target
// is refused, naming it, with nothing downloaded or created.
func TestInstallRefusesMissingTarget(t *testing.T) {
	img, sum := testImage(t)
	var random [6]byte
	_, _ = rand.Read(random[:]) // never fails
	devTypo := "/dev/shepherd-test-sdbb-" + hex.EncodeToString(random[:])
	t.Cleanup(func() {
		// Only a broken check creates it; it must not outlive the test.
		if err := os.Remove(devTypo); err == nil {
			t.Errorf("%s was created in /dev", devTypo)
		}
	})
	dir := t.TempDir()
	dangling := filepath.Join(dir, "by-id-of-a-removed-disk")
	if err := os.Symlink("/dev/shepherd-test-gone-"+hex.EncodeToString(random[:]), dangling); err != nil {
		t.Fatal(err)
	}

	tests := []refusal{
		{"mistyped device in /dev", devTypo, nil, "does not exist"},
		{"missing file, no file targets allowed", filepath.Join(dir, "disk.img"), nil, "does not exist"},
		{"missing file outside the allowed directory", filepath.Join(dir, "disk.img"), []string{t.TempDir()}, "does not exist"},
		{"missing directory under the allowed one", filepath.Join(dir, "missing", "disk.img"), []string{dir}, "neither it nor its directory exists"},
		{"dangling symlink", dangling, []string{dir}, "which does not exist"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assertRefused(t, img, sum, tt.target, tt.fileDirs, tt.want)
			if tt.target != dangling {
				assertMissing(t, tt.target)
			}
		})
	}

	// An agent that writes no files says nothing about files: a mistyped
	// device is all there is to it.
	msg := assertRefused(t, img, sum, devTypo, nil)
	if want := "checking target " + devTypo + ": it does not exist; a target must be an existing block device, and the agent never creates one"; msg != want {
		t.Errorf("error message %q, want %q", msg, want)
	}
}

// TestInstallRefusesFileOutsideAllowedDirs checks that an existing regular
// file is a target only under Config.FileTargetDirs, after resolving
// symlinks, and never by default.
func TestInstallRefusesFileOutsideAllowedDirs(t *testing.T) {
	img, sum := testImage(t)
	outside := existingTarget(t, []byte("a file that is not a disk"))
	allowed := t.TempDir()
	escape := filepath.Join(allowed, "escape")
	if err := os.Symlink(outside, escape); err != nil {
		t.Fatal(err)
	}

	tests := []refusal{
		{"no file targets allowed", outside, nil, "started without --allow-file-target-dir"},
		{"another directory allowed", outside, []string{allowed}, "writes files only under " + allowed},
		{"symlink out of the allowed directory", escape, []string{allowed}, "(-> " + outside + ")"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			before := takeSnapshot(t, outside)
			assertRefused(t, img, sum, tt.target, tt.fileDirs, "is a regular file, not a block device", tt.want)
			assertUntouched(t, outside, before)
		})
	}
}

// TestInstallRefusesNonBlockTargets checks the targets that exist but are
// neither block devices nor files: refused before the download, even in an
// allowed directory.
func TestInstallRefusesNonBlockTargets(t *testing.T) {
	img, sum := testImage(t)
	allowed := t.TempDir()
	dir := filepath.Join(allowed, "dir")
	fifo := filepath.Join(allowed, "fifo")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	devNullLink := filepath.Join(allowed, "null")
	if err := os.Symlink(os.DevNull, devNullLink); err != nil {
		t.Fatal(err)
	}
	socket := filepath.Join(allowed, "socket")
	ln, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	file := existingTarget(t, []byte("a file, not a directory"))

	tests := []struct {
		name, target, want string
	}{
		{"directory", dir, "it is a directory, not a block device"},
		{"character device", os.DevNull, "it is a character device, not a block device"},
		{"symlink to a character device", devNullLink, "(-> " + os.DevNull + "): it is a character device"},
		{"named pipe", fifo, "it is a named pipe, not a block device"},
		{"socket", socket, "it is a socket, not a block device"},
		{"path through a file", filepath.Join(file, "disk"), "resolving it: not a directory"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assertRefused(t, img, sum, tt.target, []string{allowed}, tt.want)
		})
	}
	if entries, err := os.ReadDir(dir); err != nil || len(entries) != 0 {
		t.Errorf("target directory was written to: %v (%v)", entries, err)
	}
}

// TestInstallFileTargetThroughSymlink checks that a symlink within an
// allowed directory to a file within it installs, byte-identical.
func TestInstallFileTargetThroughSymlink(t *testing.T) {
	img, sum := testImage(t)
	srv := newServer(t, serveImage(img))
	file := existingTarget(t, []byte("old"))
	link := filepath.Join(filepath.Dir(file), "by-id")
	if err := os.Symlink(file, link); err != nil {
		t.Fatal(err)
	}

	report := Install(t.Context(), allowing(t, file), request(srv.URL, sum, link))
	assertSuccess(t, report, 7)
	assertContent(t, file, img)
	if fi, err := os.Lstat(link); err != nil || fi.Mode().Type() != fs.ModeSymlink {
		t.Errorf("the symlink was replaced: %v, %v", fi, err)
	}
}

func TestConfigValidateFileTargetDirs(t *testing.T) {
	file := existingTarget(t, nil)
	devLink := filepath.Join(t.TempDir(), "dev")
	if err := os.Symlink("/dev", devLink); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, dir, want string
	}{
		{"relative", "tmp/targets", "not an absolute path"},
		{"missing", filepath.Join(t.TempDir(), "missing"), "no such file"},
		{"a file", file, "is not a directory"},
		{"root", "/", "root directory"},
		{"/dev", "/dev", "in /dev"},
		{"under /dev", "/dev/shm", "in /dev"},
		{"symlink to /dev", devLink, "in /dev"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg := Config{FileTargetDirs: []string{t.TempDir(), tt.dir}}
			err := cfg.Validate()
			if err == nil || !strings.Contains(err.Error(), "FileTargetDirs") || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Validate() = %v, want an error about FileTargetDirs mentioning %q", err, tt.want)
			}
		})
	}
	if err := (Config{FileTargetDirs: []string{t.TempDir()}}).Validate(); err != nil {
		t.Errorf("Validate() with a temporary directory = %v", err)
	}
}

// TestCheckRequestTarget checks the operator side: the form of the path
// only, since whether a device exists only the agent can tell.
func TestCheckRequestTarget(t *testing.T) {
	tests := []struct {
		target     string
		fileTarget bool
		want       string // "" means accepted
	}{
		{"/dev/sda", false, ""},
		{"/dev/sdbb", false, ""}, // may exist; the agent decides
		{"/dev/disk/by-id/nvme-SAMSUNG_123", false, ""},
		{"/dev/mapper/vg-root", false, ""},
		{"sda", false, "absolute path"},
		{"", false, "absolute path"},
		{"/sda", false, "not a device under /dev"},
		{"/dev", false, "not a device under /dev"},
		{"/dev/", false, "not a clean path"},
		{"/devices/sda", false, "not a device under /dev"},
		{"/var/lib/disk.img", false, "not a device under /dev"},
		{"/dev//sda", false, `did you mean "/dev/sda"`},
		{"/dev/../etc/passwd", false, "not a clean path"},
		{"/var/lib/disk.img", true, ""},
		{"/var/lib/../disk.img", true, "not a clean path"},
		{"disk.img", true, "absolute path"},
	}
	for _, tt := range tests {
		req := request("https://images.example/os.img", strings.Repeat("ab", 32), tt.target)
		req.Generation = 0 // the BMDB assigns it
		err := CheckRequest(req, RequestOptions{FileTarget: tt.fileTarget})
		switch {
		case tt.want == "" && err != nil:
			t.Errorf("CheckRequest(%q, file target %v) = %v, want nil", tt.target, tt.fileTarget, err)
		case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
			t.Errorf("CheckRequest(%q, file target %v) = %v, want an error mentioning %q", tt.target, tt.fileTarget, err, tt.want)
		case err != nil && !strings.Contains(err.Error(), "target_device"):
			t.Errorf("CheckRequest(%q) = %v, want it to name target_device", tt.target, err)
		}
	}
}
