package server

import (
	"context"
	"crypto/ed25519"
	"net"
	"testing"

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
		d.handle(ctx, buf[:n], from)
	}
	b.StopTimer()
	cancel()
	<-flushed
}
