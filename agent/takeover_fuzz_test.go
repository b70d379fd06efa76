package agent

import (
	"testing"

	"github.com/google/uuid"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
)

// MarshalTakeoverInit returns a valid TakeoverInit, changed by change if it
// is not nil, as the initializer writes it to the agent's stdin. (Exported
// for the tests of package agent_test.)
func MarshalTakeoverInit(t testing.TB, change func(*agentv1.TakeoverInit)) []byte {
	t.Helper()
	init := &agentv1.TakeoverInit{MachineId: uuid.NewString(), ServerEndpoint: "127.0.0.1:7443"}
	if change != nil {
		change(init)
	}
	raw, err := proto.Marshal(init)
	if err != nil {
		t.Fatal(err)
	}
	return raw
}

// FuzzTakeoverInit feeds arbitrary stdin through the takeover's parsing and
// validation. Nothing may panic, and an accepted init must name a machine
// and a reachable-looking endpoint.
func FuzzTakeoverInit(f *testing.F) {
	f.Add(MarshalTakeoverInit(f, func(i *agentv1.TakeoverInit) { i.ServerEndpoint = "shepherd.example:7443" }))
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
