package hwreport

import (
	"math"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
)

// Totals are the values the BMDB extracts from a report for queries.
type Totals struct {
	// CPUThreads is the number of logical CPUs.
	CPUThreads int32
	// MemoryBytes is the total memory.
	MemoryBytes int64
	// DiskCount is the number of block devices; it never exceeds
	// math.MaxInt32, so it also fits a 32-bit column.
	DiskCount int64
	// DiskBytes is the summed size of the block devices.
	DiskBytes int64
}

// TotalsOf computes the Totals of a report. It accepts a nil report (all
// zero) and reports built by anyone, not only Gather: values too large for
// their field are clamped to its maximum.
func TotalsOf(r *agentv1.HardwareReport) Totals {
	t := Totals{
		CPUThreads:  int32(min(r.GetCpu().GetThreads(), math.MaxInt32)),
		MemoryBytes: int64(min(r.GetMemoryBytes(), math.MaxInt64)),
	}
	for _, d := range r.GetBlockDevices() {
		if d == nil {
			continue
		}
		if t.DiskCount < math.MaxInt32 {
			t.DiskCount++
		}
		size := int64(min(d.GetSizeBytes(), math.MaxInt64))
		if t.DiskBytes > math.MaxInt64-size {
			t.DiskBytes = math.MaxInt64
		} else {
			t.DiskBytes += size
		}
	}
	return t
}
