package bmdb

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/bmdb/model"
)

// Heartbeat is one agent's heartbeat as the callback server received it,
// with the public key of the client certificate it came with.
type Heartbeat struct {
	MachineID uuid.UUID
	AgentKey  ed25519.PublicKey
	// Counter is 0 for a heartbeat that came over TLS. For one that came
	// as a datagram it is the datagram's counter, which must be above
	// every counter accepted for the machine before (see RecordHeartbeats);
	// a negative Counter is refused (HeartbeatResult.Err).
	Counter int64
	// Hardware and Installation are set when the agent sent those reports.
	Hardware     *HardwareReport
	Installation *InstallationReport
}

// HardwareReport is a hardware report as stored: the agent's protobuf and
// the few values queries need.
type HardwareReport struct {
	Raw         []byte
	CPUThreads  int32
	MemoryBytes int64
	DiskCount   int32
	DiskBytes   int64
	ReportedAt  time.Time // set when read back; ignored when recording
}

// HeartbeatResult says what became of one heartbeat.
type HeartbeatResult struct {
	// Accepted means the key is the machine's current agent key, and the
	// heartbeat and its reports were recorded. A heartbeat for an unknown
	// machine is simply not accepted, like one with a wrong key. A
	// datagram must also carry a counter above the machine's stored one.
	Accepted bool
	// Counter is, for an accepted heartbeat (TLS or datagram), the
	// machine's datagram counter after it was recorded: the highest
	// accepted so far, 0 if none. The callback server hands it to the
	// agent as the floor its next datagrams must be above. It is 0 when
	// not accepted.
	Counter int64
	// Replayed means the key was the machine's current agent key but the
	// heartbeat was a datagram whose counter was not above the stored one:
	// it is not accepted and nothing of it was recorded (the heartbeat
	// time is unchanged).
	Replayed bool
	// HardwareRecorded and InstallationRecorded acknowledge the reports
	// the heartbeat carried: the agent sends them until they are.
	// InstallationRecorded is the generation stored, 0 if none.
	HardwareRecorded     bool
	InstallationRecorded int64
	// Pending is the installation the agent should carry out, if any.
	Pending *PendingInstallation
	// Retired means the key is the last agent key of a decommissioned
	// machine: the agent should stop (it is not accepted).
	Retired bool
	// Err is set when the database refused this heartbeat for its content
	// (it wraps ErrInvalidHeartbeat); the others of its batch were
	// recorded regardless.
	Err error
}

// ErrInvalidHeartbeat means the database refused a heartbeat for what it
// carried. The callback server validates requests first, so this is a
// last line of defence: one bad request must never fail its whole batch.
var ErrInvalidHeartbeat = errors.New("bmdb: heartbeat refused by the database")

// PendingInstallation is an installation request the agent has not reported on.
type PendingInstallation struct {
	Generation int64
	Request    []byte // the request as stored (protobuf)
}

