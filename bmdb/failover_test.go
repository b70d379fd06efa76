package bmdb_test

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/internal/eventually"
	"github.com/shepherd/shepherd/internal/pgserver"
)

// failoverCluster starts a primary whose commits wait for a synchronous
// standby and that standby (pgserver.StartSyncPair), closed when the test
// ends.
func failoverCluster(t *testing.T) (primary, standby *pgserver.Server) {
	t.Helper()
	// Without a parent directory each server gets a temporary one that
	// Close removes.
	var err error
	primary, standby, err = pgserver.StartSyncPair(t.Context(), "")
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []*pgserver.Server{primary, standby} {
		t.Cleanup(func() {
			if err := s.Close(); err != nil {
				t.Error(err)
			}
		})
	}
	return primary, standby
}

// acked is what the writer was told had been committed.
type acked struct {
	mu         sync.Mutex
	machines   []uuid.UUID // AddMachine returned
	started    []uuid.UUID // AgentStart work Finish returned (with SetAgentStarted)
	heartbeats []uuid.UUID // RecordHeartbeats said Accepted
	errors     int         // calls that failed (the outage)
}

func (a *acked) counts() (machines, started, heartbeats, errs int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.machines), len(a.started), len(a.heartbeats), a.errors
}

// writeLoop adds a machine, claims and finishes its agent start and records
// a heartbeat from it, over and over until ctx ends, noting each write the
// BMDB acknowledged. Failures (while the database is away) are counted and
// the loop carries on, as a component would.
func writeLoop(ctx context.Context, db *bmdb.DB, s *bmdb.Session, a *acked) {
	keys := map[uuid.UUID]ed25519.PublicKey{}
	fail := func() {
		a.mu.Lock()
		a.errors++
		a.mu.Unlock()
	}
	for i := 0; ctx.Err() == nil; i++ {
		pub, _, err := ed25519.GenerateKey(rand.Reader)
		if err != nil {
			panic(err)
		}
		var id uuid.UUID
		err = s.Transact(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
			var err error
			id, err = tx.AddMachine(ctx, bmdb.Provided{Provider: "p", ProviderID: fmt.Sprintf("fo-%d", i), Status: bmdb.ProviderStatusRunning})
			return err
		})
		if err != nil {
			fail()
			continue
		}
		keys[id] = pub
		a.mu.Lock()
		a.machines = append(a.machines, id)
		a.mu.Unlock()

		// The claim may pick a machine whose earlier round failed.
		w, err := s.Work(ctx, bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"))
		if err != nil || w == nil {
			fail()
			continue
		}
		m, key := w.MachineID, keys[w.MachineID]
		if err := w.Finish(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
			return tx.SetAgentStarted(ctx, m, key)
		}); err != nil {
			fail()
			continue
		}
		a.mu.Lock()
		a.started = append(a.started, m)
		a.mu.Unlock()

		res, err := db.RecordHeartbeats(ctx, []bmdb.Heartbeat{{MachineID: m, AgentKey: key}})
		if err != nil || !res[0].Accepted {
			fail()
			continue
		}
		a.mu.Lock()
		a.heartbeats = append(a.heartbeats, m)
		a.mu.Unlock()
	}
}

