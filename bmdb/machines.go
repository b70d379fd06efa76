package bmdb

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/shepherd/shepherd/bmdb/model"
	"github.com/shepherd/shepherd/internal/safetext"
)

// ErrInvalidFilter means a MachineFilter (or a page size) was refused: an
// unknown state, a negative timeout, an over-long search. Nothing was read.
var ErrInvalidFilter = errors.New("bmdb: invalid machine filter")

// MaxMachinePage bounds the page size of ListMachines: a page is one
// statement, and a larger one only holds a connection longer.
const MaxMachinePage = 10_000

// maxSearchLength bounds MachineFilter.Search: provider ids are at most 128
// bytes and a UUID is 36 characters, so a longer search matches nothing.
const maxSearchLength = 256

// fleetStates are the derived states of provided machines (SPEC §3.7), in
// the order of a machine's life.
var fleetStates = []MachineState{
	StateProvided, StateAgentStarting, StateAwaitingFirstHeartbeat, StateHealthy, StateSilent, StateRecovering,
	StateInstalling, StateInstalled, StateInstallFailed, StateBackedOff, StateQuarantined, StateMissing,
	StateStopped, StateDecommissioning,
}

// factStates are the derived states only a machine with facts beyond its
// Provided tag can be in (a decommission request, a backoff or quarantine,
// live work, an installation, a silent agent: machine_state_facts,
// migration 00018): machine_state gives none of them for a machine
// without facts, whatever its provider status and agent phase
// (TestFactStatesNeedFacts). Lists of these states read only the machines
// with facts.
var factStates = []MachineState{
	StateDecommissioning, StateQuarantined, StateAgentStarting, StateRecovering, StateInstallFailed,
	StateInstalling, StateBackedOff, StateSilent, StateInstalled,
}

// MachineStates returns every derived state a machine can be in, in the
// order of a machine's life: the states of SPEC §3.7, then
// StateDecommissioned.
func MachineStates() []MachineState {
	return append(append([]MachineState(nil), fleetStates...), StateDecommissioned)
}

// Validate returns an error naming s if it is not a derived state.
func (s MachineState) Validate() error {
	for _, k := range MachineStates() {
		if s == k {
			return nil
		}
	}
	return fmt.Errorf("%w: unknown state %q", ErrInvalidFilter, string(s))
}

// MachineFilter selects machines for the UI and CLI; zero fields match
// everything.
type MachineFilter struct {
	// Provider and Location match exactly.
	Provider, Location string
	// State is a derived state (SPEC §3.7); "" matches any.
	// StateDecommissioned selects decommissioned machines whatever
	// IncludeDecommissioned says.
	State MachineState
	// Search matches, case-insensitively, a machine id prefix ("3f2a"), a
	// provider id substring, or the IP address: exactly when Search is an
	// address, by network when it is a CIDR prefix ("10.1.0.0/16"), and
	// else as a prefix of the address text ("10.1.").
	Search string
	// FirstHeartbeatTimeout and HeartbeatTimeout decide Silent, as in the
	// recovery candidate query; 0 means DefaultFirstHeartbeatTimeout and
	// DefaultHeartbeatTimeout.
	FirstHeartbeatTimeout, HeartbeatTimeout time.Duration
	// IncludeDecommissioned lists decommissioned machines too; they are
	// left out by default, having left the fleet.
	IncludeDecommissioned bool
}

// filterParams is a validated filter in the form the queries take it.
type filterParams struct {
	firstMs, heartbeatMs  int64
	includeDecommissioned bool
	provider, location    string
	state                 string
	search                string
	searchPattern         string
	searchIDFrom          uuid.NullUUID
	searchIDTo            uuid.NullUUID
	searchIP              *netip.Addr
	searchNet             *netip.Prefix
	searchIPPrefix        *string
}

// filtered reports whether anything narrows the list beyond leaving out
// decommissioned machines.
func (p filterParams) filtered() bool {
	return p.provider != "" || p.location != "" || p.state != "" || p.search != ""
}