// RecordHeartbeats records a batch of heartbeats and returns one result per
// heartbeat, in order. Authentication happens inside the statement that
// writes: a heartbeat (and its reports) counts only if AgentKey is the key
// the machine's agent answered the takeover with, and a report is stored
// exactly when its heartbeat is. Duplicates in a batch are recorded once;
// reports of a duplicate come from the last one.
//
// A datagram heartbeat (Counter > 0) counts only if, in addition, its
// counter is above the machine's stored datagram counter, which it then
// becomes; otherwise it is Replayed. The comparison is made under the row
// lock, so of two batches carrying the same datagram at once (two callback
// servers), at most one accepts it. A TLS heartbeat (Counter 0) does not
// touch the counter. Heartbeats of the same machine and key in one batch
// are settled so that a replay is never accepted and a genuine heartbeat
// is never refused for its company:
//   - of several datagrams, the first with the highest counter stands for
//     them all; the others are Replayed if it was accepted or replayed
//     (their counters are at most its own, which is now stored or below
//     the stored one), else they share its result (a wrong key, an Err);
//   - TLS heartbeats that share the batch with a datagram are recorded
//     after it, in a second statement, so each gets what it would alone
//     and reports the counter the datagram left.
//
// If the database refuses the batch for its content (a value it cannot
// store, a heartbeat that raced a recovery), the batch is split and retried
// until the heartbeats at fault are alone; they get Err, the others are
// recorded. Only a failure of the database itself (unreachable, shutting
// down) fails the whole call.
func (db *DB) RecordHeartbeats(ctx context.Context, hbs []Heartbeat) ([]HeartbeatResult, error) {
	out := make([]HeartbeatResult, len(hbs))
	plan := planHeartbeats(hbs)
	if plan.simple {
		if err := db.recordIsolating(ctx, hbs, out); err != nil {
			return nil, fmt.Errorf("bmdb: recording heartbeats: %w", err)
		}
		return out, nil
	}
	for i, h := range hbs {
		if h.Counter < 0 {
			out[i] = HeartbeatResult{Err: fmt.Errorf("%w: negative datagram counter %d", ErrInvalidHeartbeat, h.Counter)}
		}
	}
	for _, round := range [][]int{plan.first, plan.second} {
		if err := db.recordSubset(ctx, hbs, out, round); err != nil {
			return nil, fmt.Errorf("bmdb: recording heartbeats: %w", err)
		}
	}
	for i, by := range plan.standIn {
		if r := out[by]; r.Accepted || r.Replayed {
			out[i] = HeartbeatResult{Replayed: true}
		} else {
			out[i] = r
		}
	}
	return out, nil
}

// heartbeatPlan says which statements record which heartbeats of a batch.
type heartbeatPlan struct {
	// simple means the batch can go in one statement as it is: no
	// negative counter, and no (machine, key) pair with a datagram and
	// another heartbeat. first and second are then nil.
	simple bool
	// first and second are the indexes of the heartbeats recorded by the
	// first and by the second statement: second holds the TLS heartbeats
	// of pairs that also have a datagram in the batch.
	first, second []int
	// standIn maps each datagram left out to the datagram of its pair that
	// was recorded in its stead (the first with the highest counter).
	standIn map[int]int
}

// planHeartbeats splits a batch so that, within each statement, the
// heartbeats of one (machine, key) pair are all TLS or a single datagram,
// and a pair's datagram is recorded before its TLS heartbeats.
func planHeartbeats(hbs []Heartbeat) heartbeatPlan {
	if !slices.ContainsFunc(hbs, func(h Heartbeat) bool { return h.Counter != 0 }) {
		return heartbeatPlan{simple: true} // TLS only: the usual batch until agents send datagrams
	}
	type pair struct {
		machine uuid.UUID
		key     string
	}
	type group struct {
		datagram int   // index of the datagram standing for the pair, -1 if none
		tls      []int // indexes of its TLS heartbeats
		others   []int // indexes of its other datagrams
	}
	var groups []group // in the order of their first heartbeat
	index := make(map[pair]int, len(hbs))
	simple := true
	for i, h := range hbs {
		if h.Counter < 0 {
			simple = false
			continue
		}
		k := pair{h.MachineID, string(h.AgentKey)}
		gi, ok := index[k]
		if !ok {
			gi = len(groups)
			index[k] = gi
			groups = append(groups, group{datagram: -1})
		}
		g := &groups[gi]
		if ok && (h.Counter > 0 || g.datagram >= 0) {
			simple = false // a datagram with company
		}
		switch {
		case h.Counter == 0:
			g.tls = append(g.tls, i)
		case g.datagram < 0:
			g.datagram = i
		case h.Counter > hbs[g.datagram].Counter:
			g.others = append(g.others, g.datagram)
			g.datagram = i
		default:
			g.others = append(g.others, i)
		}
	}
	if simple {
		return heartbeatPlan{simple: true}
	}
	p := heartbeatPlan{standIn: map[int]int{}}
	for _, g := range groups {
		if g.datagram < 0 {
			p.first = append(p.first, g.tls...)
			continue
		}
		p.first = append(p.first, g.datagram)
		p.second = append(p.second, g.tls...)
		for _, i := range g.others {
			p.standIn[i] = g.datagram
		}
	}
	return p
}