// TestFailover runs the BMDB against a primary with a synchronous standby
// through a multi-host postgres:// URL over TCP (host1:port1,host2:port2,
// target_session_attrs=read-write; e2e tests the keyword form), loses the primary (immediate
// stop) mid-run, promotes the standby, and checks that the same *bmdb.DB
// carries on by itself: a session KeepSession lost during the outage is
// re-created, writes succeed again, and every write acknowledged before the
// failover (machines, finished work, heartbeats) is on the new primary.
func TestFailover(t *testing.T) {
	began := time.Now()
	primary, standby := failoverCluster(t)
	dsn := pgserver.MultiHostURL("", primary, standby)
	db, err := bmdb.Open(t.Context(), bmdb.Config{URL: dsn})
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()

	// A component session with a short lease, kept by KeepSession: the
	// outage below outlasts it. Not shorter: a loaded machine must not
	// lose it before the outage.
	sessions := make(chan *bmdb.Session, 4)
	kctx, stopKeep := context.WithCancel(t.Context())
	keepDone := make(chan error, 1)
	go func() {
		keepDone <- db.KeepSession(kctx, bmdb.SessionConfig{Component: "kept", Lease: 2 * time.Second},
			func(ctx context.Context, s *bmdb.Session) error {
				sessions <- s
				<-ctx.Done()
				return nil
			})
	}()
	defer func() {
		stopKeep()
		if err := <-keepDone; err != nil {
			t.Errorf("KeepSession: %v", err)
		}
	}()
	first := <-sessions

	// The writer's session has a lease longer than the outage: it must
	// survive the failover (its row was replicated synchronously).
	ws, err := db.StartSession(t.Context(), bmdb.SessionConfig{Component: "writer", Lease: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	var a acked
	wctx, stopWriter := context.WithCancel(t.Context())
	writerDone := make(chan struct{})
	go func() {
		defer close(writerDone)
		writeLoop(wctx, db, ws, &a)
	}()
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			stopWriter()
			<-writerDone
			if err := ws.Close(context.Background()); err != nil {
				t.Errorf("closing the writer's session: %v", err)
			}
		}
	}
	defer stop()

	eventually.Holds(t, 30*time.Second, "writes before the failover", func(context.Context) (bool, error) {
		_, _, hb, _ := a.counts()
		return hb >= 20, nil
	})

	if err := primary.StopImmediate(t.Context()); err != nil {
		t.Fatal(err)
	}
	failedAt := time.Now()
	// Everything acknowledged up to now was committed on the primary, and
	// so (synchronous replication) flushed on the standby.
	a.mu.Lock()
	before := acked{
		machines:   append([]uuid.UUID(nil), a.machines...),
		started:    append([]uuid.UUID(nil), a.started...),
		heartbeats: append([]uuid.UUID(nil), a.heartbeats...),
	}
	a.mu.Unlock()
	// Keep the database away until the kept session is lost.
	eventually.Holds(t, 30*time.Second, "kept session lost during the outage", func(context.Context) (bool, error) {
		return first.Lost(), nil
	})
	if err := standby.Promote(t.Context()); err != nil {
		t.Fatal(err)
	}
	promotedAt := time.Now()

	var second *bmdb.Session
	select {
	case second = <-sessions:
	case <-time.After(30 * time.Second):
		t.Fatal("KeepSession did not start a new session within 30 s of the promotion")
	}
	if second.ID() == first.ID() {
		t.Fatal("KeepSession handed out the lost session again")
	}
	_, _, hbAtPromotion, _ := a.counts()
	eventually.Holds(t, 30*time.Second, "writes after the promotion", func(context.Context) (bool, error) {
		_, _, hb, _ := a.counts()
		return hb >= hbAtPromotion+20, nil
	})
	recovered := time.Now()
	// Checked before Close: a closed session's context cause also wraps
	// ErrSessionExpired.
	if ws.Lost() {
		t.Error("the writer's session (lease 1 min) was lost in a failover of a few seconds")
	}
	stop()

	// Check on the promoted standby, directly.
	conn, err := pgx.Connect(t.Context(), standby.URL(""))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	var inRecovery bool
	if err := conn.QueryRow(t.Context(), "SELECT pg_is_in_recovery()").Scan(&inRecovery); err != nil || inRecovery {
		t.Fatalf("promoted standby: in recovery = %v, %v", inRecovery, err)
	}
	missing := func(what, sql string, ids []uuid.UUID) {
		t.Helper()
		var n int
		if err := conn.QueryRow(t.Context(), sql, ids).Scan(&n); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		if n != 0 {
			t.Errorf("%d of %d acknowledged %s missing after the failover", n, len(ids), what)
		}
	}
	missing("machines", `SELECT count(*) FROM unnest($1::uuid[]) AS id
		WHERE NOT EXISTS (SELECT FROM machines m WHERE m.machine_id = id)`, before.machines)
	missing("finished agent starts", `SELECT count(*) FROM unnest($1::uuid[]) AS id
		WHERE NOT EXISTS (SELECT FROM work_history h WHERE h.machine_id = id AND h.process = 'AgentStart' AND h.event = 'Finished')
		   OR NOT EXISTS (SELECT FROM machine_agent_started s WHERE s.machine_id = id)`, before.started)
	missing("heartbeats", `SELECT count(*) FROM unnest($1::uuid[]) AS id
		WHERE NOT EXISTS (SELECT FROM machine_agent_heartbeat h WHERE h.machine_id = id)`, before.heartbeats)

	// And the writes acknowledged after the promotion, for good measure.
	m, st, hb, errs := a.counts()
	a.mu.Lock()
	all := a.heartbeats
	a.mu.Unlock()
	missing("heartbeats (whole run)", `SELECT count(*) FROM unnest($1::uuid[]) AS id
		WHERE NOT EXISTS (SELECT FROM machine_agent_heartbeat h WHERE h.machine_id = id)`, all)
	t.Logf("acknowledged before the failover: %d machines, %d agent starts, %d heartbeats; whole run: %d, %d, %d; %d failed calls",
		len(before.machines), len(before.started), len(before.heartbeats), m, st, hb, errs)
	t.Logf("outage (stop to promotion) %s; writes back %s after the promotion; test %s",
		promotedAt.Sub(failedAt).Round(time.Millisecond), recovered.Sub(promotedAt).Round(time.Millisecond), time.Since(began).Round(time.Millisecond))
}
