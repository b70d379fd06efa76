package bmdb

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"slices"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb/model"
)

// HistoryEvent is one row of the work history (SPEC §2.7).
type HistoryEvent struct {
	ID        int64      `json:"id"`
	MachineID uuid.UUID  `json:"machine_id"`
	Process   Process    `json:"process"`
	Event     Event      `json:"event"`
	At        time.Time  `json:"at"`
	SessionID *uuid.UUID `json:"session_id,omitempty"` // nil for operator actions made outside a session
	Cause     string     `json:"cause,omitempty"`
}

// HistoryFilter selects history rows. Zero fields do not filter.
type HistoryFilter struct {
	MachineID uuid.UUID // one machine
	Process   Process   // one process
	Since     time.Time // at or after
	Until     time.Time // before
	// AfterID continues a listing after the row with this id (a page cursor).
	AfterID int64
	// BeforeID, if > 0, returns only rows before the row with this id (a
	// page cursor for NewestFirst).
	BeforeID int64
	// NewestFirst returns the newest matching rows, newest first, rather
	// than the oldest in the order they were written.
	NewestFirst bool
	// Limit bounds the rows History returns (default 1000, at most 100,000);
	// ExportHistory uses it as its page size.
	Limit int
}

// History returns history rows matching f in the order they were written,
// or newest first with f.NewestFirst.
func (db *DB) History(ctx context.Context, f HistoryFilter) ([]HistoryEvent, error) {
	if f.Limit < 0 {
		return nil, fmt.Errorf("bmdb: history limit must be >= 0 (0 = default), got %d", f.Limit)
	}
	if f.AfterID < 0 || f.BeforeID < 0 {
		return nil, fmt.Errorf("bmdb: history cursors must be >= 0, got after %d and before %d", f.AfterID, f.BeforeID)
	}
	limit := f.Limit
	if limit == 0 {
		limit = 1000
	}
	p := model.HistoryListParams{AfterID: f.AfterID, BeforeID: f.BeforeID, RowLimit: int32(min(limit, 100_000))}
	if p.BeforeID == 0 {
		p.BeforeID = math.MaxInt64
	}
	if f.MachineID != uuid.Nil {
		p.MachineID = uuid.NullUUID{UUID: f.MachineID, Valid: true}
	}
	if f.Process != "" {
		s := string(f.Process)
		p.Process = &s
	}
	if !f.Since.IsZero() {
		p.Since = &f.Since
	}
	if !f.Until.IsZero() {
		p.Until = &f.Until
	}
	var rows []model.WorkHistory
	var err error
	if f.NewestFirst || f.BeforeID > 0 {
		rows, err = db.q.HistoryListNewest(ctx, model.HistoryListNewestParams(p))
		if !f.NewestFirst {
			// The rows just before BeforeID, in the order they were written.
			slices.Reverse(rows)
		}
	} else {
		rows, err = db.q.HistoryList(ctx, p)
	}
	if err != nil {
		return nil, fmt.Errorf("bmdb: reading history: %w", err)
	}
	out := make([]HistoryEvent, len(rows))
	for i, r := range rows {
		out[i] = HistoryEvent{
			ID:        r.HistoryID,
			MachineID: r.MachineID,
			Process:   Process(r.Process),
			Event:     Event(r.Event),
			At:        r.At,
			Cause:     r.Cause,
		}
		if r.SessionID.Valid {
			id := r.SessionID.UUID
			out[i].SessionID = &id
		}
	}
	return out, nil
}

// ExportHistory writes every history row matching f to w as JSON lines, one
// event per line, reading the table a page at a time. It returns the number
// of rows written.
func (db *DB) ExportHistory(ctx context.Context, w io.Writer, f HistoryFilter) (int, error) {
	enc := json.NewEncoder(w)
	n := 0
	for {
		page, err := db.History(ctx, f)
		if err != nil {
			return n, err
		}
		for _, e := range page {
			if err := enc.Encode(e); err != nil {
				return n, fmt.Errorf("bmdb: writing history: %w", err)
			}
			n++
		}
		if len(page) == 0 || (f.Limit > 0 && len(page) < f.Limit) || (f.Limit == 0 && len(page) < 1000) {
			return n, nil
		}
		f.AfterID = page[len(page)-1].ID
	}
}
