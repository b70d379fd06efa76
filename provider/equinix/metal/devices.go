package metal

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strings"
)

// WitnessTagPrefix starts the tag by which CreateDevice recognises the
// device it created.
const WitnessTagPrefix = "shepherd-witness:"

// WitnessTag is the tag CreateDevice puts on a device created with the
// given witness.
func WitnessTag(witness string) string { return WitnessTagPrefix + witness }

// maxWitnessLen keeps the witness tag well below the API's tag length
// limit; a UUID is 36 bytes.
const maxWitnessLen = 128

// needID rejects an empty id, which would turn "/devices/{id}" into
// another endpoint.
func needID(what, id string) error {
	if id == "" {
		return fmt.Errorf("metal: empty %s id", what)
	}
	return nil
}

// ListDevices returns every device of the project, all pages.
func (c *Client) ListDevices(ctx context.Context, projectID string) ([]Device, error) {
	if err := needID("project", projectID); err != nil {
		return nil, err
	}
	return listAll(ctx, c, epProjectDevices, "/projects/"+url.PathEscape(projectID)+"/devices", "devices",
		func(d Device) string { return d.ID })
}

// GetDevice returns the device with the given id, or an error matching
// ErrNotFound.
func (c *Client) GetDevice(ctx context.Context, id string) (Device, error) {
	if err := needID("device", id); err != nil {
		return Device{}, err
	}
	var d Device
	r := &request{method: http.MethodGet, endpoint: epDevice, path: "/devices/" + url.PathEscape(id), repeatable: true}
	if err := c.do(ctx, r, &d); err != nil {
		return Device{}, err
	}
	return d, nil
}

// CreateDevice creates a device on the hardware reservation
// req.HardwareReservationID (required) in the project, and returns it as
// the API first describes it (usually queued, without addresses).
//
// It is idempotent for a given witness, a string unique to this creation
// (a UUID): the request carries WitnessTag(witness), and the POST is never
// repeated blindly. After an answer that leaves the outcome open (network
// error, timeout, 5xx, a lost or unreadable response) or a 422, it reads
// the reservation: a device there with our witness tag is the result; a
// device without it gives an error matching ErrRaceLost; no device means
// the create did not happen and, after an open outcome, it is sent again.
// Other 4xx answers are returned as they are (see IsPermanent). If the
// call's deadline passes before it knows, the error matches
// ErrOutcomeUnknown: a device with the witness tag may yet appear.
func (c *Client) CreateDevice(ctx context.Context, projectID string, req CreateDeviceRequest, witness string) (Device, error) {
	if err := needID("project", projectID); err != nil {
		return Device{}, err
	}
	if req.HardwareReservationID == "" {
		// Without a reservation there is nothing to check after a lost
		// answer, and so no way to create without risking two devices.
		return Device{}, errors.New("metal: CreateDevice needs HardwareReservationID")
	}
	if witness == "" || len(witness) > maxWitnessLen || strings.ContainsFunc(witness, isCtlOrSpace) {
		return Device{}, fmt.Errorf("metal: CreateDevice: witness must be 1-%d bytes without spaces, got %q",
			maxWitnessLen, witness)
	}
	tag := WitnessTag(witness)
	tags := make([]string, 0, len(req.Tags)+1)
	for _, t := range req.Tags {
		if strings.HasPrefix(t, WitnessTagPrefix) && t != tag {
			return Device{}, fmt.Errorf("metal: CreateDevice: Tags already carry another witness tag %q", t)
		}
		if t != tag {
			tags = append(tags, t)
		}
	}
	req.Tags = append(tags, tag) // req is a copy; the caller's slice is untouched
	body, err := json.Marshal(req)
	if err != nil {
		return Device{}, fmt.Errorf("metal: encoding the device request: %w", err)
	}
	what := fmt.Sprintf("creating device %q on hardware reservation %s", req.Hostname, req.HardwareReservationID)

	ctx, cancel := context.WithTimeout(ctx, c.cfg.RetryDeadline)
	defer cancel()
	for attempt := 1; ; attempt++ {
		if attempt > 1 {
			c.metrics.retries.WithLabelValues(epProjectDevices).Inc()
		}
		var d Device
		r := &request{method: http.MethodPost, endpoint: epProjectDevices,
			path: "/projects/" + url.PathEscape(projectID) + "/devices", body: body}
		err := c.do(ctx, r, &d)
		if err == nil {
			return d, nil
		}
		open := errors.Is(err, ErrOutcomeUnknown)
		if !open && !hasStatus(err, http.StatusUnprocessableEntity) {
			if attempt > 1 && !IsPermanent(err) {
				// Say that the earlier attempt, whose outcome was open, may
				// still complete (it may have been slow, not lost).
				return Device{}, fmt.Errorf("%s: %w: %w", what, ErrOutcomeUnknown, err)
			}
			return Device{}, fmt.Errorf("%s: %w", what, err)
		}
		// Our own earlier attempt may have succeeded: look at the reservation.
		d, found, cerr := c.witnessDevice(ctx, req.HardwareReservationID, tag)
		switch {
		case errors.Is(cerr, ErrRaceLost):
			return Device{}, fmt.Errorf("%s: %w", what, cerr)
		case cerr != nil:
			return Device{}, fmt.Errorf("%s: %w; checking the reservation: %w", what, err, cerr)
		case found:
			c.log.DebugContext(ctx, "metal device create answer lost, found the device by its witness",
				slog.String("device_id", d.ID), slog.String("reservation_id", req.HardwareReservationID))
			return d, nil
		case !open:
			return Device{}, fmt.Errorf("%s: %w", what, err) // a 422 for another reason
		}
		c.log.DebugContext(ctx, "metal device create failed and did not happen, retrying",
			slog.String("reservation_id", req.HardwareReservationID), slog.Int("attempt", attempt), slog.Any("err", err))
		if werr := c.waitBackoff(ctx, attempt); werr != nil {
			return Device{}, fmt.Errorf("%s: %w (giving up: %w)", what, err, werr)
		}
	}
}

