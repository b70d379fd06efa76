package sshtest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/shepherd/shepherd/internal/atomicfile"
)

// envMachine is the environment variable that marks the commands of a
// Machine's sessions and what they start (sshd's SetEnv sets it). sshd's own
// processes cannot carry it: sshd writes its process title over its
// environment, so they are found by their sockets instead.
const envMachine = "SSHTEST_MACHINE"

// PowerRequestTimeout bounds how long a power command from PowerCommands
// waits for the test process to carry it out before it fails. It is far
// more than a power change takes (killing processes, starting sshd); only
// a test process that is gone or stuck reaches it.
const PowerRequestTimeout = 60 * time.Second

// Machine is an OpenSSH Host standing in for a whole machine, whose power a
// test can cut and restore: through PowerOff and PowerOn in process, through
// a BMC simulator's hook running in another process (PowerCommands, for
// ipmisim.Config's PowerOn and PowerOff), or through an in-process BMC's
// hook (RedfishPowerHook, for fakeredfish.Config.OnPowerChange).
//
// A Machine's processes are its sshd processes (the listener and one or two
// per connection, found by their sockets on the machine's address), every
// command its sessions run, including daemons that detached themselves
// (setsid, double fork) as a machine's agent does (found by a mark in their
// environment, which what they start inherits), and every descendant of
// those. PowerOff kills them all, so the machine's SSH connections are
// reset, new ones are refused and its "agent" is gone. A process that both
// leaves the sessions' process tree and clears its environment escapes;
// nothing a test has reason to start does that.
//
// PowerOn starts sshd again on the same address with the same host keys, as
// a machine that boots again: a client that pinned the host key verifies it
// as before. Nothing else comes back by itself.
//
// Host's Restart, ChangeHostKey and SetHostKeys must not be used while the
// Machine is off, nor concurrently with a power change. At the end of the
// test every process of the machine is killed.
type Machine struct {
	*Host

	tag    string // value of envMachine in this machine's processes
	ctlDir string // where power requests of PowerCommands arrive

	mu sync.Mutex // serialises power changes; guards on
	on bool
}

// StartMachine starts one Machine, powered on, for cfg (whose Kind must be
// OpenSSH or empty: a Machine needs the real sshd, whose sessions are
// processes of their own) and stops it when the test ends. A missing sshd
// fails the test.
func StartMachine(t testing.TB, cfg Config) *Machine {
	t.Helper()
	if cfg.Kind == Gliderlabs {
		t.Fatalf("sshtest: a Machine runs OpenSSH's sshd, not %s: its sessions must be processes that power off can kill", Gliderlabs)
	}
	if _, err := FindSSHD(); err != nil {
		t.Fatalf("sshtest: a Machine needs OpenSSH's server: %v; run scripts/require-sshd", err)
	}
	cfg.Kind = OpenSSH
	h := Start(t, 1, cfg)[0]
	var buf [12]byte
	if _, err := rand.Read(buf[:]); err != nil {
		t.Fatalf("sshtest: %v", err)
	}
	m := &Machine{Host: h, tag: hex.EncodeToString(buf[:]), ctlDir: filepath.Join(h.Dir, "power"), on: true}
	if err := os.Mkdir(m.ctlDir, 0o700); err != nil {
		t.Fatalf("sshtest: %v", err)
	}
	// Start has no place for the mark, so the server is started again with
	// it, before anything runs on it.
	h.sshd.tag = m.tag
	if err := h.restart(t.Context()); err != nil {
		t.Fatalf("sshtest: restarting %s as a machine: %v", h, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { m.serveRequests(ctx, t) })
	// Registered after Start's cleanup, so it runs before the server is
	// stopped: no request is served then, and no process of the machine
	// outlives the test.
	t.Cleanup(func() {
		cancel()
		wg.Wait()
		if err := m.PowerOff(context.Background()); err != nil {
			t.Errorf("sshtest: powering %s off at the end of the test: %v", m, err)
		}
	})
	return m
}

// Powered reports whether the machine is on.
func (m *Machine) Powered() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.on
}

// PowerOff cuts the machine's power: it kills every process of the machine
// at once (SIGKILL, sshd included) and waits until none is left. A machine
// that is off already stays off.
func (m *Machine) PowerOff(ctx context.Context) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.on {
		return nil
	}
	if err := m.killAll(ctx); err != nil {
		return fmt.Errorf("sshtest: powering off %s: %w", m, err)
	}
	// sshd is dead already; halt reaps it and forgets it, so PowerOn can
	// start another and the end of the test does not count its death as
	// a crash.
	if err := m.sshd.halt(); err != nil {
		return fmt.Errorf("sshtest: powering off %s: %w", m, err)
	}
	m.on = false
	return nil
}

