package bmdb_test

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"errors"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/uuid"
	"golang.org/x/sync/errgroup"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/tcpproxy"
)

// record sends one batch and fails the test if the call fails.
func record(t *testing.T, db *bmdbtest.DB, hbs ...bmdb.Heartbeat) []bmdb.HeartbeatResult {
	t.Helper()
	res, err := db.RecordHeartbeats(t.Context(), hbs)
	if err != nil {
		t.Fatalf("RecordHeartbeats: %v", err)
	}
	return res
}

// storedCounter reads the machine's stored datagram counter.
func storedCounter(t *testing.T, db *bmdbtest.DB, id uuid.UUID) int64 {
	t.Helper()
	return bmdbtest.Scalar[int64](t, db, `SELECT datagram_counter FROM machine_agent_heartbeat WHERE machine_id = $1`, id)
}

// ageHeartbeat moves the machine's heartbeat an hour back, so that a test
// can tell whether a later heartbeat was recorded.
func ageHeartbeat(t *testing.T, db *bmdbtest.DB, id uuid.UUID) time.Time {
	t.Helper()
	db.Exec(t, `UPDATE machine_agent_heartbeat SET agent_heartbeat_at = agent_heartbeat_at - interval '1 hour' WHERE machine_id = $1`, id)
	at, err := db.GetAgentHeartbeat(t.Context(), id)
	if err != nil {
		t.Fatal(err)
	}
	return at
}

// A machine's datagrams are accepted only with counters that keep rising;
// a replay (equal or lower counter) records nothing, a wrong key is refused
// whatever its counter, and TLS heartbeats neither need nor move the
// counter but report it.
func TestDatagramHeartbeatCounter(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	ids, keys := startedMachines(t, db, s, 1)
	id, key := ids[0], keys[0]
	tls := bmdb.Heartbeat{MachineID: id, AgentKey: key}
	dg := func(c int64) bmdb.Heartbeat { return bmdb.Heartbeat{MachineID: id, AgentKey: key, Counter: c} }

	steps := []struct {
		name        string
		hb          bmdb.Heartbeat
		want        bmdb.HeartbeatResult
		wantStored  int64
		wantRecords bool // the heartbeat time moves
	}{
		{"first datagram", dg(5), bmdb.HeartbeatResult{Accepted: true, Counter: 5}, 5, true},
		{"same counter again", dg(5), bmdb.HeartbeatResult{Replayed: true}, 5, false},
		{"lower counter", dg(3), bmdb.HeartbeatResult{Replayed: true}, 5, false},
		{"higher counter", dg(6), bmdb.HeartbeatResult{Accepted: true, Counter: 6}, 6, true},
		{"wrong key with a good counter", bmdb.Heartbeat{MachineID: id, AgentKey: newKey(t), Counter: 100}, bmdb.HeartbeatResult{}, 6, false},
		{"TLS leaves the counter alone and reports it", tls, bmdb.HeartbeatResult{Accepted: true, Counter: 6}, 6, true},
		{"counter next to the largest", dg(math.MaxInt64 - 1), bmdb.HeartbeatResult{Accepted: true, Counter: math.MaxInt64 - 1}, math.MaxInt64 - 1, true},
		{"largest counter", dg(math.MaxInt64), bmdb.HeartbeatResult{Accepted: true, Counter: math.MaxInt64}, math.MaxInt64, true},
		{"largest counter replayed", dg(math.MaxInt64), bmdb.HeartbeatResult{Replayed: true}, math.MaxInt64, false},
		{"TLS after the largest", tls, bmdb.HeartbeatResult{Accepted: true, Counter: math.MaxInt64}, math.MaxInt64, true},
	}
	if diff := cmp.Diff([]bmdb.HeartbeatResult{{Accepted: true}}, record(t, db, tls)); diff != "" {
		t.Errorf("first heartbeat, over TLS: result (-want +got):\n%s", diff)
	}
	for _, st := range steps {
		before := ageHeartbeat(t, db, id)
		res := record(t, db, st.hb)
		if diff := cmp.Diff([]bmdb.HeartbeatResult{st.want}, res); diff != "" {
			t.Errorf("%s: result (-want +got):\n%s", st.name, diff)
		}
		if got := storedCounter(t, db, id); got != st.wantStored {
			t.Errorf("%s: stored counter %d, want %d", st.name, got, st.wantStored)
		}
		at, err := db.GetAgentHeartbeat(t.Context(), id)
		if err != nil {
			t.Fatal(err)
		}
		if recorded := at.After(before); recorded != st.wantRecords {
			t.Errorf("%s: heartbeat time moved from %v to %v, want moved = %v", st.name, before, at, st.wantRecords)
		}
	}

	res := record(t, db, dg(-1), dg(math.MaxInt64))
	if !errors.Is(res[0].Err, bmdb.ErrInvalidHeartbeat) || res[0].Accepted {
		t.Errorf("negative counter: %+v, want ErrInvalidHeartbeat", res[0])
	}
	if !res[1].Replayed {
		t.Errorf("replay sharing a batch with a negative counter: %+v, want Replayed", res[1])
	}
}

