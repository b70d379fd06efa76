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
	}
	for _, c := range []prometheus.Collector{m.accepted, m.rejected, m.batchSize, m.latency, m.connsRefused} {
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
	return m, nil
}