// recordSubset records the heartbeats of hbs at indexes idx, and puts
// their results at the same indexes of out.
func (db *DB) recordSubset(ctx context.Context, hbs []Heartbeat, out []HeartbeatResult, idx []int) error {
	if len(idx) == 0 {
		return nil
	}
	sub := make([]Heartbeat, len(idx))
	for j, i := range idx {
		sub[j] = hbs[i]
	}
	res := make([]HeartbeatResult, len(idx))
	if err := db.recordIsolating(ctx, sub, res); err != nil {
		return err
	}
	for j, i := range idx {
		out[i] = res[j]
	}
	return nil
}

// recordIsolating records hbs into out, halving the batch whenever the
// database refuses it for its content.
func (db *DB) recordIsolating(ctx context.Context, hbs []Heartbeat, out []HeartbeatResult) error {
	err := db.recordBatch(ctx, hbs, out)
	if err == nil || !isContentError(err) {
		return err
	}
	if len(hbs) == 1 {
		out[0] = HeartbeatResult{Err: fmt.Errorf("%w: %s", ErrInvalidHeartbeat, contentErrorText(err))}
		return nil
	}
	db.metrics.heartbeatSplits.Inc()
	mid := len(hbs) / 2
	if err := db.recordIsolating(ctx, hbs[:mid], out[:mid]); err != nil {
		return err
	}
	return db.recordIsolating(ctx, hbs[mid:], out[mid:])
}

// customPlanBatch is the number of distinct pairs from which a batch's
// HeartbeatRecord is planned for its own arrays instead of running the
// pool's cached generic plan. The generic plan takes every array for a
// hundred rows and every CTE built on them for one, so it joins CTEs by
// nested loops, whose cost grows with the square of the batch; planning
// costs a millisecond or two per statement, which only large batches
// repay. PostgreSQL backend CPU per TLS heartbeat over 10,000 machines,
// each mode alternating with the other (2 shared cores, so noisy):
//
//	batch      25   50  100  200  400  800
//	generic    26   23   27   25   32   48 µs
//	custom     78   66   45   40   16   12 µs
const customPlanBatch = 400

