// Package hwreport gathers a machine's hardware report from /proc and /sys
// (SPEC §4.4).
//
// The agent sends the report with its first heartbeat. Gathering never
// fails: whatever cannot be read becomes a warning in the report, and the
// parts that could be read are still reported.
package hwreport

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"unicode/utf8"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
)

// Upper bounds on what is read from one file, so that a strange file cannot
// exhaust the agent's memory. proc/cpuinfo takes about 1.2 KiB per logical
// CPU on x86, so 4 MiB covers some 3000 CPUs; sysfs attributes are at most
// a page.
const (
	maxCPUInfoSize = 4 << 20
	maxMemInfoSize = 64 << 10
	maxAttrSize    = 4 << 10
)

// Paths read, relative to the root passed to Gather.
const (
	cpuInfoPath   = "proc/cpuinfo"
	memInfoPath   = "proc/meminfo"
	cpuOnlinePath = "sys/devices/system/cpu/online"
	netClassPath  = "sys/class/net"
	blockPath     = "sys/block"
	dmiPath       = "sys/class/dmi/id"
	firmwarePath  = "sys/firmware"
)

// errTooLarge is returned (wrapped) by readFile when a file holds more than
// the limit; the data returned with it is the first limit bytes.
var errTooLarge = errors.New("file too large")

// Gather reads the hardware report from the filesystem rooted at root ("/"
// on a real machine; a fixture tree in tests). A part that cannot be read
// becomes a warning in the report, never an error: Gather always returns a
// report.
func Gather(root string) *agentv1.HardwareReport {
	g := &gatherer{root: root}
	r := &agentv1.HardwareReport{}
	r.Cpu = g.cpu()
	r.MemoryBytes = g.memory()
	r.NetworkInterfaces = g.networkInterfaces()
	r.BlockDevices = g.blockDevices()
	r.Dmi = g.dmi()
	r.FirmwareMode = g.firmwareMode()
	r.Warnings = g.warnings
	return r
}

// gatherer holds the state of one Gather call.
type gatherer struct {
	root     string
	warnings []string
}

// warn records a warning, made valid UTF-8 so that the report can be
// marshalled whatever the file names are.
func (g *gatherer) warn(format string, args ...any) {
	g.warnings = append(g.warnings, validUTF8(fmt.Sprintf(format, args...)))
}

// full turns a slash-separated path relative to the root into a path of the
// operating system.
func (g *gatherer) full(rel string) string {
	return filepath.Join(g.root, filepath.FromSlash(rel))
}

// readFile reads at most limit bytes of the file at rel. The error says
// what was read (rel, not the full path) and why it failed. If the file
// holds more than limit bytes, the error wraps errTooLarge and the first
// limit bytes are returned with it. Anything but a regular file (which
// procfs and sysfs attributes are) is refused without opening it, so a FIFO
// or device cannot block or flood the agent.
func (g *gatherer) readFile(rel string, limit int) ([]byte, error) {
	name := g.full(rel)
	fi, err := os.Stat(name)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			if lfi, lerr := os.Lstat(name); lerr == nil && lfi.Mode()&fs.ModeSymlink != 0 {
				return nil, fmt.Errorf("reading %s: dangling symbolic link", rel)
			}
		}
		return nil, fmt.Errorf("reading %s: %w", rel, cause(err))
	}
	switch {
	case fi.IsDir():
		return nil, fmt.Errorf("reading %s: %w", rel, syscall.EISDIR)
	case !fi.Mode().IsRegular():
		return nil, fmt.Errorf("reading %s: not a regular file (%v)", rel, fi.Mode().Type())
	}
	f, err := os.Open(name)
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", rel, cause(err))
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, int64(limit)+1))
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", rel, cause(err))
	}
	if len(data) > limit {
		return data[:limit], fmt.Errorf("reading %s: longer than %d bytes: %w", rel, limit, errTooLarge)
	}
	return data, nil
}

// attr reads the sysfs attribute at rel and returns its value without
// surrounding white space. ok is false if the attribute could not be read:
// a missing attribute is normal (optional attributes are absent on many
// devices) and is not reported; any other failure becomes a warning.
func (g *gatherer) attr(rel string) (value string, ok bool) {
	data, err := g.readFile(rel, maxAttrSize)
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			g.warn("%v", err)
		}
		return "", false
	}
	return validUTF8(strings.TrimSpace(string(data))), true
}

// linkBase returns the last element of the target of the symbolic link at
// rel, such as the driver name of a device/driver link. A missing link is
// not reported; any other failure becomes a warning.
func (g *gatherer) linkBase(rel string) string {
	target, err := os.Readlink(g.full(rel))
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			g.warn("reading link %s: %v", rel, cause(err))
		}
		return ""
	}
	return validUTF8(filepath.Base(target))
}

// exists reports whether rel exists (following symbolic links). A missing
// path is not reported; any other failure becomes a warning and counts as
// missing.
func (g *gatherer) exists(rel string) bool {
	_, err := os.Stat(g.full(rel))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		g.warn("checking %s: %v", rel, cause(err))
	}
	return err == nil
}

