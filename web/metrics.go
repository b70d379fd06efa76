package web

import (
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics of the web server. The page label is one of a closed set (the
// route, never the path), so machine ids never become label values.
type metrics struct {
	requests *prometheus.CounterVec
	latency  *prometheus.HistogramVec
}

var metricPages = []string{"overview", "machines", "machine", "sessions", "confirm", "action", "static", "other"}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_web_requests_total",
			Help: "Requests the web UI answered, by page and HTTP status code.",
		}, []string{"page", "code"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "shepherd_web_request_duration_seconds",
			Help:    "Time the web UI took to answer a request, by page.",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5},
		}, []string{"page"}),
	}
	for _, c := range []prometheus.Collector{m.requests, m.latency} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("web: registering metrics: %w", err)
		}
	}
	for _, p := range metricPages {
		m.latency.WithLabelValues(p)
		m.requests.WithLabelValues(p, "200")
	}
	return m, nil
}

// statusRecorder remembers the status code a handler wrote.
type statusRecorder struct {
	http.ResponseWriter
	code int
}

func (r *statusRecorder) WriteHeader(code int) {
	if r.code == 0 {
		r.code = code
	}
	r.ResponseWriter.WriteHeader(code)
}

func (r *statusRecorder) Write(b []byte) (int, error) {
	if r.code == 0 {
		r.code = http.StatusOK
	}
	return r.ResponseWriter.Write(b)
}

func (r *statusRecorder) Unwrap() http.ResponseWriter { return r.ResponseWriter }

// instrument counts and times the requests next answers as page.
func (s *Server) instrument(page string, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		rec := &statusRecorder{ResponseWriter: w}
		next.ServeHTTP(rec, r)
		code := rec.code
		if code == 0 {
			code = http.StatusOK
		}
		s.metrics.requests.WithLabelValues(page, strconv.Itoa(code)).Inc()
		s.metrics.latency.WithLabelValues(page).Observe(time.Since(start).Seconds())
	})
}