// params validates f and fills in defaults. It changes nothing.
func (f MachineFilter) params() (filterParams, error) {
	if f.State != "" {
		if err := f.State.Validate(); err != nil {
			return filterParams{}, err
		}
	}
	if f.FirstHeartbeatTimeout < 0 || f.HeartbeatTimeout < 0 {
		return filterParams{}, fmt.Errorf("%w: heartbeat timeouts must be >= 0 (0 = default), got %s and %s",
			ErrInvalidFilter, f.FirstHeartbeatTimeout, f.HeartbeatTimeout)
	}
	for _, v := range []struct{ name, text string }{{"provider", f.Provider}, {"location", f.Location}, {"search", f.Search}} {
		if !safetext.Storable(v.text) {
			return filterParams{}, fmt.Errorf("%w: %s %q is not text: it is not valid UTF-8 or holds a NUL byte", ErrInvalidFilter, v.name, safetext.Cut(v.text, 64))
		}
	}
	search := strings.ToLower(strings.TrimSpace(f.Search))
	if len(search) > maxSearchLength {
		return filterParams{}, fmt.Errorf("%w: search is %d bytes, at most %d", ErrInvalidFilter, len(search), maxSearchLength)
	}
	p := filterParams{
		firstMs:               cmp.Or(f.FirstHeartbeatTimeout, DefaultFirstHeartbeatTimeout).Milliseconds(),
		heartbeatMs:           cmp.Or(f.HeartbeatTimeout, DefaultHeartbeatTimeout).Milliseconds(),
		includeDecommissioned: f.IncludeDecommissioned || f.State == StateDecommissioned,
		provider:              f.Provider,
		location:              f.Location,
		state:                 string(f.State),
		search:                search,
	}
	if search == "" {
		return p, nil
	}
	p.searchPattern = "%" + likeEscaper.Replace(search) + "%"
	if from, to, ok := uuidPrefixRange(search); ok {
		p.searchIDFrom = uuid.NullUUID{UUID: from, Valid: true}
		p.searchIDTo = uuid.NullUUID{UUID: to, Valid: true}
	}
	if a, err := netip.ParseAddr(search); err == nil && a.Zone() == "" {
		a = a.Unmap()
		p.searchIP = &a
	} else if n, err := netip.ParsePrefix(search); err == nil {
		n = n.Masked()
		p.searchNet = &n
	} else if strings.Trim(search, "0123456789abcdef.:") == "" {
		p.searchIPPrefix = &search
	}
	return p, nil
}

