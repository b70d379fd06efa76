package bmdb

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/shepherd/shepherd/bmdb/model"
	"github.com/shepherd/shepherd/internal/ratelog"
)

// RecorderCheckIn is how often a heartbeat recorder confirms it can write.
// The recovery candidate query treats a live recorder that has not checked
// in for 5 s as unable to record (bmdb/candidates/recovery.sql).
const RecorderCheckIn = time.Second

// HeartbeatRecorder tells recovery when a callback server could not record
// heartbeats, so that silence overlapping the server's own trouble does not
// count against machines (SPEC §8 R6; issue 10 item 10). A callback server
// runs one under a session of its own (component "server"): the row of its
// session says since when it has recorded without failing and when it last
// confirmed it can write. A failed batch (Failed) or a failed check-in
// restarts the window at the next successful check-in; a recorder that
// stops checking in, or whose process dies, holds recovery back for one
// heartbeat timeout by itself.
type HeartbeatRecorder struct {
	db *DB
	// failures bounds the check-in failure lines of an outage.
	failures *ratelog.Logger
	failed   atomic.Bool
}

// NewHeartbeatRecorder returns a recorder for a callback server using db.
func (db *DB) NewHeartbeatRecorder(log *slog.Logger) *HeartbeatRecorder {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &HeartbeatRecorder{db: db, failures: ratelog.New(log, 0)}
}

// Failed records that the server failed to record heartbeats: the next
// check-in that succeeds restarts the recorder's silence window.
func (r *HeartbeatRecorder) Failed() { r.failed.Store(true) }

// Run keeps a session with a recorder row and checks in every
// RecorderCheckIn until ctx ends; then it closes the session, which ends
// the recorder's say. It returns nil when ctx ends.
func (r *HeartbeatRecorder) Run(ctx context.Context) error {
	// The failures the rate limit held back are told when the recorder
	// stops, not lost with it.
	defer r.failures.Flush()
	return r.db.KeepSession(ctx, SessionConfig{Component: "server"}, func(ctx context.Context, s *Session) error {
		t := time.NewTicker(RecorderCheckIn)
		defer t.Stop()
		registered := false
		for {
			// A black-holed database must not hold a check-in past the
			// point where it would count as missed anyway.
			cctx, cancel := context.WithTimeout(ctx, 4*RecorderCheckIn)
			var err error
			if !registered {
				err = r.db.q.HeartbeatRecorderRegister(cctx, s.id)
				registered = err == nil
				if err == nil {
					r.failed.Store(false)
				}
			} else {
				recovered := r.failed.Swap(false)
				var n int64
				n, err = r.db.q.HeartbeatRecorderCheckIn(cctx, model.HeartbeatRecorderCheckInParams{SessionID: s.id, Recovered: recovered})
				if err != nil && recovered {
					r.failed.Store(true)
				}
				if err == nil && n == 0 {
					registered = false // the row went with a deleted session
					err = fmt.Errorf("recorder row of session %s is gone", s.id)
				}
			}
			cancel()
			if err != nil && ctx.Err() == nil {
				r.failed.Store(true)
				r.failures.Warn(ctx, "heartbeat recorder check-in failed", "err", err)
			}
			select {
			case <-ctx.Done():
				return nil
			case <-t.C:
			}
		}
	})
}
