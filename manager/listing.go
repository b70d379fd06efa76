package manager

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"math"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/provider"
)

// Defaults of ListingGuard.
const (
	DefaultSuspectFraction   = 0.2
	DefaultSuspectMinMissing = 3
)

// ListingGuard decides when a provider listing lacks so many of the BMDB's
// machines that the listing is more likely wrong than the fleet (an API
// answering for the wrong project, a half-read inventory): such a listing
// is suspect, and a pass that gets one changes nothing (SPEC §3.2, §3.5).
//
// A listing is suspect when the machines it lacks are both more than
// Fraction of the machines the BMDB holds as present (not Missing) and more
// than MinMissing. The fraction judges large fleets, the minimum lets a
// small fleet lose a machine or two: without it, one machine gone from a
// fleet of four would be a quarter of it, and every later listing would be
// suspect.
//
// When the machines are really gone, an operator accepts the listing with
// `shepherd provider accept-listing` (bmdb.DB.AcceptListing); the log line
// and the shepherd_*_suspect_listing_missing_machines gauge of a suspect
// pass say so.
//
// Nil fields mean their defaults, so that 0 can be chosen: the zero value
// of a float or int cannot tell "not set" from "set to 0".
type ListingGuard struct {
	// Fraction is within [0, 1]; default DefaultSuspectFraction (0.2). 0
	// makes every listing that lacks more than MinMissing machines suspect,
	// whatever the fleet's size; 1 turns the guard off, since no listing
	// can lack more than all of the fleet.
	Fraction *float64
	// MinMissing is >= 0; default DefaultSuspectMinMissing (3). A listing
	// that lacks at most this many machines is believed whatever the
	// fraction; 0 leaves it to the fraction alone.
	MinMissing *int
}

// validate names the first bad field. It changes nothing.
func (g ListingGuard) validate(component string) error {
	if f := g.Fraction; f != nil && (*f < 0 || *f > 1 || math.IsNaN(*f)) {
		return fmt.Errorf("%s: the suspect fraction must be within [0, 1], got %v", component, *f)
	}
	if m := g.MinMissing; m != nil && *m < 0 {
		return fmt.Errorf("%s: the suspect minimum of missing machines must be >= 0, got %d", component, *m)
	}
	return nil
}

// fraction and minMissing are the guard's settings, defaults filled in.
func (g ListingGuard) fraction() float64 {
	if g.Fraction == nil {
		return DefaultSuspectFraction
	}
	return *g.Fraction
}

func (g ListingGuard) minMissing() int {
	if g.MinMissing == nil {
		return DefaultSuspectMinMissing
	}
	return *g.MinMissing
}

// suspect reports whether a listing that lacks missing of present machines
// is not to be believed.
func (g ListingGuard) suspect(missing, present int) bool {
	return missing > g.minMissing() && float64(missing) > g.fraction()*float64(present)
}

// listingCheck is how the provisioner and the updater judge listings: the
// guard, and the gauge that reports a suspect listing to the operator.
type listingCheck struct {
	guard ListingGuard
	// suspectMissing is the number of machines the last listing lacked if
	// it was suspect, else 0.
	suspectMissing prometheus.Gauge
}

// newListingCheck validates guard and registers the component's gauge.
func newListingCheck(component string, guard ListingGuard, labels prometheus.Labels, reg prometheus.Registerer) (*listingCheck, error) {
	if err := guard.validate(component); err != nil {
		return nil, err
	}
	g := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "shepherd_" + component + "_suspect_listing_missing_machines", ConstLabels: labels,
		Help: "Machines the provider's last listing lacked if it was too many to believe (a suspect listing, " +
			"which changes nothing); 0 after a believed listing. If they are really gone, accept the next " +
			"listing: shepherd provider accept-listing --provider NAME --max-missing N.",
	})
	if err := register(reg, g); err != nil {
		return nil, fmt.Errorf("%s: %w", component, err)
	}
	return &listingCheck{guard: guard, suspectMissing: g}, nil
}

