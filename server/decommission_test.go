package server_test

import (
	"context"
	"testing"

	"connectrpc.com/connect"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/server"
)

// TestHeartbeatOfDecommissionedMachine: once a machine is decommissioned,
// its agent's heartbeats are refused with PermissionDenied, which tells the
// agent to stop (the BMDB keeps its last key for that), and change nothing,
// while other agents carry on. Any other key is only Unauthenticated.
func TestHeartbeatOfDecommissionedMachine(t *testing.T) {
	t.Parallel()
	e := start(t, server.Config{})
	gone, goneKey := e.machine()
	stays, staysKey := e.machine()
	goneClient, staysClient := e.client(gone, goneKey), e.client(stays, staysKey)
	if _, err := e.heartbeat(goneClient, &agentv1.HeartbeatRequest{MachineId: gone.String()}); err != nil {
		t.Fatalf("heartbeat before the decommission: %v", err)
	}

	err := e.s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		if err := tx.RequestDecommission(ctx, gone, "test", "retired"); err != nil {
			return err
		}
		_, err := tx.Decommission(ctx, gone, false)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	before := e.rows(gone)
	_, err = e.heartbeat(goneClient, &agentv1.HeartbeatRequest{MachineId: gone.String(), HardwareReport: &agentv1.HardwareReport{MemoryBytes: 1 << 30}})
	if connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Errorf("heartbeat of the decommissioned machine: %v, want PermissionDenied", err)
	}
	if after := e.rows(gone); after != "-|-|-" || before != after {
		t.Errorf("rows of the decommissioned machine: %q before the refused heartbeat, %q after; want none", before, after)
	}
	if _, err := e.heartbeat(e.client(gone, e.startAgentKeyOnly()), &agentv1.HeartbeatRequest{MachineId: gone.String()}); connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Errorf("heartbeat of the decommissioned machine with another key: %v, want Unauthenticated", err)
	}
	waitCounts(t, e.reg, map[string]float64{"retired": 1, "unauthenticated": 1})
	if _, err := e.heartbeat(staysClient, &agentv1.HeartbeatRequest{MachineId: stays.String()}); err != nil {
		t.Errorf("heartbeat of another machine: %v", err)
	}
	if n := bmdbtest.Scalar[int64](t, e.db, "SELECT count(*) FROM machines WHERE machine_id = $1 AND decommissioned_at IS NOT NULL", gone); n != 1 {
		t.Errorf("the decommissioned machine's row: %d rows with decommissioned_at, want 1", n)
	}
}
