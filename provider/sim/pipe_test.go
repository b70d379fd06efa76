package sim

import (
	"bytes"
	"errors"
	"io"
	"os"
	"sync"
	"testing"
	"time"
)

func TestPipeBothEndsWriteFirst(t *testing.T) {
	t.Parallel()
	a, b := pipe("m:22")
	defer a.Close()
	defer b.Close()
	// SSH's version exchange: each end writes, then reads. net.Pipe
	// deadlocks here.
	for _, c := range []interface{ Write([]byte) (int, error) }{a, b} {
		if _, err := c.Write([]byte("SSH-2.0-x\r\n")); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []io.Reader{a, b} {
		buf := make([]byte, 64)
		if n, err := c.Read(buf); err != nil || string(buf[:n]) != "SSH-2.0-x\r\n" {
			t.Fatalf("Read = %q, %v", buf[:n], err)
		}
	}
	if a.RemoteAddr().String() != "m:22" || b.LocalAddr().String() != "m:22" {
		t.Errorf("addresses: %v -> %v", a.LocalAddr(), a.RemoteAddr())
	}
}

func TestPipeLargeTransfer(t *testing.T) {
	t.Parallel()
	a, b := pipe("m:22")
	want := make([]byte, 5*pipeBuffer+123)
	for i := range want {
		want[i] = byte(i * 7)
	}
	var wg sync.WaitGroup
	wg.Go(func() {
		// Odd write sizes, so the ring wraps at every offset.
		for rest := want; len(rest) > 0; {
			n := min(len(rest), 9973)
			if _, err := a.Write(rest[:n]); err != nil {
				t.Error(err)
				return
			}
			rest = rest[n:]
		}
		a.Close()
	})
	got, err := io.ReadAll(b)
	wg.Wait()
	if err != nil || !bytes.Equal(got, want) {
		t.Fatalf("read %d bytes (%v), want the %d written", len(got), err, len(want))
	}
	if _, err := b.Write([]byte("x")); !errors.Is(err, io.ErrClosedPipe) {
		t.Errorf("writing to a closed peer: %v, want ErrClosedPipe", err)
	}
	b.Close()
	if _, err := b.Read(make([]byte, 1)); !errors.Is(err, io.ErrClosedPipe) {
		t.Errorf("reading a closed end: %v, want ErrClosedPipe", err)
	}
}

func TestPipeDeadlines(t *testing.T) {
	t.Parallel()
	a, b := pipe("m:22")
	defer a.Close()
	defer b.Close()
	if err := b.SetReadDeadline(time.Now().Add(20 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("Read past its deadline: %v", err)
	}
	// A full buffer blocks the writer until its deadline.
	if err := a.SetWriteDeadline(time.Now().Add(20 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	n, err := a.Write(make([]byte, 2*pipeBuffer))
	if !errors.Is(err, os.ErrDeadlineExceeded) || n != pipeBuffer {
		t.Errorf("Write into a full pipe = %d, %v; want %d and a deadline error", n, err, pipeBuffer)
	}
	// A deadline set while a Read waits ends the wait.
	if err := b.SetReadDeadline(time.Time{}); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(b, make([]byte, pipeBuffer)); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := b.Read(make([]byte, 1))
		done <- err
	}()
	if err := b.SetDeadline(time.Now().Add(-time.Second)); err != nil {
		t.Fatal(err)
	}
	if err := <-done; !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("Read when its deadline moved into the past: %v", err)
	}
}
