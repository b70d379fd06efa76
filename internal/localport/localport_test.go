package localport

import (
	"net"
	"strconv"
	"strings"
	"testing"
)

func TestFreeStaysInRange(t *testing.T) {
	for range 50 {
		p, err := Free(20000, 20100)
		if err != nil {
			t.Fatal(err)
		}
		if p < 20000 || p > 20100 {
			t.Fatalf("port %d outside 20000-20100", p)
		}
	}
}

func TestFreeSkipsTakenPorts(t *testing.T) {
	// Hold one of two ports: Free must return the other.
	var held net.Listener
	var port int
	for p := 21000; p < 21100 && held == nil; p += 2 {
		l, err := net.Listen("tcp", "127.0.0.1:"+itoa(p))
		if err == nil {
			if probe, err := net.Listen("tcp", "127.0.0.1:"+itoa(p+1)); err == nil {
				probe.Close()
				held, port = l, p
			} else {
				l.Close()
			}
		}
	}
	if held == nil {
		t.Fatal("no two adjacent free ports in 21000-21100")
	}
	defer held.Close()
	for range 20 {
		p, err := Free(port, port+1)
		if err != nil {
			t.Fatal(err)
		}
		if p != port+1 {
			t.Fatalf("Free returned %d, which is held", p)
		}
	}
}

func TestFreeRejectsBadRanges(t *testing.T) {
	for _, r := range [][2]int{{0, 10}, {10, 70000}, {30, 20}} {
		if _, err := Free(r[0], r[1]); err == nil || !strings.Contains(err.Error(), "not within") {
			t.Errorf("Free(%d, %d) = %v, want a range error", r[0], r[1], err)
		}
	}
}

func itoa(i int) string { return strconv.Itoa(i) }
