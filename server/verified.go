package server

import (
	"context"
	"crypto/ed25519"
	"sync"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
)

// keyTag is the first bytes of an agent key: enough to tell an agent's key
// from any other a client can make up (finding a key with a given 8-byte
// prefix takes 2^64 tries), and a quarter of the memory of the whole key.
type keyTag [8]byte

func tagOf(k ed25519.PublicKey) keyTag {
	var t keyTag
	copy(t[:], k)
	return t
}

// verifiedKeys remembers, per machine, the agent key whose heartbeats the
// BMDB last accepted. It decides only which queue a heartbeat waits in; the
// BMDB still authenticates every one. It holds at most one entry per
// machine of the fleet, and only keys the BMDB accepted, so no client can
// grow it.
type verifiedKeys struct {
	mu   sync.RWMutex
	keys map[uuid.UUID]keyTag
}

func newVerifiedKeys() *verifiedKeys { return &verifiedKeys{keys: map[uuid.UUID]keyTag{}} }

func (v *verifiedKeys) has(machine uuid.UUID, key ed25519.PublicKey) bool {
	v.mu.RLock()
	t, ok := v.keys[machine]
	v.mu.RUnlock()
	return ok && t == tagOf(key)
}

// learn records what the BMDB said about (machine, key): an accepted key is
// the machine's; a refused one that was remembered is forgotten (the
// machine was recovered or decommissioned).
func (v *verifiedKeys) learn(machine uuid.UUID, key ed25519.PublicKey, accepted bool) {
	t := tagOf(key)
	v.mu.RLock()
	cur, ok := v.keys[machine]
	v.mu.RUnlock()
	if accepted == (ok && cur == t) {
		return
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if accepted {
		v.keys[machine] = t
	} else if cur, ok := v.keys[machine]; ok && cur == t {
		delete(v.keys, machine)
	}
}

// load fills the cache with every agent key the BMDB holds, so that a
// restarted server serves the fleet's heartbeats first from the start
// instead of making every agent wait in the queue of unknown keys.
func (v *verifiedKeys) load(ctx context.Context, db *bmdb.DB) error {
	keys := map[uuid.UUID]keyTag{}
	err := db.AgentKeys(ctx, func(machine uuid.UUID, key ed25519.PublicKey) {
		keys[machine] = tagOf(key)
	})
	if err != nil {
		return err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	for m, t := range keys {
		v.keys[m] = t
	}
	return nil
}