// providerListing is one listing of a provider held against the BMDB's
// machines of that provider: what a provisioner pass and an updater pass
// both start from.
type providerListing struct {
	provider string
	// machines is the listing in the provider's order, without entries
	// whose id is unusable; listed indexes it by provider id.
	machines []provider.Machine
	listed   map[string]provider.Machine
	// known are the BMDB's machines of the provider; inBMDB indexes them.
	known  []bmdb.ProvidedRef
	inBMDB map[string]bmdb.ProvidedRef
}

// listProvider reads the BMDB's machines of p, then lists p, once.
//
// The BMDB is read first: a machine is recorded only after the provider
// confirmed it, so every machine read from the BMDB exists at the provider
// before the listing starts, and a machine recorded while we list is merely
// not known yet. The other order would see a machine created and recorded
// between the two reads as missing from the listing.
func listProvider(ctx context.Context, db *bmdb.DB, p provider.Provider, log *slog.Logger) (*providerListing, error) {
	known, err := db.ListProvided(ctx, p.Name())
	if err != nil {
		return nil, err
	}
	machines, err := p.ListMachines(ctx)
	if err != nil {
		return nil, fmt.Errorf("listing %s: %w", p.Name(), err)
	}
	l := &providerListing{
		provider: p.Name(),
		machines: make([]provider.Machine, 0, len(machines)),
		listed:   make(map[string]provider.Machine, len(machines)),
		known:    known,
		inBMDB:   make(map[string]bmdb.ProvidedRef, len(known)),
	}
	for _, k := range known {
		l.inBMDB[k.ProviderID] = k
	}
	for _, m := range machines {
		if !provider.ValidID(m.ID()) {
			log.WarnContext(ctx, "provider listed a machine with an invalid id; ignoring it", "provider_id", m.ID())
			continue
		}
		l.machines = append(l.machines, m)
		l.listed[m.ID()] = m
	}
	return l, nil
}

// presence is how a listing and the BMDB differ in which machines exist.
type presence struct {
	// missing are BMDB machines, not Missing there, that the listing lacks.
	missing []bmdb.ProvidedRef
	// found are BMDB machines marked Missing that the listing has again.
	found []bmdb.ProvidedRef
	// present counts the BMDB machines that are not Missing.
	present int
	// suspect: the listing lacks too many machines (ListingGuard), which
	// means the listing is wrong, not the fleet. Nothing may be concluded
	// from it.
	suspect bool
	// accepted: the listing lacked too many machines, but an operator had
	// accepted such a listing, so it was believed.
	accepted bool
}