// list returns the sorted names in the directory rel. If the directory
// cannot be read, that is a warning (the whole section is missing).
func (g *gatherer) list(rel string) []string {
	entries, err := os.ReadDir(g.full(rel))
	if err != nil {
		g.warn("listing %s: %v", rel, cause(err))
		return nil
	}
	names := make([]string, 0, len(entries))
	for _, e := range entries {
		names = append(names, e.Name())
	}
	slices.Sort(names)
	return names
}

// isDir reports whether rel is a directory (following symbolic links),
// without warnings: it tells entries of a class directory from stray files
// such as sys/class/net/bonding_masters.
func (g *gatherer) isDir(rel string) bool {
	fi, err := os.Stat(g.full(rel))
	return err == nil && fi.IsDir()
}

// cpu reads the processor from proc/cpuinfo and cross-checks the number of
// logical CPUs with sys/devices/system/cpu/online.
func (g *gatherer) cpu() *agentv1.CPU {
	var c *agentv1.CPU
	data, err := g.readFile(cpuInfoPath, maxCPUInfoSize)
	if err != nil {
		g.warn("%v", err)
	}
	if err == nil || errors.Is(err, errTooLarge) {
		info := parseCPUInfo(data)
		c = &agentv1.CPU{Model: info.model, Sockets: info.sockets, Cores: info.cores, Threads: info.threads}
	}

	text, ok := g.attr(cpuOnlinePath)
	if !ok {
		return c
	}
	online, err := parseCPUList(text)
	if err != nil {
		g.warn("parsing %s: %v", cpuOnlinePath, err)
		return c
	}
	switch {
	case c == nil:
		// The warning about proc/cpuinfo was given above; the thread
		// count is still worth having.
		if online > 0 {
			c = &agentv1.CPU{Threads: online}
		}
	case c.Threads == 0 && online > 0:
		g.warn("%s lists no processors; using the %d online CPUs of %s", cpuInfoPath, online, cpuOnlinePath)
		c.Threads = online
	case c.Threads != online:
		g.warn("%s lists %d processors but %s lists %d online CPUs", cpuInfoPath, c.Threads, cpuOnlinePath, online)
	}
	return c
}

// memory reads the total memory from proc/meminfo.
func (g *gatherer) memory() uint64 {
	data, err := g.readFile(memInfoPath, maxMemInfoSize)
	if err != nil {
		g.warn("%v", err)
		if !errors.Is(err, errTooLarge) {
			return 0
		}
	}
	n, err := parseMemTotal(data)
	if err != nil {
		g.warn("parsing %s: %v", memInfoPath, err)
		return 0
	}
	return n
}

// networkInterfaces reads the physical network interfaces from
// sys/class/net. Interfaces without a device (loopback, bridges, veth,
// tunnels) are virtual and left out.
func (g *gatherer) networkInterfaces() []*agentv1.NetworkInterface {
	var nics []*agentv1.NetworkInterface
	for _, name := range g.list(netClassPath) {
		dir := path.Join(netClassPath, name)
		if name == "lo" || !g.isDir(dir) || !g.exists(path.Join(dir, "device")) {
			continue
		}
		nic := &agentv1.NetworkInterface{Name: validUTF8(name)}
		nic.MacAddress, _ = g.attr(path.Join(dir, "address"))
		nic.Driver = g.linkBase(path.Join(dir, "device", "driver"))
		nic.LinkUp = g.linkUp(dir)
		nic.SpeedMbps = g.speed(dir)
		nics = append(nics, nic)
	}
	slices.SortFunc(nics, func(a, b *agentv1.NetworkInterface) int { return strings.Compare(a.Name, b.Name) })
	return nics
}

// linkUp reports whether the interface in dir has its link up: its
// operstate is "up", or (for drivers that leave operstate "unknown") it has
// a carrier. Reading carrier fails with EINVAL while the interface is down.
func (g *gatherer) linkUp(dir string) bool {
	if state, _ := g.attr(path.Join(dir, "operstate")); state == "up" {
		return true
	}
	rel := path.Join(dir, "carrier")
	data, err := g.readFile(rel, maxAttrSize)
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, syscall.EINVAL) {
			g.warn("%v", err)
		}
		return false
	}
	return strings.TrimSpace(string(data)) == "1"
}

// speed returns the link speed of the interface in dir in Mbit/s, 0 if it
// is unknown: reading speed fails with EINVAL while the link is down, and
// some drivers report -1.
func (g *gatherer) speed(dir string) uint32 {
	rel := path.Join(dir, "speed")
	data, err := g.readFile(rel, maxAttrSize)
	if err != nil {
		if !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, syscall.EINVAL) {
			g.warn("%v", err)
		}
		return 0
	}
	text := strings.TrimSpace(string(data))
	n, err := strconv.ParseInt(text, 10, 64)
	switch {
	case err != nil:
		g.warn("parsing %s: %q is not a number", rel, validUTF8(truncate(text, 64)))
		return 0
	case n <= 0:
		return 0
	case n > 1<<32-1:
		g.warn("parsing %s: speed %d Mbit/s out of range", rel, n)
		return 0
	}
	return uint32(n)
}

