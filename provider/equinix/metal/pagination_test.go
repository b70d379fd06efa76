package metal

import (
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
)

func TestListFollowsPages(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	var want []string
	for i := range 25 {
		want = append(want, f.addDevice(testProject, fmt.Sprintf("d%02d", i), ""))
	}
	f.addDevice(otherProj, "theirs", "")
	c, _ := newTestClient(t, f.baseURL(), func(c *Config) { c.PerPage = 10 })

	ds, err := c.ListDevices(t.Context(), testProject)
	if err != nil {
		t.Fatalf("ListDevices: %v", err)
	}
	var got []string
	for _, d := range ds {
		got = append(got, d.ID)
	}
	if !slices.Equal(got, want) {
		t.Errorf("ListDevices = %d devices %v, want %d %v", len(got), got, len(want), want)
	}
	hits := f.requests(http.MethodGet, "/projects/"+testProject+"/devices")
	if len(hits) != 3 {
		t.Fatalf("server saw %d page requests, want 3", len(hits))
	}
	for i, h := range hits {
		if h.query.Get("per_page") != "10" || h.query.Get("page") != strconv.Itoa(i+1) {
			t.Errorf("request %d asked for %v, want page=%d per_page=10", i, h.query, i+1)
		}
	}
}

func TestListOtherKinds(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	for range 3 {
		f.addReservation(testProject)
	}
	f.addReservation(otherProj)
	c, _ := newTestClient(t, f.baseURL(), func(c *Config) { c.PerPage = 2 })
	for range 3 {
		if _, err := c.CreateSSHKey(t.Context(), testProject, "k", "ssh-ed25519 AAAA"); err != nil {
			t.Fatal(err)
		}
	}
	rs, err := c.ListHardwareReservations(t.Context(), testProject)
	if err != nil || len(rs) != 3 {
		t.Errorf("ListHardwareReservations = %d, %v; want 3", len(rs), err)
	}
	ks, err := c.ListSSHKeys(t.Context(), testProject)
	if err != nil || len(ks) != 3 {
		t.Errorf("ListSSHKeys = %d, %v; want 3", len(ks), err)
	}
}

// pager serves a listing of devices whose pages come from pages, with
// next links from next (empty: null); an unknown page is an error.
func pager(pages map[string][]string, next map[string]string) func(http.ResponseWriter, *http.Request) bool {
	return func(w http.ResponseWriter, r *http.Request) bool {
		page := r.URL.Query().Get("page")
		ids, ok := pages[page]
		if !ok {
			writeJSON(w, http.StatusBadRequest, errorBody("no page "+page))
			return true
		}
		var ds []map[string]any
		for _, id := range ids {
			ds = append(ds, map[string]any{"id": id, "hostname": "h-" + id})
		}
		var nx any
		if n := next[page]; n != "" {
			nx = map[string]string{"href": n}
		}
		writeJSON(w, http.StatusOK, map[string]any{"devices": ds, "meta": map[string]any{"next": nx}})
		return true
	}
}

