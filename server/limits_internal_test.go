package server

import (
	"errors"
	"math"
	"net"
	"os"
	"syscall"
	"testing"
	"testing/synctest"
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

// failingListener fails its accepts with the errors in errs, then accepts
// one end of a pipe; it counts the accepts.
type failingListener struct {
	net.Listener // nil: only Accept, Close and Addr are called
	errs         []error
	accepts      int
	closed       chan struct{}
}

func (f *failingListener) Accept() (net.Conn, error) {
	f.accepts++
	select {
	case <-f.closed:
		return nil, net.ErrClosed
	default:
	}
	if len(f.errs) > 0 {
		err := f.errs[0]
		f.errs = f.errs[1:]
		return nil, err
	}
	c, _ := net.Pipe()
	return c, nil
}

func (f *failingListener) Close() error { close(f.closed); return nil }

func emfile() error {
	return &net.OpError{Op: "accept", Net: "tcp", Err: os.NewSyscallError("accept4", syscall.EMFILE)}
}

// An accept that fails for lack of descriptors is reported and retried
// after a pause of 5 ms doubling to 1 s, never returned; an accepted
// connection resets the pause; any other error is returned at once.
func TestLimitListenerWaitsOutDescriptorShortage(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		errs := []error{os.NewSyscallError("accept4", syscall.ENFILE)}
		for range 9 {
			errs = append(errs, emfile())
		}
		f := &failingListener{errs: errs, closed: make(chan struct{})}
		var reported int
		l := newLimitListener(f, 100, 100, func(string) { t.Error("refused") }, func(error) { reported++ })
		start := time.Now()
		c, err := l.Accept()
		if err != nil {
			t.Fatal(err)
		}
		c.Close()
		// 5+10+20+40+80+160+320+640+1000+1000 ms
		if got, want := time.Since(start), 3275*time.Millisecond; got != want {
			t.Errorf("10 failed accepts paused %v in all, want %v", got, want)
		}
		if reported != 10 || f.accepts != 11 {
			t.Errorf("%d failures reported in %d accepts, want 10 in 11", reported, f.accepts)
		}

		f.errs = []error{emfile()}
		start = time.Now()
		if c, err = l.Accept(); err != nil {
			t.Fatal(err)
		}
		c.Close()
		if got := time.Since(start); got != 5*time.Millisecond {
			t.Errorf("after an accepted connection the pause is %v, want 5ms again", got)
		}

		other := errors.New("something else")
		f.errs = []error{other}
		if _, err := l.Accept(); !errors.Is(err, other) {
			t.Errorf("another error: Accept returned %v, want it", err)
		}

		// Close ends a pause at once, and Accept says the listener is
		// closed.
		f.errs = []error{emfile(), emfile(), emfile(), emfile(), emfile(), emfile(), emfile(), emfile()}
		done := make(chan error)
		start = time.Now()
		go func() {
			_, err := l.Accept()
			done <- err
		}()
		time.Sleep(100 * time.Millisecond) // virtual: inside the pauses
		l.Close()
		if err := <-done; !errors.Is(err, net.ErrClosed) {
			t.Errorf("Accept after Close: %v, want net.ErrClosed", err)
		}
		if got := time.Since(start); got != 100*time.Millisecond {
			t.Errorf("Accept returned %v after it began, want at Close (100ms)", got)
		}
	})
}