// recordBatch records hbs in one statement and fills out. The heartbeats of
// one (machine, key) pair are recorded once, with the highest of their
// counters: RecordHeartbeats sees that a pair with a datagram has nothing
// else in the batch.
func (db *DB) recordBatch(ctx context.Context, hbs []Heartbeat, out []HeartbeatResult) error {
	type pair struct {
		machine uuid.UUID
		key     string
	}
	index := make(map[pair]int32, len(hbs)) // pair -> ordinal in the batch arrays
	slot := make([]int32, len(hbs))         // heartbeat -> ordinal
	var p model.HeartbeatRecordParams
	hw := map[int32]*HardwareReport{}
	ins := map[int32]*InstallationReport{}
	for i, h := range hbs {
		k := pair{h.MachineID, string(h.AgentKey)}
		o, ok := index[k]
		if !ok {
			o = int32(len(p.Ordinals))
			index[k] = o
			p.Ordinals = append(p.Ordinals, o)
			p.MachineIds = append(p.MachineIds, h.MachineID)
			p.PublicKeys = append(p.PublicKeys, h.AgentKey)
			p.Counters = append(p.Counters, h.Counter)
		}
		p.Counters[o] = max(p.Counters[o], h.Counter)
		slot[i] = o
		if h.Hardware != nil {
			hw[o] = h.Hardware
		}
		if h.Installation != nil {
			ins[o] = h.Installation
		}
	}
	// The statement writes rows in machine id order whatever the order of
	// the arrays; the reports are listed by ordinal only to be deterministic.
	for _, o := range slices.Sorted(maps.Keys(hw)) {
		r := hw[o]
		p.HwOrdinals = append(p.HwOrdinals, o)
		p.HwRaws = append(p.HwRaws, r.Raw)
		p.HwCpuThreads = append(p.HwCpuThreads, r.CPUThreads)
		p.HwMemoryBytes = append(p.HwMemoryBytes, r.MemoryBytes)
		p.HwDiskCounts = append(p.HwDiskCounts, r.DiskCount)
		p.HwDiskBytes = append(p.HwDiskBytes, r.DiskBytes)
	}
	for _, o := range slices.Sorted(maps.Keys(ins)) {
		r := ins[o]
		p.InsOrdinals = append(p.InsOrdinals, o)
		p.InsGenerations = append(p.InsGenerations, r.Generation)
		p.InsSuccesses = append(p.InsSuccesses, r.Success)
		p.InsErrorMessages = append(p.InsErrorMessages, r.Error)
		p.InsRaws = append(p.InsRaws, r.Raw)
	}

	var rows []model.HeartbeatRecordRow
	err := db.retry(ctx, func(ctx context.Context) error {
		var err error
		q := db.q
		if len(p.Ordinals) >= customPlanBatch {
			q = model.New(customPlans{db.pool})
		}
		rows, err = q.HeartbeatRecord(ctx, p)
		return err
	})
	if err != nil {
		return err
	}
	byOrdinal := make([]*HeartbeatResult, len(p.Ordinals))
	for _, r := range rows {
		if r.Ordinal < 0 || int(r.Ordinal) >= len(byOrdinal) {
			return fmt.Errorf("database returned ordinal %d of %d", r.Ordinal, len(byOrdinal))
		}
		if !r.Accepted {
			byOrdinal[r.Ordinal] = &HeartbeatResult{Replayed: true}
			continue
		}
		res := &HeartbeatResult{Accepted: true, Counter: r.DatagramCounter, HardwareRecorded: r.HardwareRecorded}
		if r.InstallationRecorded != nil {
			res.InstallationRecorded = *r.InstallationRecorded
		}
		if r.PendingGeneration != nil {
			res.Pending = &PendingInstallation{Generation: *r.PendingGeneration, Request: r.PendingRequest}
		}
		byOrdinal[r.Ordinal] = res
	}
	if len(rows) < len(byOrdinal) {
		if err := db.markRetired(ctx, p, byOrdinal); err != nil {
			return err
		}
	}
	for i, o := range slot {
		if r := byOrdinal[o]; r != nil {
			out[i] = *r
		} else {
			out[i] = HeartbeatResult{}
		}
	}
	return nil
}

// markRetired fills in the results of rejected pairs whose key is the last
// agent key of a decommissioned machine. It costs a query only for batches
// with rejections.
func (db *DB) markRetired(ctx context.Context, p model.HeartbeatRecordParams, byOrdinal []*HeartbeatResult) error {
	var q model.HeartbeatRetiredParams
	for o, r := range byOrdinal {
		if r == nil {
			q.Ordinals = append(q.Ordinals, int32(o))
			q.MachineIds = append(q.MachineIds, p.MachineIds[o])
			q.PublicKeys = append(q.PublicKeys, p.PublicKeys[o])
		}
	}
	retired, err := db.q.HeartbeatRetired(ctx, q)
	if err != nil {
		return fmt.Errorf("looking up retired agents: %w", err)
	}
	for _, o := range retired {
		if o >= 0 && int(o) < len(byOrdinal) && byOrdinal[o] == nil {
			byOrdinal[o] = &HeartbeatResult{Retired: true}
		}
	}
	return nil
}

// Installation is the installation request and report of a machine.
type Installation struct {
	// RequestGeneration is 0 if nothing was ever requested.
	RequestGeneration int64
	Request           []byte
	RequestedAt       time.Time
	// RequestedBy names who asked for the current request (the operator
	// the CLI or the web UI recorded); "" for requests from before it was
	// recorded.
	RequestedBy string
	// Report is nil until the agent reported on some generation.
	Report     *InstallationReport
	ReportedAt time.Time
}

