package chaos

import (
	"context"
	"fmt"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/internal/hostile"
	"github.com/shepherd/shepherd/internal/tcpproxy"
	"github.com/shepherd/shepherd/provider/sim"
)

// record is what the soak notes while it runs, for the checks.
type record struct {
	mu      sync.Mutex
	applied map[Kind]int
	skipped map[Kind]int
	errors  []string // faults the harness failed to apply or heal
	// heldTooLong are I6 violations seen by the sampler.
	heldTooLong []string
	// lostAcks are I7 violations seen right after a PostgreSQL restart or
	// failover.
	lostAcks []string
	lostSeen map[string]bool
	// hostile are the hostile client's runs; forged are I8 violations seen
	// by sampling the targets' heartbeats.
	hostile       []hostile.Result
	forgedSamples []sample
	// hostileWindows are when the hostile client ran.
	hostileWindows []window
	// dbWindows are when the database or a callback server was impaired:
	// honest heartbeats refused then are not the hostile client's doing.
	impairedWindows []window
}

type window struct{ from, to time.Time }

// sample is a heartbeat time the BMDB held for a machine.
type sample struct {
	id string
	hb time.Time
}

func (r *record) note(f func(r *record)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	f(r)
}

func (s *soak) failf(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	s.logf("HARNESS ERROR %s", msg)
	s.rec.note(func(r *record) { r.errors = append(r.errors, msg) })
}

// runFaults applies the schedule in real time until it is done or ctx
// ends, and returns once every fault is healed.
func (s *soak) runFaults(ctx context.Context, faults []Fault) {
	start := time.Now()
	var wg sync.WaitGroup
	for _, f := range faults {
		wait := time.Until(start.Add(f.At))
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
		if ctx.Err() != nil {
			break
		}
		wg.Go(func() { s.apply(ctx, f) })
	}
	wg.Wait()
}