// The first datagram of an agent may also be its machine's first heartbeat
// (no heartbeat row yet); a replay of it must still be refused.
func TestDatagramFirstHeartbeat(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	ids, keys := startedMachines(t, db, s, 1)
	dg := bmdb.Heartbeat{MachineID: ids[0], AgentKey: keys[0], Counter: 9}
	want := []bmdb.HeartbeatResult{{Accepted: true, Counter: 9}, {Replayed: true}}
	got := []bmdb.HeartbeatResult{record(t, db, dg)[0], record(t, db, dg)[0]}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("results (-want +got):\n%s", diff)
	}
}

// Heartbeats of one machine in one batch: a replay is never accepted, and a
// genuine heartbeat is never refused because a replay or another heartbeat
// of the machine shares its batch. Each machine's stored counter is 4.
func TestDatagramHeartbeatBatches(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		// counters of the batch's heartbeats, all of the one machine: 0 is
		// TLS, -1 a datagram under a wrong key with counter 9.
		counters   []int64
		want       []bmdb.HeartbeatResult
		wantStored int64
	}{
		{"TLS and a replayed datagram", []int64{0, 4},
			[]bmdb.HeartbeatResult{{Accepted: true, Counter: 4}, {Replayed: true}}, 4},
		{"a replayed datagram and TLS", []int64{3, 0},
			[]bmdb.HeartbeatResult{{Replayed: true}, {Accepted: true, Counter: 4}}, 4},
		{"TLS and a genuine datagram: TLS reports the new floor", []int64{0, 6},
			[]bmdb.HeartbeatResult{{Accepted: true, Counter: 6}, {Accepted: true, Counter: 6}}, 6},
		{"datagrams 5 and 7: 7 stands for both", []int64{5, 7},
			[]bmdb.HeartbeatResult{{Replayed: true}, {Accepted: true, Counter: 7}}, 7},
		{"datagrams 7 and 5", []int64{7, 5},
			[]bmdb.HeartbeatResult{{Accepted: true, Counter: 7}, {Replayed: true}}, 7},
		{"one datagram twice: the copy is a replay", []int64{6, 6},
			[]bmdb.HeartbeatResult{{Accepted: true, Counter: 6}, {Replayed: true}}, 6},
		{"a replay and a genuine datagram", []int64{3, 6, 0},
			[]bmdb.HeartbeatResult{{Replayed: true}, {Accepted: true, Counter: 6}, {Accepted: true, Counter: 6}}, 6},
		{"replays only", []int64{2, 4, 3},
			[]bmdb.HeartbeatResult{{Replayed: true}, {Replayed: true}, {Replayed: true}}, 4},
		{"a wrong key's datagram and a genuine one", []int64{-1, 5},
			[]bmdb.HeartbeatResult{{}, {Accepted: true, Counter: 5}}, 5},
		{"a wrong key's datagram and TLS", []int64{0, -1},
			[]bmdb.HeartbeatResult{{Accepted: true, Counter: 4}, {}}, 4},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			db := bmdbtest.New(t)
			s := bmdbtest.Session(t, db, "test", time.Minute)
			ids, keys := startedMachines(t, db, s, 2)
			id, key := ids[0], keys[0]
			// Another machine in every batch, with a genuine datagram, so
			// that a statement confusing machines would show.
			other := bmdb.Heartbeat{MachineID: ids[1], AgentKey: keys[1], Counter: 1}
			record(t, db, bmdb.Heartbeat{MachineID: id, AgentKey: key, Counter: 4})
			wrong := newKey(t)
			batch := []bmdb.Heartbeat{other}
			for _, c := range tt.counters {
				if c < 0 {
					batch = append(batch, bmdb.Heartbeat{MachineID: id, AgentKey: wrong, Counter: 9})
				} else {
					batch = append(batch, bmdb.Heartbeat{MachineID: id, AgentKey: key, Counter: c})
				}
			}
			res := record(t, db, batch...)
			want := append([]bmdb.HeartbeatResult{{Accepted: true, Counter: 1}}, tt.want...)
			if diff := cmp.Diff(want, res); diff != "" {
				t.Errorf("results (-want +got):\n%s", diff)
			}
			if got := storedCounter(t, db, id); got != tt.wantStored {
				t.Errorf("stored counter %d, want %d", got, tt.wantStored)
			}
		})
	}
}

