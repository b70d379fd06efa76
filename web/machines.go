package web

import (
	"errors"
	"net/http"
	"slices"
	"strings"

	"github.com/google/uuid"
	"golang.org/x/sync/errgroup"

	"github.com/shepherd/shepherd/bmdb"
)

// listData is the machine list page: the filter, one page of machines and
// the cursor of the next.
type listData struct {
	States    []string
	State     string
	Provider  string
	Location  string
	Search    string
	Decom     bool
	Count     int64
	Machines  []bmdb.MachineSummary
	NextURL   string
	FirstURL  string
	FirstPage bool
	// Sort is the order: "" (machine id) or sortProviderID. SortURLs are
	// the first page of this filter in each order, by order.
	Sort     string
	SortURLs map[string]string
	// Timeouts decided which machines are Silent.
	Timeouts bmdb.SilenceTimeouts
}

// sortProviderID is ?sort= of the list in provider id order (by provider,
// then provider id), paged by ?after_provider=, ?after_pid= and ?after=.
const sortProviderID = "provider-id"

// maxFilterLength bounds a filter value: longer ones cannot match anything
// (provider ids are at most 128 bytes) and only cost the database.
const maxFilterLength = 256

// machineList serves the machine list: filtered by state, provider and
// location, searched by id, provider id or IP, a page at a time in id
// order (keyset pagination: ?after=ID continues after that machine), or
// with ?sort=provider-id by provider and provider id (?after_provider=,
// ?after_pid= and ?after= continue after that machine).
func (s *Server) machineList(_ http.ResponseWriter, r *http.Request) (*view, error) {
	q := r.URL.Query()
	d := &listData{
		State:    q.Get("state"),
		Provider: strings.TrimSpace(q.Get("provider")),
		Location: strings.TrimSpace(q.Get("location")),
		Search:   strings.TrimSpace(q.Get("q")),
		Decom:    q.Get("decommissioned") == "on",
	}
	for _, st := range bmdb.MachineStates() {
		d.States = append(d.States, string(st))
	}
	for _, v := range []string{d.Provider, d.Location, d.Search} {
		if len(v) > maxFilterLength {
			return nil, badRequest("a filter value is longer than %d bytes", maxFilterLength)
		}
	}
	d.Sort = q.Get("sort")
	if d.Sort != "" && d.Sort != sortProviderID {
		return nil, badRequest("sort=%q is not an order: use %s, or nothing for machine id order", d.Sort, sortProviderID)
	}
	var after uuid.UUID
	if a := q.Get("after"); a != "" {
		var err error
		if after, err = uuid.Parse(a); err != nil {
			return nil, badRequest("after=%q is not a machine id", a)
		}
	}
	var err error
	if d.Timeouts, err = s.db.SilenceTimeouts(r.Context()); err != nil {
		return nil, err
	}
	f := bmdb.MachineFilter{
		Provider:              d.Provider,
		Location:              d.Location,
		State:                 bmdb.MachineState(d.State),
		Search:                d.Search,
		FirstHeartbeatTimeout: d.Timeouts.FirstHeartbeat,
		HeartbeatTimeout:      d.Timeouts.Heartbeat,
		IncludeDecommissioned: d.Decom || d.State == string(bmdb.StateDecommissioned),
	}
	cursor := bmdb.ProviderIDCursor{Provider: q.Get("after_provider"), ProviderID: q.Get("after_pid"), MachineID: after}
	if len(cursor.Provider) > maxFilterLength || len(cursor.ProviderID) > maxFilterLength {
		return nil, badRequest("the page cursor is longer than %d bytes", maxFilterLength)
	}
	// The page and the count are independent statements that each scan
	// the fleet when filtered: run them side by side.
	var next uuid.UUID
	var nextCursor bmdb.ProviderIDCursor
	g, gctx := errgroup.WithContext(r.Context())
	g.Go(func() error {
		var err error
		if d.Sort == sortProviderID {
			d.Machines, nextCursor, err = s.db.ListMachinesByProviderID(gctx, f, cursor, s.cfg.PageSize)
			return err
		}
		d.Machines, next, err = s.db.ListMachines(gctx, f, after, s.cfg.PageSize)
		return err
	})
	g.Go(func() error {
		var err error
		d.Count, err = s.db.CountMachines(gctx, f)
		return err
	})
	if err := g.Wait(); err != nil {
		return nil, listError(err)
	}
	d.FirstPage = after == uuid.Nil && cursor.IsZero()
	decom := ""
	if d.Decom {
		decom = "on"
	}
	// page is the list of this filter in order, from the machine that
	// follows the cursor kv (key, value pairs).
	page := func(order string, kv ...string) string {
		return listURL(slices.Concat([]string{"state", d.State, "provider", d.Provider, "location", d.Location,
			"q", d.Search, "decommissioned", decom, "sort", order}, kv)...)
	}
	d.SortURLs = map[string]string{"": page(""), sortProviderID: page(sortProviderID)}
	d.FirstURL = page(d.Sort)
	switch {
	case !nextCursor.IsZero():
		d.NextURL = page(d.Sort, "after_provider", nextCursor.Provider, "after_pid", nextCursor.ProviderID,
			"after", nextCursor.MachineID.String())
	case next != uuid.Nil:
		d.NextURL = page(d.Sort, "after", next.String())
	}
	return &view{Title: "Machines", Nav: "machines", Data: d}, nil
}

// listError turns the BMDB's refusal of a filter into a 400.
func listError(err error) error {
	if errors.Is(err, bmdb.ErrInvalidFilter) {
		return badRequest("%v", err)
	}
	return err
}
