package install

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// These tests write to loop devices backed by temporary files, never to a
// real disk: they need root, losetup, and for the mount test partx,
// mkfs.ext4 and mount (util-linux, e2fsprogs). The one test about the real root disk
// only checks it (checkTarget), as Install would write to it if the check
// were broken.

// run runs a command the block device tests need, failing the test with
// what it printed.
func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s (the block device tests need root, losetup, partx, mkfs.ext4 and mount): %v\n%s",
			name, strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out))
}

// loopDevice attaches a loop device backed by a temporary file holding
// content, detached when the test ends, and returns its path. partitions
// makes the partitions of the table in content appear as devices (removed
// again with the loop device).
func loopDevice(t *testing.T, content []byte, partitions bool) string {
	t.Helper()
	if partitions {
		return attachLoop(t, content, true, "--partscan")
	}
	return attachLoop(t, content, false)
}

// attachLoop is loopDevice with more options for losetup.
func attachLoop(t *testing.T, content []byte, partitions bool, options ...string) string {
	t.Helper()
	backing := filepath.Join(t.TempDir(), "backing.img")
	if err := os.WriteFile(backing, content, 0o600); err != nil {
		t.Fatal(err)
	}
	args := append([]string{"--find", "--show"}, options...)
	out := run(t, "losetup", append(args, backing)...)
	dev := out[strings.LastIndex(out, "\n")+1:] // after any warning (a file smaller than a sector)
	t.Cleanup(func() {
		if out, err := exec.Command("losetup", "--detach", dev).CombinedOutput(); err != nil {
			t.Errorf("detaching %s: %v\n%s", dev, err, out)
		}
	})
	if partitions {
		// A kernel without the partition table's parser (as some VM
		// kernels are built) scans nothing; partx adds what it reads.
		run(t, "partx", "--update", dev)
	}
	return dev
}

// pattern returns n bytes that are not an image: what a disk held before.
func pattern(n int) []byte {
	return bytes.Repeat([]byte("old disk "), n/9+1)[:n]
}

// readDevice returns the first n bytes of the device at path.
func readDevice(t *testing.T, path string, n int) []byte {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, n)
	if _, err := io.ReadFull(f, buf); err != nil {
		t.Fatalf("reading %s: %v", path, err)
	}
	return buf
}

// TestInstallToBlockDevice installs to a block device directly and through
// a symlink such as /dev/disk/by-id/... : no allowance needed, the image
// lands byte-identical and the rest of the device is left alone.
func TestInstallToBlockDevice(t *testing.T) {
	img, sum := testImage(t)
	srv := newServer(t, serveImage(img))
	const devSize = 4 << 20
	for _, via := range []string{"device", "symlink"} {
		t.Run(via, func(t *testing.T) {
			dev := loopDevice(t, pattern(devSize), false)
			target := dev
			if via == "symlink" {
				target = filepath.Join(t.TempDir(), "virtio-shepherd-test")
				if err := os.Symlink(dev, target); err != nil {
					t.Fatal(err)
				}
			}
			report := Install(t.Context(), newConfig(t), request(srv.URL, sum, target))
			assertSuccess(t, report, 7)
			got := readDevice(t, dev, devSize)
			if !bytes.Equal(got[:len(img)], img) {
				t.Fatal("the device does not hold the image")
			}
			if !bytes.Equal(got[len(img):], pattern(devSize)[len(img):]) {
				t.Error("the device was written beyond the image")
			}
		})
	}
}

// TestInstallReleasesDevice checks that an installation, successful or
// not, lets go of the block device it claimed: the next installation (a
// retry, another image) or mkfs must be able to claim it.
func TestInstallReleasesDevice(t *testing.T) {
	img, sum := testImage(t)
	srv := newServer(t, serveImage(img))
	dev := loopDevice(t, pattern(4<<20), false)
	for _, tt := range []struct {
		name, sum string
		success   bool
	}{
		{"failed", strings.Repeat("0", 64), false},
		{"succeeded", sum, true},
	} {
		report := Install(t.Context(), newConfig(t), request(srv.URL, tt.sum, dev))
		if got := report.GetSuccess() != nil; got != tt.success {
			t.Fatalf("installation that should have %s: %v", tt.name, report)
		}
		f, err := os.OpenFile(dev, os.O_RDWR|syscall.O_EXCL, 0)
		if err != nil {
			t.Fatalf("after an installation that %s, claiming %s: %v", tt.name, dev, err)
		}
		f.Close()
	}
}

