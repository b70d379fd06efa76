package hwreport

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
)

// maxModelLen bounds the CPU model string taken from proc/cpuinfo.
const maxModelLen = 256

// maxCPUNumber bounds the CPU numbers accepted in a CPU list. Linux allows
// at most 8192 CPUs today; the margin keeps the count far from overflow.
const maxCPUNumber = 1 << 20

// cpuInfo is what parseCPUInfo finds in proc/cpuinfo.
type cpuInfo struct {
	model   string
	sockets uint32
	cores   uint32
	threads uint32
}

// modelKeys are the proc/cpuinfo keys that name the processor model, best
// first: x86 ("model name"), old ARM kernels ("Processor"), MIPS ("cpu
// model"), PowerPC and SPARC ("cpu"), RISC-V ("uarch"). Keys are case
// sensitive: "processor" (lower case) is the index of a logical CPU.
func modelKeys() []string {
	return []string{"model name", "Processor", "cpu model", "cpu", "uarch"}
}

// parseCPUInfo parses the contents of proc/cpuinfo. Every "processor" line
// starts the entry of one logical CPU (thread). Sockets are the distinct
// "physical id"s and cores the distinct ("physical id", "core id") pairs of
// the entries; without them a machine with threads has one socket, and
// "cpu cores" (per socket) or else the thread count gives the cores. The
// result is consistent whatever the input: with threads, 1 <= sockets <=
// cores <= threads; without, sockets and cores are 0.
func parseCPUInfo(data []byte) cpuInfo {
	type core struct{ physID, coreID string }
	var (
		models  = make(map[string]string)
		threads int
		sockets = make(map[string]struct{})
		cores   = make(map[core]struct{})
		// cpuCores is the first valid "cpu cores" of an entry.
		cpuCores int

		// The entry being read.
		inEntry          bool
		physID, coreID   string
		hasPhys, hasCore bool
	)
	endEntry := func() {
		if inEntry {
			if hasPhys {
				sockets[physID] = struct{}{}
			}
			if hasCore {
				cores[core{physID, coreID}] = struct{}{}
			}
		}
		inEntry, hasPhys, hasCore = false, false, false
		physID, coreID = "", ""
	}
	isModelKey := make(map[string]bool)
	for _, k := range modelKeys() {
		isModelKey[k] = true
	}

	for line := range bytes.Lines(data) {
		k, v, found := bytes.Cut(line, []byte(":"))
		if !found {
			if len(bytes.TrimSpace(line)) == 0 {
				endEntry()
			}
			continue
		}
		key := string(bytes.TrimSpace(k))
		value := bytes.TrimSpace(v)
		switch {
		case key == "processor":
			endEntry()
			inEntry = true
			threads++
		case key == "physical id" && inEntry:
			physID, hasPhys = string(value), true
		case key == "core id" && inEntry:
			coreID, hasCore = string(value), true
		case key == "cpu cores" && inEntry && cpuCores == 0:
			if n, err := strconv.Atoi(string(value)); err == nil && n > 0 {
				cpuCores = n
			}
		case isModelKey[key]:
			if _, seen := models[key]; !seen && len(value) > 0 {
				models[key] = strings.TrimSpace(truncate(validUTF8(string(value)), maxModelLen))
			}
		}
	}
	endEntry()

	var info cpuInfo
	for _, k := range modelKeys() {
		if m := models[k]; m != "" {
			info.model = m
			break
		}
	}
	if threads == 0 {
		return info
	}
	s := max(len(sockets), 1)
	c := len(cores)
	if c == 0 && cpuCores > 0 {
		c = min(cpuCores, threads) * s // min first: no overflow
	}
	if c == 0 {
		c = threads
	}
	c = min(max(c, s), threads)
	info.threads = clampUint32(threads)
	info.sockets = clampUint32(s)
	info.cores = clampUint32(c)
	return info
}

// clampUint32 converts n >= 0 to uint32, saturating.
func clampUint32(n int) uint32 {
	return uint32(min(uint64(n), math.MaxUint32))
}

// parseCPUList counts the CPUs in a Linux CPU list such as
// sys/devices/system/cpu/online: comma-separated numbers and ranges, e.g.
// "0-3,6,8-11" (9 CPUs). White space around the list is ignored and an
// empty list has no CPUs. The kernel writes ranges in ascending order
// without overlap; anything else is an error, so no CPU is counted twice.
func parseCPUList(s string) (uint32, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return 0, nil
	}
	var count uint32
	next := 0 // the lowest CPU number the next range may start at
	for part := range strings.SplitSeq(s, ",") {
		loText, hiText, isRange := strings.Cut(part, "-")
		lo, err := parseCPUNumber(loText)
		if err != nil {
			return 0, err
		}
		hi := lo
		if isRange {
			if hi, err = parseCPUNumber(hiText); err != nil {
				return 0, err
			}
			if hi < lo {
				return 0, fmt.Errorf("range %q is reversed", truncate(part, 32))
			}
		}
		if lo < next {
			return 0, fmt.Errorf("%q is not in ascending order", truncate(part, 32))
		}
		count += uint32(hi - lo + 1)
		next = hi + 1
	}
	return count, nil
}

// parseCPUNumber parses one CPU number of a CPU list.
func parseCPUNumber(s string) (int, error) {
	// Digits only (Atoi would accept a sign), and few enough of them that
	// Atoi cannot overflow.
	if s == "" || len(s) > 7 || strings.TrimLeft(s, "0123456789") != "" {
		return 0, fmt.Errorf("%q is not a CPU number", truncate(s, 32))
	}
	n, err := strconv.Atoi(s)
	if err != nil || n > maxCPUNumber {
		return 0, fmt.Errorf("CPU number %q out of range", s)
	}
	return n, nil
}

// parseMemTotal returns the MemTotal of proc/meminfo in bytes.
func parseMemTotal(data []byte) (uint64, error) {
	for line := range bytes.Lines(data) {
		rest, ok := bytes.CutPrefix(line, []byte("MemTotal:"))
		if !ok {
			continue
		}
		fields := strings.Fields(string(rest))
		if len(fields) != 2 || fields[1] != "kB" {
			return 0, fmt.Errorf("MemTotal line %q is not \"<number> kB\"", validUTF8(truncate(string(bytes.TrimSpace(line)), 64)))
		}
		kb, err := strconv.ParseUint(fields[0], 10, 64)
		if err != nil || kb > math.MaxUint64/1024 {
			return 0, fmt.Errorf("MemTotal %q kB is not a valid size", validUTF8(truncate(fields[0], 32)))
		}
		return kb * 1024, nil
	}
	return 0, errors.New("no MemTotal line")
}
