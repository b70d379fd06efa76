package server_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/server"
)

// A request of exactly MaxRequestBytes is served; one byte more is refused
// with ResourceExhausted before anything is decoded or written.
func TestMaxRequestBytes(t *testing.T) {
	t.Parallel()
	const limit = 4 << 10
	e := start(t, server.Config{MaxRequestBytes: limit})
	id, key := e.machine()
	c := e.client(id, key)
	// sized is a request of exactly n bytes on the wire.
	sized := func(n int) *agentv1.HeartbeatRequest {
		t.Helper()
		req := &agentv1.HeartbeatRequest{MachineId: id.String(), HardwareReport: &agentv1.HardwareReport{Warnings: []string{""}}}
		for w := n; w >= 0 && proto.Size(req) != n; w-- {
			req.HardwareReport.Warnings[0] = strings.Repeat("x", w)
		}
		if got := proto.Size(req); got != n {
			t.Fatalf("cannot make a request of %d bytes: got %d", n, got)
		}
		return req
	}
	if _, err := e.heartbeat(c, sized(limit)); err != nil {
		t.Errorf("request of exactly MaxRequestBytes: %v", err)
	}
	before := e.rows(id)
	if _, err := e.heartbeat(c, sized(limit+1)); connect.CodeOf(err) != connect.CodeResourceExhausted {
		t.Errorf("request one byte over MaxRequestBytes: %v, want ResourceExhausted", err)
	}
	if after := e.rows(id); after != before {
		t.Errorf("a refused request changed rows: %s -> %s", before, after)
	}
	waitCounts(t, e.reg, map[string]float64{"too_large": 1, "accepted": 1})
}

// A request of the default limit (1 MiB, some 64 TLS records and HTTP/2
// frames) is served, and so is a small one after it on the same kept
// connection: the server reads frames straight from the TLS connection,
// with no read buffer of its own, so requests spanning records and
// frames must come through whole.
func TestLargeRequestOnKeptConnection(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{})
	id, key := e.machine()
	c := e.client(id, key)
	const limit = 1 << 20
	req := &agentv1.HeartbeatRequest{MachineId: id.String(), HardwareReport: &agentv1.HardwareReport{Warnings: []string{""}}}
	for w := limit; w >= 0 && proto.Size(req) != limit; w-- {
		req.HardwareReport.Warnings[0] = strings.Repeat("x", w)
	}
	if got := proto.Size(req); got != limit {
		t.Fatalf("cannot make a request of %d bytes: got %d", limit, got)
	}
	for i, r := range []*agentv1.HeartbeatRequest{req, {MachineId: id.String()}, req} {
		if _, err := e.heartbeat(c, r); err != nil {
			t.Errorf("heartbeat %d (%d bytes): %v", i, proto.Size(r), err)
		}
	}
	waitCounts(t, e.reg, map[string]float64{"accepted": 3})
}

// agent_version is stored up to 256 bytes; a longer one is refused as
// invalid, saying why.
func TestAgentVersionLength(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{})
	id, key := e.machine()
	c := e.client(id, key)
	if _, err := e.heartbeat(c, &agentv1.HeartbeatRequest{MachineId: id.String(), AgentVersion: strings.Repeat("v", 256)}); err != nil {
		t.Errorf("agent_version of 256 bytes: %v", err)
	}
	_, err := e.heartbeat(c, &agentv1.HeartbeatRequest{MachineId: id.String(), AgentVersion: strings.Repeat("v", 257)})
	var cerr *connect.Error
	if !errors.As(err, &cerr) || cerr.Code() != connect.CodeInvalidArgument || cerr.Message() != "agent_version is longer than 256 bytes" {
		t.Errorf("agent_version of 257 bytes: %v, want InvalidArgument saying it is longer than 256 bytes", err)
	}
}

// A machine id that is not a UUID is refused, quoting it: whole up to 64
// bytes, longer ones cut on a character boundary and marked.
func TestInvalidMachineIDIsQuotedShort(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{})
	id, key := e.machine()
	c := e.client(id, key)
	for _, tc := range []struct{ id, quoted string }{
		{strings.Repeat("a", 64), strings.Repeat("a", 64)},
		{strings.Repeat("a", 65), strings.Repeat("a", 61) + "..."},
		// 61 bytes would end inside the 21st "€" (3 bytes each).
		{strings.Repeat("€", 30), strings.Repeat("€", 20) + "..."},
	} {
		_, err := e.heartbeat(c, &agentv1.HeartbeatRequest{MachineId: tc.id})
		want := `machine_id "` + tc.quoted + `" is not a UUID`
		var cerr *connect.Error
		if !errors.As(err, &cerr) || cerr.Code() != connect.CodeInvalidArgument || cerr.Message() != want {
			t.Errorf("machine id of %d bytes: %v, want InvalidArgument %q", len(tc.id), err, want)
		}
	}
}

// An installation report names a generation, which starts at 1: 0 is
// refused before anything is written, saying why.
func TestInstallationReportGeneration(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{})
	id, key := e.machine()
	c := e.client(id, key)
	report := func(gen int64) *agentv1.HeartbeatRequest {
		return &agentv1.HeartbeatRequest{MachineId: id.String(), InstallationReport: &agentv1.OSInstallationReport{Generation: gen,
			Result: &agentv1.OSInstallationReport_Success{Success: &agentv1.InstallationSuccess{}}}}
	}
	for _, gen := range []int64{0, -1} {
		_, err := e.heartbeat(c, report(gen))
		want := fmt.Sprintf("installation_report.generation must be > 0, got %d", gen)
		var cerr *connect.Error
		if !errors.As(err, &cerr) || cerr.Code() != connect.CodeInvalidArgument || cerr.Message() != want {
			t.Errorf("report of generation %d: %v, want InvalidArgument %q", gen, err, want)
		}
	}
	if _, err := e.heartbeat(c, report(1)); err != nil {
		t.Errorf("report of generation 1: %v", err)
	}
	in, err := e.db.GetInstallation(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	if in.Report == nil || in.Report.Generation != 1 || !in.Report.Success {
		t.Errorf("stored report %+v, want generation 1, success", in.Report)
	}
}
