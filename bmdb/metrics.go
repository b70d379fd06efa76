package bmdb

import (
	"errors"
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the BMDB client's Prometheus metrics (SPEC §6, first part).
// Label values come from closed sets: component names, process names,
// results and SQLSTATEs, never machine or session ids.
type metrics struct {
	sessionsStarted *prometheus.CounterVec
	sessionsClosed  *prometheus.CounterVec
	sessionsLost    *prometheus.CounterVec
	sessionsOpen    *prometheus.GaugeVec
	renewals        *prometheus.CounterVec

	transactions *prometheus.CounterVec
	txRetries    *prometheus.CounterVec

	workStarted     *prometheus.CounterVec
	workEnded       *prometheus.CounterVec
	workConflicts   *prometheus.CounterVec
	workExpired     *prometheus.CounterVec
	workQuarantined *prometheus.CounterVec
	heartbeatSplits prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		sessionsStarted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_bmdb_sessions_started_total",
			Help: "Sessions opened by this process, by component.",
		}, []string{"component"}),
		sessionsClosed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_bmdb_sessions_closed_total",
			Help: "Sessions closed gracefully by this process, by component.",
		}, []string{"component"}),
		sessionsLost: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_bmdb_sessions_lost_total",
			Help: "Sessions of this process whose lease lapsed before they were closed, by component.",
		}, []string{"component"}),
		sessionsOpen: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "shepherd_bmdb_sessions_open",
			Help: "Sessions of this process that are open and not known to be lost, by component.",
		}, []string{"component"}),
		renewals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_bmdb_session_renewals_total",
			Help: "Session lease renewals, by result (ok, error, expired).",
		}, []string{"result"}),
		transactions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_bmdb_transactions_total",
			Help: "BMDB transactions (including single-statement ones), by result (committed, rolled_back, failed).",
		}, []string{"result"}),
		txRetries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_bmdb_transaction_retries_total",
			Help: "Transactions retried after a serialization failure or deadlock, by SQLSTATE.",
		}, []string{"sqlstate"}),
		workStarted: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_bmdb_work_started_total",
			Help: "Work items claimed, by process.",
		}, []string{"process"}),
		workEnded: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_bmdb_work_ended_total",
			Help: "Work items ended, by process and result (finished, failed, canceled, lost).",
		}, []string{"process", "result"}),
		workConflicts: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_bmdb_work_claim_conflicts_total",
			Help: "Claims that lost a race for a candidate and had to try again, by process.",
		}, []string{"process"}),
		workExpired: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_bmdb_work_expired_total",
			Help: "Work items of dead sessions expired by this process, by process.",
		}, []string{"process"}),
		workQuarantined: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "shepherd_bmdb_work_quarantined_total",
			Help: "Machines quarantined for a process after too many failures in a row, by process.",
		}, []string{"process"}),
		heartbeatSplits: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "shepherd_bmdb_heartbeat_batch_splits_total",
			Help: "Heartbeat batches the database refused for their content and that were split to find the heartbeats at fault.",
		}),
	}
	cs := []prometheus.Collector{
		m.sessionsStarted, m.sessionsClosed, m.sessionsLost, m.sessionsOpen, m.renewals,
		m.transactions, m.txRetries,
		m.workStarted, m.workEnded, m.workConflicts, m.workExpired, m.workQuarantined, m.heartbeatSplits,
	}
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if errors.As(err, &are) {
				return nil, fmt.Errorf("registering BMDB metrics: already registered (one bmdb.DB per registry): %w", err)
			}
			return nil, fmt.Errorf("registering BMDB metrics: %w", err)
		}
	}
	// Create every series at zero so dashboards see them before the first event.
	for _, r := range []string{"ok", "error", "expired"} {
		m.renewals.WithLabelValues(r)
	}
	for _, r := range []string{"committed", "rolled_back", "failed"} {
		m.transactions.WithLabelValues(r)
	}
	for _, s := range []string{sqlstateSerializationFailure, sqlstateDeadlockDetected} {
		m.txRetries.WithLabelValues(s)
	}
	for p := range processExclusive {
		ps := string(p)
		m.workStarted.WithLabelValues(ps)
		m.workConflicts.WithLabelValues(ps)
		m.workExpired.WithLabelValues(ps)
		m.workQuarantined.WithLabelValues(ps)
		for _, r := range workResults {
			m.workEnded.WithLabelValues(ps, r)
		}
	}
	return m, nil
}

// Results of a work item, the values of the result label of work_ended_total.
const (
	resultFinished = "finished"
	resultFailed   = "failed"
	resultCanceled = "canceled"
	resultHeld     = "held" // given back by a safety limit (history Held)
	resultLost     = "lost" // the session expired before the work could be ended
)

var workResults = []string{resultFinished, resultFailed, resultCanceled, resultHeld, resultLost}
