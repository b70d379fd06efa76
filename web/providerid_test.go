package web_test

import (
	"html"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/web"
)

// TestMachinePageTitle: the machine page is titled with the provider id and
// provider operators know the machine by, escaped; the UUID stays on the
// page.
func TestMachinePageTitle(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	s := newServer(t, f.db.DB, web.Config{})
	for _, id := range append(f.healthy[:1], f.quarantined, f.evil) {
		d, err := f.db.GetMachine(t.Context(), id)
		if err != nil {
			t.Fatal(err)
		}
		page := s.get(t, "/machines/"+id.String())
		title := html.EscapeString("Machine " + d.ProviderID + " (" + d.Provider + ")")
		for _, want := range []string{"<title>" + title + " · Shepherd</title>", "<h1>" + title + "</h1>", `id="machine-id">` + id.String() + "<"} {
			if !strings.Contains(page, want) {
				t.Errorf("page of %s/%s lacks %q", d.Provider, d.ProviderID, want)
			}
		}
	}
}

// TestListSortsByProviderID: ?sort=provider-id lists the machines by
// provider and provider id, each once over all pages, filters kept; the
// column header links to that order.
func TestListSortsByProviderID(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "b", Healthy: 14, Stale: 3})
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "a", Healthy: 9})
	db.Exec(t, `UPDATE machine_provided p SET provider_id = 'm' || n.n
		FROM (SELECT machine_id, row_number() OVER (PARTITION BY provider ORDER BY machine_id DESC) AS n FROM machine_provided) n
		WHERE n.machine_id = p.machine_id`)
	s := newServer(t, db.DB, web.Config{PageSize: 4})
	for _, tt := range []struct{ query, where string }{
		{"?sort=provider-id", "true"},
		{"?state=Healthy&sort=provider-id&provider=b", "provider = 'b' AND machine_id NOT IN (SELECT machine_id FROM machine_agent_heartbeat WHERE agent_heartbeat_at < now() - interval '5 minutes')"},
	} {
		want := column[string](t, db, "SELECT machine_id::text FROM machine_provided WHERE "+tt.where+" ORDER BY provider, provider_id")
		var got []string
		paths, bodies := s.listPages(t, "/machines"+tt.query)
		for i, body := range bodies {
			for _, m := range listedMachine.FindAllStringSubmatch(body, -1) {
				got = append(got, m[1])
			}
			if i > 0 && !strings.Contains(paths[i], "sort=provider-id") {
				t.Errorf("%s: the next page %s leaves the order", tt.query, paths[i])
			}
		}
		if !slices.Equal(got, want) {
			t.Errorf("%s: listed %v, want %v", tt.query, got, want)
		}
	}
	for query, want := range map[string]string{
		"?state=Healthy":                     "/machines?sort=provider-id&state=Healthy",
		"?decommissioned=on&provider=a&q=m1": "/machines?decommissioned=on&provider=a&q=m1&sort=provider-id",
	} {
		body := s.get(t, "/machines"+query)
		link := regexp.MustCompile(`id="sort-provider-id" href="([^"]+)"`).FindStringSubmatch(body)
		if link == nil || html.UnescapeString(link[1]) != want {
			t.Errorf("%s: the provider id header links to %v, want the filtered list in provider id order", query, link)
		}
	}
	if resp, body := s.do(t, http.MethodGet, "/machines?sort=name", nil); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("sort=name: %s\n%s", resp.Status, body)
	}
}

// column returns the first column of query's rows, in order.
func column[T any](t *testing.T, db *bmdbtest.DB, query string, args ...any) []T {
	t.Helper()
	rows, err := db.Pool.Query(t.Context(), query, args...)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[T])
	if err != nil {
		t.Fatal(err)
	}
	return out
}
