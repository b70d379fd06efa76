package main

import (
	"net"
	"net/netip"
	"testing"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/api/agent/pulse"
)

// A P5 agent starts over TLS, takes its grant and heartbeats by datagram;
// after it goes back to TLS, a grant whose floor is below the counters it
// already sent does not make it send them again (the server would refuse
// them as replays).
func TestP5AgentKeepsItsCounterAcrossGrants(t *testing.T) {
	t.Parallel()
	srv, err := startTransportOnly(t.TempDir(), transportDatagram)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.close)
	host, _, err := net.SplitHostPort(srv.addr)
	if err != nil {
		t.Fatal(err)
	}
	machine := uuid.New()
	a := &p5Agent{index: 3, id: machine.String(), machine: machine, endpoint: srv.addr, host: host, ca: srv.ca,
		local: netip.MustParseAddr("127.0.0.2")}
	t.Cleanup(func() {
		if a.pulse != nil {
			a.pulse.close()
		}
	})
	beat := func(want uint64) {
		t.Helper()
		rep, err := a.pulse.beat(t.Context())
		if err != nil {
			t.Fatalf("datagram heartbeat: %v", err)
		}
		if rep.Counter != want || rep.Status != pulse.StatusRecorded {
			t.Fatalf("reply = %+v, want counter %d, recorded", rep, want)
		}
	}
	for grant := range 2 {
		if err := a.tlsBeat(t.Context()); err != nil {
			t.Fatalf("TLS heartbeat %d: %v", grant+1, err)
		}
		if !a.reported || a.pulse == nil {
			t.Fatalf("after TLS heartbeat %d: reported %v, grant %v; want both", grant+1, a.reported, a.pulse != nil)
		}
		for i := range uint64(3) {
			beat(uint64(3*grant) + i + 1) // the transport-only server's floor is always 0
		}
		a.dropGrant()
	}
	if got := srv.tls.Load(); got != 2 {
		t.Fatalf("the server answered %d TLS heartbeats, want 2", got)
	}
}
