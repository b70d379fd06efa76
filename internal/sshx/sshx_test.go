package sshx

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"
)

// TestDialTimeoutIsDeadlineExceeded dials a server that accepts the TCP
// connection and never says a word: the handshake must end at the
// context's deadline and say so, so callers can tell a hung machine from
// one that refused them.
func TestDialTimeoutIsDeadlineExceeded(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := ln.Accept()
		if err == nil {
			accepted <- c
		}
	}()
	t.Cleanup(func() {
		select {
		case c := <-accepted:
			c.Close()
		default:
		}
	})
	ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = Dial(ctx, Target{Addr: ln.Addr().String(), User: "root", HostKey: ssh.InsecureIgnoreHostKey()})
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Dial to a silent server: %v, want DeadlineExceeded", err)
	}
	if took := time.Since(start); took > 10*time.Second {
		t.Errorf("Dial returned after %s, long after its 200ms deadline", took)
	}
}

func TestDialNeedsHostKeyCheck(t *testing.T) {
	t.Parallel()
	_, err := Dial(t.Context(), Target{Addr: "127.0.0.1:1", User: "root"})
	if err == nil {
		t.Fatal("Dial without a host key check succeeded")
	}
}
