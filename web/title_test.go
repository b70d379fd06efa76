package web_test

import (
	"html"
	"strings"
	"testing"

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
