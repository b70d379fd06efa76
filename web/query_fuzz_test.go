package web_test

import (
	"html"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"testing"

	"github.com/shepherd/shepherd/web"
)

// errorMessage finds the message of an error page.
var errorMessage = regexp.MustCompile(`<p class="error">([^<]*)</p>`)

// FuzzPageQuery sends any query string to every page that reads one,
// through the real handler against a real database (one fleet, started
// once per fuzzing process, not per input). Bad input is a 400 whose page
// says what was wrong; nothing is a 500 or a panic, which a
// hand-typed or mangled URL must never cause.
func FuzzPageQuery(f *testing.F) {
	fl := newFleet(f)
	s := newServer(f, fl.db.DB, web.Config{PageSize: 2, Actions: true, OperatorToken: mustToken(f)})
	// The pages that read a query (and the overview, which reads none);
	// the fuzzer picks one by index.
	paths := []string{
		"/machines",
		"/machines/" + fl.evil.String(),
		"/machines/" + fl.quarantined.String(),
		"/machines/" + fl.quarantined.String() + "/reset",
		"/sessions",
		"/",
	}
	for _, q := range []string{
		"", "state=Healthy", "state=Sleepy", "state=Decommissioned&decommissioned=on",
		"provider=sim&location=fra1&q=10.1.2.3", "q=10.1.0.0%2F16", "q=10.1.", "q=3f2a", "q=%3Cscript%3E",
		"after=" + fl.healthy[0].String(), "after=nope", "q=" + strings.Repeat("x", 300),
		"history_after=12", "history_after=-1", "history_after=99999999999999999999", "done=reset",
		"history_before=12", "history_before=0", "history_before=-3", "history_before=x", "history_before=5&history_after=2",
		"process=AgentStart", "process=Nope", "dead=on",
		"q=%00", "provider=%FF%FE", "location=a%00b", "q=1.2.3.4%25eth0", "q=::ffff:10.1.2.3", "q=%5C%25_",
		"state=Healthy&state=Silent", "q=%", "a=%zz&state=Healthy", ";;&&==",
		"sort=provider-id", "sort=provider-id&after_provider=sim&after_pid=sim-1&after=" + fl.healthy[0].String(),
		"sort=provider-id&after_provider=%00", "sort=provider-id&after_pid=%FF", "sort=nope",
	} {
		f.Add(uint8(0), q)
	}
	f.Add(uint8(1), "history_after=0&done=nope")
	f.Add(uint8(2), "history_after=1&done=reset")
	f.Add(uint8(2), "history_before=3")
	f.Add(uint8(1), "history_before=99999999999999999999")
	f.Add(uint8(3), "process=AgentStart")
	f.Add(uint8(3), "process=%00")
	f.Add(uint8(4), "dead=on")
	f.Add(uint8(5), "x=%FF")
	f.Fuzz(func(t *testing.T, pick uint8, query string) {
		req := httptest.NewRequest(http.MethodGet, paths[int(pick)%len(paths)], nil)
		req.URL.RawQuery = query
		rec := httptest.NewRecorder()
		s.h.ServeHTTP(rec, req)
		switch rec.Code {
		case http.StatusOK:
		case http.StatusBadRequest:
			m := errorMessage.FindStringSubmatch(rec.Body.String())
			if m == nil || strings.TrimSpace(html.UnescapeString(m[1])) == "" {
				t.Fatalf("GET %s?%s = 400 without a message:\n%s", req.URL.Path, query, rec.Body)
			}
		default:
			t.Fatalf("GET %s?%s = %d, want 200 or 400:\n%s\nlog:\n%s", req.URL.Path, query, rec.Code, rec.Body, s.log)
		}
	})
}