// Installed reports whether the current request has a successful report of
// its generation, the one definition of "installed" (SPEC §2.6).
func (i Installation) Installed() bool {
	return i.RequestGeneration > 0 && i.Report != nil && i.Report.Generation == i.RequestGeneration && i.Report.Success
}

// GetInstallation returns the installation state of a machine, or
// ErrNotFound if the machine does not exist.
func (db *DB) GetInstallation(ctx context.Context, machine uuid.UUID) (Installation, error) {
	r, err := db.q.InstallationGet(ctx, machine)
	if errors.Is(err, pgx.ErrNoRows) {
		return Installation{}, ErrNotFound
	} else if err != nil {
		return Installation{}, fmt.Errorf("bmdb: reading installation of machine %s: %w", machine, err)
	}
	var in Installation
	if r.RequestGeneration != nil {
		in.RequestGeneration, in.Request = *r.RequestGeneration, r.RequestRaw
		if r.RequestedBy != nil {
			in.RequestedBy = *r.RequestedBy
		}
		if r.RequestedAt != nil {
			in.RequestedAt = *r.RequestedAt
		}
	}
	if r.ReportGeneration != nil {
		in.Report = &InstallationReport{Generation: *r.ReportGeneration, Raw: r.ReportRaw}
		if r.ReportSuccess != nil {
			in.Report.Success = *r.ReportSuccess
		}
		if r.ReportError != nil {
			in.Report.Error = *r.ReportError
		}
		if r.ReportedAt != nil {
			in.ReportedAt = *r.ReportedAt
		}
	}
	return in, nil
}

// GetHardwareReport returns the last hardware report of a machine, or
// ErrNotFound if its agent never sent one.
func (db *DB) GetHardwareReport(ctx context.Context, machine uuid.UUID) (HardwareReport, error) {
	r, err := db.q.HardwareReportGet(ctx, machine)
	if errors.Is(err, pgx.ErrNoRows) {
		return HardwareReport{}, ErrNotFound
	} else if err != nil {
		return HardwareReport{}, fmt.Errorf("bmdb: reading hardware report of machine %s: %w", machine, err)
	}
	return HardwareReport{
		Raw: r.HardwareReportRaw, ReportedAt: r.ReportedAt,
		CPUThreads: r.CpuThreads, MemoryBytes: r.MemoryBytes, DiskCount: r.DiskCount, DiskBytes: r.DiskBytes,
	}, nil
}

// GetAgentHeartbeat returns when the machine's agent last sent a heartbeat
// (database time), or ErrNotFound if it never did since its last start.
func (db *DB) GetAgentHeartbeat(ctx context.Context, machine uuid.UUID) (time.Time, error) {
	at, err := db.q.AgentHeartbeatGet(ctx, machine)
	if errors.Is(err, pgx.ErrNoRows) {
		return time.Time{}, ErrNotFound
	} else if err != nil {
		return time.Time{}, fmt.Errorf("bmdb: reading heartbeat of machine %s: %w", machine, err)
	}
	return at, nil
}

// GetAgentStarted returns when the machine's agent was started and its key,
// or ErrNotFound if it has no AgentStarted tag.
func (db *DB) GetAgentStarted(ctx context.Context, machine uuid.UUID) (time.Time, ed25519.PublicKey, error) {
	r, err := db.q.AgentStartedGet(ctx, machine)
	if errors.Is(err, pgx.ErrNoRows) {
		return time.Time{}, nil, ErrNotFound
	} else if err != nil {
		return time.Time{}, nil, fmt.Errorf("bmdb: reading AgentStarted of machine %s: %w", machine, err)
	}
	return r.AgentStartedAt, ed25519.PublicKey(r.AgentPublicKey), nil
}

