package sim

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the simulated fleet's Prometheus metrics. Every series
// carries the provider name, so that two fleets can share a registry.
type metrics struct {
	heartbeats *prometheus.CounterVec
	takeovers  *prometheus.CounterVec
	reboots    *prometheus.CounterVec
	agents     prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer, name string) (*metrics, error) {
	labels := prometheus.Labels{"provider": name}
	m := &metrics{
		heartbeats: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name:        "shepherd_sim_heartbeats_total",
			Help:        "Heartbeat RPCs simulated agents sent, by result.",
			ConstLabels: labels,
		}, []string{"result"}),
		takeovers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name:        "shepherd_sim_takeovers_total",
			Help:        "Takeovers run on simulated machines, by result.",
			ConstLabels: labels,
		}, []string{"result"}),
		reboots: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name:        "shepherd_sim_reboots_total",
			Help:        "Reboots and reinstalls of simulated machines (the provider's, the reboot command's, a BMC's power on), by result.",
			ConstLabels: labels,
		}, []string{"result"}),
		agents: prometheus.NewGauge(prometheus.GaugeOpts{
			Name:        "shepherd_sim_agents_running",
			Help:        "Simulated agents running, silenced ones included.",
			ConstLabels: labels,
		}),
	}
	for _, c := range []prometheus.Collector{m.heartbeats, m.takeovers, m.reboots, m.agents} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("sim: registering metrics: %w", err)
		}
	}
	for _, v := range []*prometheus.CounterVec{m.heartbeats, m.takeovers, m.reboots} {
		for _, r := range []string{"ok", "error"} {
			v.WithLabelValues(r)
		}
	}
	return m, nil
}
