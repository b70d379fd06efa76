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

// synthetic serves a listing of n devices ("d0000000", ...) in pages of
// the per_page asked for, with the meta the API gives (last_page, total,
// next); reportPages, if > 0, is the last_page it claims instead, while its
// next links go on to the real end. Pages are made on the fly, so a
// listing of 100,000 objects costs no memory.
func synthetic(n, reportPages int) func(http.ResponseWriter, *http.Request) bool {
	return func(w http.ResponseWriter, r *http.Request) bool {
		q := r.URL.Query()
		page, _ := strconv.Atoi(q.Get("page"))
		perPage, _ := strconv.Atoi(q.Get("per_page"))
		if page < 1 || perPage < 1 {
			writeJSON(w, http.StatusBadRequest, errorBody("bad page or per_page"))
			return true
		}
		last := max(1, (n+perPage-1)/perPage)
		var b strings.Builder
		b.WriteString(`{"devices":[`)
		for i := (page - 1) * perPage; i < min(n, page*perPage); i++ {
			if i > (page-1)*perPage {
				b.WriteByte(',')
			}
			fmt.Fprintf(&b, `{"id":"d%07d","hostname":"h%07d"}`, i, i)
		}
		next := "null"
		if page < last {
			next = fmt.Sprintf(`{"href":"%s?page=%d&per_page=%d"}`, r.URL.Path, page+1, perPage)
		}
		reported := last
		if reportPages > 0 {
			reported = reportPages
		}
		fmt.Fprintf(&b, `],"meta":{"current_page":%d,"last_page":%d,"total":%d,"next":%s}}`, page, reported, n, next)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(b.String()))
		return true
	}
}

// TestListMoreThan100000 lists 100,001 devices at the default page size:
// 1,001 pages. How many pages a listing may take follows from what the
// API says it has, not from a fixed cap.
func TestListMoreThan100000(t *testing.T) {
	t.Parallel()
	const n = 100_001
	f := newFake(t)
	f.setIntercept(synthetic(n, 0))
	c, _ := newTestClient(t, f.baseURL(), nil)
	ds, err := c.ListDevices(t.Context(), testProject)
	if err != nil {
		t.Fatalf("ListDevices of %d devices: %v", n, err)
	}
	if len(ds) != n || ds[0].ID != "d0000000" || ds[n-1].ID != fmt.Sprintf("d%07d", n-1) {
		t.Fatalf("ListDevices = %d devices, want %d in order", len(ds), n)
	}
	if got := len(f.allHits()); got != (n+DefaultPerPage-1)/DefaultPerPage {
		t.Errorf("server saw %d page requests, want %d", got, (n+DefaultPerPage-1)/DefaultPerPage)
	}
}

// TestListLongerThanReported: an API whose pages go on far beyond the
// last_page it reports is not followed forever, but some slack is granted:
// objects created while a listing runs add pages.
func TestListLongerThanReported(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name            string
		n, reportPages  int
		wantErr         string
		wantPagesServed int
	}{
		{"a page more than reported", 31, 3, "", 4},
		{"ten times the reported pages", 300, 3, "more than 13 pages (the API reported 3)", 13},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			f := newFake(t)
			f.setIntercept(synthetic(tt.n, tt.reportPages))
			c, _ := newTestClient(t, f.baseURL(), func(c *Config) { c.PerPage = 10 })
			ds, err := c.ListDevices(t.Context(), testProject)
			switch {
			case tt.wantErr == "" && (err != nil || len(ds) != tt.n):
				t.Errorf("ListDevices = %d devices, %v; want %d", len(ds), err, tt.n)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Errorf("ListDevices = %d devices, %v; want an error containing %q", len(ds), err, tt.wantErr)
			}
			if got := len(f.allHits()); got != tt.wantPagesServed {
				t.Errorf("server saw %d page requests, want %d", got, tt.wantPagesServed)
			}
		})
	}
}
