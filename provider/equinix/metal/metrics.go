package metal

import (
	"errors"
	"fmt"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
)

// Path templates, the values of the endpoint label: a closed set, so an id
// is never a label value.
const (
	epProjectDevices      = "/projects/{id}/devices"
	epDevice              = "/devices/{id}"
	epDeviceActions       = "/devices/{id}/actions"
	epProjectReservations = "/projects/{id}/hardware-reservations"
	epReservation         = "/hardware-reservations/{id}"
	epReservationMove     = "/hardware-reservations/{id}/move"
	epProjectSSHKeys      = "/projects/{id}/ssh-keys"
	epSSHKey              = "/ssh-keys/{id}"
)

// endpoints lists every endpoint with its methods, to create the series at
// zero.
var endpoints = []struct{ path, method string }{
	{epProjectDevices, http.MethodGet},
	{epProjectDevices, http.MethodPost},
	{epDevice, http.MethodGet},
	{epDevice, http.MethodDelete},
	{epDeviceActions, http.MethodPost},
	{epProjectReservations, http.MethodGet},
	{epReservation, http.MethodGet},
	{epReservationMove, http.MethodPost},
	{epProjectSSHKeys, http.MethodGet},
	{epProjectSSHKeys, http.MethodPost},
	{epSSHKey, http.MethodPut},
}

// statusError is the status label of an attempt that got no HTTP answer.
const statusError = "error"

type metrics struct {
	requests    *prometheus.CounterVec
	duration    *prometheus.HistogramVec
	rateLimited prometheus.Counter
	retries     *prometheus.CounterVec
}

// newMetrics registers the client's collectors on reg, or on a private
// registry if reg is nil. If a collector of the same description is
// already registered (another client on the same registerer), that one is
// used, so the two clients' counts add up instead of New failing.
func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	m := metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_metal_requests_total",
			Help: "HTTP attempts to the Equinix Metal API, by endpoint template, method and status code (or \"error\" without an answer).",
		}, []string{"endpoint", "method", "status"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "shepherd_metal_request_duration_seconds",
			Help:    "Duration of HTTP attempts to the Equinix Metal API, by endpoint template.",
			Buckets: []float64{0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30},
		}, []string{"endpoint"}),
		rateLimited: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "shepherd_metal_rate_limited_total",
			Help: "Answers 429 Too Many Requests from the Equinix Metal API.",
		}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_metal_retries_total",
			Help: "Attempts after the first within one call to the Equinix Metal API, by endpoint template.",
		}, []string{"endpoint"}),
	}
	var added []prometheus.Collector // registered here, to undo on failure
	err := errors.Join(
		register(reg, &m.requests, &added),
		register(reg, &m.duration, &added),
		register(reg, &m.rateLimited, &added),
		register(reg, &m.retries, &added),
	)
	if err != nil {
		for _, c := range added {
			reg.Unregister(c)
		}
		return nil, err
	}
	for _, ep := range endpoints {
		m.requests.WithLabelValues(ep.path, ep.method, statusError)
		m.duration.WithLabelValues(ep.path)
		m.retries.WithLabelValues(ep.path)
	}
	return &m, nil
}

// register registers *c on reg and appends it to added, or, if an
// equal collector is registered already, replaces *c with that one.
func register[C prometheus.Collector](reg prometheus.Registerer, c *C, added *[]prometheus.Collector) error {
	err := reg.Register(*c)
	if err == nil {
		*added = append(*added, *c)
		return nil
	}
	if are, ok := errors.AsType[prometheus.AlreadyRegisteredError](err); ok {
		if existing, ok := are.ExistingCollector.(C); ok {
			*c = existing
			return nil
		}
	}
	return fmt.Errorf("metal: registering metrics: %w", err)
}
