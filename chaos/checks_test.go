package chaos

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// checkReboots compares the reboots the BMDB admitted with those the
// simulator saw: I2 (no reboot admitted while a heartbeat proves the agent
// alive and recorded), I3 (no second reboot without an agent started in
// between) and that no machine was rebooted more often than admitted.
func (s *soak) checkReboots(ctx context.Context, pool *pgxpool.Pool) (falseReboots, double, unadmitted []string) {
	// Reboots the simulator saw before the query were admitted before it.
	truth := make(map[string]MachineTruth, len(s.simIDs))
	for _, id := range s.simIDs {
		truth[id] = s.truth.Machine(id)
	}
	// Every rung of the recovery ladder counts for I2 (nothing is done to a
	// machine whose agent is alive); only those that restart the machine
	// (all but agent) can explain a reboot the simulator saw.
	rows, err := pool.Query(ctx, `
		SELECT p.provider_id, a.admitted_at, a.rung
		FROM recovery_admissions a JOIN machine_provided p USING (machine_id)
		WHERE a.reached AND p.provider = $1 ORDER BY a.admitted_at`, providerName)
	if err != nil {
		return []string{err.Error()}, nil, nil
	}
	admitted := map[string]int{}
	for rows.Next() {
		var id, rung string
		var at time.Time
		if err := rows.Scan(&id, &at, &rung); err != nil {
			rows.Close()
			return []string{err.Error()}, nil, nil
		}
		if rung != "agent" {
			admitted[id]++
		}
		if !strings.HasPrefix(id, "sim-") {
			continue
		}
		if a, alive := s.truth.Machine(id).AliveAt(at, heartbeatTimeout); alive {
			falseReboots = append(falseReboots, fmt.Sprintf("%s: reboot admitted at %s, but a heartbeat sent at %s was acknowledged at %s",
				id, at.Format("15:04:05.000"), a.Sent.Format("15:04:05.000"), a.Acked.Format("15:04:05.000")))
		}
	}
	rows.Close()
	for _, id := range s.simIDs {
		m := truth[id]
		for _, at := range m.RebootsWithoutStart() {
			double = append(double, fmt.Sprintf("%s: rebooted at %s with no agent started since its previous reboot", id, at.Format("15:04:05.000")))
		}
		if n := len(m.Reboots); n > admitted[id] {
			unadmitted = append(unadmitted, fmt.Sprintf("%s: rebooted %d times, %d reboots admitted", id, n, admitted[id]))
		}
	}
	return falseReboots, double, unadmitted
}

// checkBudget finds windows with more reboots admitted than the budget
// (I4), counting as the circuit breaker does: every admission of a rung
// that restarts the machine (all but agent) that reached its machine.
func (s *soak) checkBudget(ctx context.Context, pool *pgxpool.Pool) []string {
	rows, err := pool.Query(ctx, `
		SELECT a.admitted_at, (SELECT count(*) FROM recovery_admissions b
		                       WHERE b.provider = a.provider AND b.reached AND b.rung <> 'agent'
		                         AND b.admitted_at > a.admitted_at - interval '1 millisecond' * $2 AND b.admitted_at <= a.admitted_at)
		FROM recovery_admissions a WHERE a.provider = $1 AND a.reached AND a.rung <> 'agent'`, providerName, rebootWindow.Milliseconds())
	if err != nil {
		return []string{err.Error()}
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var at time.Time
		var n int
		if err := rows.Scan(&at, &n); err != nil {
			return append(out, err.Error())
		}
		if n > rebootBudget {
			out = append(out, fmt.Sprintf("%d reboots in the %s up to %s", n, rebootWindow, at.Format("15:04:05.000")))
		}
	}
	return out
}