// blockDevices reads the disks from sys/block, leaving out virtual devices.
func (g *gatherer) blockDevices() []*agentv1.BlockDevice {
	var disks []*agentv1.BlockDevice
	for _, name := range g.list(blockPath) {
		dir := path.Join(blockPath, name)
		if isVirtualBlock(name) || !g.isDir(dir) {
			continue
		}
		d := &agentv1.BlockDevice{Name: validUTF8(name)}
		d.SizeBytes = g.blockSize(dir)
		d.Model, _ = g.attr(path.Join(dir, "device", "model"))
		// SCSI and NVMe devices have the serial number on the device,
		// virtio disks (and NVMe namespaces) on the block device.
		d.Serial, _ = g.attr(path.Join(dir, "device", "serial"))
		if d.Serial == "" {
			d.Serial, _ = g.attr(path.Join(dir, "serial"))
		}
		rot, _ := g.attr(path.Join(dir, "queue", "rotational"))
		d.Rotational = rot == "1"
		d.Virtio = strings.HasPrefix(name, "vd") ||
			strings.Contains(g.linkBase(path.Join(dir, "device", "driver")), "virtio")
		disks = append(disks, d)
	}
	slices.SortFunc(disks, func(a, b *agentv1.BlockDevice) int { return strings.Compare(a.Name, b.Name) })
	return disks
}

// isVirtualBlock reports whether the block device name is one of the kinds
// that are not disks of the machine: loop devices, RAM disks, device-mapper
// and md arrays, optical and floppy drives, network block devices.
func isVirtualBlock(name string) bool {
	for _, p := range [...]string{"loop", "ram", "zram", "dm-", "md", "sr", "fd", "nbd"} {
		if strings.HasPrefix(name, p) {
			return true
		}
	}
	return false
}

// blockSize returns the size in bytes of the block device in dir, whose
// size attribute counts 512-byte sectors.
func (g *gatherer) blockSize(dir string) uint64 {
	rel := path.Join(dir, "size")
	text, ok := g.attr(rel)
	if !ok {
		return 0
	}
	sectors, err := strconv.ParseUint(text, 10, 64)
	if err != nil {
		g.warn("parsing %s: %q is not a number of sectors", rel, truncate(text, 64))
		return 0
	}
	if sectors > (1<<64-1)/512 {
		g.warn("parsing %s: %d sectors out of range", rel, sectors)
		return 0
	}
	return sectors * 512
}

// dmi reads the system identification from sys/class/dmi/id. Machines
// without DMI (most ARM boards) have no such directory: that is a warning
// and the report has no DMI.
func (g *gatherer) dmi() *agentv1.DMI {
	if _, err := os.Stat(g.full(dmiPath)); err != nil {
		g.warn("reading %s: %v", dmiPath, cause(err))
		return nil
	}
	d := &agentv1.DMI{}
	d.SystemVendor, _ = g.attr(path.Join(dmiPath, "sys_vendor"))
	d.ProductName, _ = g.attr(path.Join(dmiPath, "product_name"))
	// Readable by root only: without root this is a permission warning.
	d.ProductSerial, _ = g.attr(path.Join(dmiPath, "product_serial"))
	return d
}

// firmwareMode tells EFI from BIOS boots by sys/firmware/efi. If
// sys/firmware itself is missing, sysfs is not mounted (or the root is
// wrong) and the mode is reported as unknown rather than guessed.
func (g *gatherer) firmwareMode() agentv1.FirmwareMode {
	efi := path.Join(firmwarePath, "efi")
	_, err := os.Stat(g.full(efi))
	switch {
	case err == nil:
		return agentv1.FirmwareMode_FIRMWARE_MODE_EFI
	case !errors.Is(err, fs.ErrNotExist):
		g.warn("checking %s: %v", efi, cause(err))
		return agentv1.FirmwareMode_FIRMWARE_MODE_UNSPECIFIED
	}
	if _, err := os.Stat(g.full(firmwarePath)); err != nil {
		g.warn("checking %s: %v; firmware mode unknown", firmwarePath, cause(err))
		return agentv1.FirmwareMode_FIRMWARE_MODE_UNSPECIFIED
	}
	return agentv1.FirmwareMode_FIRMWARE_MODE_BIOS
}

// cause strips the operation and the full path from an error of the os
// package, so that a warning names the path relative to the root once.
func cause(err error) error {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err
	}
	var le *os.LinkError
	if errors.As(err, &le) {
		return le.Err
	}
	var se *os.SyscallError
	if errors.As(err, &se) {
		return se.Err
	}
	return err
}

// validUTF8 replaces invalid UTF-8 in s: protobuf strings must be valid
// UTF-8, or the report cannot be marshalled.
func validUTF8(s string) string {
	return strings.ToValidUTF8(s, "\uFFFD")
}

// truncate shortens s to at most n bytes without splitting a UTF-8
// sequence.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}
