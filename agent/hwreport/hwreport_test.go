package hwreport

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
)

// tree builds a fixture filesystem under a temporary root.
type tree struct {
	t    *testing.T
	root string
}

func newTree(t *testing.T) *tree {
	t.Helper()
	return &tree{t: t, root: t.TempDir()}
}

// path returns the full path of the slash-separated rel.
func (tr *tree) path(rel string) string {
	return filepath.Join(tr.root, filepath.FromSlash(rel))
}

// dir creates the directory rel and its parents.
func (tr *tree) dir(rel string) {
	tr.t.Helper()
	if err := os.MkdirAll(tr.path(rel), 0o755); err != nil {
		tr.t.Fatal(err)
	}
}

// file writes content to rel, creating the parent directories.
func (tr *tree) file(rel, content string) {
	tr.t.Helper()
	tr.dir(filepath.Dir(filepath.FromSlash(rel)))
	if err := os.WriteFile(tr.path(rel), []byte(content), 0o644); err != nil {
		tr.t.Fatal(err)
	}
}

// link makes rel a symbolic link to target (relative, as in sysfs),
// creating the parent directories of rel.
func (tr *tree) link(rel, target string) {
	tr.t.Helper()
	tr.dir(filepath.Dir(filepath.FromSlash(rel)))
	if err := os.Symlink(target, tr.path(rel)); err != nil {
		tr.t.Fatal(err)
	}
}

const xeonModel = "Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz"

// x86CPUInfo returns a proc/cpuinfo of sockets × cores × threads logical
// CPUs, numbered as Linux does (all first threads, then all second ones).
func x86CPUInfo(sockets, cores, threads int) string {
	var b strings.Builder
	n := 0
	for th := range threads {
		for s := range sockets {
			for c := range cores {
				fmt.Fprintf(&b, "processor\t: %d\n", n)
				fmt.Fprintf(&b, "vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 106\n")
				fmt.Fprintf(&b, "model name\t: %s\n", xeonModel)
				fmt.Fprintf(&b, "cpu MHz\t\t: 2000.000\ncache size\t: 49152 KB\n")
				fmt.Fprintf(&b, "physical id\t: %d\nsiblings\t: %d\n", s, cores*threads)
				fmt.Fprintf(&b, "core id\t\t: %d\ncpu cores\t: %d\n", c, cores)
				fmt.Fprintf(&b, "apicid\t\t: %d\n", s*64+c*2+th)
				fmt.Fprintf(&b, "flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep ht\n")
				fmt.Fprintf(&b, "bogomips\t: 4000.00\npower management:\n\n")
				n++
			}
		}
	}
	return b.String()
}

const memInfo = `MemTotal:       65843392 kB
MemFree:        60123456 kB
MemAvailable:   62000000 kB
Buffers:          123456 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
`

