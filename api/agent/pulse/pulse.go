// Package pulse is the wire format of heartbeat datagrams: the UDP form of
// the heartbeat RPC that an agent uses once a TLS heartbeat has granted it a
// key (agentv1.DatagramGrant). A datagram needs no connection, so the
// callback server holds nothing per agent between heartbeats; server/doc.go
// has the measurements that chose it.
//
// A request names the machine and the agent's ed25519 public key, carries a
// counter and the installation generation the agent knows, and ends in a MAC
// under the key K = HMAC-SHA256(secret, label ‖ machine id ‖ agent key),
// where the secret is held by the BMDB and known only to callback servers.
// The server derives K from the request's own fields, so it needs no state
// to check the MAC; the BMDB then checks, in the statement that records the
// heartbeat, that the agent key is still the machine's (a recovery replaces
// it) and that the counter is above the last one accepted (replays).
//
// The reply echoes the counter, says what became of the heartbeat, and is
// MACed under the same K, so the agent can trust it. A reply is never longer
// than its request: the server cannot be used to amplify traffic towards a
// forged source address.
//
// All integers are big-endian.
//
//	request (84 bytes)            reply (33 bytes)
//	 0  magic "SHB" + 0x01         0  magic "SHB" + 0x81
//	 4  machine id (16)            4  counter (8)
//	20  agent public key (32)     12  status (1)
//	52  counter (8)               13  next heartbeat in, ms (4)
//	60  known generation (8)      17  MAC (16)
//	68  MAC (16)
package pulse

import (
	"crypto/ed25519"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/google/uuid"
)

// Sizes of the two datagrams.
const (
	RequestSize = 84
	ReplySize   = 33
)

const (
	macSize      = 16
	requestMagic = "SHB\x01"
	replyMagic   = "SHB\x81"
	// keyLabel separates the derivation of K from any other use of the
	// secret.
	keyLabel = "shepherd heartbeat datagram key v1\x00"
	// SecretSize is the size of the BMDB-held secret keys are derived from.
	SecretSize = 32
)

// Errors of parsing; test with errors.Is.
var (
	// ErrMalformed means the datagram is not one of ours: wrong size,
	// magic or field value.
	ErrMalformed = errors.New("pulse: malformed datagram")
	// ErrBadMAC means the MAC does not match the key.
	ErrBadMAC = errors.New("pulse: datagram MAC does not match")
)

// Key is the MAC key of one (machine, agent key) pair. It is a secret: its
// String and Format print REDACTED.
type Key [32]byte

// String keeps the key out of log lines.
func (Key) String() string { return "REDACTED" }

// Format keeps every fmt verb from printing the key.
func (Key) Format(f fmt.State, _ rune) { _, _ = f.Write([]byte("REDACTED")) }

// DeriveKey returns the MAC key of machine and agentKey under secret.
func DeriveKey(secret []byte, machine uuid.UUID, agentKey ed25519.PublicKey) Key {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte(keyLabel))
	m.Write(machine[:])
	m.Write(agentKey)
	var k Key
	m.Sum(k[:0])
	return k
}

// Request is one heartbeat datagram.
type Request struct {
	MachineID uuid.UUID
	// AgentKey is the agent's ed25519 public key (32 bytes).
	AgentKey ed25519.PublicKey
	// Counter is greater than that of every earlier datagram of this agent
	// key; 1 ≤ Counter ≤ math.MaxInt64 (the BMDB stores it as a bigint).
	Counter uint64
	// KnownGeneration is the newest installation request generation the
	// agent has received (0: none). The server tells the agent to call over
	// TLS when a newer one is pending.
	KnownGeneration int64
}

// Seal appends r, MACed under k, to dst.
func (r *Request) Seal(dst []byte, k *Key) []byte {
	start := len(dst)
	dst = append(dst, requestMagic...)
	dst = append(dst, r.MachineID[:]...)
	var ak [ed25519.PublicKeySize]byte
	copy(ak[:], r.AgentKey)
	dst = append(dst, ak[:]...)
	dst = binary.BigEndian.AppendUint64(dst, r.Counter)
	dst = binary.BigEndian.AppendUint64(dst, uint64(r.KnownGeneration))
	return appendMAC(dst, dst[start:], k)
}

