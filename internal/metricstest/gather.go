package metricstest

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// Value returns the sum of the series of family name in g whose labels
// include every name, value pair of labels (all its series when none is
// given): a counter's or gauge's value, a histogram's or summary's count. A
// family or series that does not exist reads 0, as a counter nobody has
// incremented yet. It fails the test if g cannot be gathered.
func Value(t testing.TB, g prometheus.Gatherer, name string, labels ...string) float64 {
	t.Helper()
	var sum float64
	for _, m := range series(t, g, name, labels) {
		switch {
		case m.Counter != nil:
			sum += m.GetCounter().GetValue()
		case m.Gauge != nil:
			sum += m.GetGauge().GetValue()
		case m.Untyped != nil:
			sum += m.GetUntyped().GetValue()
		case m.Histogram != nil:
			sum += float64(m.GetHistogram().GetSampleCount())
		case m.Summary != nil:
			sum += float64(m.GetSummary().GetSampleCount())
		}
	}
	return sum
}

// Series returns how many series of family name in g have labels among
// theirs, for a test that a metric exists as well as what it reads.
func Series(t testing.TB, g prometheus.Gatherer, name string, labels ...string) int {
	t.Helper()
	return len(series(t, g, name, labels))
}

func series(t testing.TB, g prometheus.Gatherer, name string, labels []string) []*dto.Metric {
	t.Helper()
	if len(labels)%2 != 0 {
		t.Fatalf("metric %s: labels %q are not name, value pairs", name, labels)
	}
	mfs, err := g.Gather()
	if err != nil {
		t.Fatalf("gathering metrics: %v", err)
	}
	var out []*dto.Metric
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if hasLabels(m.GetLabel(), labels) {
				out = append(out, m)
			}
		}
	}
	return out
}

func hasLabels(have []*dto.LabelPair, want []string) bool {
	for i := 0; i < len(want); i += 2 {
		found := false
		for _, l := range have {
			if l.GetName() == want[i] && l.GetValue() == want[i+1] {
				found = true
				break
			}
		}
		if !found {
			return false
		}
	}
	return true
}
