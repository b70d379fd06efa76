package bmdb

import (
	"cmp"
	"context"
	"fmt"
	"time"

	"github.com/shepherd/shepherd/bmdb/model"
)

// SilenceTimeouts are the heartbeat timeouts that decide which agents are
// silent (SPEC §2.6, §3.7): the recovery candidates, the derived state
// Silent and the circuit breaker's count. They are the recoverer's
// configuration; every recoverer records the values it uses in the BMDB
// (RecordSilenceTimeouts), and every surface that derives Silent reads them
// from there (DB.SilenceTimeouts), so that none judges by defaults of its
// own what the recoverer judges otherwise.
type SilenceTimeouts struct {
	// FirstHeartbeat: a started agent without a heartbeat for this long is
	// silent. Heartbeat: an agent whose last heartbeat is older is silent.
	FirstHeartbeat, Heartbeat time.Duration
	// Recorded says the values were written by a recoverer; false means no
	// recoverer ever recorded them and they are the defaults.
	Recorded bool
	// Provider and WrittenBy name the recoverer that wrote them last (its
	// provider; its component, host and process id), at WrittenAt.
	Provider, WrittenBy string
	WrittenAt           time.Time
}

// DefaultSilenceTimeouts are the timeouts in force when no recoverer has
// recorded any: DefaultFirstHeartbeatTimeout and DefaultHeartbeatTimeout.
func DefaultSilenceTimeouts() SilenceTimeouts {
	return SilenceTimeouts{FirstHeartbeat: DefaultFirstHeartbeatTimeout, Heartbeat: DefaultHeartbeatTimeout}
}

// Describe says what the timeouts are and where they come from, for the
// CLI and the web UI.
func (t SilenceTimeouts) Describe() string {
	s := fmt.Sprintf("first heartbeat timeout %s, heartbeat timeout %s", t.FirstHeartbeat, t.Heartbeat)
	if !t.Recorded {
		return s + " (defaults: no recoverer has recorded the timeouts it uses)"
	}
	return fmt.Sprintf("%s (recorded by the recoverer of provider %s, %s, at %s)",
		s, t.Provider, t.WrittenBy, t.WrittenAt.UTC().Format(time.RFC3339))
}

// RecordSilenceTimeouts records the timeouts a recoverer of provider uses
// (zero: the defaults); the last writer wins. writtenBy names the process
// (component, host, process id).
func (db *DB) RecordSilenceTimeouts(ctx context.Context, provider, writtenBy string, firstHeartbeat, heartbeat time.Duration) error {
	if firstHeartbeat < 0 || heartbeat < 0 {
		return fmt.Errorf("bmdb: heartbeat timeouts must be >= 0 (0 = default), got %s and %s", firstHeartbeat, heartbeat)
	}
	first, hb := cmp.Or(firstHeartbeat, DefaultFirstHeartbeatTimeout), cmp.Or(heartbeat, DefaultHeartbeatTimeout)
	if first < time.Millisecond || hb < time.Millisecond {
		return fmt.Errorf("bmdb: heartbeat timeouts must be at least 1ms, got %s and %s", first, hb)
	}
	err := db.retry(ctx, func(ctx context.Context) error {
		return db.q.SilenceTimeoutsSet(ctx, model.SilenceTimeoutsSetParams{
			FirstHeartbeatTimeoutMs: first.Milliseconds(),
			HeartbeatTimeoutMs:      hb.Milliseconds(),
			Provider:                provider,
			WrittenBy:               writtenBy,
		})
	})
	if err != nil {
		return fmt.Errorf("bmdb: recording the heartbeat timeouts: %w", err)
	}
	return nil
}

// SilenceTimeouts returns the timeouts in force: those the last recoverer
// recorded, or the defaults (Recorded false) if none did.
func (db *DB) SilenceTimeouts(ctx context.Context) (SilenceTimeouts, error) {
	rows, err := db.q.SilenceTimeoutsGet(ctx)
	if err != nil {
		return SilenceTimeouts{}, fmt.Errorf("bmdb: reading the heartbeat timeouts: %w", err)
	}
	t := DefaultSilenceTimeouts()
	for _, r := range rows {
		d := time.Duration(r.ValueMs) * time.Millisecond
		switch r.Setting {
		case "first_heartbeat_timeout":
			t.FirstHeartbeat = d
		case "heartbeat_timeout":
			t.Heartbeat = d
		default:
			continue
		}
		t.Recorded = true
		if r.WrittenAt.After(t.WrittenAt) {
			t.Provider, t.WrittenBy, t.WrittenAt = r.Provider, r.WrittenBy, r.WrittenAt
		}
	}
	return t, nil
}
