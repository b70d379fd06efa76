package install

import (
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"strconv"
	"syscall"
	"testing"
)

// TestDefaultClientKeepAlive checks that the default client's connection to
// the image server sends TCP keepalives once it is idle for 30s (as Go's
// default transport does): a NAT or firewall between the agent and a server
// that is slow to send keeps the connection.
func TestDefaultClientKeepAlive(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	t.Cleanup(srv.Close)
	client, release := newDefaultClient()
	defer release()

	var on, idle int
	var optErr error
	trace := &httptrace.ClientTrace{GotConn: func(info httptrace.GotConnInfo) {
		tcp, ok := info.Conn.(*net.TCPConn)
		if !ok {
			t.Errorf("the connection is a %T, not TCP", info.Conn)
			return
		}
		raw, err := tcp.SyscallConn()
		if err != nil {
			optErr = err
			return
		}
		_ = raw.Control(func(fd uintptr) {
			if on, optErr = syscall.GetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_KEEPALIVE); optErr != nil {
				return
			}
			idle, optErr = syscall.GetsockoptInt(int(fd), syscall.IPPROTO_TCP, syscall.TCP_KEEPIDLE)
		})
	}}
	req, err := http.NewRequestWithContext(httptrace.WithClientTrace(t.Context(), trace), http.MethodGet, srv.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if optErr != nil {
		t.Fatalf("reading the connection's socket options: %v", optErr)
	}
	if on != 1 || idle != 30 {
		t.Errorf("SO_KEEPALIVE %d, TCP_KEEPIDLE %ds; want keepalives on, after 30s idle", on, idle)
	}
}

// TestInstallServerUnreachable: an image server that refuses the
// connection fails the installation with an error naming the URL and the
// refusal, and the target is untouched.
func TestInstallServerUnreachable(t *testing.T) {
	_, sum := testImage(t)
	url := "http://" + refusingAddr(t) + "/os.img"
	target := existingTarget(t, []byte("old"))
	before := takeSnapshot(t, target)

	report := Install(t.Context(), allowing(t, target), request(url, sum, target))
	assertError(t, report, 7, "downloading "+url+": waiting for the response: dial tcp", "connection refused")
	assertUntouched(t, target, before)
}

// refusingAddr returns an address on 127.0.0.1 that refuses connections
// until the test ends: its port is bound without listening, so no other
// server can take it meanwhile.
func refusingAddr(t *testing.T) string {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(sa.(*syscall.SockaddrInet4).Port))
}
