package server

import (
	"context"
	"crypto/ed25519"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/api/agent/pulse"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// BenchmarkDatagramPath is the server's work per heartbeat datagram without
// the database: read it from the socket, parse, derive the key, verify,
// queue it, and (a stand-in flusher that accepts every heartbeat) seal and
// send the reply. The client's send is in the loop too.
func BenchmarkDatagramPath(b *testing.B) {
	db := bmdbtest.New(b)
	s, err := New(Config{DataDir: b.TempDir()}, db.DB)
	if err != nil {
		b.Fatal(err)
	}
	secret := make([]byte, pulse.SecretSize)
	s.secret.Store(&datagramSecret{b: secret})
	srvConn, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		b.Fatal(err)
	}
	defer srvConn.Close()
	d := s.datagrams
	d.conn = srvConn
	client, err := net.DialUDP("udp", nil, srvConn.LocalAddr().(*net.UDPAddr))
	if err != nil {
		b.Fatal(err)
	}
	defer client.Close()
	pub, _, _ := ed25519.GenerateKey(nil)
	id := uuid.New()
	s.verified.learn(id, pub, true)
	k := pulse.DeriveKey(secret, id, pub)
	ctx, cancel := context.WithCancel(b.Context())
	defer cancel()
	flushed := make(chan struct{})
	go func() { // the stand-in flusher
		defer close(flushed)
		for {
			select {
			case p := <-s.batch.verified:
				p.finish(beatResult{res: bmdb.HeartbeatResult{Accepted: true}})
			case <-ctx.Done():
				return
			}
		}
	}()
	go func() { // drains the replies
		buf := make([]byte, 64)
		for {
			if _, err := client.Read(buf); err != nil {
				return
			}
		}
	}()
	buf := make([]byte, pulse.RequestSize+1)
	var req []byte
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		r := pulse.Request{MachineID: id, AgentKey: pub, Counter: uint64(i + 1)}
		req = r.Seal(req[:0], &k)
		if _, err := client.Write(req); err != nil {
			b.Fatal(err)
		}
		n, from, err := srvConn.ReadFromUDPAddrPort(buf)
		if err != nil {
			b.Fatal(err)
		}
		d.handle(ctx, buf[:n], from, netip.Addr{}, 0)
	}
	b.StopTimer()
	cancel()
	<-flushed
}

// TestReplySourceIPv4: on an IPv4-only socket bound to 0.0.0.0 (a host
// without IPv6, where Go cannot open a dual-stack socket), the destination
// of a datagram is read from IP_PKTINFO and a reply sent with source() comes
// from it. The dual-stack socket Go opens elsewhere is tested end to end in
// TestDatagramReplyComesFromTheAddressAsked.
func TestReplySourceIPv4(t *testing.T) {
	conn, err := net.ListenUDP("udp4", &net.UDPAddr{IP: net.IPv4zero})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if mode, err := askForDestination(conn); err != nil || mode != dstIPv4 {
		t.Fatalf("askForDestination on an IPv4 socket bound to 0.0.0.0: mode %d, %v; want dstIPv4", mode, err)
	}
	client, err := net.DialUDP("udp4", nil, &net.UDPAddr{IP: net.IPv4(127, 0, 0, 2), Port: conn.LocalAddr().(*net.UDPAddr).Port})
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	if _, err := client.Write([]byte("request")); err != nil {
		t.Fatal(err)
	}
	buf, oob := make([]byte, 64), make([]byte, oobSize)
	_, oobn, _, from, err := conn.ReadMsgUDPAddrPort(buf, oob)
	if err != nil {
		t.Fatal(err)
	}
	local, ifIndex := dstIPv4.parse(oob[:oobn])
	if want := netip.MustParseAddr("127.0.0.2"); local != want {
		t.Fatalf("destination %v, want %v", local, want)
	}
	if _, _, err := conn.WriteMsgUDPAddrPort([]byte("reply"), dstIPv4.source(local, ifIndex), from); err != nil {
		t.Fatal(err)
	}
	// The client's socket is connected to 127.0.0.2: it drops a reply from
	// any other address, and its read would time out.
	if err := client.SetReadDeadline(time.Now().Add(10 * time.Second)); err != nil {
		t.Fatal(err)
	}
	n, err := client.Read(buf)
	if err != nil || string(buf[:n]) != "reply" {
		t.Fatalf("read %q, %v; want the reply", buf[:n], err)
	}
	// A bound socket, or a destination no reply can come from, leaves the
	// source to the kernel.
	for _, c := range []struct {
		m     localDst
		local netip.Addr
	}{
		{dstBound, local},
		{dstIPv4, netip.Addr{}},
		{dstIPv4, netip.MustParseAddr("255.255.255.255")},
		{dstIPv4, netip.MustParseAddr("224.0.0.1")},
		{dstIPv6, netip.MustParseAddr("::ffff:255.255.255.255")},
	} {
		if oob := c.m.source(c.local, 1); oob != nil {
			t.Errorf("source(%v) in mode %d = %x, want none", c.local, c.m, oob)
		}
	}
}
