package server

import (
	"math"
	"net"
	"syscall"
	"testing"
	"time"
)

// The listener keeps no state for an address once its connections have
// closed, so a scan from many addresses cannot grow its memory.
func TestLimitListenerForgetsAddresses(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := newLimitListener(ln, 100, 2, func(string) {}, func(error) {})
	defer l.Close()
	var conns []net.Conn
	for _, ip := range []string{"127.0.0.2", "127.0.0.2", "127.0.0.3"} {
		d := &net.Dialer{Timeout: 10 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
		client, err := d.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer client.Close()
		c, err := l.Accept()
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	for _, c := range conns {
		c.Close()
		c.Close() // a second Close gives nothing back twice
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.total != 0 || len(l.perIP) != 0 {
		t.Errorf("after every connection closed: %d counted, per address %v; want none", l.total, l.perIP)
	}
}

// The default connection limit leaves 1,024 descriptors of the open-file
// limit for everything else, and is at least 64.
func TestMaxConnectionsFor(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		nofile uint64
		want   int
	}{
		{1 << 20, 1<<20 - 1024},
		{20000, 18976},
		{1100, 76},
		{1088, 64},
		{1087, 64},
		{256, 64},
		{0, 64},
		{math.MaxInt32, math.MaxInt32 - 1024},
		{math.MaxInt32 + 1, 1 << 20},
		{math.MaxUint64, 1 << 20}, // RLIM_INFINITY
	} {
		if got := maxConnectionsFor(tc.nofile); got != tc.want {
			t.Errorf("maxConnectionsFor(%d) = %d, want %d", tc.nofile, got, tc.want)
		}
	}
}

// defaultMaxConnections follows the process's open-file limit as it is
// when the server starts. The test lowers the soft limit of the whole
// process for a moment, so it does not run in parallel with others.
func TestDefaultMaxConnectionsFollowsTheOpenFileLimit(t *testing.T) {
	var orig syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &orig); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &orig); err != nil {
			t.Errorf("restoring the open-file limit: %v", err)
		}
	})
	for _, tc := range []struct {
		soft uint64
		want int
	}{{1100, 76}, {1500, 476}} {
		lim := orig
		lim.Cur = tc.soft
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
			t.Fatal(err)
		}
		if got := defaultMaxConnections(); got != tc.want {
			t.Errorf("with an open-file limit of %d: default MaxConnections %d, want %d", tc.soft, got, tc.want)
		}
	}
}
