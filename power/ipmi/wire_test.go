package ipmi

// Unit tests of the driver's pure parts: reading session-setup statuses off
// the wire and classing errors. They cover replies and completion codes that
// ipmi_sim never sends; the driver's behaviour against a real BMC is tested
// in ipmi_test.go.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/bougou/go-ipmi/pkg/client"
	"github.com/bougou/go-ipmi/pkg/types"

	"github.com/shepherd/shepherd/internal/secret"
	"github.com/shepherd/shepherd/power"
)

// setupReply is an RMCP+ session-setup reply of payload type pt whose
// payload begins with message tag 0 and status st.
func setupReply(pt, st byte) []byte {
	return []byte{
		0x06, 0x00, 0xff, 0x07, // RMCP: version, reserved, sequence, class IPMI
		0x06, pt, // auth type RMCP+, payload type
		0, 0, 0, 0, 0, 0, 0, 0, // session ID and sequence: 0 during setup
		8, 0, // payload length
		0x00, st, 0, 0, 0xa4, 0xa3, 0xa2, 0xa0, // message tag, status, reserved, console session ID
	}
}

// TestObserve: the wire records the first non-zero status of an Open
// Session reply or RAKP message 2 or 4, and an open session only on a RAKP
// message 4 with status 0; anything else, and a datagram too short to hold
// a status, is ignored.
func TestObserve(t *testing.T) {
	t.Parallel()
	openOK := setupReply(payloadOpenSessionResponse, 0)
	ipmiMsg := setupReply(0x00, 0x20) // an IPMI message: byte 17 is not a status
	for _, tt := range []struct {
		name       string
		datagrams  [][]byte
		wantStatus types.RmcpStatusCode // 0: none
		wantOpened bool
	}{
		{"open session accepted", [][]byte{openOK}, 0, false},
		{"open session refused", [][]byte{setupReply(payloadOpenSessionResponse, 0x04)}, 0x04, false},
		{"RAKP 2 refused", [][]byte{openOK, setupReply(payloadRAKP2, 0x0d)}, 0x0d, false},
		{"RAKP 2 accepted", [][]byte{openOK, setupReply(payloadRAKP2, 0)}, 0, false},
		{"RAKP 4 accepted", [][]byte{openOK, setupReply(payloadRAKP2, 0), setupReply(payloadRAKP4, 0)}, 0, true},
		{"RAKP 4 refused", [][]byte{openOK, setupReply(payloadRAKP2, 0), setupReply(payloadRAKP4, 0x0f)}, 0x0f, false},
		{"first status kept", [][]byte{setupReply(payloadRAKP2, 0x0d), setupReply(payloadRAKP4, 0x0f)}, 0x0d, false},
		{"IPMI message", [][]byte{ipmiMsg}, 0, false},
		{"encrypted IPMI message", [][]byte{setupReply(0xc0, 0x20)}, 0, false},
		{"RAKP 1 (a request)", [][]byte{setupReply(0x12, 0x20)}, 0, false},
		{"status cut off", [][]byte{setupReply(payloadOpenSessionResponse, 0x04)[:17]}, 0, false},
		{"payload cut off", [][]byte{setupReply(payloadRAKP2, 0x0d)[:14]}, 0, false},
		{"empty", [][]byte{{}}, 0, false},
		{"not RMCP", [][]byte{append([]byte{0x05}, setupReply(payloadRAKP2, 0x0d)[1:]...)}, 0, false},
		{"not class IPMI", [][]byte{append([]byte{0x06, 0, 0xff, 0x06}, setupReply(payloadRAKP2, 0x0d)[4:]...)}, 0, false},
		{"IPMI v1.5 session", [][]byte{append([]byte{0x06, 0, 0xff, 0x07, 0x00}, setupReply(payloadRAKP2, 0x0d)[5:]...)}, 0, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var w wire
			for _, p := range tt.datagrams {
				w.observe(p)
			}
			st, ok := w.rmcpStatus()
			if ok != (tt.wantStatus != 0) || st != tt.wantStatus {
				t.Errorf("status = %#02x, %t; want %#02x, %t", uint8(st), ok, uint8(tt.wantStatus), tt.wantStatus != 0)
			}
			if got := w.sessionOpened(); got != tt.wantOpened {
				t.Errorf("sessionOpened() = %t, want %t", got, tt.wantOpened)
			}
		})
	}
}

type timeoutErr struct{}

func (timeoutErr) Error() string   { return "i/o timeout" }
func (timeoutErr) Timeout() bool   { return true }
func (timeoutErr) Temporary() bool { return true }

