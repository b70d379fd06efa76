package web

import (
	"cmp"
	"context"
	"net/http"
	"slices"
	"sync"

	"golang.org/x/sync/errgroup"

	"github.com/shepherd/shepherd/bmdb"
)

// providerSummary is one column of the overview's state table.
type providerSummary struct {
	Name   string
	Counts map[string]int64 // by derived state
	Total  int64
	// Decommissioned machines left the fleet; they are not in Counts.
	Decommissioned int64
	Breaker        *BreakerState
	BreakerErr     string
	// SilentAgents counts the machines whose agent is silent (what the
	// breaker counts) by their derived state, and SilentAgentsTotal all of
	// them, from the same snapshot as Counts.
	SilentAgents      map[string]int64
	SilentAgentsTotal int64
}

// processCounts is one row of the overview's work table.
type processCounts struct {
	Process                          bmdb.Process
	LiveWork, BackedOff, Quarantined int64
}

type overviewData struct {
	States    []string
	Providers []*providerSummary
	// Total counts the whole fleet per derived state: the cards and the
	// All column of the state table show these very numbers.
	Total        *providerSummary
	Processes    []processCounts
	Hardware     []bmdb.HardwareTotals
	LiveSessions int
	Breakers     bool
	// Timeouts decided which machines are silent.
	Timeouts bmdb.SilenceTimeouts
}

// overview shows the fleet: machines per derived state and provider, work,
// backoffs and quarantines per process, hardware totals and each provider's
// circuit breaker. The counts come from one consistent snapshot, with
// silence judged by the timeouts the recoverers recorded; the breakers are
// read meanwhile, judging by the same timeouts.
func (s *Server) overview(_ http.ResponseWriter, r *http.Request) (*view, error) {
	ctx := r.Context()
	timeouts, err := s.db.SilenceTimeouts(ctx)
	if err != nil {
		return nil, err
	}
	d := &overviewData{Total: &providerSummary{Name: "", Counts: map[string]int64{}}, Breakers: s.cfg.Breaker != nil,
		Timeouts: timeouts}
	for _, st := range bmdb.MachineStates() {
		if st != bmdb.StateDecommissioned { // not in the fleet: counted apart
			d.States = append(d.States, string(st))
		}
	}
	byName := map[string]*providerSummary{}
	provider := func(name string) *providerSummary {
		p := byName[name]
		if p == nil {
			p = &providerSummary{Name: name, Counts: map[string]int64{}, SilentAgents: map[string]int64{}}
			byName[name] = p
			d.Providers = append(d.Providers, p)
		}
		return p
	}
	for _, name := range s.cfg.Providers {
		provider(name)
	}
	configured := len(d.Providers)
	// The snapshot scans the fleet; the sessions and the breakers of the
	// configured providers are read meanwhile (those of other providers
	// with machines after it).
	var snap bmdb.FleetSnapshot
	var sessions []bmdb.SessionInfo
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		var err error
		snap, err = s.db.FleetSnapshot(gctx, timeouts.FirstHeartbeat, timeouts.Heartbeat)
		return err
	})
	g.Go(func() error {
		var err error
		sessions, err = s.db.ListSessions(gctx, false, maxSessions)
		return err
	})
	if s.cfg.Breaker != nil {
		for _, p := range d.Providers {
			g.Go(func() error { s.readBreaker(gctx, p, timeouts); return nil })
		}
	}
	if err := g.Wait(); err != nil {
		return nil, err
	}
	d.LiveSessions = len(sessions)
	for _, c := range snap.States {
		p := provider(c.Provider)
		p.Counts[string(c.State)] += c.Machines
		p.Total += c.Machines
		p.SilentAgents[string(c.State)] += c.SilentAgents
		p.SilentAgentsTotal += c.SilentAgents
		d.Total.Counts[string(c.State)] += c.Machines
		d.Total.Total += c.Machines
		if !slices.Contains(d.States, string(c.State)) { // a state this UI does not know yet
			d.States = append(d.States, string(c.State))
		}
	}
	for name, n := range snap.Decommissioned {
		provider(name).Decommissioned = n
		d.Total.Decommissioned += n
	}
	if s.cfg.Breaker != nil {
		// The providers with machines but not configured: their breakers
		// now, side by side.
		var wg sync.WaitGroup
		for _, p := range d.Providers[configured:] {
			wg.Go(func() { s.readBreaker(ctx, p, timeouts) })
		}
		wg.Wait()
	}
	slices.SortFunc(d.Providers, func(a, b *providerSummary) int { return cmp.Compare(a.Name, b.Name) })

	procs := map[bmdb.Process]*processCounts{}
	proc := func(p bmdb.Process) *processCounts {
		if procs[p] == nil {
			procs[p] = &processCounts{Process: p}
		}
		return procs[p]
	}
	for p, n := range snap.LiveWork {
		proc(p).LiveWork = n
	}
	for _, b := range snap.Backoffs {
		if b.Quarantined {
			proc(b.Process).Quarantined = b.Machines
		} else {
			proc(b.Process).BackedOff = b.Machines
		}
	}
	for _, p := range procs {
		d.Processes = append(d.Processes, *p)
	}
	slices.SortFunc(d.Processes, func(a, b processCounts) int { return cmp.Compare(a.Process, b.Process) })
	d.Hardware = snap.Hardware
	slices.SortFunc(d.Hardware, func(a, b bmdb.HardwareTotals) int {
		return cmp.Or(cmp.Compare(a.Provider, b.Provider), cmp.Compare(a.Location, b.Location))
	})
	return &view{Title: "Fleet overview", Nav: "overview", Refresh: s.refreshSeconds(), Data: d}, nil
}

// readBreaker reads p's circuit breaker into it, judging silence by
// timeouts; a failure is logged and shown in p's row.
func (s *Server) readBreaker(ctx context.Context, p *providerSummary, timeouts bmdb.SilenceTimeouts) {
	b, err := s.cfg.Breaker(ctx, p.Name, timeouts)
	if err != nil {
		if ctx.Err() == nil {
			s.log.WarnContext(ctx, "reading the circuit breaker", "provider", p.Name, "err", err)
		}
		p.BreakerErr = "could not read the breaker; the server log has the details"
		return
	}
	p.Breaker = &b
}
