package manager

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/provider"
)

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
	// suspect: more than the suspect fraction of the present machines is
	// missing from the listing, which means the listing is wrong, not the
	// fleet. Nothing may be concluded from it.
	suspect bool
}

// reconcilePresence compares the listing with the BMDB and, unless the
// listing is suspect, records it: machines it lacks become Missing, and
// Missing machines it has again get the details it gives them. A suspect
// listing changes nothing and is logged. SPEC §3.2 and §3.5 both mark
// machines this way; this is the one place that does it.
func (l *providerListing) reconcilePresence(ctx context.Context, s *bmdb.Session, suspectFraction float64, log *slog.Logger) (presence, error) {
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
	if pr.present > 0 && float64(len(pr.missing)) > suspectFraction*float64(pr.present) {
		pr.suspect = true
		log.WarnContext(ctx, "provider listing lacks too many known machines; believing none of it this pass",
			"missing", len(pr.missing), "known", pr.present, "suspect_fraction", suspectFraction)
		return pr, nil
	}
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