// hold waits d or until ctx ends.
func hold(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

// apply injects one fault, waits its duration and heals it. A fault that
// cannot apply now (its target is already down) is skipped and counted.
func (s *soak) apply(ctx context.Context, f Fault) {
	ok := true
	s.logf("fault  %s", f)
	began := time.Now()
	switch f.Kind {
	case KillProcess:
		p := s.procs[f.Target]
		if !p.running() {
			ok = false
			break
		}
		p.kill()
		s.impaired(began, f.For+lease)
		hold(ctx, f.For)
		if err := p.ensureRunning(); err != nil {
			s.failf("restarting %s: %v", p.name, err)
		}
	case StopProcess:
		p := s.procs[f.Target]
		if !p.signal(syscall.SIGSTOP) {
			ok = false
			break
		}
		s.impaired(began, f.For+lease)
		hold(ctx, f.For)
		p.signal(syscall.SIGCONT)
	case RestartPostgres:
		ok = s.restartPostgres(ctx)
	case FailoverPostgres:
		ok = s.failover(ctx)
	case DBBlackhole, DBReset:
		mode := tcpproxy.Blackhole
		if f.Kind == DBReset {
			mode = tcpproxy.Reset
		}
		s.impaired(began, f.For+heartbeatTimeout)
		s.setProxies(mode, 0)
		hold(ctx, f.For)
		s.setProxies(tcpproxy.Pass, 0)
	case DBDelay:
		s.impaired(began, f.For+heartbeatTimeout)
		s.setProxies(tcpproxy.Pass, f.Delay)
		hold(ctx, f.For)
		s.setProxies(tcpproxy.Pass, 0)
	case AgentHang:
		for _, m := range f.Machines {
			// A machine without an agent has nothing to hang: fine.
			_ = s.fleet.Silence(s.simIDs[m])
		}
	case MachineDeath:
		for _, m := range f.Machines {
			if err := s.fleet.Kill(s.simIDs[m]); err != nil {
				s.failf("killing %s: %v", s.simIDs[m], err)
			}
		}
		hold(ctx, f.For)
		for _, m := range f.Machines {
			if err := s.fleet.Revive(s.simIDs[m]); err != nil {
				s.failf("reviving %s: %v", s.simIDs[m], err)
			}
		}
	case RebootFails, RebootHangs:
		fault := sim.RebootFails
		if f.Kind == RebootHangs {
			fault = sim.RebootHangs
		}
		for _, m := range f.Machines {
			if err := s.fleet.SetRebootFault(s.simIDs[m], fault); err != nil {
				s.failf("setting the reboot fault of %s: %v", s.simIDs[m], err)
			}
			_ = s.fleet.Silence(s.simIDs[m])
		}
		hold(ctx, f.For)
		for _, m := range f.Machines {
			if err := s.fleet.SetRebootFault(s.simIDs[m], sim.RebootWorks); err != nil {
				s.failf("clearing the reboot fault of %s: %v", s.simIDs[m], err)
			}
		}
	case RackPartition:
		rack := s.rack(f.Target)
		for _, id := range rack {
			if err := s.fleet.Partition(id, true); err != nil {
				s.failf("partitioning %s: %v", id, err)
			}
		}
		hold(ctx, f.For)
		for _, id := range rack {
			if err := s.fleet.Partition(id, false); err != nil {
				s.failf("ending the partition of %s: %v", id, err)
			}
		}
	case RealAgentKill:
		if pid := readPID(agentPIDFile(s.agents, realID(f.Target))); pid > 1 {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		} else {
			ok = false
		}
	case HostKeyRotation:
		h := s.hosts[f.Target]
		mu := &s.hostMu[f.Target]
		if !mu.TryLock() {
			ok = false
			break
		}
		old := h.Keys()
		h.ChangeHostKey(s.t)
		hold(ctx, f.For)
		h.SetHostKeys(s.t, old)
		mu.Unlock()
	case HostileClient:
		ok = s.runHostile(ctx, f)
	}
	s.rec.note(func(r *record) {
		if ok {
			r.applied[f.Kind]++
		} else {
			r.skipped[f.Kind]++
		}
	})
	if !ok {
		s.logf("skip   %s (its target is down or busy)", f)
		return
	}
	s.logf("healed %s after %s", f, time.Since(began).Round(time.Millisecond))
}

// impaired records a window in which honest heartbeats may be refused or
// lost for reasons other than the hostile client.
func (s *soak) impaired(from time.Time, d time.Duration) {
	s.rec.note(func(r *record) { r.impairedWindows = append(r.impairedWindows, window{from, from.Add(d)}) })
}

func (s *soak) setProxies(m tcpproxy.Mode, delay time.Duration) {
	for _, p := range s.proxies {
		p.SetDelay(delay)
		p.SetMode(m)
	}
}

// rack returns the provider ids of rack r's simulated machines.
func (s *soak) rack(r int) []string {
	const perRack = 100 // sim's machinesPerRack
	var out []string
	for i := r * perRack; i < min(len(s.simIDs), (r+1)*perRack); i++ {
		out = append(out, s.simIDs[i])
	}
	return out
}

// restartPostgres restarts the primary (fast shutdown) and checks that no
// acknowledged heartbeat was lost.
func (s *soak) restartPostgres(ctx context.Context) bool {
	if !s.pgMu.TryLock() {
		return false
	}
	defer s.pgMu.Unlock()
	began := time.Now()
	s.impaired(began, time.Minute)
	before := s.truth.LastAcks()
	if err := s.primary.Stop(ctx); err != nil {
		s.failf("stopping the primary: %v", err)
	}
	if err := s.primary.Start(ctx); err != nil {
		s.failf("starting the primary again: %v", err)
		return true
	}
	s.checkAcks(ctx, "restart", s.primary.TCPURL(databaseName), before, began)
	return true
}

// failover stops the primary at once (no shutdown checkpoint, like a
// crash), promotes the synchronous standby, checks that nothing
// acknowledged was lost, and builds a new standby of the new primary so
// that the next failover has one.
func (s *soak) failover(ctx context.Context) bool {
	if !s.pgMu.TryLock() {
		return false
	}
	defer s.pgMu.Unlock()
	if s.standby == nil {
		return false
	}
	began := time.Now()
	s.impaired(began, time.Minute)
	before := s.truth.LastAcks()
	if err := s.primary.StopImmediate(ctx); err != nil {
		s.failf("stopping the primary at once: %v", err)
	}
	if err := s.standby.Promote(ctx); err != nil {
		s.failf("promoting the standby: %v", err)
		return true
	}
	old := s.primary
	s.primary, s.standby = s.standby, nil
	s.primaryAt = 1 - s.primaryAt
	s.checkAcks(ctx, "failover", s.primary.TCPURL(databaseName), before, began)
	if err := old.Close(); err != nil {
		s.logf("closing the old primary: %v", err)
	}
	sb, err := s.newStandby(ctx)
	if err != nil {
		s.failf("building a new standby: %v", err)
		return true
	}
	s.standby = sb
	// The old primary's place in the URL leads to the new standby now.
	s.proxies[1-s.primaryAt].SetTarget(fmt.Sprintf("127.0.0.1:%d", sb.Port()))
	return true
}

// sampleAcks runs until ctx ends, checking every two seconds that every
// heartbeat the server has acknowledged is in the BMDB (I7, while it runs:
// a later heartbeat would hide a lost one from the final check). Failing
// connections are skipped: the database may be down.
func (s *soak) sampleAcks(ctx context.Context) {
	for ctx.Err() == nil {
		hold(ctx, 2*time.Second)
		if ctx.Err() != nil {
			return
		}
		before := s.truth.LastAcks()
		qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		s.checkAcks(qctx, "sample", s.directURL(), before, time.Now())
		cancel()
	}
}

// checkAcks compares, right after PostgreSQL came back, every machine's
// heartbeat in the BMDB with the last one the server acknowledged before
// the fault (I7): it must be there, or a later one, unless the machine was
// rebooted or taken over again since (which deletes it).
func (s *soak) checkAcks(ctx context.Context, what, url string, before map[string]Ack, at time.Time) {
	failf := s.failf
	if what == "sample" {
		failf = func(string, ...any) {} // the database may be down; the next sample reads it
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		failf("connecting after the %s: %v", what, err)
		return
	}
	defer conn.Close(context.WithoutCancel(ctx))
	rows, err := conn.Query(ctx, `
		SELECT p.provider_id, h.agent_heartbeat_at, s.agent_started_at
		FROM machine_provided p
		LEFT JOIN machine_agent_heartbeat h USING (machine_id)
		LEFT JOIN machine_agent_started s USING (machine_id)
		WHERE p.provider = $1`, providerName)
	if err != nil {
		failf("reading heartbeats after the %s: %v", what, err)
		return
	}
	type row struct {
		hb, started *time.Time
	}
	got := map[string]row{}
	for rows.Next() {
		var id string
		var r row
		if err := rows.Scan(&id, &r.hb, &r.started); err != nil {
			failf("reading heartbeats after the %s: %v", what, err)
			return
		}
		got[id] = r
	}
	if rows.Err() != nil {
		failf("reading heartbeats after the %s: %v", what, rows.Err())
		return
	}
	for id, a := range before {
		r := got[id]
		if r.hb != nil && !r.hb.Before(a.Sent.Add(-margin)) {
			continue
		}
		// The heartbeat belonged to an agent the BMDB no longer has (a
		// recovery ended it since) or to an earlier one than it has now:
		// it is gone with its agent, not lost.
		if r.started == nil || r.started.After(a.Acked) {
			continue
		}
		s.rec.note(func(rec *record) {
			key := id + a.Sent.String()
			if rec.lostSeen[key] {
				return // a later sample sees the same loss
			}
			rec.lostSeen[key] = true
			rec.lostAcks = append(rec.lostAcks, fmt.Sprintf("%s: after the %s at %s the BMDB has heartbeat %v, but the server acknowledged one sent at %s",
				id, what, at.Format("15:04:05.000"), r.hb, a.Sent.Format("15:04:05.000")))
		})
	}
}

// runHostile runs the hostile client against one callback server while the
// agents of its targets hang, and samples the targets' heartbeats: only
// honest heartbeats may ever explain them (I8). It returns false, the fault
// skipped, when the targets could not be looked up while it lasted.
func (s *soak) runHostile(ctx context.Context, f Fault) bool {
	hctx, cancel := context.WithTimeout(ctx, f.For)
	defer cancel()
	// The lookup goes straight to the primary, which another fault may be
	// restarting or failing over (a 10-minute soak met a connect timeout
	// there): try again until the fault's time is up.
	var ids []string
	for {
		lctx, lcancel := context.WithTimeout(hctx, 5*time.Second)
		var err error
		ids, err = s.machineIDs(lctx, f.Machines)
		lcancel()
		if err == nil {
			break
		}
		if hctx.Err() != nil {
			s.logf("hostile client: its targets could not be looked up while it lasted: %v", err)
			return false
		}
		hold(hctx, 500*time.Millisecond)
	}
	for _, m := range f.Machines {
		_ = s.fleet.Silence(s.simIDs[m])
	}
	began := time.Now()
	var res hostile.Result
	var wg sync.WaitGroup
	wg.Go(func() {
		var err error
		res, err = hostile.Run(hctx, hostile.Config{Endpoint: s.servers[f.Target], CA: s.caPEM, Targets: ids,
			// Its connection flood comes from an address of its own, so the
			// per-address limit it hits is not the honest agents'.
			ConnFloodFrom: "127.0.0.9"})
		if err != nil {
			s.failf("hostile client: %v", err)
		}
	})
	for hctx.Err() == nil {
		s.sampleForged(hctx, f.Machines)
		hold(hctx, 500*time.Millisecond)
	}
	wg.Wait()
	s.sampleForged(context.WithoutCancel(ctx), f.Machines)
	s.rec.note(func(r *record) {
		r.hostile = append(r.hostile, res)
		r.hostileWindows = append(r.hostileWindows, window{began, time.Now()})
	})
	return true
}

// machineIDs returns the BMDB ids of simulated machines.
func (s *soak) machineIDs(ctx context.Context, idx []int) ([]string, error) {
	conn, err := pgx.Connect(ctx, s.directURL())
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	var out []string
	for _, i := range idx {
		var id string
		if err := conn.QueryRow(ctx, "SELECT machine_id::text FROM machine_provided WHERE provider = $1 AND provider_id = $2",
			providerName, s.simIDs[i]).Scan(&id); err != nil {
			return nil, fmt.Errorf("machine %s: %w", s.simIDs[i], err)
		}
		out = append(out, id)
	}
	return out, nil
}

// sampleForged reads the targets' heartbeats; a time no honest heartbeat
// of the machine explains was written for a forgery (judged at the end).
func (s *soak) sampleForged(ctx context.Context, idx []int) {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.directURL())
	if err != nil {
		return // the database may be down: the next sample reads it
	}
	defer conn.Close(context.WithoutCancel(ctx))
	for _, i := range idx {
		id := s.simIDs[i]
		var hb time.Time
		err := conn.QueryRow(ctx, `SELECT h.agent_heartbeat_at FROM machine_agent_heartbeat h
			JOIN machine_provided p USING (machine_id) WHERE p.provider = $1 AND p.provider_id = $2`, providerName, id).Scan(&hb)
		if err != nil {
			continue
		}
		// Judged at the end (checkHostile): an honest heartbeat in flight
		// now may be recorded already while its agent has no answer yet.
		s.rec.note(func(r *record) { r.forgedSamples = append(r.forgedSamples, sample{id, hb}) })
	}
}