// An accepted datagram heartbeat returns the pending installation (the
// server then tells the agent to call over TLS); a replayed one does not,
// and a report it carries is not stored.
func TestDatagramHeartbeatReturnsPending(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	f := fixture{t: t, db: db, s: s}
	ids, keys := startedMachines(t, db, s, 1)
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error {
		_, err := tx.RequestInstallation(ctx, ids[0], "test", []byte("gen1"))
		return err
	})
	dg := bmdb.Heartbeat{MachineID: ids[0], AgentKey: keys[0], Counter: 1}
	want := []bmdb.HeartbeatResult{
		{Accepted: true, Counter: 1, Pending: &bmdb.PendingInstallation{Generation: 1, Request: []byte("gen1")}},
		{Replayed: true},
	}
	got := []bmdb.HeartbeatResult{record(t, db, dg)[0]}
	dg.Hardware = &bmdb.HardwareReport{Raw: []byte("replayed")}
	got = append(got, record(t, db, dg)[0])
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("results (-want +got):\n%s", diff)
	}
	if r, err := db.GetHardwareReport(t.Context(), ids[0]); !errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("a replayed datagram's hardware report: stored %q (err %v), want none", r.Raw, err)
	}
}

// A recovery deletes the heartbeat row, and its counter with it; the next
// takeover's agent has a fresh key. So the old agent's datagrams stay
// refused, however high their counter, while the new agent starts from 0.
func TestDatagramCounterResetDoesNotReviveOldAgent(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	f := fixture{t: t, db: db, s: s}
	ids, keys := startedMachines(t, db, s, 1)
	id, oldKey := ids[0], keys[0]
	if res := record(t, db, bmdb.Heartbeat{MachineID: id, AgentKey: oldKey, Counter: 100}); !res[0].Accepted {
		t.Fatalf("old agent's datagram: %+v", res[0])
	}
	newKey := newKey(t)
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error { return tx.ClearAgent(ctx, id) })
	f.tx(func(ctx context.Context, tx *bmdb.Tx) error { return tx.SetAgentStarted(ctx, id, newKey) })

	got := record(t, db,
		bmdb.Heartbeat{MachineID: id, AgentKey: oldKey, Counter: 1000}, // the old agent, still running, or a recording of it
		bmdb.Heartbeat{MachineID: id, AgentKey: newKey},                // the new agent's first heartbeat
	)
	got = append(got, record(t, db, bmdb.Heartbeat{MachineID: id, AgentKey: oldKey, Counter: math.MaxInt64})...)
	got = append(got, record(t, db, bmdb.Heartbeat{MachineID: id, AgentKey: newKey, Counter: 1})...)
	want := []bmdb.HeartbeatResult{{}, {Accepted: true}, {}, {Accepted: true, Counter: 1}}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("results (-want +got):\n%s", diff)
	}
}

// Two callback servers handed the same datagram at once (a replay sent to
// the other one) must not both accept it: the counter is compared under
// the row lock, not in the statements' snapshots, which both predate the
// first one's commit here.
func TestDatagramReplayRacingItsOriginal(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "test", time.Minute)
	ids, keys := startedMachines(t, db, s, 1)
	id, key := ids[0], keys[0]
	record(t, db, bmdb.Heartbeat{MachineID: id, AgentKey: key, Counter: 1})

	// Hold the heartbeat row, so that both statements take their snapshot
	// and then wait for it.
	tx, err := db.Pool.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.WithoutCancel(t.Context()))
	if _, err := tx.Exec(t.Context(), `SELECT 1 FROM machine_agent_heartbeat WHERE machine_id = $1 FOR UPDATE`, id); err != nil {
		t.Fatal(err)
	}
	const copies = 2
	results := make([]bmdb.HeartbeatResult, copies)
	var g errgroup.Group
	for i := range copies {
		g.Go(func() error {
			res, err := db.RecordHeartbeats(context.WithoutCancel(t.Context()), []bmdb.Heartbeat{{MachineID: id, AgentKey: key, Counter: 2}})
			if err == nil {
				results[i] = res[0]
			}
			return err
		})
	}
	bmdbtest.WaitFor(t, 30*time.Second, "both heartbeats wait for the row lock", func(ctx context.Context) (bool, error) {
		var n int
		err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&n)
		return n == copies, err
	})
	if err := tx.Commit(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	var accepted, replayed int
	for _, r := range results {
		if r.Accepted {
			accepted++
		}
		if r.Replayed {
			replayed++
		}
	}
	if accepted != 1 || replayed != copies-1 {
		t.Errorf("one datagram sent %d times at once: %d accepted, %d replayed (%+v), want 1 accepted", copies, accepted, replayed, results)
	}
}