// reconcilePresence compares the listing with the BMDB and, unless the
// listing is suspect, records it: machines it lacks become Missing, and
// Missing machines it has again get the details it gives them. A suspect
// listing changes nothing and is logged, with what to do if the machines
// are really gone; a suspect listing an operator accepted is believed. SPEC
// §3.2 and §3.5 both mark machines this way; this is the one place that
// does it.
func (l *providerListing) reconcilePresence(ctx context.Context, s *bmdb.Session, check *listingCheck, log *slog.Logger) (presence, error) {
	var pr presence
	for _, k := range l.known {
		_, ok := l.listed[k.ProviderID]
		switch {
		case !ok && k.Status != bmdb.ProviderStatusMissing:
			pr.missing = append(pr.missing, k)
		case ok && k.Status == bmdb.ProviderStatusMissing:
			pr.found = append(pr.found, k)
		}
		if k.Status != bmdb.ProviderStatusMissing {
			pr.present++
		}
	}
	if check.guard.suspect(len(pr.missing), pr.present) {
		var acc bmdb.ListingAcceptance
		err := s.Transact(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
			var err error
			acc, pr.accepted, err = tx.TakeListingAcceptance(ctx, l.provider, len(pr.missing))
			return err
		})
		if err != nil {
			return pr, err
		}
		if !pr.accepted {
			pr.suspect = true
			check.suspectMissing.Set(float64(len(pr.missing)))
			log.WarnContext(ctx, "provider listing lacks too many known machines; believing none of it this pass",
				"missing", len(pr.missing), "known", pr.present,
				"suspect_fraction", check.guard.fraction(), "suspect_min_missing", check.guard.minMissing(),
				"if_really_gone", fmt.Sprintf("shepherd provider accept-listing --provider %s --max-missing %d", l.provider, len(pr.missing)))
			return pr, nil
		}
		log.WarnContext(ctx, "provider listing lacks many known machines; believing it, as an operator accepted it",
			"missing", len(pr.missing), "known", pr.present, "accepted_by", acc.By,
			"accepted_at", acc.At, "accepted_max_missing", acc.MaxMissing)
	}
	check.suspectMissing.Set(0)
	ids := make([]string, len(pr.missing))
	for i, k := range pr.missing {
		ids[i] = k.ProviderID
	}
	err := inChunks(ids, bmdb.MaxProvidedUpdates, func(chunk []string) error {
		return s.Transact(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
			_, err := tx.SetProviderStatus(ctx, l.provider, bmdb.ProviderStatusMissing, chunk)
			return err
		})
	})
	if err != nil {
		return pr, err
	}
	for _, k := range pr.missing {
		log.WarnContext(ctx, "machine missing at the provider", "provider_id", k.ProviderID, "machine_id", k.MachineID.String())
	}
	updates := make([]bmdb.ProvidedUpdate, len(pr.found))
	for i, k := range pr.found {
		updates[i] = providedUpdateOf(l.provider, l.listed[k.ProviderID])
	}
	err = inChunks(updates, bmdb.MaxProvidedUpdates, func(chunk []bmdb.ProvidedUpdate) error {
		return s.Transact(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
			_, err := tx.UpdateProvided(ctx, l.provider, chunk)
			return err
		})
	})
	if err != nil {
		return pr, err
	}
	for i, k := range pr.found {
		log.InfoContext(ctx, "machine listed by the provider again", "provider_id", k.ProviderID,
			"machine_id", k.MachineID.String(), "provider_status", string(updates[i].Status))
	}
	return pr, nil
}

// inChunks calls fn on consecutive chunks of at most size items, in order,
// and stops at the first error.
func inChunks[T any](items []T, size int, fn func([]T) error) error {
	for len(items) > 0 {
		n := min(size, len(items))
		if err := fn(items[:n]); err != nil {
			return err
		}
		items = items[n:]
	}
	return nil
}

// providedOf is the Provided tag of m: what the provider says of it.
// Machines that do not describe themselves get status Unknown.
func providedOf(name string, m provider.Machine) bmdb.Provided {
	p := bmdb.Provided{Provider: name, ProviderID: m.ID(), Status: bmdb.ProviderStatusUnknown}
	if a := m.Addr(); a.IsValid() {
		p.Address = a.Addr()
	}
	if d, ok := m.(provider.Described); ok {
		p.Location, p.ReservationID = d.Location(), d.ReservationID()
		p.Status = cmp.Or(bmdb.ProviderStatus(d.Status()), bmdb.ProviderStatusUnknown)
	}
	if m.Failed() {
		p.Status = bmdb.ProviderStatusProvisioningFailedPermanent
	}
	return p
}

// providedUpdateOf is providedOf as an update of a recorded machine.
func providedUpdateOf(name string, m provider.Machine) bmdb.ProvidedUpdate {
	p := providedOf(name, m)
	return bmdb.ProvidedUpdate{
		ProviderID: p.ProviderID, Status: p.Status, Address: p.Address, Location: p.Location, ReservationID: p.ReservationID,
	}
}

// providedUpdateIn is what the BMDB holds of k's details, in the form of an
// update, to compare with what a listing says.
func providedUpdateIn(k bmdb.ProvidedRef) bmdb.ProvidedUpdate {
	return bmdb.ProvidedUpdate{
		ProviderID: k.ProviderID, Status: k.Status, Address: k.Address, Location: k.Location, ReservationID: k.ReservationID,
	}
}