// checkHeld is I6: what the sampler saw while the soak ran, and every
// claim its own session ended after longer than the work timeout plus a
// lease (a claim that outlived its session ends Expired, and was not held
// by a live session).
func (s *soak) checkHeld(ctx context.Context, pool *pgxpool.Pool) []string {
	s.rec.mu.Lock()
	out := slices.Clone(s.rec.heldTooLong)
	s.rec.mu.Unlock()
	bound := workTimeout + lease + 5*time.Second
	rows, err := pool.Query(ctx, `
		WITH ends AS (
			SELECT machine_id, process, event, at, session_id,
			       lead(event) OVER w AS next_event, lead(at) OVER w AS next_at, lead(session_id) OVER w AS next_session
			FROM work_history
			WINDOW w AS (PARTITION BY machine_id, process ORDER BY history_id)
		)
		SELECT p.provider_id, e.process, e.next_event, e.next_at - e.at
		FROM ends e JOIN machine_provided p USING (machine_id)
		WHERE e.event = 'Started' AND e.next_event IN ('Finished', 'Failed', 'Canceled', 'Held')
		  AND e.next_session = e.session_id AND e.next_at - e.at > interval '1 millisecond' * $1`, bound.Milliseconds())
	if err != nil {
		return append(out, err.Error())
	}
	defer rows.Close()
	for rows.Next() {
		var id, process, event string
		var held time.Duration
		if err := rows.Scan(&id, &process, &event, &held); err != nil {
			return append(out, err.Error())
		}
		out = append(out, fmt.Sprintf("%s: %s held %s before it ended %s, more than %s", id, process, held.Round(time.Second), event, bound))
	}
	return out
}

// checkLostReports is I7: what was missing right after restarts and
// failovers, and now, at rest, every machine's last acknowledged heartbeat
// and its hardware report, once acknowledged to its current agent.
func (s *soak) checkLostReports(ctx context.Context, pool *pgxpool.Pool) []string {
	s.rec.mu.Lock()
	out := slices.Clone(s.rec.lostAcks)
	s.rec.mu.Unlock()
	// The record is read before the query: what was acknowledged by then
	// was committed before the query's snapshot. Read after, it would hold
	// heartbeats acknowledged while the query ran, which the snapshot
	// cannot show.
	truth := make(map[string]MachineTruth, len(s.simIDs))
	for _, id := range s.simIDs {
		truth[id] = s.truth.Machine(id)
	}
	rows, err := pool.Query(ctx, `
		SELECT p.provider_id, h.agent_heartbeat_at, r.machine_id IS NOT NULL
		FROM machine_provided p
		LEFT JOIN machine_agent_heartbeat h USING (machine_id)
		LEFT JOIN machine_hardware_report r USING (machine_id)
		WHERE p.provider = $1`, providerName)
	if err != nil {
		return append(out, err.Error())
	}
	defer rows.Close()
	for rows.Next() {
		var id string
		var hb *time.Time
		var hw bool
		if err := rows.Scan(&id, &hb, &hw); err != nil {
			return append(out, err.Error())
		}
		m, ok := truth[id]
		if !ok {
			continue // a real machine: the simulator knows nothing of it
		}
		var since time.Time
		if len(m.Starts) > 0 {
			since = m.Starts[len(m.Starts)-1].At
		}
		var last Ack
		hwAcked := false
		for _, a := range m.Acks {
			if a.Sent.Before(since) {
				continue
			}
			if a.Sent.After(last.Sent) {
				last = a
			}
			hwAcked = hwAcked || a.Hardware
		}
		if !last.Sent.IsZero() && (hb == nil || hb.Before(last.Sent.Add(-margin))) {
			out = append(out, fmt.Sprintf("%s: the BMDB's last heartbeat is %v, but the server acknowledged one sent at %s",
				id, hb, last.Sent.Format("15:04:05.000")))
		}
		if hwAcked && !hw {
			out = append(out, fmt.Sprintf("%s: the server acknowledged its hardware report, and the BMDB has none", id))
		}
	}
	return out
}

