package pulse

import (
	"bytes"
	"crypto/ed25519"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/google/uuid"
)

var (
	testSecret  = bytes.Repeat([]byte{7}, SecretSize)
	testMachine = uuid.MustParse("6f1c2d3e-4a5b-4c6d-8e7f-90a1b2c3d4e5")
)

func testAgentKey(b byte) ed25519.PublicKey {
	pub, _, err := ed25519.GenerateKey(bytes.NewReader(bytes.Repeat([]byte{b}, 64)))
	if err != nil {
		panic(err)
	}
	return pub
}

func sealed(t *testing.T, r Request, k Key) []byte {
	t.Helper()
	b := r.Seal(nil, &k)
	if len(b) != RequestSize {
		t.Fatalf("sealed request is %d bytes, want %d", len(b), RequestSize)
	}
	return b
}

func TestRequestRoundTrip(t *testing.T) {
	ak := testAgentKey(1)
	k := DeriveKey(testSecret, testMachine, ak)
	want := Request{MachineID: testMachine, AgentKey: ak, Counter: math.MaxInt64, KnownGeneration: 42}
	b := sealed(t, want, k)
	got, err := ParseRequest(b)
	if err != nil {
		t.Fatalf("ParseRequest: %v", err)
	}
	if got.MachineID != want.MachineID || !got.AgentKey.Equal(want.AgentKey) || got.Counter != want.Counter ||
		got.KnownGeneration != want.KnownGeneration {
		t.Fatalf("ParseRequest = %+v, want %+v", got, want)
	}
	if err := VerifyRequest(b, &k); err != nil {
		t.Fatalf("VerifyRequest with the right key: %v", err)
	}
	// Sealing appends: a prefix in dst stays and is not covered.
	pre := []byte("prefix")
	if b2 := want.Seal(pre, &k); !bytes.Equal(b2[len(pre):], b) || string(b2[:len(pre)]) != "prefix" {
		t.Fatal("Seal with a non-empty dst wrote something else than the datagram after it")
	}
}

// TestKeysAreBoundToMachineAndAgentKey: a grant for one machine or one
// agent key does not authenticate another (R6), nor does a key derived
// under another secret.
func TestKeysAreBoundToMachineAndAgentKey(t *testing.T) {
	ak, other := testAgentKey(1), testAgentKey(2)
	k := DeriveKey(testSecret, testMachine, ak)
	for name, k2 := range map[string]Key{
		"other machine":   DeriveKey(testSecret, uuid.New(), ak),
		"other agent key": DeriveKey(testSecret, testMachine, other),
		"other secret":    DeriveKey(bytes.Repeat([]byte{8}, SecretSize), testMachine, ak),
	} {
		if k2 == k {
			t.Errorf("%s: same key", name)
		}
		b := sealed(t, Request{MachineID: testMachine, AgentKey: ak, Counter: 1}, k2)
		if err := VerifyRequest(b, &k); !errors.Is(err, ErrBadMAC) {
			t.Errorf("%s: VerifyRequest = %v, want ErrBadMAC", name, err)
		}
	}
}

// TestEveryBitIsCovered: flipping any bit of a request or a reply makes it
// fail its MAC (or its parse).
func TestEveryBitIsCovered(t *testing.T) {
	ak := testAgentKey(1)
	k := DeriveKey(testSecret, testMachine, ak)
	req := sealed(t, Request{MachineID: testMachine, AgentKey: ak, Counter: 9, KnownGeneration: 3}, k)
	rep := (&Reply{Counter: 9, Status: StatusCallTLS, NextIn: 30 * time.Second}).Seal(nil, &k)
	for bit := range len(req) * 8 {
		b := bytes.Clone(req)
		b[bit/8] ^= 1 << (bit % 8)
		_, perr := ParseRequest(b)
		if perr == nil && VerifyRequest(b, &k) == nil {
			t.Fatalf("request with bit %d flipped passes", bit)
		}
	}
	for bit := range len(rep) * 8 {
		b := bytes.Clone(rep)
		b[bit/8] ^= 1 << (bit % 8)
		if _, err := OpenReply(b, &k); err == nil {
			t.Fatalf("reply with bit %d flipped opens", bit)
		}
	}
}

func TestReplyRoundTrip(t *testing.T) {
	k := DeriveKey(testSecret, testMachine, testAgentKey(1))
	for _, want := range []Reply{
		{Counter: 1, Status: StatusRecorded, NextIn: 30 * time.Second},
		{Counter: math.MaxInt64, Status: StatusCallTLS},
		{Counter: 5, Status: StatusRetryLater, NextIn: 1500 * time.Millisecond},
	} {
		b := want.Seal(nil, &k)
		if len(b) != ReplySize {
			t.Fatalf("reply is %d bytes, want %d", len(b), ReplySize)
		}
		got, err := OpenReply(b, &k)
		if err != nil || got != want {
			t.Fatalf("OpenReply = %+v, %v; want %+v", got, err, want)
		}
	}
	other := DeriveKey(testSecret, uuid.New(), testAgentKey(1))
	b := (&Reply{Counter: 1}).Seal(nil, &k)
	if _, err := OpenReply(b, &other); !errors.Is(err, ErrBadMAC) {
		t.Fatalf("reply under another key: %v, want ErrBadMAC", err)
	}
	// A reply never carries more than 2^32-1 ms, and never a negative time.
	long := (&Reply{Counter: 1, NextIn: 100 * 24 * time.Hour}).Seal(nil, &k)
	if r, _ := OpenReply(long, &k); r.NextIn != math.MaxUint32*time.Millisecond {
		t.Fatalf("100 days came back as %v", r.NextIn)
	}
	neg := (&Reply{Counter: 1, NextIn: -time.Second}).Seal(nil, &k)
	if r, _ := OpenReply(neg, &k); r.NextIn != 0 {
		t.Fatalf("-1s came back as %v", r.NextIn)
	}
}

