package hwreport

import (
	"os"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
)

// onlineCPUs counts the CPUs in a list like "0-3,6,8-11", independently of
// parseCPUList.
func onlineCPUs(t *testing.T, list string) int {
	t.Helper()
	n := 0
	for part := range strings.SplitSeq(strings.TrimSpace(list), ",") {
		lo, hi, _ := strings.Cut(part, "-")
		if hi == "" {
			hi = lo
		}
		a, err1 := strconv.Atoi(lo)
		b, err2 := strconv.Atoi(hi)
		if err1 != nil || err2 != nil || b < a {
			t.Fatalf("cannot parse online CPU list %q", list)
		}
		n += b - a + 1
	}
	return n
}

// TestGatherRealMachine checks the report of the machine running the test
// against the kernel's own figures.
func TestGatherRealMachine(t *testing.T) {
	online, err := os.ReadFile("/sys/devices/system/cpu/online")
	if err != nil {
		t.Fatalf("reading the online CPUs from sysfs: %v", err)
	}
	wantThreads := onlineCPUs(t, string(online))
	var si syscall.Sysinfo_t
	if err := syscall.Sysinfo(&si); err != nil {
		t.Fatal(err)
	}
	wantMem := uint64(si.Totalram) * uint64(si.Unit)

	r := Gather("/")
	t.Logf("report: %v", r)
	for _, w := range r.Warnings {
		if strings.Contains(w, "cpuinfo") || strings.Contains(w, "meminfo") || strings.Contains(w, "cpu/online") {
			t.Errorf("warning about the CPU or memory: %s", w)
		}
	}
	if got := r.GetCpu().GetThreads(); int(got) != wantThreads {
		t.Errorf("CPU threads = %d, want %d (from /sys/devices/system/cpu/online)", got, wantThreads)
	}
	if c := r.GetCpu(); c.GetSockets() < 1 || c.GetCores() < c.GetSockets() || c.GetCores() > c.GetThreads() {
		t.Errorf("implausible CPU topology: %v", c)
	}
	// arm64 kernels name no model in /proc/cpuinfo.
	if runtime.GOARCH == "amd64" || runtime.GOARCH == "386" {
		if r.GetCpu().GetModel() == "" {
			t.Error("no CPU model")
		}
	}
	got := r.GetMemoryBytes()
	if diff := max(got, wantMem) - min(got, wantMem); float64(diff) > 0.001*float64(wantMem) {
		t.Errorf("memory = %d bytes, want %d (sysinfo) within 0.1%%", got, wantMem)
	}
	if _, err := proto.Marshal(r); err != nil {
		t.Errorf("marshalling the report: %v", err)
	}
}

// TestGatherSpecialFiles checks that a FIFO does not block Gather and that
// file names that are not UTF-8 do not break the report.
func TestGatherSpecialFiles(t *testing.T) {
	tr := goodTree(t)
	if err := os.Remove(tr.path("sys/class/dmi/id/product_name")); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(tr.path("sys/class/dmi/id/product_name"), 0o644); err != nil {
		t.Fatal(err)
	}
	tr.file("sys/class/net/eth\xff/address", "00:11:22:33:44:55\n")
	tr.dir("sys/class/net/eth\xff/device")
	tr.file("sys/block/sd\xfe/size", "8\n")
	tr.file("sys/block/sd\xfe/device/model", "\xff\n")
	tr.file("sys/block/sd\xfe/device/serial", "\xc3\n")

	done := make(chan *agentv1.HardwareReport, 1)
	go func() { done <- Gather(tr.root) }()
	var r *agentv1.HardwareReport
	select {
	case r = <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("Gather blocked on a FIFO")
	}
	if !anyContains(r.Warnings, "reading sys/class/dmi/id/product_name: not a regular file") {
		t.Errorf("no warning about the FIFO: %q", r.Warnings)
	}
	if r.GetDmi().GetSystemVendor() != "Supermicro" {
		t.Errorf("DMI = %v, want the vendor still read", r.GetDmi())
	}
	if _, err := proto.Marshal(r); err != nil {
		t.Errorf("marshalling the report: %v", err)
	}
	if n := len(r.NetworkInterfaces); n != 4 {
		t.Errorf("%d network interfaces, want 4: %v", n, r.NetworkInterfaces)
	}
}
