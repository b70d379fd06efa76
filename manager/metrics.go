package manager

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// loopMetrics are a control loop's metrics (SPEC §6): claims by result and
// processing latency. Label values come from closed sets.
type loopMetrics struct {
	claims     *prometheus.CounterVec
	processing prometheus.Histogram
	endRetries prometheus.Counter
}

func newLoopMetrics(reg prometheus.Registerer, process string) (*loopMetrics, error) {
	m := &loopMetrics{
		claims: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name:        "shepherd_loop_claims_total",
			Help:        "Claims a control loop made, by result (claimed, nothing_to_do, conflict, error; held: not tried, the loop's admission, the recoverer's circuit breaker, said no) and, for claimed work, how it ended (finished, failed, canceled, held_back: given back by a safety limit, lost).",
			ConstLabels: prometheus.Labels{"process": process},
		}, []string{"result"}),
		processing: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:        "shepherd_loop_processing_seconds",
			Help:        "Time a control loop spent processing one claimed machine.",
			ConstLabels: prometheus.Labels{"process": process},
			Buckets:     prometheus.ExponentialBuckets(0.01, 2, 16),
		}),
		endRetries: prometheus.NewCounter(prometheus.CounterOpts{
			Name:        "shepherd_loop_end_retries_total",
			Help:        "Attempts to end claimed work (finish, fail, cancel) that failed and were retried, mostly while the database was unreachable.",
			ConstLabels: prometheus.Labels{"process": process},
		}),
	}
	for _, c := range []prometheus.Collector{m.claims, m.processing, m.endRetries} {
		if err := register(reg, c); err != nil {
			return nil, err
		}
	}
	for _, r := range []string{"claimed", "nothing_to_do", "conflict", "error", "held", "finished", "failed", "canceled", "held_back", "lost"} {
		m.claims.WithLabelValues(r)
	}
	return m, nil
}

// register registers c on reg (nil: keep it private).
func register(reg prometheus.Registerer, c prometheus.Collector) error {
	if reg == nil {
		return nil
	}
	if err := reg.Register(c); err != nil {
		return fmt.Errorf("registering metrics: %w", err)
	}
	return nil
}