// goodTree returns the fixture of a complete two-socket server.
func goodTree(t *testing.T) *tree {
	tr := newTree(t)
	tr.file("proc/cpuinfo", x86CPUInfo(2, 2, 2))
	tr.file("proc/meminfo", memInfo)
	tr.file("sys/devices/system/cpu/online", "0-7\n")

	// eno1: laid out as in sysfs, the class entry a link into the device
	// tree, device a link to the PCI function, driver a link to the bus.
	pci := "sys/devices/pci0000:00/0000:00:02.0/0000:03:00.0"
	tr.file(pci+"/net/eno1/address", "3c:ec:ef:00:00:01\n")
	tr.file(pci+"/net/eno1/operstate", "up\n")
	tr.file(pci+"/net/eno1/carrier", "1\n")
	tr.file(pci+"/net/eno1/speed", "10000\n")
	tr.link(pci+"/net/eno1/device", "../../../0000:03:00.0")
	tr.link(pci+"/driver", "../../../../bus/pci/drivers/ixgbe")
	tr.dir("sys/bus/pci/drivers/ixgbe")
	tr.link("sys/class/net/eno1", "../../devices/pci0000:00/0000:00:02.0/0000:03:00.0/net/eno1")

	// eno2: down, speed -1, device without a driver link.
	tr.file("sys/class/net/eno2/address", "3c:ec:ef:00:00:02\n")
	tr.file("sys/class/net/eno2/operstate", "down\n")
	tr.file("sys/class/net/eno2/speed", "-1\n")
	tr.dir("sys/class/net/eno2/device")

	// enp5s0: operstate unknown but carrier, no speed attribute.
	tr.file("sys/class/net/enp5s0/address", "52:54:00:12:34:56\n")
	tr.file("sys/class/net/enp5s0/operstate", "unknown\n")
	tr.file("sys/class/net/enp5s0/carrier", "1\n")
	tr.dir("sys/class/net/enp5s0/device")

	// Virtual interfaces and a stray file: all left out.
	for _, name := range []string{"lo", "veth1a2b3c", "docker0"} {
		tr.file("sys/class/net/"+name+"/address", "02:42:ac:11:00:02\n")
		tr.file("sys/class/net/"+name+"/operstate", "up\n")
	}
	tr.file("sys/class/net/bonding_masters", "\n")

	// sda: a SATA disk.
	tr.file("sys/block/sda/size", "3907029168\n")
	tr.file("sys/block/sda/device/model", "ST2000DM008-2FR1\x20\x20\x20\x20\n")
	tr.file("sys/block/sda/device/serial", "ZFL0ABCD\n")
	tr.file("sys/block/sda/queue/rotational", "1\n")
	tr.link("sys/block/sda/device/driver", "../../../../bus/scsi/drivers/sd")

	// vda: virtio, serial at the top level, no model.
	tr.file("sys/block/vda/size", "41943040\n")
	tr.file("sys/block/vda/serial", "vd-serial-1\n")
	tr.file("sys/block/vda/queue/rotational", "0\n")
	tr.link("sys/block/vda/device/driver", "../../../../bus/virtio/drivers/virtio_blk")

	// sdb: virtio by its driver, not its name.
	tr.file("sys/block/sdb/size", "2048\n")
	tr.file("sys/block/sdb/queue/rotational", "0\n")
	tr.link("sys/block/sdb/device/driver", "../../../../bus/virtio/drivers/virtio_blk")

	// nvme0n1: NVMe, model and serial on the controller.
	tr.file("sys/block/nvme0n1/size", "1953525168\n")
	tr.file("sys/block/nvme0n1/device/model", "Samsung SSD 980 PRO 1TB                 \n")
	tr.file("sys/block/nvme0n1/device/serial", "S5GXNF0R123456      \n")
	tr.file("sys/block/nvme0n1/queue/rotational", "0\n")

	// Virtual block devices: left out.
	for _, name := range []string{"loop0", "ram0", "zram0", "dm-0", "md127", "sr0", "fd0", "nbd0"} {
		tr.file("sys/block/"+name+"/size", "1024\n")
		tr.file("sys/block/"+name+"/queue/rotational", "0\n")
	}

	tr.file("sys/class/dmi/id/sys_vendor", "Supermicro\n")
	tr.file("sys/class/dmi/id/product_name", "SYS-1029P-WTR\n")
	tr.file("sys/class/dmi/id/product_serial", "S123456X9\n")
	tr.dir("sys/firmware/efi/efivars")
	return tr
}

// goodReport is the report of goodTree.
func goodReport() *agentv1.HardwareReport {
	return &agentv1.HardwareReport{
		Cpu:         &agentv1.CPU{Model: xeonModel, Sockets: 2, Cores: 4, Threads: 8},
		MemoryBytes: 65843392 * 1024,
		NetworkInterfaces: []*agentv1.NetworkInterface{
			{Name: "eno1", MacAddress: "3c:ec:ef:00:00:01", Driver: "ixgbe", LinkUp: true, SpeedMbps: 10000},
			{Name: "eno2", MacAddress: "3c:ec:ef:00:00:02"},
			{Name: "enp5s0", MacAddress: "52:54:00:12:34:56", LinkUp: true},
		},
		BlockDevices: []*agentv1.BlockDevice{
			{Name: "nvme0n1", SizeBytes: 1953525168 * 512, Model: "Samsung SSD 980 PRO 1TB", Serial: "S5GXNF0R123456"},
			{Name: "sda", SizeBytes: 3907029168 * 512, Model: "ST2000DM008-2FR1", Serial: "ZFL0ABCD", Rotational: true},
			{Name: "sdb", SizeBytes: 2048 * 512, Virtio: true},
			{Name: "vda", SizeBytes: 41943040 * 512, Serial: "vd-serial-1", Virtio: true},
		},
		Dmi:          &agentv1.DMI{SystemVendor: "Supermicro", ProductName: "SYS-1029P-WTR", ProductSerial: "S123456X9"},
		FirmwareMode: agentv1.FirmwareMode_FIRMWARE_MODE_EFI,
	}
}

