package manager

import (
	"strings"
	"testing"

	"github.com/google/uuid"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb"
)

// TestCheckTakeover: the agent's answer is accepted only as a success that
// echoes the TakeoverInit sent and carries a 32-byte key; anything else is
// refused with a cause that says what was wrong, with the agent's text cut
// short.
func TestCheckTakeover(t *testing.T) {
	t.Parallel()
	sent := &agentv1.TakeoverInit{MachineId: uuid.NewString(), ServerEndpoint: "server:443"}
	key := make([]byte, 32)
	key[0] = 7
	marshal := func(r *agentv1.TakeoverResponse) []byte {
		b, err := proto.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	success := func(init *agentv1.TakeoverInit, key []byte) []byte {
		return marshal(&agentv1.TakeoverResponse{Result: &agentv1.TakeoverResponse_Success{Success: &agentv1.TakeoverSuccess{InitMessage: init, PublicKey: key}}})
	}
	refusal := func(msg string) []byte {
		return marshal(&agentv1.TakeoverResponse{Result: &agentv1.TakeoverResponse_Error{Error: &agentv1.TakeoverError{Message: msg}}})
	}
	garbage := strings.Repeat("\xff", 300)
	for _, tt := range []struct {
		name   string
		stdout []byte
		want   string // "" for success
	}{
		{"success", success(sent, key), ""},
		{"not a response", []byte(garbage), `the agent's output is no TakeoverResponse: `},
		{"not a response, cut short", []byte(garbage), `(300 bytes: "` + strings.Repeat(`\xff`, 200) + `...")`},
		{"refused", refusal("disk full"), "the agent refused the takeover: disk full"},
		{"refused at length", refusal(strings.Repeat("x", 1001)), "the agent refused the takeover: " + strings.Repeat("x", 1000) + "..."},
		{"refused at the limit", refusal(strings.Repeat("y", 1000)), "the agent refused the takeover: " + strings.Repeat("y", 1000)},
		{"another init", success(&agentv1.TakeoverInit{MachineId: uuid.NewString(), ServerEndpoint: "server:443"}, key), "the agent echoed a TakeoverInit other than the one sent"},
		{"short key", success(sent, key[:31]), "the agent answered with a 31-byte key, want 32"},
		{"long key", success(sent, append(key, 0)), "the agent answered with a 33-byte key, want 32"},
		{"empty", marshal(&agentv1.TakeoverResponse{}), "the agent's TakeoverResponse is empty"},
	} {
		got, err := checkTakeover(tt.stdout, sent)
		switch {
		case tt.want == "" && (err != nil || string(got) != string(key)):
			t.Errorf("%s: checkTakeover() = %x, %v; want the key", tt.name, got, err)
		case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
			t.Errorf("%s: checkTakeover() error = %v, want it to contain %q", tt.name, err, tt.want)
		}
		if tt.name == "refused at the limit" && err != nil && strings.HasSuffix(err.Error(), "...") {
			t.Errorf("%s: a message of exactly the limit was cut: %v", tt.name, err)
		}
	}
}

// TestRemotePaths: a provider id becomes one path element of the agent's
// directory whatever it holds, and arguments reach the remote shell as
// they are.
func TestRemotePaths(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"m-1":       "m-1",
		"rack/m1":   "rack_m1",
		"a\x00b":    "a_b",
		"a\nb\x1fc": "a_b_c",
		" a b ":     " a b ",
		"été":       "été",
		".":         "_",
		"..":        "_",
		"...":       "...",
		"":          "",
	} {
		if got := safePathElem(in); got != want {
			t.Errorf("safePathElem(%q) = %q, want %q", in, got, want)
		}
	}
	id := uuid.MustParse("6f1c2a3e-0000-4000-8000-000000000001")
	m := bmdb.ProvidedMachine{MachineID: id, Provided: bmdb.Provided{ProviderID: "rack/m1"}}
	if got, want := expandAgentDir("/var/lib/{provider_id}/{machine_id}", m), "/var/lib/rack_m1/"+id.String(); got != want {
		t.Errorf("expandAgentDir() = %q, want %q", got, want)
	}
	for _, c := range []struct{ configured, user, want string }{
		{"", "root", "/var/lib/shepherd-agent"},
		{"", "admin", ".local/state/shepherd-agent"}, // under admin's home
		{"", "", ".local/state/shepherd-agent"},
		{"/opt/{provider_id}", "admin", "/opt/rack_m1"},
		{"/opt/{provider_id}", "root", "/opt/rack_m1"},
		{"agents/{machine_id}", "root", "agents/" + id.String()},
	} {
		if got := agentDir(c.configured, c.user, m); got != c.want {
			t.Errorf("agentDir(%q, %q) = %q, want %q", c.configured, c.user, got, c.want)
		}
	}
}