// sampleWork runs until ctx ends, checking every two seconds that no live
// session holds work longer than its deadline plus one lease (I6).
func (s *soak) sampleWork(ctx context.Context) {
	bound := workTimeout + lease + 5*time.Second // 5 s: the sampler's own lag and clock steps
	seen := map[string]bool{}
	for ctx.Err() == nil {
		hold(ctx, 2*time.Second)
		qctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		conn, err := pgx.Connect(qctx, s.directURL())
		if err != nil {
			cancel()
			continue
		}
		rows, err := conn.Query(qctx, `
			SELECT p.provider_id, w.process, w.session_id::text, w.started_at, now() - w.started_at
			FROM work w JOIN sessions s USING (session_id) JOIN machine_provided p USING (machine_id)
			WHERE s.closed_at IS NULL AND s.deadline > now() AND w.started_at < now() - interval '1 millisecond' * $1`,
			bound.Milliseconds())
		if err == nil {
			for rows.Next() {
				var id, process, session string
				var started time.Time
				var held time.Duration
				if rows.Scan(&id, &process, &session, &started, &held) != nil {
					continue
				}
				key := id + process + started.String()
				if seen[key] {
					continue
				}
				seen[key] = true
				s.rec.note(func(r *record) {
					r.heldTooLong = append(r.heldTooLong, fmt.Sprintf("%s: %s held by live session %s for %s (since %s), more than %s",
						id, process, session, held.Round(time.Second), started.Format("15:04:05"), bound))
				})
			}
			rows.Close()
		}
		conn.Close(context.WithoutCancel(ctx))
		cancel()
	}
}

// healAll ends every fault still in force: processes run, PostgreSQL is
// reachable, machines live and reboot, racks are connected, host keys are
// the pinned ones. Hung agents are left to recovery.
func (s *soak) healAll() {
	s.setProxies(tcpproxy.Pass, 0)
	for _, p := range s.procs {
		if err := p.ensureRunning(); err != nil {
			s.failf("restarting %s: %v", p.name, err)
		}
	}
	for _, id := range s.simIDs {
		_ = s.fleet.Partition(id, false)
		_ = s.fleet.SetRebootFault(id, sim.RebootWorks)
		if _, alive := s.fleet.Agent(id); !alive {
			// Revive also wakes a hung agent; recovery would have to
			// reboot it otherwise, which it does for those it saw.
			_ = s.fleet.Revive(id)
		}
	}
}
