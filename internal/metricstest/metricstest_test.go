package metricstest

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestScrape(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			http.NotFound(w, r)
			return
		}
		_, _ = w.Write([]byte("# HELP x a gauge\nx{a=\"1\"} 2.5\nx{a=\"10\"} 7\nx_total 3\n"))
	}))
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")
	for series, want := range map[string]float64{`x{a="1"}`: 2.5, `x{a="10"}`: 7, "x_total": 3, `x{a="2"}`: 0} {
		got, err := Scrape(t.Context(), addr, series)
		if err != nil || got != want {
			t.Errorf("Scrape(%s) = %v, %v, want %v", series, got, err, want)
		}
	}
}

func TestScrapeReportsErrors(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	defer srv.Close()
	if _, err := Scrape(t.Context(), strings.TrimPrefix(srv.URL, "http://"), "x"); err == nil || !strings.Contains(err.Error(), "404") {
		t.Errorf("a 404 gave %v, want an error naming it", err)
	}
}