// TestClassify: each way a call can fail gets its class, including the
// completion codes and statuses ipmi_sim never sends.
func TestClassify(t *testing.T) {
	t.Parallel()
	refused := &net.OpError{Op: "read", Net: "udp", Err: os.NewSyscallError("recvfrom", syscall.ECONNREFUSED)}
	// go-ipmi's session setup joins errors with %v: only the text is left.
	lost := func(err error) error { return fmt.Errorf("connect20 failed: %v", err) }
	cc := func(c types.CompletionCode) error {
		return fmt.Errorf("ChassisControl failed: %w", types.NewResponseError(c, "from the BMC"))
	}
	for _, tt := range []struct {
		name    string
		ctxErr  error
		wire    func(*wire)
		err     error
		want    error // nil: no class
		wantMsg string
	}{
		{"out of sessions", nil, func(w *wire) { w.observe(setupReply(payloadOpenSessionResponse, 0x01)) },
			errors.New("decoding failed"), power.ErrBusy, "status 01h"},
		{"unknown user", nil, func(w *wire) { w.observe(setupReply(payloadRAKP2, 0x0d)) },
			errors.New("rakp1 failed"), power.ErrAuth, "status 0dh"},
		{"cipher suite refused", nil, func(w *wire) { w.observe(setupReply(payloadOpenSessionResponse, 0x04)) },
			errors.New("decoding failed"), power.ErrUnsupported, "status 04h"},
		{"status without a class", nil, func(w *wire) { w.observe(setupReply(payloadOpenSessionResponse, 0x80)) },
			errors.New("decoding failed"), nil, "status 80h"},
		{"node busy C0h", nil, nil, cc(types.CodeNodeBusy), power.ErrBusy, ""},
		{"out of space C4h", nil, nil, cc(types.CodeOutOfSpace), power.ErrBusy, ""},
		{"not in present state D5h", nil, nil, cc(types.CodeNotSupported), power.ErrWrongState, ""},
		{"invalid command C1h", nil, nil, cc(types.CodeInvalidCommand), power.ErrUnsupported, ""},
		{"insufficient privilege D4h", nil, nil, cc(types.CodeInsufficientPrivilege), power.ErrAuth, ""},
		{"unspecified FFh", nil, nil, cc(types.CodeUnspecifiedError), nil, ""},
		{"RAKP mismatch", nil, nil, lost(fmt.Errorf("rakp1: %w", client.ErrRAKPAuthentication)), power.ErrAuth, "does not match"},
		{"canceled", context.Canceled, nil, errors.New("canceled from caller"), nil, ""},
		{"deadline", context.DeadlineExceeded, nil, errors.New("canceled from caller"), power.ErrUnreachable, "deadline"},
		{"no such host", nil, nil, fmt.Errorf("dial: %w", &net.DNSError{Err: "no such host", Name: "bmc.example", IsNotFound: true}),
			power.ErrUnreachable, "resolve"},
		{"refused", nil, nil, fmt.Errorf("read: %w", refused), power.ErrUnreachable, "nothing listens"},
		{"refused, chain lost", nil, func(w *wire) { w.observeErr(refused) }, lost(refused), power.ErrUnreachable, "nothing listens"},
		{"timeout", nil, nil, fmt.Errorf("read: %w", timeoutErr{}), power.ErrUnreachable, "no answer"},
		{"timeout, chain lost", nil, func(w *wire) { w.observeErr(&net.OpError{Op: "read", Err: timeoutErr{}}) },
			lost(timeoutErr{}), power.ErrUnreachable, "no answer"},
		{"other", nil, nil, errors.New("unexpected response"), nil, ""},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			var w wire
			if tt.wire != nil {
				tt.wire(&w)
			}
			words, class := classify(tt.ctxErr, &w, tt.err)
			if class != tt.want {
				t.Errorf("classify() class = %v, want %v", class, tt.want)
			}
			if tt.wantMsg == "" && words != "" || tt.wantMsg != "" && !strings.Contains(words, tt.wantMsg) {
				t.Errorf("classify() words = %q, want %q", words, tt.wantMsg)
			}
		})
	}
}

// TestWireSocket: expire makes a blocked read return at once and closeConn
// closes the socket; before a socket exists both do nothing.
func TestWireSocket(t *testing.T) {
	t.Parallel()
	var w wire
	w.expire() // no socket yet (the dial failed or never happened)
	w.closeConn()

	peer, err := net.ListenPacket("udp4", "127.0.0.1:0") // never answers
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	conn, err := net.Dial("udp4", peer.LocalAddr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	w.setConn(conn)
	if err := conn.SetReadDeadline(time.Now().Add(time.Minute)); err != nil {
		t.Fatal(err)
	}
	errc := make(chan error, 1)
	go func() {
		_, err := conn.Read(make([]byte, 64))
		errc <- err
	}()
	w.expire()
	select {
	case err := <-errc:
		if ne, ok := err.(net.Error); !ok || !ne.Timeout() {
			t.Fatalf("read after expire: error = %v, want a timeout", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("read still blocked 5 s after expire")
	}

	w.closeConn()
	if _, err := conn.Write([]byte{0}); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("write after closeConn: error = %v, want net.ErrClosed", err)
	}
}

// deadlinePassed is a context whose deadline has passed while its timer has
// not fired yet: Err is still nil.
type deadlinePassed struct{ context.Context }

func (deadlinePassed) Deadline() (time.Time, bool) { return time.Now().Add(-time.Millisecond), true }

// TestFailDeadlinePassed: a read that timed out at ctx's deadline a moment
// before ctx's own timer fired (go-ipmi takes its read deadline from ctx) is
// the deadline's doing: the error wraps context.DeadlineExceeded.
func TestFailDeadlinePassed(t *testing.T) {
	t.Parallel()
	d := &Driver{spec: power.Spec{Driver: power.DriverIPMI, Address: "10.0.0.7", Username: "admin", Password: secret.New("pw")}}
	var w wire
	readErr := &net.OpError{Op: "read", Net: "udp", Err: timeoutErr{}}
	w.observeErr(readErr)
	err := d.fail(deadlinePassed{context.Background()}, "reading chassis status", &w, fmt.Errorf("exchange: %w", readErr))
	if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, power.ErrUnreachable) {
		t.Fatalf("fail() = %v, want ErrUnreachable and context.DeadlineExceeded", err)
	}
	if !strings.Contains(err.Error(), "no answer before the deadline") {
		t.Errorf("fail() = %q, want it to say the deadline passed", err)
	}
}