// ParseRequest decodes b's fields without checking its MAC (the key is
// derived from them); call VerifyRequest with that key before trusting any.
func ParseRequest(b []byte) (Request, error) {
	if len(b) != RequestSize {
		return Request{}, fmt.Errorf("%w: request of %d bytes, want %d", ErrMalformed, len(b), RequestSize)
	}
	if string(b[:4]) != requestMagic {
		return Request{}, fmt.Errorf("%w: request magic %x", ErrMalformed, b[:4])
	}
	var r Request
	copy(r.MachineID[:], b[4:20])
	r.AgentKey = ed25519.PublicKey(append([]byte(nil), b[20:52]...))
	r.Counter = binary.BigEndian.Uint64(b[52:60])
	r.KnownGeneration = int64(binary.BigEndian.Uint64(b[60:68]))
	if r.Counter == 0 || r.Counter > math.MaxInt64 {
		return Request{}, fmt.Errorf("%w: counter %d outside 1..%d", ErrMalformed, r.Counter, uint64(math.MaxInt64))
	}
	if r.KnownGeneration < 0 {
		return Request{}, fmt.Errorf("%w: known generation %d is negative", ErrMalformed, r.KnownGeneration)
	}
	return r, nil
}

// VerifyRequest reports whether the MAC of request b (of RequestSize bytes)
// is right under k, in constant time.
func VerifyRequest(b []byte, k *Key) error {
	if len(b) != RequestSize {
		return fmt.Errorf("%w: request of %d bytes, want %d", ErrMalformed, len(b), RequestSize)
	}
	return checkMAC(b, k)
}

// Status says what became of a heartbeat datagram.
type Status uint8

const (
	// StatusRecorded: the heartbeat was recorded, nothing else to do.
	StatusRecorded Status = 0
	// StatusCallTLS: make the next heartbeat over TLS now. The server says
	// so when an installation request is pending, and when it refused the
	// datagram (an agent key no longer the machine's, a replayed counter, a
	// retired machine): the TLS call then gives the agent the full answer.
	StatusCallTLS Status = 1
	// StatusRetryLater: the server could not record the heartbeat (its
	// database is unreachable); send it again after a back-off, without
	// falling back to TLS, which would cost every agent a handshake for
	// nothing.
	StatusRetryLater Status = 2
)

func (s Status) String() string {
	switch s {
	case StatusRecorded:
		return "recorded"
	case StatusCallTLS:
		return "call-tls"
	case StatusRetryLater:
		return "retry-later"
	}
	return fmt.Sprintf("status(%d)", uint8(s))
}

// Reply is the server's answer to one request.
type Reply struct {
	// Counter is the request's counter: an agent ignores replies to
	// datagrams it is no longer waiting for.
	Counter uint64
	Status  Status
	// NextIn is when to send the next heartbeat (with StatusRetryLater:
	// when to send this one again); 0 means the agent's default. Carried
	// in whole milliseconds, at most about 49 days.
	NextIn time.Duration
}

// Seal appends r, MACed under k, to dst.
func (r *Reply) Seal(dst []byte, k *Key) []byte {
	start := len(dst)
	dst = append(dst, replyMagic...)
	dst = binary.BigEndian.AppendUint64(dst, r.Counter)
	dst = append(dst, byte(r.Status))
	ms := r.NextIn.Milliseconds()
	ms = max(0, min(ms, math.MaxUint32))
	dst = binary.BigEndian.AppendUint32(dst, uint32(ms))
	return appendMAC(dst, dst[start:], k)
}

// OpenReply checks reply b's MAC under k and decodes it.
func OpenReply(b []byte, k *Key) (Reply, error) {
	if len(b) != ReplySize {
		return Reply{}, fmt.Errorf("%w: reply of %d bytes, want %d", ErrMalformed, len(b), ReplySize)
	}
	if string(b[:4]) != replyMagic {
		return Reply{}, fmt.Errorf("%w: reply magic %x", ErrMalformed, b[:4])
	}
	if err := checkMAC(b, k); err != nil {
		return Reply{}, err
	}
	r := Reply{
		Counter: binary.BigEndian.Uint64(b[4:12]),
		Status:  Status(b[12]),
		NextIn:  time.Duration(binary.BigEndian.Uint32(b[13:17])) * time.Millisecond,
	}
	if r.Status > StatusRetryLater {
		return Reply{}, fmt.Errorf("%w: unknown status %d", ErrMalformed, b[12])
	}
	return r, nil
}

// appendMAC appends the MAC of msg under k to dst (msg may alias dst).
func appendMAC(dst, msg []byte, k *Key) []byte {
	m := hmac.New(sha256.New, k[:])
	m.Write(msg)
	var sum [sha256.Size]byte
	return append(dst, m.Sum(sum[:0])[:macSize]...)
}

// checkMAC checks the MAC that ends b.
func checkMAC(b []byte, k *Key) error {
	body := b[:len(b)-macSize]
	m := hmac.New(sha256.New, k[:])
	m.Write(body)
	var sum [sha256.Size]byte
	if !hmac.Equal(m.Sum(sum[:0])[:macSize], b[len(body):]) {
		return ErrBadMAC
	}
	return nil
}
