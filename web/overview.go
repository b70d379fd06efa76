package web

import (
	"cmp"
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
}

// processCounts is one row of the overview's work table.
type processCounts struct {
	Process                          bmdb.Process
	LiveWork, BackedOff, Quarantined int64
}

type overviewData struct {
	States    []string
	Providers []*providerSummary
	Total     *providerSummary
	// Quarantined counts machines whose derived state is Quarantined.
	Quarantined  int64
	Processes    []processCounts
	Hardware     []bmdb.HardwareTotals
	LiveSessions int
	Breakers     bool
}

// overview shows the fleet: machines per derived state and provider, work,
// backoffs and quarantines per process, hardware totals and each provider's
// circuit breaker. The counts come from one consistent snapshot.
func (s *Server) overview(_ http.ResponseWriter, r *http.Request) (*view, error) {
	ctx := r.Context()
	// The snapshot scans the fleet; the sessions are read meanwhile.
	var snap bmdb.FleetSnapshot
	var sessions []bmdb.SessionInfo
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		var err error
		snap, err = s.db.FleetSnapshot(gctx, s.cfg.FirstHeartbeatTimeout, s.cfg.HeartbeatTimeout)
		return err
	})
	g.Go(func() error {
		var err error
		sessions, err = s.db.ListSessions(gctx, false, maxSessions)
		return err
	})
	if err := g.Wait(); err != nil {
		return nil, err
	}
	d := &overviewData{Total: &providerSummary{Name: "", Counts: map[string]int64{}}, Breakers: s.cfg.Breaker != nil,
		LiveSessions: len(sessions)}
	for _, st := range bmdb.MachineStates() {
		if st != bmdb.StateDecommissioned { // not in the fleet: counted apart
			d.States = append(d.States, string(st))
		}
	}
	byName := map[string]*providerSummary{}
	provider := func(name string) *providerSummary {
		p := byName[name]
		if p == nil {
			p = &providerSummary{Name: name, Counts: map[string]int64{}}
			byName[name] = p
			d.Providers = append(d.Providers, p)
		}
		return p
	}
	for _, name := range s.cfg.Providers {
		provider(name)
	}
	for _, c := range snap.States {
		p := provider(c.Provider)
		p.Counts[string(c.State)] += c.Machines
		p.Total += c.Machines
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
	d.Quarantined = d.Total.Counts[string(bmdb.StateQuarantined)]
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

	if s.cfg.Breaker != nil {
		// One breaker per provider, read side by side: each is a few
		// counts over the provider's machines.
		var wg sync.WaitGroup
		for _, p := range d.Providers {
			wg.Go(func() {
				b, err := s.cfg.Breaker(ctx, p.Name)
				if err != nil {
					s.log.WarnContext(ctx, "reading the circuit breaker", "provider", p.Name, "err", err)
					p.BreakerErr = "could not read the breaker; the server log has the details"
					return
				}
				p.Breaker = &b
			})
		}
		wg.Wait()
	}
	return &view{Title: "Fleet overview", Nav: "overview", Refresh: s.refreshSeconds(), Data: d}, nil
}
