package bmdb

import (
	"context"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb/model"
)

// causeClaimUnknown is the history cause of work released because its claim
// committed while the claimer never heard so.
const causeClaimUnknown = "claim outcome unknown (reply lost); released by its session"

// workKey names one work item of a session.
type workKey struct {
	machine uuid.UUID
	process Process
}

// hold records w as held by its session, so that reconciliation keeps it.
func (s *Session) hold(w *Work) {
	s.heldMu.Lock()
	defer s.heldMu.Unlock()
	s.held[workKey{w.MachineID, w.Process}] = w
}

// drop forgets w once it has ended (or was lost).
func (s *Session) drop(w *Work) {
	s.heldMu.Lock()
	defer s.heldMu.Unlock()
	k := workKey{w.MachineID, w.Process}
	if s.held[k] == w {
		delete(s.held, k)
	}
}

// heldKeys names the work the session knows it holds, in the form
// WorkReleaseUnknown takes.
func (s *Session) heldKeys() []string {
	s.heldMu.Lock()
	defer s.heldMu.Unlock()
	keys := make([]string, 0, len(s.held))
	for k := range s.held {
		keys = append(keys, k.machine.String()+" "+string(k.process))
	}
	return keys
}

// claimUnknown records that a claim may have committed without the session
// hearing so, and wakes reconcileLoop to release what it may have taken.
func (s *Session) claimUnknown() {
	s.unsure.Store(true)
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// reconcileLoop resolves claims whose outcome is unknown. A claim whose
// reply is lost (the connection broke after the statement was sent) may
// have committed: the machine is then held by this live session, but no
// Work exists to end it, so without this it would stay claimed for the
// life of the process. After such a claim, the session releases every work
// row it holds that no live Work of its own knows (history Canceled), and
// retries that with growing pauses until it succeeds or the session ends.
// It runs until ctx (the session's renewal context) is done.
func (s *Session) reconcileLoop(ctx context.Context) {
	defer close(s.reconcileDone)
	const firstPause = 100 * time.Millisecond
	pause := firstPause
	var retry <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.kick:
		case <-retry:
		}
		retry = nil
		if !s.unsure.Load() {
			continue
		}
		if err := s.reconcile(ctx); err != nil {
			if s.ctx.Err() != nil {
				// Lost or closed: expiry or Close deals with the work.
				return
			}
			s.db.failures.Warn(ctx, "releasing work of claims with an unknown outcome failed, retrying",
				"session_id", s.id.String(), "session_component", s.cfg.Component, "err", err, "pause", pause)
			retry = time.After(jitter(pause))
			pause = min(2*pause, max(s.cfg.Lease/3, firstPause))
			continue
		}
		pause = firstPause
	}
}

// reconcile releases the session's work rows that no live Work knows. It
// excludes claims while it runs, so that a claim that committed but is not
// yet recorded as held cannot be mistaken for a lost one.
func (s *Session) reconcile(ctx context.Context) error {
	s.claimMu.Lock()
	defer s.claimMu.Unlock()
	if !s.unsure.Swap(false) {
		return nil
	}
	rctx, cancel := context.WithTimeout(ctx, max(s.cfg.Lease/3, minLease/3))
	defer cancel()
	rows, err := s.db.q.WorkReleaseUnknown(rctx, model.WorkReleaseUnknownParams{
		SessionID: s.id, Held: s.heldKeys(), Cause: causeClaimUnknown,
	})
	if err != nil {
		s.unsure.Store(true)
		return fmt.Errorf("bmdb: releasing work of claims with an unknown outcome in session %s: %w", s.id, err)
	}
	for _, r := range rows {
		s.db.metrics.workStarted.WithLabelValues(r.Process).Inc()
		s.db.metrics.workEnded.WithLabelValues(r.Process, resultCanceled).Inc()
		s.log.WarnContext(ctx, "released work whose claim's outcome was unknown", "machine_id", r.MachineID.String(), "process", r.Process)
	}
	return nil
}
