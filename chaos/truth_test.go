package chaos

import (
	"testing"
	"time"

	"connectrpc.com/connect"
)

func TestTruthJudgesReboots(t *testing.T) {
	t0 := time.Date(2026, 11, 26, 4, 0, 0, 0, time.UTC)
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	tr := NewTruth()
	tr.AgentStarted("sim-000001", "m1", at(0))
	tr.HeartbeatAcked("sim-000001", "m1", at(1), at(1.1), true)
	tr.HeartbeatAcked("sim-000001", "m1", at(3), at(3.1), false)
	tr.HeartbeatFailed("sim-000001", "m1", at(5))
	tr.HeartbeatRefused("sim-000001", "m1", at(7), connect.CodeUnavailable)
	m := tr.Machine("sim-000001")

	// Admitted at 12 s with a 10 s timeout: the heartbeat sent at 3 s was
	// recorded before 12 s and is younger than 10 s.
	if _, alive := m.AliveAt(at(12), 10*time.Second); !alive {
		t.Error("a reboot 9 s after an acknowledged heartbeat was not judged false")
	}
	if a, alive := m.AliveAt(at(13.1), 10*time.Second); alive {
		t.Errorf("a reboot 10.1 s after the last acknowledged heartbeat was judged false (%+v)", a)
	}
	// Acknowledged after the admission: not visible to it.
	if _, alive := m.AliveAt(at(1.05), 10*time.Second); alive {
		t.Error("a heartbeat acknowledged after the admission counted")
	}

	tr.Rebooted("sim-000001", at(20))
	tr.Rebooted("sim-000001", at(30))
	tr.AgentStarted("sim-000001", "m1", at(35))
	tr.Rebooted("sim-000001", at(70))
	if got := tr.Machine("sim-000001").RebootsWithoutStart(); len(got) != 1 || !got[0].Equal(at(30)) {
		t.Errorf("second reboots of one silence: %v, want the one at 30 s", got)
	}

	if !m.Explains(at(3.05)) {
		t.Error("a time between an acknowledged heartbeat's sending and its answer is not explained")
	}
	if !m.Explains(at(6)) {
		t.Error("a time after an unanswered heartbeat is not explained")
	}
	if m.Explains(at(0.5)) {
		t.Error("a time before any heartbeat was sent is explained")
	}
	if !m.Explains(at(8)) {
		t.Error("a time after a heartbeat refused as Unavailable (its outcome unknown) is not explained")
	}
	tr.HeartbeatRefused("sim-000002", "m2", at(1), connect.CodePermissionDenied)
	if tr.Machine("sim-000002").Explains(at(1.5)) {
		t.Error("a heartbeat refused for cause explains a recorded time")
	}
	if m.Explains(at(40)) {
		t.Error("a time 35 s after an unanswered heartbeat is explained")
	}
	if got := tr.RefusalCodes(); got["unavailable"] != 1 || got["permission_denied"] != 1 || len(got) != 2 {
		t.Errorf("refusals by code %v, want one unavailable and one permission_denied", got)
	}
	if got := tr.LastAcks()["sim-000001"]; !got.Sent.Equal(at(3)) {
		t.Errorf("last acknowledged heartbeat %+v, want the one sent at 3 s", got)
	}
}