// RequestInstallation stores an OS installation request (protobuf bytes)
// for a provided machine under its next generation, which it returns; the
// agent receives it with its next heartbeat. by names who asks (an
// operator), for history and every view of the request. It returns an error wrapping
// ErrDecommissioned if the machine was decommissioned or an operator asked
// for it to be (GetDecommissioned tells which), and ErrNotFound if the
// machine does not exist or is not provided otherwise. Operators make
// requests outside any session.
func (db *DB) RequestInstallation(ctx context.Context, machine uuid.UUID, by string, request []byte) (int64, error) {
	var gen int64
	err := db.transact(ctx, func(ctx context.Context, q *model.Queries) error {
		_, perr := q.MachineProvidedGet(ctx, machine)
		if perr != nil && !errors.Is(perr, pgx.ErrNoRows) {
			return perr
		}
		d, err := q.MachineDecommissionGet(ctx, machine)
		switch {
		case err != nil:
			return err
		case d.Decommissioned:
			return fmt.Errorf("the machine was decommissioned: %w", ErrDecommissioned)
		case d.Requested:
			return fmt.Errorf("the machine is being decommissioned: %w", ErrDecommissioned)
		case perr != nil:
			return ErrNotFound
		}
		gen, err = (&Tx{q: q}).RequestInstallation(ctx, machine, by, request)
		return err
	})
	switch {
	case errors.Is(err, ErrNotFound) || errors.Is(err, ErrDecommissioned):
		return 0, fmt.Errorf("bmdb: requesting installation on machine %s: %w", machine, err)
	case err != nil:
		return 0, err
	}
	return gen, nil
}

// AgentKeys calls fn with every machine's current agent key (AgentStarted).
// The callback server reads them at start to know the fleet's keys.
func (db *DB) AgentKeys(ctx context.Context, fn func(machine uuid.UUID, key ed25519.PublicKey)) error {
	rows, err := db.q.AgentKeyList(ctx)
	if err != nil {
		return fmt.Errorf("bmdb: listing agent keys: %w", err)
	}
	for _, r := range rows {
		fn(r.MachineID, ed25519.PublicKey(r.AgentPublicKey))
	}
	return nil
}

// datagramSecretSize is the size of the datagram secret: the key size of
// HMAC-SHA256, the MAC keys derived from it.
const datagramSecretSize = 32

// DatagramSecret returns the 32-byte secret that every callback server
// derives the MAC keys of heartbeat datagrams from, so that a datagram may
// reach any of them. The first call against a database creates it from
// crypto/rand; every later call, by any process, returns the same bytes.
// While the database is unavailable (see [Unavailable]) it retries until
// ctx ends.
//
// Whoever can read the secret can forge datagram heartbeats for any machine
// whose agent key they know, as whoever can write the BMDB can forge any
// heartbeat: keep it out of logs, errors and everything shown to operators.
func (db *DB) DatagramSecret(ctx context.Context) ([]byte, error) {
	fresh := make([]byte, datagramSecretSize)
	if _, err := rand.Read(fresh); err != nil {
		return nil, fmt.Errorf("bmdb: generating the heartbeat datagram secret: %w", err)
	}
	pause := 20 * time.Millisecond
	for {
		secret, err := db.datagramSecret(ctx, fresh)
		if err == nil {
			return secret, nil
		}
		if !Unavailable(err) {
			return nil, fmt.Errorf("bmdb: reading the heartbeat datagram secret: %w", err)
		}
		if !sleep(ctx, jitter(pause)) {
			return nil, fmt.Errorf("bmdb: reading the heartbeat datagram secret: %w (while the database was unavailable: %w)", ctx.Err(), err)
		}
		pause = min(2*pause, time.Second)
	}
}

// datagramSecret stores fresh as the secret unless one exists, then reads
// the secret. The read is a second statement, with a snapshot of its own,
// so that it sees the secret that a concurrent first call committed while
// this one's insert waited on it; both statements may be repeated.
func (db *DB) datagramSecret(ctx context.Context, fresh []byte) ([]byte, error) {
	if err := db.q.DatagramSecretCreate(ctx, fresh); err != nil {
		return nil, err
	}
	secret, err := db.q.DatagramSecretGet(ctx)
	if err != nil {
		return nil, err
	}
	if len(secret) != datagramSecretSize {
		return nil, fmt.Errorf("the stored secret has %d bytes, want %d", len(secret), datagramSecretSize)
	}
	return secret, nil
}
