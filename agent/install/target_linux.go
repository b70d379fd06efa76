package install

import (
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"
	"syscall"
)

// exclusiveOpen is added to the flags that open a block device target. On
// Linux, O_EXCL without O_CREAT claims a block device: the open fails with
// EBUSY while the kernel has the device, or a partition of it, in use
// (mounted, active swap, part of LVM, RAID or device mapper, or opened
// exclusively by another program such as mkfs), and while the claim is
// held none of those can start. This covers what the mount table cannot
// show, such as a btrfs or LVM volume on the disk.
const exclusiveOpen = syscall.O_EXCL

// noFollow makes opening a file target fail if it is a symlink.
const noFollow = syscall.O_NOFOLLOW

// Where mountedAt reads the mount table and the block devices' partitions.
const (
	mountInfoPath = "/proc/self/mountinfo"
	sysDevBlock   = "/sys/dev/block"
)

// mountedAt says where the block device fi (from Stat), or a partition of
// it, is mounted according to the mount table, for the error of a target
// that must not be overwritten; "" if nowhere or if it cannot tell (the
// exclusive open guards those cases). It is only read, never opened: it
// works for devices this process may not even open, such as a container's
// root disk.
func mountedAt(fi fs.FileInfo) string {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return ""
	}
	table, err := os.ReadFile(mountInfoPath)
	if err != nil {
		return ""
	}
	return describeMounts(parseMountInfo(table), devicesOf(sysDevBlock, deviceNumber(uint64(st.Rdev))))
}

// deviceNumber formats a Linux dev_t as the "major:minor" of the mount
// table and sysfs (the kernel's split of the 64-bit number, as glibc's
// major() and minor() do it).
func deviceNumber(rdev uint64) string {
	major := (rdev>>32)&0xfffff000 | (rdev>>8)&0xfff
	minor := (rdev>>12)&0xffffff00 | rdev&0xff
	return fmt.Sprintf("%d:%d", major, minor)
}

// devicesOf returns the device number dev and those of its partitions,
// each mapped to how a message names it relative to the target: "" for the
// device itself, "partition NAME" for a partition. The partitions are the
// entries of sysfs's directory of the device that have a "partition" file.
func devicesOf(sysDevBlock, dev string) map[string]string {
	devs := map[string]string{dev: ""}
	dir := sysDevBlock + "/" + dev
	entries, err := os.ReadDir(dir)
	if err != nil {
		return devs
	}
	for _, e := range entries {
		if _, err := os.Stat(dir + "/" + e.Name() + "/partition"); err != nil {
			continue
		}
		if n, err := os.ReadFile(dir + "/" + e.Name() + "/dev"); err == nil {
			devs[strings.TrimSpace(string(n))] = "partition " + e.Name()
		}
	}
	return devs
}

// mount is one entry of the mount table.
type mount struct {
	dev   string // "major:minor" of the mounted file system's device
	point string // where it is mounted
}

// parseMountInfo parses /proc/self/mountinfo (proc(5)): the third field of
// each line is the device number, the fifth the mount point with space,
// tab, newline and backslash escaped in octal. Lines it cannot parse are
// skipped: the table is a hint for the error message, not the guard.
func parseMountInfo(table []byte) []mount {
	var mounts []mount
	for line := range strings.Lines(string(table)) {
		f := strings.Fields(line)
		if len(f) < 5 || !strings.Contains(f[2], ":") {
			continue
		}
		mounts = append(mounts, mount{dev: f[2], point: unescapeOctal(f[4])})
	}
	return mounts
}

// unescapeOctal undoes the kernel's \NNN escapes of a mount point.
func unescapeOctal(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// describeMounts says which of devs are mounted where, or "" if none is.
func describeMounts(mounts []mount, devs map[string]string) string {
	var found []string
	for _, m := range mounts {
		what, ok := devs[m.dev]
		if !ok {
			continue
		}
		msg := "mounted at " + m.point
		if what != "" {
			msg = "its " + what + " is " + msg
		}
		if m.point == "/" {
			msg += " (the running system's root file system)"
		}
		found = append(found, msg)
	}
	return strings.Join(found, "; ")
}
