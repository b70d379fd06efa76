package metal

import (
	"errors"
	"net/http"
	"testing"
)

const (
	label = "shepherd"
	key1  = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOne shepherd"
	key2  = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAITwo shepherd"
)

func TestEnsureSSHKey(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	c, _ := newTestClient(t, f.baseURL(), nil)
	posts := func() int { return len(f.requests(http.MethodPost, "/projects/"+testProject+"/ssh-keys")) }
	puts := func() int {
		n := 0
		for _, h := range f.allHits() {
			if h.method == http.MethodPut {
				n++
			}
		}
		return n
	}
	if _, err := c.CreateSSHKey(t.Context(), testProject, "someone else's", key1); err != nil {
		t.Fatal(err)
	}

	// None with the label: created.
	k, err := c.EnsureSSHKey(t.Context(), testProject, label, key1)
	if err != nil || k.Label != label || k.Key != key1 || k.ID == "" {
		t.Fatalf("EnsureSSHKey = %+v, %v; want a new key", k, err)
	}
	if posts() != 2 || f.keyCount() != 2 {
		t.Errorf("%d creates, %d keys; want 2, 2", posts(), f.keyCount())
	}

	// Again, the same: nothing changes.
	k2, err := c.EnsureSSHKey(t.Context(), testProject, label, key1+"\n")
	if err != nil || k2.ID != k.ID {
		t.Fatalf("EnsureSSHKey again = %+v, %v; want %s as it is", k2, err, k.ID)
	}
	if posts() != 2 || puts() != 0 {
		t.Errorf("%d creates, %d updates; want 2, 0", posts(), puts())
	}

	// Another key under the label: updated in place.
	k3, err := c.EnsureSSHKey(t.Context(), testProject, label, key2)
	if err != nil || k3.ID != k.ID || k3.Key != key2 {
		t.Fatalf("EnsureSSHKey with a new key = %+v, %v; want %s updated", k3, err, k.ID)
	}
	if posts() != 2 || puts() != 1 || f.keyCount() != 2 {
		t.Errorf("%d creates, %d updates, %d keys; want 2, 1, 2", posts(), puts(), f.keyCount())
	}

	if _, err := c.EnsureSSHKey(t.Context(), testProject, "", key1); err == nil {
		t.Error("EnsureSSHKey without a label succeeded")
	}
}

// TestEnsureSSHKeyLostCreate: the create happens but its answer is lost;
// EnsureSSHKey lists again and finds the key instead of making a second.
func TestEnsureSSHKeyLostCreate(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	f.setLoseResponse(onFirst(http.MethodPost, "/ssh-keys"))
	c, _ := newTestClient(t, f.baseURL(), nil)

	k, err := c.EnsureSSHKey(t.Context(), testProject, label, key1)
	if err != nil || k.Label != label {
		t.Fatalf("EnsureSSHKey = %+v, %v; want the key", k, err)
	}
	if n := f.keyCount(); n != 1 {
		t.Errorf("%d keys exist, want 1", n)
	}
	if n := len(f.requests(http.MethodPost, "/projects/"+testProject+"/ssh-keys")); n != 1 {
		t.Errorf("server saw %d creates, want 1", n)
	}
}

// TestEnsureSSHKeyCreateFailedBeforeActing: a 502 where nothing was
// created; EnsureSSHKey lists, finds nothing, and creates again.
func TestEnsureSSHKeyCreateFailedBeforeActing(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		if r.Method != http.MethodPost || len(f.requests(http.MethodPost, "/projects/"+testProject+"/ssh-keys")) > 1 {
			return false
		}
		writeJSON(w, http.StatusBadGateway, errorBody("bad gateway"))
		return true
	})
	c, _ := newTestClient(t, f.baseURL(), nil)

	// CreateSSHKey alone reports the open outcome.
	_, err := c.CreateSSHKey(t.Context(), testProject, label, key1)
	if !errors.Is(err, ErrOutcomeUnknown) || !hasStatus(err, http.StatusBadGateway) {
		t.Fatalf("CreateSSHKey error = %v, want ErrOutcomeUnknown wrapping the 502", err)
	}
	if _, err := c.EnsureSSHKey(t.Context(), testProject, label, key1); err != nil {
		t.Fatalf("EnsureSSHKey: %v", err)
	}
	if n := f.keyCount(); n != 1 {
		t.Errorf("%d keys exist, want 1", n)
	}
}