// witnessDevice reads the reservation and the device on it. It returns the
// device and true if the device carries tag, false if the reservation has
// no device, and an error matching ErrRaceLost if the device lacks tag.
func (c *Client) witnessDevice(ctx context.Context, reservationID, tag string) (Device, bool, error) {
	// A device deleted between the two reads sends us back to the
	// reservation; a few rounds suffice unless someone churns it on purpose.
	const rounds = 3
	for range rounds {
		res, err := c.GetHardwareReservation(ctx, reservationID)
		if err != nil {
			return Device{}, false, err
		}
		if res.Device == nil || res.Device.ID == "" {
			return Device{}, false, nil
		}
		d, err := c.GetDevice(ctx, res.Device.ID)
		if errors.Is(err, ErrNotFound) {
			continue
		}
		if err != nil {
			return Device{}, false, err
		}
		if slices.Contains(d.Tags, tag) {
			return d, true, nil
		}
		return Device{}, false, fmt.Errorf("%w: reservation %s holds device %s (%s)",
			ErrRaceLost, reservationID, d.ID, d.Hostname)
	}
	return Device{}, false, fmt.Errorf("metal: the device on hardware reservation %s changed %d times while we read it",
		reservationID, rounds)
}

// DeleteDevice deletes the device; its reservation becomes free again. A
// device that does not exist gives an error matching ErrNotFound, unless
// an earlier attempt of this call may have deleted it: then that is
// success.
func (c *Client) DeleteDevice(ctx context.Context, id string) error {
	if err := needID("device", id); err != nil {
		return err
	}
	r := &request{method: http.MethodDelete, endpoint: epDevice, path: "/devices/" + url.PathEscape(id), repeatable: true}
	err := c.do(ctx, r, nil)
	if errors.Is(err, ErrNotFound) && r.ambiguous {
		return nil
	}
	return err
}

// RebootDevice asks for the device to be power cycled. It returns once the
// API accepted; the device then goes through powering_off and powering_on
// to active.
func (c *Client) RebootDevice(ctx context.Context, id string) error {
	return c.deviceAction(ctx, id, struct {
		Type string `json:"type"`
	}{"reboot"}, DeviceStatePoweringOff, DeviceStatePoweringOn)
}

// ReinstallDevice asks for the device to be reinstalled. It returns once
// the API accepted; the device then goes through reinstalling to active.
func (c *Client) ReinstallDevice(ctx context.Context, id string, req ReinstallRequest) error {
	return c.deviceAction(ctx, id, struct {
		Type string `json:"type"`
		ReinstallRequest
	}{"reinstall", req}, DeviceStateReinstalling)
}

// deviceAction posts an action. Repeating one after an ambiguous failure
// is harmless (at worst a second reboot), but if the first attempt did act
// the repetition gets 422 (the device is no longer active): then a device
// in one of the action's states means success.
func (c *Client) deviceAction(ctx context.Context, id string, action any, states ...string) error {
	if err := needID("device", id); err != nil {
		return err
	}
	body, err := json.Marshal(action)
	if err != nil {
		return fmt.Errorf("metal: encoding the device action: %w", err)
	}
	ctx, cancel := context.WithTimeout(ctx, c.cfg.RetryDeadline)
	defer cancel()
	r := &request{method: http.MethodPost, endpoint: epDeviceActions,
		path: "/devices/" + url.PathEscape(id) + "/actions", body: body, repeatable: true}
	err = c.do(ctx, r, nil)
	if err == nil || !r.ambiguous || !hasStatus(err, http.StatusUnprocessableEntity) {
		return err
	}
	if d, gerr := c.GetDevice(ctx, id); gerr == nil && slices.Contains(states, d.State) {
		return nil
	}
	return err
}