func TestGatherFixture(t *testing.T) {
	tr := goodTree(t)
	got := Gather(tr.root)
	if diff := cmp.Diff(goodReport(), got, protocmp.Transform()); diff != "" {
		t.Errorf("Gather report mismatch (-want +got):\n%s", diff)
	}
	if _, err := proto.Marshal(got); err != nil {
		t.Errorf("marshalling the report: %v", err)
	}
}

func TestGatherBIOS(t *testing.T) {
	tr := goodTree(t)
	if err := os.RemoveAll(tr.path("sys/firmware/efi")); err != nil {
		t.Fatal(err)
	}
	got := Gather(tr.root)
	if got.FirmwareMode != agentv1.FirmwareMode_FIRMWARE_MODE_BIOS {
		t.Errorf("FirmwareMode = %v, want BIOS", got.FirmwareMode)
	}
	if len(got.Warnings) != 0 {
		t.Errorf("warnings: %q", got.Warnings)
	}
}

// TestGatherBroken breaks parts of the fixture in ways that also stop root
// (a directory or a dangling link where a file should be, garbage in a
// file) and checks that each broken part is a warning naming its path and
// that the rest is still reported.
func TestGatherBroken(t *testing.T) {
	tr := goodTree(t)
	replaceWithDir := func(rel string) {
		t.Helper()
		if err := os.Remove(tr.path(rel)); err != nil {
			t.Fatal(err)
		}
		tr.dir(rel)
	}
	replaceWithDir("proc/meminfo")
	tr.file("sys/devices/system/cpu/online", "0-7,zz\n")
	pci := "sys/devices/pci0000:00/0000:00:02.0/0000:03:00.0"
	replaceWithDir(pci + "/net/eno1/address")
	if err := os.Remove(tr.path(pci + "/driver")); err != nil {
		t.Fatal(err)
	}
	tr.file(pci+"/driver", "not a link\n")
	tr.file("sys/class/net/eno2/speed", "fast\n")
	if err := os.Remove(tr.path("sys/block/sda/size")); err != nil {
		t.Fatal(err)
	}
	tr.link("sys/block/sda/size", "nonexistent")
	replaceWithDir("sys/block/sda/queue/rotational")
	tr.file("sys/block/vda/size", "12e9\n")
	replaceWithDir("sys/class/dmi/id/product_serial")
	tr.file("sys/class/dmi/id/product_name", strings.Repeat("x", 5000))

	got := Gather(tr.root)

	want := goodReport()
	want.MemoryBytes = 0
	want.NetworkInterfaces[0].MacAddress = ""
	want.NetworkInterfaces[0].Driver = ""
	want.BlockDevices[1].SizeBytes = 0
	want.BlockDevices[1].Rotational = false
	want.BlockDevices[3].SizeBytes = 0
	want.Dmi.ProductSerial = ""
	want.Dmi.ProductName = ""
	want.Warnings = []string{
		`parsing sys/devices/system/cpu/online: "zz" is not a CPU number`,
		"reading proc/meminfo: is a directory",
		"reading sys/class/net/eno1/address: is a directory",
		"reading link sys/class/net/eno1/device/driver: invalid argument",
		`parsing sys/class/net/eno2/speed: "fast" is not a number`,
		"reading sys/block/sda/size: dangling symbolic link",
		"reading sys/block/sda/queue/rotational: is a directory",
		`parsing sys/block/vda/size: "12e9" is not a number of sectors`,
		"reading sys/class/dmi/id/product_name: longer than 4096 bytes: file too large",
		"reading sys/class/dmi/id/product_serial: is a directory",
	}
	if diff := cmp.Diff(want, got, protocmp.Transform()); diff != "" {
		t.Errorf("Gather report mismatch (-want +got):\n%s", diff)
	}
}