// likeEscaper quotes the characters LIKE patterns give a meaning.
var likeEscaper = strings.NewReplacer(`\`, `\\`, "%", `\%`, "_", `\_`)

// uuidPrefixRange returns the smallest and the largest UUID whose text
// starts with prefix (lower case, dashes where a UUID has them), or false
// if no UUID's text does.
func uuidPrefixRange(prefix string) (from, to uuid.UUID, ok bool) {
	const zero = "00000000-0000-0000-0000-000000000000"
	if len(prefix) > len(zero) {
		return uuid.Nil, uuid.Nil, false
	}
	for i := 0; i < len(prefix); i++ {
		c := prefix[i]
		if zero[i] == '-' {
			if c != '-' {
				return uuid.Nil, uuid.Nil, false
			}
		} else if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return uuid.Nil, uuid.Nil, false
		}
	}
	from, err := uuid.Parse(prefix + zero[len(prefix):])
	if err != nil {
		return uuid.Nil, uuid.Nil, false
	}
	to, err = uuid.Parse(prefix + strings.ReplaceAll(zero[len(prefix):], "0", "f"))
	if err != nil {
		return uuid.Nil, uuid.Nil, false
	}
	return from, to, true
}

// MachineSummary is a machine as the machine list shows it.
type MachineSummary struct {
	MachineID uuid.UUID
	// Provider, ProviderID and Location are what the Provided tag says, or
	// for a decommissioned machine what it said.
	Provider, ProviderID, Location string
	// Address is the main IP address; the zero Addr if unknown.
	Address netip.Addr
	// ProviderStatus is "" for a decommissioned machine.
	ProviderStatus ProviderStatus
	State          MachineState
	// AgentStartedAt and LastHeartbeatAt are nil without those tags.
	AgentStartedAt, LastHeartbeatAt *time.Time
	// DecommissionedAt is nil unless the machine was decommissioned.
	DecommissionedAt *time.Time
}

// ListMachines returns the machines matching f in id order, at most limit
// (1 to MaxMachinePage) of them, starting after the machine after
// (uuid.Nil: from the first). next is the cursor of the following page:
// pass it as after to continue, and it is uuid.Nil on the last page.
//
// A page without a filter reads one page of rows by the primary key. A
// filtered page is looked for among the next few hundred machines first,
// which finds it at once for a filter most machines pass, and otherwise by
// one scan of the fleet (see queries/machines.sql): at 100,000 machines, a
// few milliseconds against about a hundred. ErrInvalidFilter means f or
// limit was refused.
func (db *DB) ListMachines(ctx context.Context, f MachineFilter, after uuid.UUID, limit int) (page []MachineSummary, next uuid.UUID, err error) {
	return listMachines(ctx, model.New(customPlans{db.pool}), f, after, limit)
}

func listMachines(ctx context.Context, q *model.Queries, f MachineFilter, after uuid.UUID, limit int) (page []MachineSummary, next uuid.UUID, err error) {
	p, rowLimit, err := f.pageParams(limit)
	if err != nil {
		return nil, uuid.Nil, err
	}
	var rows []model.MachineListAllRow
	if !p.filtered() {
		rows, err = q.MachineListAll(ctx, model.MachineListAllParams{
			FirstHeartbeatTimeoutMs: p.firstMs,
			HeartbeatTimeoutMs:      p.heartbeatMs,
			IncludeDecommissioned:   p.includeDecommissioned,
			After:                   after,
			RowLimit:                rowLimit,
		})
	} else {
		rows, err = listFiltered(ctx, q, p, after, rowLimit)
	}
	if err != nil {
		return nil, uuid.Nil, fmt.Errorf("bmdb: listing machines: %w", err)
	}
	page, last := pageOf(rows, limit, machineSummary)
	return page, last.MachineID, nil
}

// pageParams validates f and the page size limit (1 to MaxMachinePage),
// and returns f's parameters and the row limit of the page's statement:
// one row more than asked says whether another page follows.
func (f MachineFilter) pageParams(limit int) (filterParams, int32, error) {
	p, err := f.params()
	if err != nil {
		return filterParams{}, 0, err
	}
	if limit < 1 || limit > MaxMachinePage {
		return filterParams{}, 0, fmt.Errorf("%w: page size must be 1 to %d, got %d", ErrInvalidFilter, MaxMachinePage, limit)
	}
	return p, int32(limit + 1), nil
}

// pageOf converts the rows of a page statement run with pageParams' row
// limit: the first limit rows, and the last of them if another page
// follows (where the next page continues), else the zero MachineSummary.
func pageOf[R any](rows []R, limit int, summary func(R) MachineSummary) (page []MachineSummary, last MachineSummary) {
	page = make([]MachineSummary, len(rows))
	for i, r := range rows {
		page[i] = summary(r)
	}
	if len(page) > limit {
		page = page[:limit]
		last = page[limit-1]
	}
	return page, last
}

// windowPerRow is how many machines MachineListWindow may look at per row
// of the page it looks for: a filter that fewer than one machine in 8 pass
// is left to the scan. The window's machines cost about as much each as
// 50 machines of the scan, so a window that fails adds a few percent.
const windowPerRow = 8

// listFiltered looks for a filtered page among the next machines in id
// order first, which finds one at once for a filter most machines pass,
// and scans the fleet for the others (see queries/machines.sql).
func listFiltered(ctx context.Context, q *model.Queries, p filterParams, after uuid.UUID, rowLimit int32) ([]model.MachineListAllRow, error) {
	win, err := q.MachineListWindow(ctx, model.MachineListWindowParams{
		IncludeDecommissioned:   p.includeDecommissioned,
		After:                   after,
		WindowSize:              max(256, windowPerRow*rowLimit),
		FirstHeartbeatTimeoutMs: p.firstMs,
		HeartbeatTimeoutMs:      p.heartbeatMs,
		Provider:                p.provider,
		Location:                p.location,
		Search:                  p.search,
		SearchIDFrom:            p.searchIDFrom,
		SearchIDTo:              p.searchIDTo,
		SearchIp:                p.searchIP,
		SearchNet:               p.searchNet,
		SearchPattern:           p.searchPattern,
		SearchIpPrefix:          p.searchIPPrefix,
		State:                   p.state,
		RowLimit:                rowLimit,
	})
	if err != nil {
		return nil, err
	}
	var rows []model.MachineListAllRow
	if len(win) == int(rowLimit) {
		for _, r := range win {
			rows = append(rows, model.MachineListAllRow(r))
		}
		return rows, nil
	}
	if slices.Contains(factStates, MachineState(p.state)) {
		rs, err := q.MachineListInFactState(ctx, model.MachineListInFactStateParams{
			FirstHeartbeatTimeoutMs: p.firstMs,
			HeartbeatTimeoutMs:      p.heartbeatMs,
			After:                   after,
			State:                   p.state,
			Provider:                p.provider,
			Location:                p.location,
			Search:                  p.search,
			SearchPattern:           p.searchPattern,
			SearchIDFrom:            p.searchIDFrom,
			SearchIDTo:              p.searchIDTo,
			SearchIp:                p.searchIP,
			SearchNet:               p.searchNet,
			SearchIpPrefix:          p.searchIPPrefix,
			RowLimit:                rowLimit,
		})
		for _, r := range rs {
			rows = append(rows, model.MachineListAllRow(r))
		}
		return rows, err
	}
	if p.state != "" {
		rs, err := q.MachineListInState(ctx, model.MachineListInStateParams{
			FirstHeartbeatTimeoutMs: p.firstMs,
			HeartbeatTimeoutMs:      p.heartbeatMs,
			IncludeDecommissioned:   p.includeDecommissioned,
			After:                   after,
			State:                   p.state,
			Provider:                p.provider,
			Location:                p.location,
			Search:                  p.search,
			SearchPattern:           p.searchPattern,
			SearchIDFrom:            p.searchIDFrom,
			SearchIDTo:              p.searchIDTo,
			SearchIp:                p.searchIP,
			SearchNet:               p.searchNet,
			SearchIpPrefix:          p.searchIPPrefix,
			RowLimit:                rowLimit,
		})
		for _, r := range rs {
			rows = append(rows, model.MachineListAllRow(r))
		}
		return rows, err
	}
	rs, err := q.MachineListFiltered(ctx, model.MachineListFilteredParams{
		FirstHeartbeatTimeoutMs: p.firstMs,
		HeartbeatTimeoutMs:      p.heartbeatMs,
		IncludeDecommissioned:   p.includeDecommissioned,
		After:                   after,
		Provider:                p.provider,
		Location:                p.location,
		Search:                  p.search,
		SearchPattern:           p.searchPattern,
		SearchIDFrom:            p.searchIDFrom,
		SearchIDTo:              p.searchIDTo,
		SearchIp:                p.searchIP,
		SearchNet:               p.searchNet,
		SearchIpPrefix:          p.searchIPPrefix,
		RowLimit:                rowLimit,
	})
	for _, r := range rs {
		rows = append(rows, model.MachineListAllRow(r))
	}
	return rows, err
}

func machineSummary(r model.MachineListAllRow) MachineSummary {
	s := MachineSummary{
		MachineID:        r.MachineID,
		Provider:         r.Provider,
		ProviderID:       r.ProviderID,
		Location:         r.ProviderLocation,
		ProviderStatus:   ProviderStatus(r.ProviderStatus),
		State:            MachineState(r.State),
		AgentStartedAt:   r.AgentStartedAt,
		LastHeartbeatAt:  r.AgentHeartbeatAt,
		DecommissionedAt: r.DecommissionedAt,
	}
	if r.ProviderIPAddress != nil {
		s.Address = *r.ProviderIPAddress
	}
	return s
}

// CountMachines returns how many machines ListMachines would return for f
// over all pages.
func (db *DB) CountMachines(ctx context.Context, f MachineFilter) (int64, error) {
	p, err := f.params()
	if err != nil {
		return 0, err
	}
	q := model.New(customPlans{db.pool})
	var n int64
	if p.state != "" && p.search == "" && MachineState(p.state) != StateDecommissioned {
		// Counted as the overview counts (FleetMachineStates: the
		// machines without facts by their tags alone), not by working out
		// every machine's state; provider and location are its groups.
		rows, err := q.FleetMachineStates(ctx, model.FleetMachineStatesParams{
			FirstHeartbeatTimeoutMs: p.firstMs, HeartbeatTimeoutMs: p.heartbeatMs})
		if err != nil {
			return 0, fmt.Errorf("bmdb: counting machines: %w", err)
		}
		for _, r := range rows {
			if r.State == p.state && (p.provider == "" || r.Provider == p.provider) && (p.location == "" || r.Location == p.location) {
				n += r.Machines
			}
		}
		return n, nil
	}
	if p.state != "" {
		n, err = q.MachineCountInState(ctx, model.MachineCountInStateParams{
			FirstHeartbeatTimeoutMs: p.firstMs,
			HeartbeatTimeoutMs:      p.heartbeatMs,
			IncludeDecommissioned:   p.includeDecommissioned,
			State:                   p.state,
			Provider:                p.provider,
			Location:                p.location,
			Search:                  p.search,
			SearchPattern:           p.searchPattern,
			SearchIDFrom:            p.searchIDFrom,
			SearchIDTo:              p.searchIDTo,
			SearchIp:                p.searchIP,
			SearchNet:               p.searchNet,
			SearchIpPrefix:          p.searchIPPrefix,
		})
	} else {
		n, err = q.MachineCount(ctx, model.MachineCountParams{
			IncludeDecommissioned: p.includeDecommissioned,
			Provider:              p.provider,
			Location:              p.location,
			Search:                p.search,
			SearchPattern:         p.searchPattern,
			SearchIDFrom:          p.searchIDFrom,
			SearchIDTo:            p.searchIDTo,
			SearchIp:              p.searchIP,
			SearchNet:             p.searchNet,
			SearchIpPrefix:        p.searchIPPrefix,
		})
	}
	if err != nil {
		return 0, fmt.Errorf("bmdb: counting machines: %w", err)
	}
	return n, nil
}

// LiveWork is work held on a machine by a live session.
type LiveWork struct {
	Process   Process
	SessionID uuid.UUID
	// Component is the session's component (initializer, recoverer, ...).
	Component string
	StartedAt time.Time
}

// BackoffInfo is one process's backoff of a machine, as the machine page
// shows it. Backoff.Interval is the un-jittered interval of the last
// failure.
type BackoffInfo struct {
	Process Process
	Backoff
	// QuarantinedAt is when the machine was quarantined for Process; nil
	// unless Quarantined.
	QuarantinedAt *time.Time
	// UpdatedAt is when the last failure was recorded.
	UpdatedAt time.Time
	// Active says whether the backoff holds the process off now (database
	// time): Until is in the future, or the machine is quarantined. A past
	// backoff stays until the process next finishes its work, because the
	// next failure grows from its interval.
	Active bool
}

// DecommissionInfo is an operator's request to decommission a machine.
type DecommissionInfo struct {
	// RequestedAt is the zero time for a machine decommissioned without a
	// request.
	RequestedAt time.Time
	RequestedBy string
	Reason      string
}

// MachineDetail is a machine with all of its tags, as the machine page
// shows it. Fields of tags the machine lacks are zero (nil).
type MachineDetail struct {
	MachineSummary
	// CreatedAt is when the machine entered the BMDB.
	CreatedAt time.Time
	// Provided is the Provided tag; its MachineID is uuid.Nil if the
	// machine has none (a decommissioned machine).
	Provided ProvidedMachine
	// AgentPublicKey is the ed25519 key the agent answered the takeover
	// with.
	AgentPublicKey []byte
	// HardwareReportRaw is the last hardware report as stored (an
	// agentv1.HardwareReport protobuf; the caller decodes it), received at
	// HardwareReportAt.
	HardwareReportRaw []byte
	HardwareReportAt  *time.Time
	// Installation is nil unless an installation was requested or
	// reported.
	Installation *Installation
	// Work is the work live sessions hold on the machine.
	Work []LiveWork
	// Backoffs are the machine's backoffs and quarantines, by process.
	Backoffs []BackoffInfo
	// HostKey is the recorded (or pinned) SSH host key in SSH wire format,
	// recorded at HostKeyRecordedAt.
	HostKey           []byte
	HostKeyPinned     bool
	HostKeyRecordedAt *time.Time
	// OfferedHostKey is the key the machine last presented instead of
	// HostKey, at OfferedHostKeyAt: the key an operator may accept.
	OfferedHostKey   []byte
	OfferedHostKeyAt *time.Time
	// DecommissionRequested is nil unless an operator asked for the
	// machine to leave the fleet; for a decommissioned machine it is what
	// the decommission record kept of the request.
	DecommissionRequested *DecommissionInfo
	// Power is the last known power state, read through the machine's BMC
	// (`shepherd machine power`); nil if it was never checked.
	Power *PowerStatus
	// Ladder is the recovery ladder's progress: the rungs taken since the
	// agent last heartbeated (DB.RecoveryStreak); empty when none.
	Ladder []RungAttempt
	// AgentSilent says the agent is silent by the recoverer's definition
	// (with the timeouts the machine was read with), whatever State shows:
	// a machine Recovering, BackedOff or Quarantined may have a silent
	// agent. The circuit breaker counts these machines.
	AgentSilent bool
}

// AgentStatus is what the agent is doing, as the CLI and the web UI show
// it: "Silent" for a silent agent, whatever its tag phase (a phase of
// Heartbeating only says that a heartbeat came since the agent started),
// else the phase of the Provided tag (AwaitingAgent,
// AwaitingFirstHeartbeat, Heartbeating); "" for a decommissioned machine.
func (d MachineDetail) AgentStatus() string {
	if d.AgentSilent {
		return "Silent"
	}
	return string(d.Provided.AgentPhase)
}

// GetMachine returns a machine with all of its tags, read in one
// consistent snapshot, or ErrNotFound. Silent is judged by the default
// timeouts; use GetMachineWithTimeouts to pass the recoverer's.
func (db *DB) GetMachine(ctx context.Context, id uuid.UUID) (MachineDetail, error) {
	return db.GetMachineWithTimeouts(ctx, id, 0, 0)
}

// GetMachineWithTimeouts is GetMachine with the timeouts that decide Silent
// (0: the defaults), as in MachineFilter.
func (db *DB) GetMachineWithTimeouts(ctx context.Context, id uuid.UUID, firstHeartbeatTimeout, heartbeatTimeout time.Duration) (MachineDetail, error) {
	if firstHeartbeatTimeout < 0 || heartbeatTimeout < 0 {
		return MachineDetail{}, fmt.Errorf("%w: heartbeat timeouts must be >= 0 (0 = default), got %s and %s",
			ErrInvalidFilter, firstHeartbeatTimeout, heartbeatTimeout)
	}
	var d MachineDetail
	err := db.readSnapshot(ctx, func(ctx context.Context, q *model.Queries) error {
		r, err := q.MachineGet(ctx, model.MachineGetParams{
			MachineID:               id,
			FirstHeartbeatTimeoutMs: cmp.Or(firstHeartbeatTimeout, DefaultFirstHeartbeatTimeout).Milliseconds(),
			HeartbeatTimeoutMs:      cmp.Or(heartbeatTimeout, DefaultHeartbeatTimeout).Milliseconds(),
		})
		if errors.Is(err, pgx.ErrNoRows) {
			return ErrNotFound
		} else if err != nil {
			return fmt.Errorf("reading tags: %w", err)
		}
		d = machineDetail(r)
		work, err := q.MachineLiveWork(ctx, id)
		if err != nil {
			return fmt.Errorf("reading work: %w", err)
		}
		d.Work = make([]LiveWork, len(work))
		for i, w := range work {
			d.Work[i] = LiveWork{Process: Process(w.Process), SessionID: w.SessionID, Component: w.Component, StartedAt: w.StartedAt}
		}
		if d.Power, err = powerStatus(ctx, q, id); err != nil {
			return fmt.Errorf("reading power state: %w", err)
		}
		if d.Ladder, err = recoveryStreak(ctx, q, id); err != nil {
			return err
		}
		backoffs, err := q.MachineBackoffs(ctx, id)
		if err != nil {
			return fmt.Errorf("reading backoffs: %w", err)
		}
		d.Backoffs = make([]BackoffInfo, len(backoffs))
		for i, b := range backoffs {
			d.Backoffs[i] = BackoffInfo{
				Process: Process(b.Process),
				Backoff: Backoff{
					Interval:    time.Duration(b.LastIntervalMs) * time.Millisecond,
					Until:       b.BackoffUntil,
					Attempts:    int(b.Attempts),
					Quarantined: b.QuarantinedAt != nil,
					Cause:       b.Cause,
				},
				QuarantinedAt: b.QuarantinedAt,
				UpdatedAt:     b.UpdatedAt,
				Active:        b.Active,
			}
		}
		return nil
	})
	if errors.Is(err, ErrNotFound) {
		return MachineDetail{}, ErrNotFound
	} else if err != nil {
		return MachineDetail{}, fmt.Errorf("bmdb: reading machine %s: %w", id, err)
	}
	return d, nil
}

func machineDetail(r model.MachineGetRow) MachineDetail {
	d := MachineDetail{
		MachineSummary: MachineSummary{
			MachineID:        r.MachineID,
			Provider:         r.Provider,
			ProviderID:       r.ProviderID,
			Location:         r.ProviderLocation,
			ProviderStatus:   ProviderStatus(r.ProviderStatus),
			State:            MachineState(r.State),
			AgentStartedAt:   r.AgentStartedAt,
			LastHeartbeatAt:  r.AgentHeartbeatAt,
			DecommissionedAt: r.DecommissionedAt,
		},
		CreatedAt:         r.CreatedAt,
		AgentPublicKey:    r.AgentPublicKey,
		HardwareReportRaw: r.HardwareReportRaw,
		HardwareReportAt:  r.HardwareReportedAt,
		HostKey:           r.HostKey,
		HostKeyPinned:     r.HostKeyPinned,
		HostKeyRecordedAt: r.HostKeyRecordedAt,
		OfferedHostKey:    r.OfferedHostKey,
		OfferedHostKeyAt:  r.HostKeyOfferedAt,
		AgentSilent:       r.AgentSilent,
	}
	if r.ProviderIPAddress != nil {
		d.Address = *r.ProviderIPAddress
	}
	if r.Provided {
		d.Provided = ProvidedMachine{
			MachineID: r.MachineID,
			Provided: Provided{
				Provider:      r.Provider,
				ProviderID:    r.ProviderID,
				ReservationID: r.ProviderReservationID,
				Address:       d.Address,
				Location:      r.ProviderLocation,
				Status:        ProviderStatus(r.ProviderStatus),
			},
			AgentPhase: AgentPhase(r.AgentPhase),
		}
		if r.ProviderStatusAt != nil {
			d.Provided.StatusAt = *r.ProviderStatusAt
		}
	}
	if r.RequestGeneration != nil || r.ReportGeneration != nil {
		in := &Installation{Request: r.RequestRaw}
		if r.RequestGeneration != nil {
			in.RequestGeneration = *r.RequestGeneration
		}
		if r.RequestedAt != nil {
			in.RequestedAt = *r.RequestedAt
		}
		if r.InstallationRequestedBy != nil {
			in.RequestedBy = *r.InstallationRequestedBy
		}
		if r.ReportGeneration != nil {
			in.Report = &InstallationReport{Generation: *r.ReportGeneration, Raw: r.ReportRaw}
			if r.ReportSuccess != nil {
				in.Report.Success = *r.ReportSuccess
			}
			if r.ReportError != nil {
				in.Report.Error = *r.ReportError
			}
			if r.InstallationReportedAt != nil {
				in.ReportedAt = *r.InstallationReportedAt
			}
		}
		d.Installation = in
	}
	switch {
	case r.DecommissionRequested && r.DecommissionRequestedAt != nil:
		d.DecommissionRequested = &DecommissionInfo{RequestedAt: *r.DecommissionRequestedAt,
			RequestedBy: r.DecommissionRequestedBy, Reason: r.DecommissionReason}
	case r.DecommissionedRequestAt != nil:
		d.DecommissionRequested = &DecommissionInfo{RequestedAt: *r.DecommissionedRequestAt,
			RequestedBy: r.DecommissionRequestedBy, Reason: r.DecommissionReason}
	}
	return d
}

// customPlans runs statements as unnamed prepared statements, which
// PostgreSQL plans anew for the parameter values of every execution. The
// list and count statements have optional filters ("@provider = ” OR
// provider = @provider"): a generic plan, which the pool's cached
// statements switch to after five executions, cannot know which filters
// are off, takes them all for selective, and probes every tag table per
// machine instead of scanning once (over a second at 100,000 machines
// instead of tens of milliseconds). Planning each time costs a millisecond
// or two and one more round trip.
type customPlans struct{ db model.DBTX }

func (c customPlans) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return c.db.Exec(ctx, sql, append([]any{pgx.QueryExecModeDescribeExec}, args...)...)
}

func (c customPlans) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return c.db.Query(ctx, sql, append([]any{pgx.QueryExecModeDescribeExec}, args...)...)
}

func (c customPlans) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return c.db.QueryRow(ctx, sql, append([]any{pgx.QueryExecModeDescribeExec}, args...)...)
}

// readSnapshot runs fn in a read-only, repeatable-read transaction, so that
// the statements it makes see one moment of the database.
func (db *DB) readSnapshot(ctx context.Context, fn func(ctx context.Context, q *model.Queries) error) error {
	return db.retry(ctx, func(ctx context.Context) error {
		tx, err := db.pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead, AccessMode: pgx.ReadOnly})
		if err != nil {
			return fmt.Errorf("beginning transaction: %w", err)
		}
		defer func() {
			// After a successful Commit this is a no-op. Otherwise it must run
			// even if ctx is done, or the connection goes back dirty.
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			_ = tx.Rollback(rctx)
		}()
		if err := fn(ctx, model.New(customPlans{tx})); err != nil {
			return err
		}
		// Read-only: committing only ends the transaction.
		if err := tx.Commit(ctx); err != nil {
			return fmt.Errorf("committing: %w", err)
		}
		return nil
	})
}

// RequestDecommission records, outside any session, that an operator (by)
// asked for the machine to leave the fleet, and why; the decommissioner
// carries it out. Asking again changes nothing: the first request stands.
// It returns ErrNotFound if the machine does not exist or has no Provided
// tag (it was decommissioned already).
func (db *DB) RequestDecommission(ctx context.Context, machine uuid.UUID, by, reason string) error {
	err := db.transact(ctx, func(ctx context.Context, q *model.Queries) error {
		if _, err := q.MachineProvidedGet(ctx, machine); errors.Is(err, pgx.ErrNoRows) {
			return ErrNotFound
		} else if err != nil {
			return err
		}
		return (&Tx{q: q}).RequestDecommission(ctx, machine, by, reason)
	})
	if errors.Is(err, ErrNotFound) {
		return fmt.Errorf("bmdb: requesting decommission of machine %s: %w", machine, ErrNotFound)
	} else if err != nil {
		return fmt.Errorf("bmdb: requesting decommission of machine %s: %w", machine, err)
	}
	return nil
}

// SessionInfo is a session as the sessions page and `shepherd session
// list` show it.
type SessionInfo struct {
	SessionID uuid.UUID
	Component string
	// Hostname, PID and Version describe the process that opened it.
	Hostname string
	PID      int
	Version  string
	// StartedAt is when the session opened; RenewedAt when its lease was
	// last renewed (ExpiresAt minus Lease); ExpiresAt its deadline.
	StartedAt, RenewedAt, ExpiresAt time.Time
	Lease                           time.Duration
	// Alive means the deadline has not passed and the session is not
	// closed (database time).
	Alive bool
	// ClosedAt is nil unless the session was closed.
	ClosedAt *time.Time
	// Work counts the work items the session holds (a dead session's until
	// they are expired).
	Work int
}

// ListSessions returns up to limit (at least 1) sessions, newest first:
// live ones only unless includeDead.
func (db *DB) ListSessions(ctx context.Context, includeDead bool, limit int) ([]SessionInfo, error) {
	if limit < 1 {
		return nil, fmt.Errorf("bmdb: listing sessions: limit must be >= 1, got %d", limit)
	}
	rows, err := db.q.SessionListWithWork(ctx, model.SessionListWithWorkParams{IncludeDead: includeDead, RowLimit: int32(min(limit, 1<<30))})
	if err != nil {
		return nil, fmt.Errorf("bmdb: listing sessions: %w", err)
	}
	out := make([]SessionInfo, len(rows))
	for i, r := range rows {
		lease := time.Duration(r.LeaseMs) * time.Millisecond
		out[i] = SessionInfo{
			SessionID: r.SessionID,
			Component: r.Component,
			Hostname:  r.Hostname,
			PID:       int(r.Pid),
			Version:   r.Version,
			StartedAt: r.CreatedAt,
			RenewedAt: r.Deadline.Add(-lease),
			ExpiresAt: r.Deadline,
			Lease:     lease,
			Alive:     r.Alive,
			ClosedAt:  r.ClosedAt,
			Work:      int(r.Work),
		}
	}
	return out, nil
}

// ExplainListMachines returns PostgreSQL's plan for the first statement
// ListMachines sends for f, after and limit, one line per plan node: the
// keyset walk of an unfiltered page, or the window a filtered page is
// looked for in first. With analyze, the statement runs (EXPLAIN ANALYZE,
// which reads only) and the plan carries its actual rows and times.
// Operators use it to check that a page reads what it should.
func (db *DB) ExplainListMachines(ctx context.Context, f MachineFilter, after uuid.UUID, limit int, analyze bool) (string, error) {
	return db.explainStatement(ctx, analyze, func(q *model.Queries) error {
		_, _, err := listMachines(ctx, q, f, after, limit)
		return err
	})
}

// ExplainGetMachine returns PostgreSQL's plan for the statement that
// GetMachine reads a machine's tags with; see ExplainListMachines.
func (db *DB) ExplainGetMachine(ctx context.Context, id uuid.UUID, analyze bool) (string, error) {
	return db.explainStatement(ctx, analyze, func(q *model.Queries) error {
		_, err := q.MachineGet(ctx, model.MachineGetParams{
			MachineID:               id,
			FirstHeartbeatTimeoutMs: DefaultFirstHeartbeatTimeout.Milliseconds(),
			HeartbeatTimeoutMs:      DefaultHeartbeatTimeout.Milliseconds(),
		})
		return err
	})
}

// explainStatement captures the first statement run sends and explains it.
func (db *DB) explainStatement(ctx context.Context, analyze bool, run func(q *model.Queries) error) (string, error) {
	var capt capturedQuery
	if err := run(model.New(&capt)); !errors.Is(err, errCaptured) {
		if err != nil {
			return "", err
		}
		return "", errors.New("bmdb: explaining: no statement was sent")
	}
	explain := "EXPLAIN "
	if analyze {
		explain = "EXPLAIN (ANALYZE, BUFFERS) "
	}
	rows, err := db.pool.Query(ctx, explain+capt.sql, capt.args...)
	if err != nil {
		return "", fmt.Errorf("bmdb: explaining: %w", err)
	}
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return "", fmt.Errorf("bmdb: explaining: %w", err)
	}
	return strings.Join(lines, "\n"), nil
}
