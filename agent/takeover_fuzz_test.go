package agent

import (
	"testing"

	"github.com/google/uuid"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
)

// FuzzTakeoverInit feeds arbitrary stdin through the takeover's parsing and
// validation. Nothing may panic, and an accepted init must name a machine
// and a reachable-looking endpoint.
func FuzzTakeoverInit(f *testing.F) {
	good, err := proto.Marshal(&agentv1.TakeoverInit{MachineId: uuid.NewString(), ServerEndpoint: "shepherd.example:7443"})
	if err != nil {
		f.Fatal(err)
	}
	f.Add(good)
	f.Add([]byte("garbage"))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, stdin []byte) {
		var init agentv1.TakeoverInit
		if err := proto.Unmarshal(stdin, &init); err != nil {
			return
		}
		if err := ValidateTakeoverInit(&init); err != nil {
			return
		}
		if _, err := uuid.Parse(init.GetMachineId()); err != nil {
			t.Fatalf("accepted machine id %q", init.GetMachineId())
		}
		if init.GetServerEndpoint() == "" {
			t.Fatal("accepted an empty endpoint")
		}
	})
}
