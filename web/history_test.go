package web_test

import (
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/web"
)

// TestMachineHistoryNewestFirst: the machine page shows a machine's
// history newest first, a page at a time, with links to older and newer
// pages that together show every event once; bad cursors are a 400 that
// says why.
func TestMachineHistoryNewestFirst(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	m := f.healthy[0]
	const events = 1234 // two full pages of 500 and a part
	f.db.Exec(t, `INSERT INTO work_history (machine_id, process, event, cause)
		SELECT $1, 'Recovery', 'Failed', 'event ' || g FROM generate_series(1, $2) g`, m, events)
	all := bmdbtest.Scalar[int64](t, f.db, "SELECT count(*) FROM work_history WHERE machine_id = $1", m)
	s := newServer(t, f.db.DB, web.Config{})

	row := regexp.MustCompile(`<tr><td class="num">(\d+)</td>`)
	link := regexp.MustCompile(`<a rel="(first|prev|next)" href="([^"]+)">`)
	ids := func(body string) []int64 {
		var out []int64
		for _, m := range row.FindAllStringSubmatch(body[strings.Index(body, `id="history"`):], -1) {
			n, _ := strconv.ParseInt(m[1], 10, 64)
			out = append(out, n)
		}
		return out
	}
	links := func(body string) map[string]string {
		out := map[string]string{}
		for _, m := range link.FindAllStringSubmatch(body[strings.Index(body, `id="history-pager"`):], -1) {
			out[m[1]] = strings.ReplaceAll(m[2], "&amp;", "&")
		}
		return out
	}
	// Older and older: every event once, newest first throughout.
	var seen []int64
	path := "/machines/" + m.String()
	var pages []string
	for path != "" {
		body := s.get(t, path)
		got := ids(body)
		if len(got) == 0 || len(got) > 500 {
			t.Fatalf("GET %s: %d events", path, len(got))
		}
		if !slices.IsSortedFunc(got, func(a, b int64) int { return int(b - a) }) {
			t.Fatalf("GET %s: events not newest first: %v", path, got)
		}
		if len(seen) > 0 && got[0] >= seen[len(seen)-1] {
			t.Fatalf("GET %s starts at %d, after %d on the page before", path, got[0], seen[len(seen)-1])
		}
		seen = append(seen, got...)
		pages = append(pages, path)
		l := links(body)
		if len(pages) == 1 && (l["first"] != "" || l["prev"] != "") {
			t.Errorf("the newest page links to newer pages: %v", l)
		}
		if len(pages) > 1 && (l["first"] == "" || l["prev"] == "") {
			t.Errorf("page %d (%s) lacks the links to newer pages: %v", len(pages), path, l)
		}
		path = strings.TrimSuffix(l["next"], "#history")
	}
	if int64(len(seen)) != all || len(pages) != 3 {
		t.Fatalf("%d events on %d pages, the machine has %d", len(seen), len(pages), all)
	}
	// Newer from the oldest page: back to the events of the page before.
	body := s.get(t, pages[2])
	newer := strings.TrimSuffix(links(body)["prev"], "#history")
	newerBody := s.get(t, newer)
	if got := ids(newerBody); len(got) != 500 || got[len(got)-1] != ids(body)[0]+1 {
		t.Errorf("the newer page of the oldest (%s) shows %d events ending at %v, want 500 right above %d", newer, len(got), got[len(got)-1:], ids(body)[0])
	}
	// That page links on both ways: newer again to the newest events,
	// older back to the oldest page.
	l := links(newerBody)
	for _, tt := range []struct{ rel, what, want string }{{"prev", "the newest", pages[0]}, {"next", "the oldest", pages[2]}} {
		if l[tt.rel] == "" {
			t.Errorf("the newer page %s has no %s link", newer, tt.rel)
			continue
		}
		if got, want := ids(s.get(t, strings.TrimSuffix(l[tt.rel], "#history"))), ids(s.get(t, tt.want)); !slices.Equal(got, want) {
			t.Errorf("the newer page %s links %s to %s, showing %d events, want %s page's %d", newer, tt.rel, l[tt.rel], len(got), tt.what, len(want))
		}
	}

	for _, q := range []string{"history_before=0", "history_before=-1", "history_before=x", "history_after=-1", "history_before=5&history_after=2"} {
		resp, body := s.do(t, "GET", "/machines/"+m.String()+"?"+q, nil)
		if resp.StatusCode != 400 || !errorMessage.MatchString(body) {
			t.Errorf("?%s = %d, want 400 with a message", q, resp.StatusCode)
		}
	}
}
