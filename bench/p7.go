package main

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/web"
)

const (
	p7Machines   = 100_000
	p7Iterations = 50
	p7LimitMs    = 200.0
)

// benchUIRender is P7: the server-side render time of the web UI's pages
// on a fleet of 100,000 machines, the handler called directly (no network,
// no browser): the overview, the first page of the machine list, the list
// filtered by a state, a later page of a filtered list and a machine page.
// The figure is the p99 of the slowest page.
func benchUIRender(ctx context.Context, e *env) error {
	url, err := e.database(ctx, "p7")
	if err != nil {
		return err
	}
	db, err := bmdb.Open(ctx, bmdb.Config{URL: url})
	if err != nil {
		return err
	}
	defer db.Close()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		return err
	}
	defer pool.Close()
	fleet := bmdbtest.Fleet{Provider: "p", Healthy: p7Machines - 1_100, Stale: 500, Installed: 300, AwaitingAgent: 200, NeverHeartbeat: 100}
	if err := bmdbtest.BuildFleet(ctx, pool, fleet); err != nil {
		return err
	}
	srv, err := web.New(web.Config{
		Providers: []string{"p"},
		// The overview shows the breaker as `shepherd run` wires it.
		Breaker: func(ctx context.Context, provider string, t bmdb.SilenceTimeouts) (web.BreakerState, error) {
			b, err := manager.ReadBreaker(ctx, db, provider,
				manager.RecovererConfig{FirstHeartbeatTimeout: t.FirstHeartbeat, HeartbeatTimeout: t.Heartbeat})
			return web.BreakerState{Started: b.Started, Silent: b.Silent, SilentFraction: b.SilentFraction,
				RebootsInWindow: b.RebootsInWindow, Budget: b.Budget, Window: b.Window, Paused: b.Paused}, err
		},
	}, db)
	if err != nil {
		return err
	}
	h := srv.Handler()
	first, _, err := db.ListMachines(ctx, bmdb.MachineFilter{}, [16]byte{}, 1)
	if err != nil {
		return err
	}
	if len(first) == 0 {
		return fmt.Errorf("the fleet has no machines")
	}
	// The figure and its limit hold for every page operators open: the
	// overview (which counts the whole fleet by state, as the janitor's
	// gauges do), the list (first page, filtered by state, further on)
	// and a machine.
	pages := []struct{ name, path string }{
		{"overview", "/"},
		{"list", "/machines"},
		{"list_silent", "/machines?state=Silent"},
		{"list_healthy_page2", ""},
		{"machine", "/machines/" + first[0].MachineID.String()},
	}
	// The second page of Healthy machines: keyset pagination must not get
	// slower further into the list.
	rec := get(h, "/machines?state=Healthy")
	if rec.Code != http.StatusOK {
		return fmt.Errorf("GET /machines?state=Healthy: %d", rec.Code)
	}
	next, _, err := db.ListMachines(ctx, bmdb.MachineFilter{State: bmdb.StateHealthy}, [16]byte{}, 50)
	if err != nil || len(next) == 0 {
		return fmt.Errorf("listing healthy machines: %v", err)
	}
	pages[3].path = "/machines?state=Healthy&after=" + next[len(next)-1].MachineID.String()

	var worst, worstP50 float64
	var worstPage string
	var kv []any
	for _, p := range pages {
		lat := make([]time.Duration, 0, p7Iterations)
		for i := range p7Iterations + 5 {
			start := time.Now()
			rec := get(h, p.path)
			d := time.Since(start)
			if rec.Code != http.StatusOK {
				return fmt.Errorf("%s: GET %s: status %d: %s", p.name, p.path, rec.Code, rec.Body.String())
			}
			if i >= 5 { // the first requests warm caches and prepared statements
				lat = append(lat, d)
			}
		}
		p50, p99 := quantiles(lat)
		kv = append(kv, p.name+"_p50_ms", p50, p.name+"_p99_ms", p99)
		if p99 > worst {
			worst, worstP50, worstPage = p99, p50, p.name
		}
	}
	// value is the p99 of the slowest page, which the limit holds.
	args := append([]any{"p50", worstP50, "limit", p7LimitMs, "limit_ratio", worst / p7LimitMs,
		"worst_page", worstPage, "machines", p7Machines, "requests", p7Iterations}, kv...)
	report("P7", "ui_render_ms", worst, args...)
	return nil
}

func get(h http.Handler, path string) *httptest.ResponseRecorder {
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	return rec
}