// TestInstallRefusesBlockDeviceInUse holds the device exclusively, as
// mkfs, LVM or a RAID would: the installation is refused before the
// download and the device is untouched.
func TestInstallRefusesBlockDeviceInUse(t *testing.T) {
	img, sum := testImage(t)
	dev := loopDevice(t, pattern(4<<20), false)
	holder, err := os.OpenFile(dev, os.O_RDONLY|syscall.O_EXCL, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()

	assertRefused(t, img, sum, dev, nil, "in use", "device or resource busy")
	if !bytes.Equal(readDevice(t, dev, 4<<20), pattern(4<<20)) {
		t.Error("the device in use was written")
	}
}

// mbr returns a disk image of size bytes with an MBR partition table
// holding one Linux partition from 1 MiB to the end.
func mbr(size int) []byte {
	disk := pattern(size)
	clear(disk[:512])
	entry := disk[446:462]
	entry[4] = 0x83 // Linux
	const sector, first = 512, 2048
	binary.LittleEndian.PutUint32(entry[8:], first)
	binary.LittleEndian.PutUint32(entry[12:], uint32(size/sector-first))
	disk[510], disk[511] = 0x55, 0xaa
	return disk
}

// TestInstallRefusesMountedDisk mounts a file system on the first
// partition of a disk: neither the partition nor the whole disk may be
// written, and the error says where it is mounted.
func TestInstallRefusesMountedDisk(t *testing.T) {
	img, sum := testImage(t)
	const devSize = 16 << 20
	disk := loopDevice(t, mbr(devSize), true)
	part := disk + "p1"
	if _, err := os.Stat(part); err != nil {
		t.Fatalf("the partition of %s: %v", disk, err)
	}
	run(t, "mkfs.ext4", "-q", "-F", part)
	mnt := t.TempDir()
	run(t, "mount", "-t", "ext4", part, mnt)
	t.Cleanup(func() { // before the loop device is detached
		if out, err := exec.Command("umount", mnt).CombinedOutput(); err != nil {
			t.Errorf("unmounting %s: %v\n%s", mnt, err, out)
		}
	})
	before := readDevice(t, disk, devSize)

	for _, tt := range []struct{ target, want string }{
		{disk, "its partition " + filepath.Base(part) + " is mounted at " + mnt},
		{part, "it is in use: mounted at " + mnt},
	} {
		assertRefused(t, img, sum, tt.target, nil, tt.want, "does not overwrite a mounted disk")
	}
	if !bytes.Equal(readDevice(t, disk, devSize), before) {
		t.Error("the mounted disk was written")
	}
}

// TestInstallRefusesImageLargerThanDevice checks that an image that does
// not fit is refused before the first byte is written, instead of leaving
// the disk half overwritten.
func TestInstallRefusesImageLargerThanDevice(t *testing.T) {
	img, sum := testImage(t)
	srv := newServer(t, serveImage(img))
	const devSize = 1 << 20
	dev := loopDevice(t, pattern(devSize), false)

	report := Install(t.Context(), newConfig(t), request(srv.URL, sum, dev))
	assertError(t, report, 7, "larger than target "+dev, "(1048576 bytes)", "nothing was written")
	if !bytes.Equal(readDevice(t, dev, devSize), pattern(devSize)) {
		t.Error("the device was written")
	}
}

// TestInstallImageFillingDevice checks that an image of exactly the
// device's size is written whole: only a larger one is refused.
func TestInstallImageFillingDevice(t *testing.T) {
	const devSize = 1 << 20
	img := make([]byte, devSize)
	_, _ = rand.Read(img) // never fails
	digest := sha256.Sum256(img)
	srv := newServer(t, serveImage(img))
	dev := loopDevice(t, pattern(devSize), false)

	report := Install(t.Context(), newConfig(t), request(srv.URL, hex.EncodeToString(digest[:]), dev))
	assertSuccess(t, report, 7)
	if !bytes.Equal(readDevice(t, dev, devSize), img) {
		t.Error("the device does not hold the image")
	}
}

// TestInstallRefusesEmptyDevice: a block device of size 0 can hold no
// image; it is refused before the download.
func TestInstallRefusesEmptyDevice(t *testing.T) {
	img, sum := testImage(t)
	assertRefused(t, img, sum, attachLoop(t, nil, false), nil, "the device has no space (size 0)")
}

// TestInstallToReadOnlyDevice: a device that refuses writes (here attached
// read-only) fails the installation with the write's error, naming the
// device, and keeps what it held.
func TestInstallToReadOnlyDevice(t *testing.T) {
	img, sum := testImage(t)
	srv := newServer(t, serveImage(img))
	const devSize = 4 << 20
	dev := attachLoop(t, pattern(devSize), false, "--read-only")

	report := Install(t.Context(), newConfig(t), request(srv.URL, sum, dev))
	assertError(t, report, 7, "writing image to "+dev)
	if !bytes.Equal(readDevice(t, dev, devSize), pattern(devSize)) {
		t.Error("the read-only device was written")
	}
}

// TestCheckTargetRefusesRootDisk checks the real disk of the running
// system's root file system (as this test sees it), and only checks it:
// checkTarget reads the mount table and never opens a mounted device.
func TestCheckTargetRefusesRootDisk(t *testing.T) {
	var st syscall.Stat_t
	if err := syscall.Stat("/", &st); err != nil {
		t.Fatal(err)
	}
	uevent, err := os.ReadFile("/sys/dev/block/" + deviceNumber(st.Dev) + "/uevent")
	if err != nil {
		t.Fatalf("the root file system is not on a block device this test can name (%v); the test needs a machine or VM whose / is on a disk", err)
	}
	var root string
	for line := range strings.Lines(string(uevent)) {
		if name, ok := strings.CutPrefix(strings.TrimSpace(line), "DEVNAME="); ok {
			root = "/dev/" + name
		}
	}
	link := filepath.Join(t.TempDir(), "root-disk")
	if err := os.Symlink(root, link); err != nil {
		t.Fatal(err)
	}
	for _, target := range []string{root, link} {
		tgt, err := checkTarget(target, nil)
		if err == nil {
			tgt.close()
			t.Fatalf("checkTarget(%s) accepted the disk of the root file system", target)
		}
		if want := "mounted at / (the running system's root file system)"; !strings.Contains(err.Error(), want) {
			t.Errorf("checkTarget(%s) = %v, want it to mention %q", target, err, want)
		}
	}
}

func TestParseMountInfo(t *testing.T) {
	table := "26 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n" +
		"41 26 259:0 / /mnt/with\\040space\\134x rw - ext4 /dev/loop0p1 rw\n" +
		"short line\n" +
		"43 26 0:41 /\n" + // no fifth field: no mount point
		"44 26 0:42 / /five-fields\n" + // all it takes
		"42 26 0:40 / /proc rw - proc proc rw"
	want := []mount{{"254:0", "/"}, {"259:0", `/mnt/with space\x`}, {"0:42", "/five-fields"}, {"0:40", "/proc"}}
	got := parseMountInfo([]byte(table))
	if len(got) != len(want) {
		t.Fatalf("parseMountInfo() = %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("mount %d = %v, want %v", i, got[i], want[i])
		}
	}
	desc := describeMounts(got, map[string]string{"254:0": "", "259:0": "partition vda1"})
	if want := "mounted at / (the running system's root file system); its partition vda1 is mounted at /mnt/with space\\x"; desc != want {
		t.Errorf("describeMounts() = %q, want %q", desc, want)
	}
}

// TestUnescapeOctal checks the kernel's escapes of a mount point, also
// at its very end, and that a backslash without three octal digits after
// it (which the kernel does not write) is kept as it is.
func TestUnescapeOctal(t *testing.T) {
	for _, tt := range []struct{ in, want string }{
		{`/mnt/plain`, "/mnt/plain"},
		{`/mnt/a\040b`, "/mnt/a b"},
		{`/mnt/trailing\040`, "/mnt/trailing "},
		{`/mnt/tab\011and\012newline`, "/mnt/tab\tand\nnewline"},
		{`/mnt/short\04`, `/mnt/short\04`},
		{`/mnt/lone\`, `/mnt/lone\`},
		{`/mnt/not-octal\089`, `/mnt/not-octal\089`},
	} {
		if got := unescapeOctal(tt.in); got != tt.want {
			t.Errorf("unescapeOctal(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

func TestDeviceNumber(t *testing.T) {
	for _, tt := range []struct {
		rdev uint64
		want string
	}{
		{0xfe00, "254:0"},
		{0x10300, "259:0"},
		{0x11032c, "259:300"},             // minor above 255
		{0x0000_1000_0000_0801, "4104:1"}, // major above 4095
	} {
		if got := deviceNumber(tt.rdev); got != tt.want {
			t.Errorf("deviceNumber(%#x) = %s, want %s", tt.rdev, got, tt.want)
		}
	}
}
