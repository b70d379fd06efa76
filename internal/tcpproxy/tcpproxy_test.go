package tcpproxy

import (
	"bufio"
	"errors"
	"io"
	"net"
	"os"
	"runtime"
	"testing"
	"time"
)

// echoServer answers every line with the same line.
func echoServer(t *testing.T) string { return prefixServer(t, "") }

func roundTrip(c net.Conn, deadline time.Duration) (string, error) {
	_ = c.SetDeadline(time.Now().Add(deadline))
	if _, err := c.Write([]byte("ping\n")); err != nil {
		return "", err
	}
	return bufio.NewReader(c).ReadString('\n')
}

func TestModes(t *testing.T) {
	p, err := Start(echoServer(t))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()

	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if got, err := roundTrip(c, 5*time.Second); err != nil || got != "ping\n" {
		t.Fatalf("pass: got %q, %v", got, err)
	}

	p.SetMode(Blackhole)
	if p.Mode() != Blackhole {
		t.Fatalf("mode = %v, want blackhole", p.Mode())
	}
	// A black hole accepts the bytes and never answers: the read times out
	// rather than failing with a refused or reset connection.
	_, err = roundTrip(c, 300*time.Millisecond)
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("blackhole: err = %v, want a read timeout", err)
	}

	p.SetMode(Reset)
	c2, err := net.Dial("tcp", p.Addr())
	if err == nil {
		defer c2.Close()
		if _, err = roundTrip(c2, 5*time.Second); err == nil {
			t.Fatal("reset: a new connection still answered")
		}
	}

	p.SetMode(Pass)
	c3, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c3.Close()
	if got, err := roundTrip(c3, 5*time.Second); err != nil || got != "ping\n" {
		t.Fatalf("pass again: got %q, %v", got, err)
	}
}

func TestDelay(t *testing.T) {
	p, err := Start(echoServer(t))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	p.SetDelay(200 * time.Millisecond)
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	start := time.Now()
	if got, err := roundTrip(c, 5*time.Second); err != nil || got != "ping\n" {
		t.Fatalf("got %q, %v", got, err)
	}
	// Each direction is delayed once.
	if el := time.Since(start); el < 400*time.Millisecond {
		t.Fatalf("round trip took %v, want at least 400ms with a 200ms delay", el)
	}
}

// recordingServer answers every line with the same line and sends each line
// it received to got.
func recordingServer(t *testing.T, got chan<- string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					got <- line
					if _, err := c.Write([]byte(line)); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}

func TestDropReplies(t *testing.T) {
	got := make(chan string, 10)
	p, err := Start(recordingServer(t, got))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if line, err := roundTrip(c, 5*time.Second); err != nil || line != "ping\n" {
		t.Fatalf("pass: got %q, %v", line, err)
	}
	<-got
	if n := p.DroppedReplies(); n != 0 {
		t.Fatalf("DroppedReplies() = %d after a passed reply, want 0", n)
	}

	p.SetMode(DropReplies)
	if p.Mode() != DropReplies || p.Mode().String() != "drop-replies" {
		t.Fatalf("mode %v, want drop-replies", p.Mode())
	}
	// The request arrives; the answer never does.
	_, err = roundTrip(c, 300*time.Millisecond)
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("drop-replies: err = %v, want a read timeout", err)
	}
	select {
	case line := <-got:
		if line != "ping\n" {
			t.Fatalf("server got %q", line)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("drop-replies: the request never reached the server")
	}
	// The read timed out after the server answered, and the proxy swallowed
	// the answer: it was counted.
	for deadline := time.Now().Add(5 * time.Second); p.DroppedReplies() == 0; {
		if time.Now().After(deadline) {
			t.Fatal("DroppedReplies() stayed 0 after a reply was swallowed")
		}
		runtime.Gosched()
	}

	// The connection lost a reply, so it is broken once the mode changes;
	// new connections work.
	p.SetMode(Pass)
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 16)); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("pass after drop-replies: read on the broken connection: %v, want it closed", err)
	}
	c2, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	if line, err := roundTrip(c2, 5*time.Second); err != nil || line != "ping\n" {
		t.Fatalf("pass again: got %q, %v", line, err)
	}
}

// prefixServer answers every line with prefix and the line.
func prefixServer(t *testing.T, prefix string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c)
				for {
					line, err := r.ReadString('\n')
					if err != nil {
						return
					}
					if _, err := io.WriteString(c, prefix+line); err != nil {
						return
					}
				}
			}()
		}
	}()
	return ln.Addr().String()
}

func TestSetTarget(t *testing.T) {
	p, err := Start(prefixServer(t, "a:"))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	old, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	if got, err := roundTrip(old, 5*time.Second); err != nil || got != "a:ping\n" {
		t.Fatalf("before: got %q, %v", got, err)
	}
	p.SetTarget(prefixServer(t, "b:"))
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if got, err := roundTrip(c, 5*time.Second); err != nil || got != "b:ping\n" {
		t.Fatalf("a new connection after SetTarget: got %q, %v, want the new target", got, err)
	}
	if got, err := roundTrip(old, 5*time.Second); err != nil || got != "a:ping\n" {
		t.Fatalf("an existing connection after SetTarget: got %q, %v, want the old target", got, err)
	}
}