// PowerOn starts the machine's sshd again on its address with its host
// keys, and returns once it completes an SSH handshake. A machine that is
// on already is left alone.
func (m *Machine) PowerOn(ctx context.Context) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.on {
		return nil
	}
	if err := m.sshd.start(ctx); err != nil {
		return fmt.Errorf("sshtest: powering on %s: %w", m, err)
	}
	m.on = true
	return nil
}

// killAll sends SIGKILL to every process of the machine until none is left.
// Processes started between two scans carry the mark too, so a later scan
// finds them; it takes two scans in a row that find none, pollInterval
// apart, because a scan can miss a process in the midst of exec (see
// Processes).
func (m *Machine) killAll(ctx context.Context) error {
	return killAll(ctx, m.Processes, func(pid int) { _ = syscall.Kill(pid, syscall.SIGKILL) })
}

// minKillScans is how many scans killAll makes before it gives up, however
// long they take: on a loaded machine one scan of /proc has taken more than
// half of stopTimeout.
const minKillScans = 5

// killAll kills what scan finds until two scans in a row find nothing. It
// gives up, naming what is left, once stopTimeout has passed and it has
// scanned at least minKillScans times, or when ctx ends.
func killAll(ctx context.Context, scan func() []int, kill func(pid int)) error {
	deadline := time.Now().Add(stopTimeout)
	tick := time.NewTicker(pollInterval)
	defer tick.Stop()
	for scans, empty := 1, 0; empty < 2; scans++ {
		pids := scan()
		if len(pids) == 0 {
			empty++
		} else {
			empty = 0
		}
		for _, pid := range pids {
			kill(pid)
		}
		if len(pids) > 0 && scans >= minKillScans && !time.Now().Before(deadline) {
			return fmt.Errorf("processes %v still run after SIGKILL (%d scans in %s)", pids, scans, stopTimeout)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("processes %v may still run: %w", pids, context.Cause(ctx))
		case <-tick.C:
		}
	}
	return nil
}

// Processes returns the pids of the machine's live processes (zombies do
// not count): those holding a TCP socket on its address, those carrying its
// mark, and their descendants. It is empty while the machine is off.
//
// A process that is in the midst of exec has no environment for a moment,
// so one that left the sessions' process tree (a daemon) can be missed by
// one call: poll with a deadline for a process just started.
func (m *Machine) Processes() []int {
	procs := scanProcs()
	sockets := socketsOn(m.Addr)
	mark := []byte("\x00" + envMachine + "=" + m.tag + "\x00")
	children := map[int][]int{}
	var todo []int
	for pid, p := range procs {
		children[p.ppid] = append(children[p.ppid], pid)
		// environ is NUL-separated, without a NUL before the first entry.
		if bytes.Contains(append([]byte{0}, p.environ...), mark) || holdsSocket(pid, sockets) {
			todo = append(todo, pid)
		}
	}
	seen := map[int]bool{}
	for len(todo) > 0 {
		pid := todo[len(todo)-1]
		todo = todo[:len(todo)-1]
		if seen[pid] {
			continue
		}
		seen[pid] = true
		todo = append(todo, children[pid]...)
	}
	out := make([]int, 0, len(seen))
	for pid := range seen {
		out = append(out, pid)
	}
	slices.Sort(out)
	return out
}

// Runs reports whether pid is a live process of the machine (with
// Processes' caveat about a process just started).
func (m *Machine) Runs(pid int) bool { return slices.Contains(m.Processes(), pid) }

// proc is what Processes needs to know of one process.
type proc struct {
	ppid    int
	environ []byte // NUL-separated, as in /proc/PID/environ
}

// scanProcs reads every live, non-zombie process but this one from /proc.
func scanProcs() map[int]proc {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil // not Linux: nothing to find
	}
	self := os.Getpid()
	out := map[int]proc{}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self {
			continue
		}
		stat, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue // exited
		}
		// "PID (COMM) STATE PPID ...": COMM may hold spaces and parentheses.
		i := bytes.LastIndexByte(stat, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(stat[i+1:]))
		if len(f) < 2 || f[0] == "Z" || f[0] == "X" {
			continue
		}
		ppid, err := strconv.Atoi(f[1])
		if err != nil {
			continue
		}
		environ, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "environ")) // empty if it exited meanwhile
		out[pid] = proc{ppid: ppid, environ: environ}
	}
	return out
}

// socketsOn returns the inodes of the IPv4 TCP sockets whose local address
// is addr (a listener on it, and the server's end of its connections), from
// /proc/net/tcp. Its lines read "SL: LOCAL REMOTE STATE ... UID TIMEOUT
// INODE ...", addresses as hex IP (the 4 bytes of the address read as one
// native-endian word) and hex port.
func socketsOn(addr netip.AddrPort) map[string]bool {
	data, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		return nil
	}
	ip := addr.Addr().As4()
	want := fmt.Sprintf("%08X:%04X", binary.NativeEndian.Uint32(ip[:]), addr.Port())
	out := map[string]bool{}
	for line := range strings.Lines(string(data)) {
		f := strings.Fields(line)
		if len(f) < 10 || f[1] != want || f[9] == "0" { // inode 0: no process holds it (TIME_WAIT)
			continue
		}
		out[f[9]] = true
	}
	return out
}

