// Package metricstest reads Prometheus metrics for tests: a running
// process's /metrics (Scrape), or a registry in the test's own process
// (Value, Series).
package metricstest

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strconv"
)

// Get reads /metrics at addr (host:port): the exposition text, or an error
// that names the address if the answer is not 200 OK.
func Get(ctx context.Context, addr string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET http://%s/metrics: %s", addr, resp.Status)
	}
	return io.ReadAll(resp.Body)
}

// Scrape reads /metrics at addr (host:port) and returns the value of the
// series written exactly as series (name{labels} in the exposition
// format); 0 if it is not there yet.
func Scrape(ctx context.Context, addr, series string) (float64, error) {
	body, err := Get(ctx, addr)
	if err != nil {
		return 0, err
	}
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(series) + ` (\S+)$`).FindSubmatch(body)
	if m == nil {
		return 0, nil
	}
	return strconv.ParseFloat(string(m[1]), 64)
}
