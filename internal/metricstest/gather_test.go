package metricstest

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

func TestValueAndSeries(t *testing.T) {
	reg := prometheus.NewRegistry()
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "c_total", Help: "h"}, []string{"process", "result"})
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "g", Help: "h"})
	h := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "h_seconds", Help: "h"}, []string{"provider"})
	reg.MustRegister(c, g, h)
	c.WithLabelValues("A", "ok").Add(2)
	c.WithLabelValues("A", "error").Add(3)
	c.WithLabelValues("B", "ok").Add(5)
	g.Set(1.5)
	h.WithLabelValues("lab").Observe(1)
	h.WithLabelValues("lab").Observe(2)
	for _, tc := range []struct {
		name   string
		labels []string
		want   float64
		n      int
	}{
		{"c_total", nil, 10, 3},
		{"c_total", []string{"process", "A"}, 5, 2},
		{"c_total", []string{"result", "ok"}, 7, 2},
		{"c_total", []string{"process", "A", "result", "ok"}, 2, 1},
		{"c_total", []string{"process", "C"}, 0, 0},
		{"c_total", []string{"result", "A"}, 0, 0}, // a value under another label
		{"g", nil, 1.5, 1},
		{"h_seconds", []string{"provider", "lab"}, 2, 1},
		{"absent_total", nil, 0, 0},
	} {
		if got := Value(t, reg, tc.name, tc.labels...); got != tc.want {
			t.Errorf("Value(%s, %q) = %v, want %v", tc.name, tc.labels, got, tc.want)
		}
		if got := Series(t, reg, tc.name, tc.labels...); got != tc.n {
			t.Errorf("Series(%s, %q) = %d, want %d", tc.name, tc.labels, got, tc.n)
		}
	}
}
