package server

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the callback server's Prometheus metrics (SPEC §6).
type metrics struct {
	accepted  prometheus.Counter
	rejected  *prometheus.CounterVec
	batchSize prometheus.Histogram
	latency   prometheus.Histogram
	// connsRefused counts connections closed at once for being over a limit.
	connsRefused *prometheus.CounterVec
	// acceptErrors counts accepts that failed and were retried, by reason
	// (descriptors: the process or the system ran out of file descriptors).
	acceptErrors *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		accepted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "shepherd_server_heartbeats_accepted_total",
			Help: "Heartbeats recorded for authenticated agents.",
		}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_server_heartbeats_rejected_total",
			Help: "Heartbeat requests rejected, by reason.",
		}, []string{"reason"}),
		batchSize: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "shepherd_server_heartbeat_batch_size",
			Help:    "Heartbeats written per database transaction.",
			Buckets: prometheus.ExponentialBuckets(1, 4, 7),
		}),
		latency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "shepherd_server_heartbeat_duration_seconds",
			Help:    "Time to answer a heartbeat request, from the request to the response.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
		}),
		connsRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_server_connections_refused_total",
			Help: "Client connections closed at once because a limit was reached, by limit (total, per_ip).",
		}, []string{"limit"}),
		acceptErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_server_accept_errors_total",
			Help: "Accepts of client connections that failed and were retried after a pause, by reason (descriptors: out of file descriptors).",
		}, []string{"reason"}),
	}
	for _, c := range []prometheus.Collector{m.accepted, m.rejected, m.batchSize, m.latency, m.connsRefused, m.acceptErrors} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("server: registering metrics: %w", err)
		}
	}
	for _, r := range rejectReasons {
		m.rejected.WithLabelValues(r)
	}
	for _, l := range []string{"total", "per_ip"} {
		m.connsRefused.WithLabelValues(l)
	}
	m.acceptErrors.WithLabelValues("descriptors")
	return m, nil
}
