package server

import (
	"crypto/ed25519"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/google/uuid"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
)

// FuzzParseHeartbeat feeds arbitrary bytes through what the server does with
// a request body: decode it, then validate and convert it. Nothing may panic,
// and whatever is accepted must be what the agent sent.
func FuzzParseHeartbeat(f *testing.F) {
	id := uuid.NewString()
	seeds := []*agentv1.HeartbeatRequest{
		{MachineId: id},
		{MachineId: id, AgentVersion: "v1.2.3", HardwareReport: &agentv1.HardwareReport{
			Cpu: &agentv1.CPU{Threads: 8}, MemoryBytes: 1 << 34,
			BlockDevices: []*agentv1.BlockDevice{{Name: "sda", SizeBytes: 1 << 40}},
			Warnings:     []string{"reading x: denied"},
		}},
		{MachineId: id, InstallationReport: &agentv1.OSInstallationReport{Generation: 3,
			Result: &agentv1.OSInstallationReport_Error{Error: &agentv1.InstallationError{Message: "checksum mismatch"}}}},
		{MachineId: "not-a-uuid"},
		{MachineId: id, InstallationReport: &agentv1.OSInstallationReport{Generation: 1,
			Result: &agentv1.OSInstallationReport_Error{Error: &agentv1.InstallationError{Message: "a\x00b" + strings.Repeat("€", 2000)}}}},
	}
	for _, s := range seeds {
		b, err := proto.Marshal(s)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{0xff, 0xff, 0xff})
	key := make(ed25519.PublicKey, ed25519.PublicKeySize)
	f.Fuzz(func(t *testing.T, body []byte) {
		var req agentv1.HeartbeatRequest
		if err := proto.Unmarshal(body, &req); err != nil {
			return // the RPC layer answers InvalidArgument
		}
		hb, err := parseHeartbeat(&req, key)
		if err != nil {
			return
		}
		if want, err := uuid.Parse(req.GetMachineId()); err != nil || hb.MachineID != want {
			t.Fatalf("accepted machine id %q as %s", req.GetMachineId(), hb.MachineID)
		}
		if (hb.Hardware != nil) != (req.GetHardwareReport() != nil) {
			t.Fatal("hardware report lost or invented")
		}
		if hb.Hardware != nil {
			var back agentv1.HardwareReport
			if err := proto.Unmarshal(hb.Hardware.Raw, &back); err != nil || !proto.Equal(&back, req.GetHardwareReport()) {
				t.Fatalf("stored hardware report does not round-trip: %v", err)
			}
			if hb.Hardware.CPUThreads < 0 || hb.Hardware.MemoryBytes < 0 || hb.Hardware.DiskCount < 0 || hb.Hardware.DiskBytes < 0 {
				t.Fatalf("negative extracted values: %+v", hb.Hardware)
			}
		}
		if in := hb.Installation; in != nil {
			if in.Generation <= 0 || in.Success == (in.Error != "" || req.GetInstallationReport().GetError() != nil) {
				t.Fatalf("installation report %+v from %v", in, req.GetInstallationReport())
			}
			// The error is stored as PostgreSQL text: anything else would
			// fail the whole batch it is written with.
			if !utf8.ValidString(in.Error) || strings.ContainsRune(in.Error, 0) || len(in.Error) > maxErrorText {
				t.Fatalf("installation error %q cannot be stored as text", in.Error)
			}
		}
	})
}

// FuzzTruncate: whatever the text, even invalid UTF-8, truncate returns at
// most n bytes, the text itself if it fits, else a prefix marked with "...",
// cut on a character boundary if the text is valid UTF-8.
func FuzzTruncate(f *testing.F) {
	for _, s := range []string{"", "short", strings.Repeat("a", 64), strings.Repeat("a", 65),
		strings.Repeat("€", 30), strings.Repeat("\x80", 100), "a" + strings.Repeat("\x80", 99)} {
		f.Add(s, 64)
	}
	f.Add("abcdef", 2)
	f.Fuzz(func(t *testing.T, s string, n int) {
		if n < 3 || n > 1<<16 {
			return // the mark alone takes 3 bytes
		}
		got := truncate(s, n)
		switch {
		case len(s) <= n:
			if got != s {
				t.Fatalf("truncate(%q, %d) = %q, want it whole", s, n, got)
			}
		case len(got) > n || !strings.HasSuffix(got, "...") || !strings.HasPrefix(s, strings.TrimSuffix(got, "...")):
			t.Fatalf("truncate(%q, %d) = %q, want a prefix of at most %d bytes marked with ...", s, n, got, n)
		case utf8.ValidString(s) && !utf8.ValidString(got):
			t.Fatalf("truncate(%q, %d) = %q cuts a character", s, n, got)
		}
	})
}