func TestListPagingFaults(t *testing.T) {
	t.Parallel()
	const dev = "/metal/v1/projects/proj-1/devices"
	tests := []struct {
		name    string
		pages   map[string][]string
		next    map[string]string
		want    []string // ids; nil when an error is wanted
		wantErr string
	}{
		{
			name:  "duplicates across pages are dropped",
			pages: map[string][]string{"1": {"a", "b"}, "2": {"b", "c"}, "3": {"d"}},
			next:  map[string]string{"1": dev + "?page=2&per_page=2", "2": dev + "?per_page=2&page=3"},
			want:  []string{"a", "b", "c", "d"},
		},
		{
			name:  "empty listing",
			pages: map[string][]string{"1": {}},
			want:  nil,
		},
		{
			name:    "next link back to the first page",
			pages:   map[string][]string{"1": {"a"}, "2": {"b"}},
			next:    map[string]string{"1": dev + "?page=2&per_page=7", "2": dev + "?per_page=7&page=1"},
			wantErr: "leads back to an earlier page",
		},
		{
			name:    "next link to itself",
			pages:   map[string][]string{"1": {"a"}},
			next:    map[string]string{"1": dev + "?page=1&per_page=7"},
			wantErr: "leads back to an earlier page",
		},
		{
			name:    "a page repeats under a new link",
			pages:   map[string][]string{"1": {"a", "b"}, "2": {"c"}, "3": {"a", "b"}},
			next:    map[string]string{"1": dev + "?page=2", "2": dev + "?page=3", "3": dev + "?page=4"},
			wantErr: "repeats an earlier page",
		},
		{
			name:    "link to another host",
			pages:   map[string][]string{"1": {"a"}},
			next:    map[string]string{"1": "http://evil.example" + dev + "?page=2"},
			wantErr: "leaves the API",
		},
		{
			name:    "link outside the API path",
			pages:   map[string][]string{"1": {"a"}},
			next:    map[string]string{"1": "/other/v1/projects/proj-1/devices?page=2"},
			wantErr: "leaves the API",
		},
		{
			name:    "relative link",
			pages:   map[string][]string{"1": {"a"}},
			next:    map[string]string{"1": "devices?page=2"},
			wantErr: "neither absolute nor host-relative",
		},
		{
			name:    "object without id",
			pages:   map[string][]string{"1": {""}},
			wantErr: "has no id",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			f := newFake(t)
			f.setIntercept(pager(tt.pages, tt.next))
			c, _ := newTestClient(t, f.baseURL(), func(c *Config) { c.PerPage = 7 })
			ds, err := c.ListDevices(t.Context(), testProject)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("ListDevices = %d devices, %v; want an error containing %q", len(ds), err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("ListDevices: %v", err)
			}
			var got []string
			for _, d := range ds {
				got = append(got, d.ID)
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("ListDevices = %v, want %v", got, tt.want)
			}
			for _, h := range f.allHits() {
				if h.query.Get("per_page") == "" {
					t.Errorf("request %s?%s does not ask for per_page", h.path, h.query.Encode())
				}
			}
		})
	}
}

func TestListEndlessPages(t *testing.T) {
	t.Parallel()
	f := newFake(t)
	var calls atomic.Int32
	f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
		n := calls.Add(1)
		writeJSON(w, http.StatusOK, map[string]any{
			"devices": []map[string]any{{"id": fmt.Sprint("d", n)}},
			"meta":    map[string]any{"next": map[string]string{"href": fmt.Sprintf("%s?page=%d", r.URL.Path, n+1)}},
		})
		return true
	})
	c, _ := newTestClient(t, f.baseURL(), nil)
	c.maxPages = 5
	_, err := c.ListDevices(t.Context(), testProject)
	if err == nil || !strings.Contains(err.Error(), "more than 5 pages") {
		t.Fatalf("ListDevices error = %v, want more than 5 pages", err)
	}
	if n := calls.Load(); n != 5 {
		t.Errorf("server saw %d requests, want 5", n)
	}
}

func TestListBadAnswers(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name, body, wantErr string
	}{
		{"not JSON", "<html>", "decoding the 200 answer"},
		{"wrong key", `{"servers": []}`, `has no "devices"`},
		{"wrong type", `{"devices": {"id": "a"}}`, "decoding devices"},
		{"bad meta", `{"devices": [], "meta": []}`, "decoding meta"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			f := newFake(t)
			f.setIntercept(func(w http.ResponseWriter, r *http.Request) bool {
				w.WriteHeader(http.StatusOK)
				_, _ = w.Write([]byte(tt.body))
				return true
			})
			c, _ := newTestClient(t, f.baseURL(), nil)
			_, err := c.ListDevices(t.Context(), testProject)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("ListDevices error = %v, want %q", err, tt.wantErr)
			}
			if n := len(f.allHits()); n != 1 {
				t.Errorf("server saw %d requests, want 1: a bad answer is not retried", n)
			}
		})
	}
}
