package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// clockTicks is USER_HZ, the unit of CPU times in /proc/<pid>/stat; it is
// 100 on every Linux architecture Go supports.
const clockTicks = 100

// processCPU returns the CPU time (user and system) this process has used.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// pidCPU returns the CPU time of process pid and its parent pid.
func pidCPU(pid int) (cpu time.Duration, ppid int, err error) {
	cpu, _, ppid, err = pidCPUWithChildren(pid)
	return cpu, ppid, err
}

// pidCPUWithChildren returns the CPU time of process pid, that of its
// children that exited and were waited for, and its parent pid.
func pidCPUWithChildren(pid int) (cpu, children time.Duration, ppid int, err error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, 0, 0, err
	}
	// Fields after "(comm)": state ppid ... utime(14) stime(15), 1-based.
	s := string(data)
	fields := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(fields) < 15 {
		return 0, 0, 0, fmt.Errorf("short /proc/%d/stat", pid)
	}
	ppid, _ = strconv.Atoi(fields[1])
	ticks := func(i int) int64 { n, _ := strconv.ParseInt(fields[i], 10, 64); return n }
	toDuration := func(n int64) time.Duration { return time.Duration(n) * time.Second / clockTicks }
	return toDuration(ticks(11) + ticks(12)), toDuration(ticks(13) + ticks(14)), ppid, nil
}

// postgresCPU returns the CPU time used so far by the postmaster of dataDir
// and its children (backends, WAL writer, checkpointer), live or exited:
// the postmaster reaps every child it forks, so the kernel adds an exited
// backend's time to the postmaster's children time, and a figure that
// measures across connections that closed (pgbench's) still counts them.
func postgresCPU(dataDir string) time.Duration {
	data, err := os.ReadFile(filepath.Join(dataDir, "postmaster.pid"))
	if err != nil {
		return 0
	}
	pm, err := strconv.Atoi(strings.TrimSpace(strings.SplitN(string(data), "\n", 2)[0]))
	if err != nil {
		return 0
	}
	own, exited, _, _ := pidCPUWithChildren(pm)
	total := own + exited
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if cpu, ppid, err := pidCPU(pid); err == nil && ppid == pm {
			total += cpu
		}
	}
	return total
}
