package metal

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
)

// ListHardwareReservations returns every hardware reservation of the
// project, all pages.
func (c *Client) ListHardwareReservations(ctx context.Context, projectID string) ([]HardwareReservation, error) {
	if err := needID("project", projectID); err != nil {
		return nil, err
	}
	return listAll(ctx, c, epProjectReservations,
		"/projects/"+url.PathEscape(projectID)+"/hardware-reservations", "hardware_reservations",
		func(r HardwareReservation) string { return r.ID })
}

// GetHardwareReservation returns the hardware reservation with the given
// id, or an error matching ErrNotFound.
func (c *Client) GetHardwareReservation(ctx context.Context, id string) (HardwareReservation, error) {
	if err := needID("hardware reservation", id); err != nil {
		return HardwareReservation{}, err
	}
	var res HardwareReservation
	r := &request{method: http.MethodGet, endpoint: epReservation,
		path: "/hardware-reservations/" + url.PathEscape(id), repeatable: true}
	if err := c.do(ctx, r, &res); err != nil {
		return HardwareReservation{}, err
	}
	return res, nil
}

// MoveHardwareReservation moves the hardware reservation to another
// project and returns it as it is there. Moving it where it already is
// succeeds. After an answer that leaves the outcome open it reads the
// reservation instead of repeating the move blindly; an error matching
// ErrOutcomeUnknown means the deadline passed before it knew.
func (c *Client) MoveHardwareReservation(ctx context.Context, id, projectID string) (HardwareReservation, error) {
	if err := needID("hardware reservation", id); err != nil {
		return HardwareReservation{}, err
	}
	if err := needID("project", projectID); err != nil {
		return HardwareReservation{}, err
	}
	body, err := json.Marshal(struct {
		ProjectID string `json:"project_id"`
	}{projectID})
	if err != nil {
		return HardwareReservation{}, fmt.Errorf("metal: encoding the move request: %w", err)
	}
	what := fmt.Sprintf("moving hardware reservation %s to project %s", id, projectID)

	ctx, cancel := context.WithTimeout(ctx, c.cfg.RetryDeadline)
	defer cancel()
	for attempt := 1; ; attempt++ {
		if attempt > 1 {
			c.metrics.retries.WithLabelValues(epReservationMove).Inc()
		}
		var res HardwareReservation
		r := &request{method: http.MethodPost, endpoint: epReservationMove,
			path: "/hardware-reservations/" + url.PathEscape(id) + "/move", body: body}
		err := c.do(ctx, r, &res)
		if err == nil {
			return res, nil
		}
		open := errors.Is(err, ErrOutcomeUnknown)
		if !open && !hasStatus(err, http.StatusUnprocessableEntity) {
			return HardwareReservation{}, fmt.Errorf("%s: %w", what, err)
		}
		// The move may have happened (ours, lost), or have happened before.
		cur, cerr := c.GetHardwareReservation(ctx, id)
		switch {
		case cerr != nil:
			return HardwareReservation{}, fmt.Errorf("%s: %w; checking the reservation: %w", what, err, cerr)
		case cur.Project != nil && cur.Project.ID == projectID:
			return cur, nil
		case !open:
			return HardwareReservation{}, fmt.Errorf("%s: %w", what, err)
		}
		c.log.DebugContext(ctx, "metal reservation move failed and did not happen, retrying",
			slog.String("reservation_id", id), slog.Int("attempt", attempt), slog.Any("err", err))
		if werr := c.waitBackoff(ctx, attempt); werr != nil {
			return HardwareReservation{}, fmt.Errorf("%s: %w (giving up: %w)", what, err, werr)
		}
	}
}