// TestGatherEmptyRoot checks a root without proc and sys.
func TestGatherEmptyRoot(t *testing.T) {
	for _, root := range []string{t.TempDir(), filepath.Join(t.TempDir(), "missing")} {
		got := Gather(root)
		for _, want := range []string{"proc/cpuinfo", "proc/meminfo", "sys/class/net", "sys/block", "sys/class/dmi/id", "sys/firmware"} {
			if !anyContains(got.Warnings, want) {
				t.Errorf("Gather(%q): no warning mentions %s; warnings: %q", root, want, got.Warnings)
			}
		}
		if got.Cpu != nil || got.MemoryBytes != 0 || len(got.NetworkInterfaces) != 0 || len(got.BlockDevices) != 0 || got.Dmi != nil {
			t.Errorf("Gather(%q) found hardware: %v", root, got)
		}
		if got.FirmwareMode != agentv1.FirmwareMode_FIRMWARE_MODE_UNSPECIFIED {
			t.Errorf("Gather(%q) FirmwareMode = %v, want UNSPECIFIED", root, got.FirmwareMode)
		}
	}
}

// TestGatherCPUFallbacks checks how proc/cpuinfo and the online CPU list
// make up for each other.
func TestGatherCPUFallbacks(t *testing.T) {
	t.Run("disagree", func(t *testing.T) {
		tr := newTree(t)
		tr.file("proc/cpuinfo", x86CPUInfo(1, 2, 2))
		tr.file("sys/devices/system/cpu/online", "0-5\n")
		got := Gather(tr.root)
		if got.GetCpu().GetThreads() != 4 {
			t.Errorf("threads = %d, want 4 (from cpuinfo)", got.GetCpu().GetThreads())
		}
		if !anyContains(got.Warnings, "proc/cpuinfo lists 4 processors but sys/devices/system/cpu/online lists 6 online CPUs") {
			t.Errorf("no warning about the disagreement: %q", got.Warnings)
		}
	})
	t.Run("no cpuinfo", func(t *testing.T) {
		tr := newTree(t)
		tr.file("sys/devices/system/cpu/online", "0-5\n")
		got := Gather(tr.root)
		if diff := cmp.Diff(&agentv1.CPU{Threads: 6}, got.Cpu, protocmp.Transform()); diff != "" {
			t.Errorf("CPU mismatch (-want +got):\n%s", diff)
		}
	})
	t.Run("no processor lines", func(t *testing.T) {
		tr := newTree(t)
		tr.file("proc/cpuinfo", "vendor_id       : IBM/S390\n# processors    : 2\nprocessor 0: version = FF\nprocessor 1: version = FF\n")
		tr.file("sys/devices/system/cpu/online", "0-1\n")
		got := Gather(tr.root)
		if diff := cmp.Diff(&agentv1.CPU{Threads: 2}, got.Cpu, protocmp.Transform()); diff != "" {
			t.Errorf("CPU mismatch (-want +got):\n%s", diff)
		}
		if !anyContains(got.Warnings, "proc/cpuinfo lists no processors") {
			t.Errorf("no warning about the missing processors: %q", got.Warnings)
		}
	})
	t.Run("cpuinfo too large", func(t *testing.T) {
		tr := newTree(t)
		tr.file("proc/cpuinfo", x86CPUInfo(1, 1, 1)+strings.Repeat("x", maxCPUInfoSize))
		got := Gather(tr.root)
		if diff := cmp.Diff(&agentv1.CPU{Model: xeonModel, Sockets: 1, Cores: 1, Threads: 1}, got.Cpu, protocmp.Transform()); diff != "" {
			t.Errorf("CPU mismatch (-want +got):\n%s", diff)
		}
		if !anyContains(got.Warnings, "reading proc/cpuinfo: longer than") {
			t.Errorf("no warning about the size: %q", got.Warnings)
		}
	})
}

func anyContains(list []string, sub string) bool {
	for _, s := range list {
		if strings.Contains(s, sub) {
			return true
		}
	}
	return false
}