// checkHostile is I8: the hostile client got no heartbeat accepted, no
// forged heartbeat reached the BMDB, and no honest heartbeat was refused
// while it ran, unless the database or a server was impaired then too.
func (s *soak) checkHostile() []string {
	s.rec.mu.Lock()
	samples := slices.Clone(s.rec.forgedSamples)
	runs := slices.Clone(s.rec.hostile)
	hostileWindows := slices.Clone(s.rec.hostileWindows)
	impaired := slices.Clone(s.rec.impairedWindows)
	s.rec.mu.Unlock()
	var out []string
	for _, sm := range samples {
		if !s.truth.Machine(sm.id).Explains(sm.hb) {
			out = append(out, fmt.Sprintf("%s: the BMDB had heartbeat %s, which no honest heartbeat of its agent explains",
				sm.id, sm.hb.Format("15:04:05.000000")))
		}
	}
	for i, r := range runs {
		if r.Accepted > 0 {
			out = append(out, fmt.Sprintf("hostile run %d: the server accepted %d forged or malformed heartbeats (sent %v, answers %v)", i+1, r.Accepted, r.Sent, r.Codes))
		}
	}
	in := func(at time.Time, ws []window) bool {
		return slices.ContainsFunc(ws, func(w window) bool { return !at.Before(w.from) && !at.After(w.to) })
	}
	for _, id := range s.simIDs {
		m := s.truth.Machine(id)
		for _, r := range m.Refusals {
			// A new agent's first heartbeats may race its start being
			// recorded: refused then, whoever else talks to the server.
			justStarted := slices.ContainsFunc(m.Starts, func(st Start) bool {
				return !st.At.After(r.Sent) && r.Sent.Sub(st.At) < 10*time.Second
			})
			// Impaired while it was on its way (up to the agent's RPC
			// timeout after sending), the refusal is not the client's.
			onItsWay := window{r.Sent, r.Sent.Add(unansweredBound)}
			if in(r.Sent, hostileWindows) && !overlaps(onItsWay, impaired) && !justStarted {
				out = append(out, fmt.Sprintf("%s: an honest heartbeat sent at %s was refused (%s) while the hostile client ran",
					id, r.Sent.Format("15:04:05.000"), r.Code))
			}
		}
	}
	return out
}

// overlaps reports whether w overlaps any of ws.
func overlaps(w window, ws []window) bool {
	return slices.ContainsFunc(ws, func(o window) bool { return !w.to.Before(o.from) && !o.to.Before(w.from) })
}

var machineRef = regexp.MustCompile(`\b(sim-\d{6}|real-\d+)\b`)

// printHistories logs, for the machines the violations name (the first 10),
// their work history and what the simulator saw.
func (s *soak) printHistories(ctx context.Context, pool *pgxpool.Pool, violations string) {
	// The machines the violations name, in their order, without repeats.
	var ids []string
	for _, id := range machineRef.FindAllString(violations, -1) {
		if !slices.Contains(ids, id) {
			ids = append(ids, id)
		}
	}
	printed := 0
	for _, id := range ids {
		if printed == 10 {
			break
		}
		if !machineRef.MatchString(id) {
			continue
		}
		printed++
		var b strings.Builder
		fmt.Fprintf(&b, "history of %s:\n", id)
		rows, err := pool.Query(ctx, `
			SELECT h.at, h.process, h.event, coalesce(h.session_id::text, ''), h.cause
			FROM work_history h JOIN machine_provided p USING (machine_id)
			WHERE p.provider = $1 AND p.provider_id = $2 ORDER BY h.history_id`, providerName, id)
		if err == nil {
			for rows.Next() {
				var at time.Time
				var process, event, session, cause string
				if rows.Scan(&at, &process, &event, &session, &cause) == nil {
					fmt.Fprintf(&b, "  %s %-12s %-11s %.8s %s\n", at.Format("15:04:05.000"), process, event, session, cause)
				}
			}
			rows.Close()
		}
		m := s.truth.Machine(id)
		for _, st := range m.Starts {
			fmt.Fprintf(&b, "  sim %s agent started\n", st.At.Format("15:04:05.000"))
		}
		for _, r := range m.Reboots {
			fmt.Fprintf(&b, "  sim %s rebooted\n", r.Format("15:04:05.000"))
		}
		if n := len(m.Acks); n > 0 {
			fmt.Fprintf(&b, "  sim %d heartbeats acknowledged, last sent %s\n", n, m.Acks[n-1].Sent.Format("15:04:05.000"))
		}
		s.t.Log(b.String())
	}
}
