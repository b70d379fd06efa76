// Package localport picks free TCP ports on 127.0.0.1 for test servers
// that restart on the port they started on (an sshd "rebooted", PostgreSQL
// restarted).
//
// Such a port must not come from the kernel's ephemeral range (32768-60999
// by default on Linux): while the server is down for a moment, any
// outgoing connection on the machine may get it as its local port, and the
// restart fails with "address already in use". Tests that open thousands
// of connections (the chaos soak) made that happen. Free picks below the
// range instead.
package localport

import (
	"fmt"
	"math/rand/v2"
	"net"
)

// Low and High bound the ports below Linux's default ephemeral range that
// test servers use; packages that pick many (sshtest, pgserver) keep to
// parts of it so as not to race each other.
const (
	Low  = 20000
	High = 32767
)

// Free returns a port in [lo, hi] that was free on 127.0.0.1 when it was
// tried. Another process may still take it before the caller binds it:
// callers retry with a new port when their bind fails.
func Free(lo, hi int) (int, error) {
	if lo < 1 || hi > 65535 || lo > hi {
		return 0, fmt.Errorf("localport: range %d-%d is not within 1-65535", lo, hi)
	}
	var last error
	for range 100 {
		port := lo + rand.IntN(hi-lo+1)
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			last = err
			continue
		}
		if err := l.Close(); err != nil {
			return 0, fmt.Errorf("localport: closing the probe of port %d: %w", port, err)
		}
		return port, nil
	}
	return 0, fmt.Errorf("localport: no free port in %d-%d after 100 tries: %w", lo, hi, last)
}