// TestRepliesAreNoLongerThanRequests keeps the server useless as a
// traffic amplifier towards a forged source address.
func TestRepliesAreNoLongerThanRequests(t *testing.T) {
	if ReplySize > RequestSize {
		t.Fatalf("reply %d bytes > request %d bytes", ReplySize, RequestSize)
	}
}

// TestRequestAndReplyDoNotPassForEachOther: a reply sent back to the
// server, or a request to the agent, is refused by its magic.
func TestRequestAndReplyDoNotPassForEachOther(t *testing.T) {
	ak := testAgentKey(1)
	k := DeriveKey(testSecret, testMachine, ak)
	req := sealed(t, Request{MachineID: testMachine, AgentKey: ak, Counter: 1}, k)
	if _, err := OpenReply(req, &k); !errors.Is(err, ErrMalformed) {
		t.Fatalf("request opened as reply: %v", err)
	}
	rep := (&Reply{Counter: 1}).Seal(nil, &k)
	if _, err := ParseRequest(rep); !errors.Is(err, ErrMalformed) {
		t.Fatalf("reply parsed as request: %v", err)
	}
}

func TestParseRequestRefusesBadFields(t *testing.T) {
	ak := testAgentKey(1)
	k := DeriveKey(testSecret, testMachine, ak)
	good := sealed(t, Request{MachineID: testMachine, AgentKey: ak, Counter: 1}, k)
	for name, c := range map[string]struct {
		b    []byte
		want string
	}{
		"empty":             {nil, "request of 0 bytes, want 84"},
		"short":             {good[:83], "request of 83 bytes"},
		"long":              {append(bytes.Clone(good), 0), "request of 85 bytes"},
		"magic":             {append([]byte("SHB\x02"), good[4:]...), "request magic 53484202"},
		"counter 0":         {sealed(t, Request{MachineID: testMachine, AgentKey: ak}, k), "counter 0 outside"},
		"counter above int": {sealed(t, Request{MachineID: testMachine, AgentKey: ak, Counter: 1 << 63}, k), "counter 9223372036854775808 outside"},
		"generation":        {sealed(t, Request{MachineID: testMachine, AgentKey: ak, Counter: 1, KnownGeneration: -1}, k), "known generation -1 is negative"},
	} {
		_, err := ParseRequest(c.b)
		if !errors.Is(err, ErrMalformed) || !bytes.Contains([]byte(err.Error()), []byte(c.want)) {
			t.Errorf("%s: ParseRequest = %v, want ErrMalformed saying %q", name, err, c.want)
		}
	}
}

func TestKeyIsNeverPrinted(t *testing.T) {
	k := DeriveKey(testSecret, testMachine, testAgentKey(1))
	h := hex.EncodeToString(k[:])
	for _, verb := range []string{"%v", "%s", "%x", "%X", "%q", "%+v", "%#v", "%d"} {
		out := fmt.Sprintf(verb, k)
		if out != "REDACTED" || bytes.Contains([]byte(out), []byte(h[:8])) {
			t.Errorf("%s printed %q", verb, out)
		}
	}
	if out := fmt.Sprint(struct{ K Key }{k}); out != "{REDACTED}" {
		t.Errorf("a struct holding the key printed %q", out)
	}
}

// FuzzParseRequest: whatever arrives on the server's UDP port, parsing it
// never panics, and what it accepts seals back to the same bytes once
// given the same MAC.
func FuzzParseRequest(f *testing.F) {
	ak := testAgentKey(1)
	k := DeriveKey(testSecret, testMachine, ak)
	f.Add((&Request{MachineID: testMachine, AgentKey: ak, Counter: 3, KnownGeneration: 1}).Seal(nil, &k))
	f.Add([]byte("SHB\x01"))
	f.Add(make([]byte, RequestSize))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := ParseRequest(b)
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("error %v is not ErrMalformed", err)
			}
			return
		}
		var kk Key
		again := r.Seal(nil, &kk)
		if !bytes.Equal(again[:RequestSize-macSize], b[:RequestSize-macSize]) {
			t.Fatalf("parsed %+v does not seal back to its bytes", r)
		}
		_ = VerifyRequest(b, &k)
	})
}

// FuzzOpenReply: whatever arrives at the agent, opening it never panics
// and never accepts a reply without the right MAC.
func FuzzOpenReply(f *testing.F) {
	k := DeriveKey(testSecret, testMachine, testAgentKey(1))
	f.Add((&Reply{Counter: 3, Status: StatusCallTLS, NextIn: time.Second}).Seal(nil, &k))
	f.Add([]byte("SHB\x81"))
	f.Fuzz(func(t *testing.T, b []byte) {
		r, err := OpenReply(b, &k)
		if err != nil {
			if !errors.Is(err, ErrMalformed) && !errors.Is(err, ErrBadMAC) {
				t.Fatalf("error %v is neither ErrMalformed nor ErrBadMAC", err)
			}
			return
		}
		if again := r.Seal(nil, &k); !bytes.Equal(again, b) {
			t.Fatalf("opened %+v does not seal back to its bytes", r)
		}
	})
}