// holdsSocket reports whether pid has one of the socket inodes open.
func holdsSocket(pid int, inodes map[string]bool) bool {
	if len(inodes) == 0 {
		return false
	}
	dir := filepath.Join("/proc", strconv.Itoa(pid), "fd")
	fds, err := os.ReadDir(dir)
	if err != nil {
		return false
	}
	for _, fd := range fds {
		link, err := os.Readlink(filepath.Join(dir, fd.Name()))
		if err != nil {
			continue
		}
		if inode, ok := strings.CutPrefix(link, "socket:["); ok && inodes[strings.TrimSuffix(inode, "]")] {
			return true
		}
	}
	return false
}

// PowerCommands returns the commands that power the machine on and off from
// another process, for ipmisim.Config's PowerOn and PowerOff: ipmi_sim runs
// its chassis hook as a process of its own, which cannot reach this
// process's sshd bookkeeping. Each command hands its request to the test
// process through a file in the machine's directory, waits (polling, up to
// PowerRequestTimeout) until the test process has carried it out with
// PowerOn or PowerOff, and exits 0, or 1 with the error on stderr. So the
// power command returns when the machine really is off, or on again.
func (m *Machine) PowerCommands() (on, off []string) {
	cmd := func(op string) []string {
		return []string{"/bin/sh", "-c", powerRequestScript, "sshtest-power", m.ctlDir, op, strconv.Itoa(int(PowerRequestTimeout / time.Second))}
	}
	return cmd("on"), cmd("off")
}

// powerRequestScript is run as `sh -c SCRIPT sshtest-power DIR OP LIMIT`.
// Its request file is named after its pid, unique among live processes, and
// written under a temporary name first, so the test process never reads it
// half written; the same holds for the result.
const powerRequestScript = `set -eu
dir=$1 op=$2 limit=$3 id=$$
printf '%s\n' "$op" >"$dir/.request.$id"
mv "$dir/.request.$id" "$dir/request.$id"
end=$(($(date +%s) + limit))
while [ ! -e "$dir/result.$id" ]; do
	if [ "$(date +%s)" -ge "$end" ]; then
		rm -f "$dir/request.$id"
		echo "sshtest power $op: the test process did not carry out the request within ${limit}s" >&2
		exit 1
	fi
	sleep 0.02
done
result=$(cat "$dir/result.$id")
rm -f "$dir/result.$id"
if [ "$result" != ok ]; then
	echo "sshtest power $op: $result" >&2
	exit 1
fi
`

// serveRequests carries out the requests of PowerCommands until ctx ends,
// polling the machine's request directory.
func (m *Machine) serveRequests(ctx context.Context, t testing.TB) {
	tick := time.NewTicker(pollInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		entries, err := os.ReadDir(m.ctlDir)
		if err != nil {
			t.Errorf("sshtest: reading power requests of %s: %v", m, err)
			return
		}
		for _, e := range entries {
			id, ok := strings.CutPrefix(e.Name(), "request.")
			if !ok {
				continue
			}
			m.serveRequest(ctx, t, id)
		}
	}
}

// serveRequest carries out request id and writes its result.
func (m *Machine) serveRequest(ctx context.Context, t testing.TB, id string) {
	path := filepath.Join(m.ctlDir, "request."+id)
	data, err := os.ReadFile(path)
	if err == nil {
		err = os.Remove(path)
	}
	if err == nil {
		switch op := strings.TrimSpace(string(data)); op {
		case "on":
			err = m.PowerOn(ctx)
		case "off":
			err = m.PowerOff(ctx)
		default:
			err = fmt.Errorf("sshtest: unknown power request %q", op)
		}
	}
	result := "ok"
	if err != nil {
		result = strings.ReplaceAll(err.Error(), "\n", " ")
	}
	if err := atomicfile.Write(filepath.Join(m.ctlDir, "result."+id), []byte(result+"\n"), 0o600); err != nil {
		t.Errorf("sshtest: answering power request %s of %s: %v", id, m, err)
	}
}

// RedfishPowerHook returns a function for fakeredfish.Config.OnPowerChange
// that powers the machine on when the Redfish PowerState becomes "On" and
// off when it becomes "Off" (the transitional PoweringOn and PoweringOff
// change nothing: the machine is off, or on, once the BMC says so). It runs
// in process and returns once the change is done; a failure fails the test.
func (m *Machine) RedfishPowerHook(t testing.TB) func(state string) {
	return func(state string) {
		var err error
		switch state {
		case "On":
			err = m.PowerOn(t.Context())
		case "Off":
			err = m.PowerOff(t.Context())
		}
		if err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("sshtest: Redfish power state %s: %v", state, err)
		}
	}
}