func TestParseCPUInfo(t *testing.T) {
	tests := []struct {
		name string
		in   string
		want cpuInfo
	}{
		{"empty", "", cpuInfo{}},
		{"x86 2x2x2", x86CPUInfo(2, 2, 2), cpuInfo{model: xeonModel, sockets: 2, cores: 4, threads: 8}},
		{"x86 1x4x1", x86CPUInfo(1, 4, 1), cpuInfo{model: xeonModel, sockets: 1, cores: 4, threads: 4}},
		{
			"arm64",
			"processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\n\n" +
				"processor\t: 1\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\n\n",
			cpuInfo{sockets: 1, cores: 2, threads: 2},
		},
		{
			"old arm",
			"Processor\t: ARMv7 Processor rev 10 (v7l)\nprocessor\t: 0\nBogoMIPS\t: 1996.80\n\n" +
				"processor\t: 1\nBogoMIPS\t: 1996.80\n\nHardware\t: Freescale i.MX 6Quad\n",
			cpuInfo{model: "ARMv7 Processor rev 10 (v7l)", sockets: 1, cores: 2, threads: 2},
		},
		{
			"powerpc",
			"processor\t: 0\ncpu\t\t: POWER9 (architected), altivec supported\nclock\t\t: 2200.000000MHz\n\n" +
				"processor\t: 1\ncpu\t\t: POWER9 (architected), altivec supported\n\n",
			cpuInfo{model: "POWER9 (architected), altivec supported", sockets: 1, cores: 2, threads: 2},
		},
		{
			"mips",
			"system type\t\t: MT7621\nprocessor\t\t: 0\ncpu model\t\t: MIPS 1004Kc V2.15\n\n",
			cpuInfo{model: "MIPS 1004Kc V2.15", sockets: 1, cores: 1, threads: 1},
		},
		{
			"model name preferred",
			"processor : 0\ncpu : generic\nmodel name : Specific\n",
			cpuInfo{model: "Specific", sockets: 1, cores: 1, threads: 1},
		},
		{
			"cpu cores without core id",
			strings.Repeat("processor : x\nphysical id : 0\ncpu cores : 2\n\n", 4),
			cpuInfo{sockets: 1, cores: 2, threads: 4},
		},
		{
			"cpu cores larger than threads",
			"processor : 0\ncpu cores : 64\n",
			cpuInfo{sockets: 1, cores: 1, threads: 1},
		},
		{
			"ids before any processor are ignored",
			"physical id : 7\ncore id : 3\n\nprocessor : 0\n",
			cpuInfo{sockets: 1, cores: 1, threads: 1},
		},
		{
			"invalid UTF-8 model",
			"processor : 0\nmodel name : Bad \xff\xfe CPU\n",
			cpuInfo{model: "Bad \uFFFD CPU", sockets: 1, cores: 1, threads: 1},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := parseCPUInfo([]byte(tt.in))
			if got != tt.want {
				t.Errorf("parseCPUInfo = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestParseCPUList(t *testing.T) {
	tests := []struct {
		in      string
		want    uint32
		wantErr bool
	}{
		{"", 0, false},
		{"\n", 0, false},
		{"0", 1, false},
		{"0-3\n", 4, false},
		{"0-3,6,8-11", 9, false},
		{"1,3,5", 3, false},
		{"0-1048576", 1048577, false},
		{"3-1", 0, true},
		{"0-3,2", 0, true},
		{"0-3,3", 0, true},
		{"a", 0, true},
		{"-1", 0, true},
		{"+1", 0, true},
		{"0,,1", 0, true},
		{"1-", 0, true},
		{"0-1-2", 0, true},
		{"1048577", 0, true},
		{"99999999999999999999", 0, true},
	}
	for _, tt := range tests {
		got, err := parseCPUList(tt.in)
		if (err != nil) != tt.wantErr || got != tt.want {
			t.Errorf("parseCPUList(%q) = %d, %v; want %d, error %t", tt.in, got, err, tt.want, tt.wantErr)
		}
	}
}

func TestParseMemTotal(t *testing.T) {
	tests := []struct {
		in      string
		want    uint64
		wantErr bool
	}{
		{memInfo, 65843392 * 1024, false},
		{"MemTotal: 0 kB\n", 0, false},
		{"", 0, true},
		{"MemFree: 1 kB\n", 0, true},
		{"MemTotal: 1 MB\n", 0, true},
		{"MemTotal: 1\n", 0, true},
		{"MemTotal: -1 kB\n", 0, true},
		{"MemTotal: 18014398509481984 kB\n", 0, true},
	}
	for _, tt := range tests {
		got, err := parseMemTotal([]byte(tt.in))
		if (err != nil) != tt.wantErr || got != tt.want {
			t.Errorf("parseMemTotal(%q) = %d, %v; want %d, error %t", tt.in, got, err, tt.want, tt.wantErr)
		}
	}
}

func TestTotalsOf(t *testing.T) {
	tests := []struct {
		name string
		in   *agentv1.HardwareReport
		want Totals
	}{
		{"nil", nil, Totals{}},
		{"empty", &agentv1.HardwareReport{}, Totals{}},
		{
			"fixture", goodReport(),
			Totals{CPUThreads: 8, MemoryBytes: 65843392 * 1024, DiskCount: 4, DiskBytes: (1953525168 + 3907029168 + 2048 + 41943040) * 512},
		},
		{
			"clamped",
			&agentv1.HardwareReport{
				Cpu:          &agentv1.CPU{Threads: math.MaxUint32},
				MemoryBytes:  math.MaxUint64,
				BlockDevices: []*agentv1.BlockDevice{{SizeBytes: math.MaxUint64}, nil, {SizeBytes: 1}},
			},
			Totals{CPUThreads: math.MaxInt32, MemoryBytes: math.MaxInt64, DiskCount: 2, DiskBytes: math.MaxInt64},
		},
	}
	for _, tt := range tests {
		if got := TotalsOf(tt.in); got != tt.want {
			t.Errorf("%s: TotalsOf = %+v, want %+v", tt.name, got, tt.want)
		}
	}
}

// countProcessorLines counts the lines whose key is "processor",
// independently of parseCPUInfo.
func countProcessorLines(data string) int {
	n := 0
	for _, line := range strings.Split(data, "\n") {
		if key, _, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(key) == "processor" {
			n++
		}
	}
	return n
}

func FuzzParseCPUInfo(f *testing.F) {
	f.Add([]byte(x86CPUInfo(2, 2, 2)))
	f.Add([]byte(x86CPUInfo(1, 3, 1)))
	f.Add([]byte("processor : 0\nBogoMIPS : 50.00\n\nprocessor : 1\n"))
	f.Add([]byte("Processor : ARMv7\nprocessor : 0\n"))
	f.Add([]byte("processor:0\nphysical id:1\ncore id:2\ncpu cores:9999999999999\n"))
	f.Add([]byte("physical id : 0\ncore id : 0\n"))
	f.Add([]byte("processor : 0\nmodel name : \xff\xfe\n"))
	f.Add([]byte(""))
	f.Fuzz(func(t *testing.T, data []byte) {
		got := parseCPUInfo(data)
		if want := countProcessorLines(string(data)); int(got.threads) != want {
			t.Errorf("threads = %d, but the input has %d processor lines", got.threads, want)
		}
		if got.threads == 0 {
			if got.sockets != 0 || got.cores != 0 {
				t.Errorf("no threads but %d sockets, %d cores", got.sockets, got.cores)
			}
		} else if got.sockets < 1 || got.sockets > got.cores || got.cores > got.threads {
			t.Errorf("not 1 <= sockets <= cores <= threads: %+v", got)
		}
		if !utf8.ValidString(got.model) || len(got.model) > maxModelLen {
			t.Errorf("bad model %q", got.model)
		}
		if got.model != strings.TrimSpace(got.model) {
			t.Errorf("model %q not trimmed", got.model)
		}
	})
}

func FuzzParseCPUList(f *testing.F) {
	for _, s := range []string{"", "0", "0-3,6,8-11\n", "3-1", "0-3,2", "1,,2", "-", "0-1048576", "07-08"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		n, err := parseCPUList(s)
		if err != nil {
			if n != 0 {
				t.Errorf("parseCPUList(%q) = %d with error %v", s, n, err)
			}
			return
		}
		s = strings.TrimSpace(s)
		if s == "" {
			if n != 0 {
				t.Errorf("parseCPUList(%q) = %d, want 0", s, n)
			}
			return
		}
		// Every part names at least one CPU, and no CPU is above the
		// end of the last part.
		parts := strings.Split(s, ",")
		last := parts[len(parts)-1]
		if i := strings.LastIndex(last, "-"); i >= 0 {
			last = last[i+1:]
		}
		hi, convErr := strconv.Atoi(last)
		if convErr != nil {
			t.Fatalf("parseCPUList(%q) accepted a list ending in %q", s, last)
		}
		if int(n) < len(parts) || int(n) > hi+1 {
			t.Errorf("parseCPUList(%q) = %d, want between %d and %d", s, n, len(parts), hi+1)
		}
	})
}

func FuzzParseMemTotal(f *testing.F) {
	f.Add([]byte(memInfo))
	f.Add([]byte("MemTotal: 18014398509481983 kB\n"))
	f.Add([]byte("MemTotal:\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		n, err := parseMemTotal(data)
		if err != nil && n != 0 {
			t.Errorf("parseMemTotal = %d with error %v", n, err)
		}
		if n%1024 != 0 {
			t.Errorf("parseMemTotal = %d, not whole kB", n)
		}
	})
}