// Every handle on the database, in any process, gets the same secret, also
// when the first calls race.
func TestDatagramSecret(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	const handles = 4
	dbs := []*bmdb.DB{db.DB}
	for range handles - 1 {
		other, err := bmdb.Open(t.Context(), bmdb.Config{URL: db.URL})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(other.Close)
		dbs = append(dbs, other)
	}
	secrets := make([][]byte, len(dbs))
	var mu sync.Mutex
	var g errgroup.Group
	for i, d := range dbs {
		g.Go(func() error {
			secret, err := d.DatagramSecret(t.Context())
			mu.Lock()
			secrets[i] = secret
			mu.Unlock()
			return err
		})
	}
	if err := g.Wait(); err != nil {
		t.Fatal(err)
	}
	again, err := dbs[1].DatagramSecret(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	secrets = append(secrets, again)
	if len(secrets[0]) != 32 || bytes.Equal(secrets[0], make([]byte, 32)) {
		t.Fatalf("secret of %d bytes, all zero: %v", len(secrets[0]), bytes.Equal(secrets[0], make([]byte, 32)))
	}
	for i, sec := range secrets {
		if !bytes.Equal(sec, secrets[0]) {
			t.Errorf("call %d got another secret than call 0", i)
		}
	}
	if n := bmdbtest.Scalar[int](t, db, `SELECT count(*) FROM heartbeat_datagram_secret`); n != 1 {
		t.Errorf("%d stored secrets, want 1", n)
	}

	// Another database has its own.
	other := bmdbtest.New(t)
	theirs, err := other.DatagramSecret(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Equal(theirs, secrets[0]) {
		t.Error("two databases share one secret: it is not random")
	}
}

// A batch large enough to be planned for its own arrays (customPlanBatch)
// settles TLS heartbeats, datagrams, replays and wrong keys as a small one
// does.
func TestRecordHeartbeatsLargeBatch(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	const n = 500
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "p", Healthy: n})
	var ids []uuid.UUID
	var keys []ed25519.PublicKey
	if err := db.AgentKeys(t.Context(), func(m uuid.UUID, k ed25519.PublicKey) { ids = append(ids, m); keys = append(keys, k) }); err != nil {
		t.Fatal(err)
	}
	first := make([]bmdb.Heartbeat, n)
	for i := range ids {
		first[i] = bmdb.Heartbeat{MachineID: ids[i], AgentKey: keys[i], Counter: int64(i % 3)} // TLS, 1, 2
	}
	record(t, db, first...)
	var batch []bmdb.Heartbeat
	var want []bmdb.HeartbeatResult
	for i := range ids {
		switch i % 4 {
		case 0: // TLS
			batch = append(batch, bmdb.Heartbeat{MachineID: ids[i], AgentKey: keys[i]})
			want = append(want, bmdb.HeartbeatResult{Accepted: true, Counter: int64(i % 3)})
		case 1: // a genuine datagram
			batch = append(batch, bmdb.Heartbeat{MachineID: ids[i], AgentKey: keys[i], Counter: 10})
			want = append(want, bmdb.HeartbeatResult{Accepted: true, Counter: 10})
		case 2: // a replay of the datagram just accepted, or of none
			batch = append(batch, bmdb.Heartbeat{MachineID: ids[i], AgentKey: keys[i], Counter: max(int64(i%3), 1)})
			if i%3 == 0 {
				want = append(want, bmdb.HeartbeatResult{Accepted: true, Counter: 1})
			} else {
				want = append(want, bmdb.HeartbeatResult{Replayed: true})
			}
		case 3: // a wrong key
			batch = append(batch, bmdb.Heartbeat{MachineID: ids[i], AgentKey: newKey(t), Counter: 10})
			want = append(want, bmdb.HeartbeatResult{})
		}
	}
	if diff := cmp.Diff(want, record(t, db, batch...)); diff != "" {
		t.Errorf("results (-want +got):\n%s", diff)
	}
}

// While the database cannot be reached, DatagramSecret keeps trying until
// its context ends, and then says so; once it is back, the call succeeds.
func TestDatagramSecretRetriesWhileUnavailable(t *testing.T) {
	t.Parallel()
	db, proxy := bmdbtest.NewBehindProxy(t, bmdb.Config{})
	proxy.SetMode(tcpproxy.Reset)
	ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
	defer cancel()
	_, err := db.DatagramSecret(ctx)
	if !errors.Is(err, context.DeadlineExceeded) || !bmdb.Unavailable(err) {
		t.Fatalf("DatagramSecret with the database unreachable: %v, want it to retry until the deadline", err)
	}
	proxy.SetMode(tcpproxy.Pass)
	secret, err := db.DatagramSecret(t.Context())
	if err != nil || len(secret) != 32 {
		t.Fatalf("DatagramSecret once the database is back: %d bytes, %v", len(secret), err)
	}
}
