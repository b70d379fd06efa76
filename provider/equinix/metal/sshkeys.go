package metal

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
)

// ListSSHKeys returns every SSH key of the project, all pages.
func (c *Client) ListSSHKeys(ctx context.Context, projectID string) ([]SSHKey, error) {
	if err := needID("project", projectID); err != nil {
		return nil, err
	}
	return listAll(ctx, c, epProjectSSHKeys, "/projects/"+url.PathEscape(projectID)+"/ssh-keys", "ssh_keys",
		func(k SSHKey) string { return k.ID })
}

type sshKeyBody struct {
	Label string `json:"label"`
	Key   string `json:"key"`
}

// CreateSSHKey adds an SSH key to the project. The API does not make
// creation idempotent, so the POST is not repeated after a failure that
// leaves the outcome open; the error then matches ErrOutcomeUnknown, and a
// key may have been created. EnsureSSHKey handles that.
func (c *Client) CreateSSHKey(ctx context.Context, projectID, label, key string) (SSHKey, error) {
	if err := needID("project", projectID); err != nil {
		return SSHKey{}, err
	}
	body, err := json.Marshal(sshKeyBody{Label: label, Key: key})
	if err != nil {
		return SSHKey{}, fmt.Errorf("metal: encoding the SSH key: %w", err)
	}
	var k SSHKey
	r := &request{method: http.MethodPost, endpoint: epProjectSSHKeys,
		path: "/projects/" + url.PathEscape(projectID) + "/ssh-keys", body: body}
	if err := c.do(ctx, r, &k); err != nil {
		return SSHKey{}, fmt.Errorf("creating SSH key %q in project %s: %w", label, projectID, err)
	}
	return k, nil
}

// UpdateSSHKey sets the label and key of an SSH key. Setting them is
// idempotent, so it is repeated like a read.
func (c *Client) UpdateSSHKey(ctx context.Context, id, label, key string) (SSHKey, error) {
	if err := needID("SSH key", id); err != nil {
		return SSHKey{}, err
	}
	body, err := json.Marshal(sshKeyBody{Label: label, Key: key})
	if err != nil {
		return SSHKey{}, fmt.Errorf("metal: encoding the SSH key: %w", err)
	}
	var k SSHKey
	r := &request{method: http.MethodPut, endpoint: epSSHKey, path: "/ssh-keys/" + url.PathEscape(id),
		body: body, repeatable: true}
	if err := c.do(ctx, r, &k); err != nil {
		return SSHKey{}, fmt.Errorf("updating SSH key %s (%q): %w", id, label, err)
	}
	return k, nil
}

// EnsureSSHKey makes the project have an SSH key with this label and key,
// and returns it: an existing key with both is returned as it is; one with
// the label but another key is updated; otherwise a key is created. After
// a create whose outcome is open it lists the keys again before creating,
// so it never makes a second key with the label (unless the API, after an
// attempt timed out, completes the create later than our next listing).
// Keys are compared without surrounding white space; with several keys of
// the label, the first in the API's order is the one updated.
func (c *Client) EnsureSSHKey(ctx context.Context, projectID, label, key string) (SSHKey, error) {
	if label == "" {
		return SSHKey{}, errors.New("metal: EnsureSSHKey needs a label")
	}
	ctx, cancel := context.WithTimeout(ctx, c.cfg.RetryDeadline)
	defer cancel()
	for attempt := 1; ; attempt++ {
		keys, err := c.ListSSHKeys(ctx, projectID)
		if err != nil {
			return SSHKey{}, fmt.Errorf("ensuring SSH key %q: %w", label, err)
		}
		var labelled *SSHKey
		for i, k := range keys {
			if k.Label != label {
				continue
			}
			if strings.TrimSpace(k.Key) == strings.TrimSpace(key) {
				return k, nil
			}
			if labelled == nil {
				labelled = &keys[i]
			}
		}
		if labelled != nil {
			return c.UpdateSSHKey(ctx, labelled.ID, label, key)
		}
		k, err := c.CreateSSHKey(ctx, projectID, label, key)
		if err == nil || !errors.Is(err, ErrOutcomeUnknown) {
			return k, err
		}
		c.log.DebugContext(ctx, "metal SSH key create outcome unknown, listing again",
			slog.String("label", label), slog.Int("attempt", attempt), slog.Any("err", err))
		if werr := c.waitBackoff(ctx, attempt); werr != nil {
			return SSHKey{}, fmt.Errorf("%w (giving up: %w)", err, werr)
		}
	}
}
