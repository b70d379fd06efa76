package bmdb_test

import (
	"context"
	"crypto/ed25519"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// exampleSession opens a fresh BMDB for an example and starts a session
// of component on it; the returned function closes both. A real program
// calls bmdb.Open with its own URL (see ExampleOpen).
func exampleSession(ctx context.Context, component string) (*bmdb.DB, *bmdb.Session, func()) {
	url, drop := bmdbtest.ExampleDatabase()
	db, err := bmdb.Open(ctx, bmdb.Config{URL: url})
	if err != nil {
		panic(err)
	}
	s, err := db.StartSession(ctx, bmdb.SessionConfig{Component: component})
	if err != nil {
		panic(err)
	}
	return db, s, func() { s.Close(ctx); db.Close(); drop() }
}

// exampleMachine records a provided machine of provider "example" under s,
// as a provisioner does, and returns its id.
func exampleMachine(ctx context.Context, s *bmdb.Session, providerID string) uuid.UUID {
	var id uuid.UUID
	err := s.Transact(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
		var err error
		id, err = tx.AddMachine(ctx, bmdb.Provided{Provider: "example", ProviderID: providerID, Status: bmdb.ProviderStatusRunning})
		return err
	})
	if err != nil {
		panic(err)
	}
	return id
}

// printHistory prints a machine's history, one event per line.
func printHistory(ctx context.Context, db *bmdb.DB, machine uuid.UUID) {
	events, err := db.History(ctx, bmdb.HistoryFilter{MachineID: machine})
	if err != nil {
		panic(err)
	}
	for _, e := range events {
		line := fmt.Sprintf("  %s %s", e.Process, e.Event)
		if e.Cause != "" {
			line += ": " + e.Cause
		}
		fmt.Println(line)
	}
}

// Opening the BMDB migrates it to the schema the binary knows; a session
// then gives a component its lease, renewed in the background until Close.
func ExampleOpen() {
	ctx := context.Background()
	url, drop := bmdbtest.ExampleDatabase() // a real program uses its own URL
	defer drop()

	db, err := bmdb.Open(ctx, bmdb.Config{URL: url})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer db.Close()
	fmt.Println("schema version > 0:", db.SchemaVersion() > 0)

	s, err := db.StartSession(ctx, bmdb.SessionConfig{Component: "example"})
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("component:", s.Component(), "lost:", s.Lost())
	if err := s.Close(ctx); err != nil {
		fmt.Println(err)
	}
	// A closed session's calls fail with ErrSessionExpired.
	_, err = s.Work(ctx, bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("example"))
	fmt.Println(errors.Is(err, bmdb.ErrSessionExpired))
	// Output:
	// schema version > 0: true
	// component: example lost: false
	// true
}

// A worker claims the candidate that has waited longest, does its side
// effect, and finishes the work with the tag changes it made, in one
// transaction. The machine then no longer matches the candidate query.
func ExampleSession_Work() {
	ctx := context.Background()
	db, s, done := exampleSession(ctx, "initializer")
	defer done()
	m := exampleMachine(ctx, s, "m1")

	candidates := bmdb.AgentStartCandidates("example")
	w, err := s.Work(ctx, bmdb.ProcessAgentStart, candidates)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("claimed m1:", w.MachineID == m, w.Provided.ProviderID)

	// ... SSH in and start the agent, then record it:
	key, _, _ := ed25519.GenerateKey(nil)
	err = w.Finish(ctx, func(ctx context.Context, tx *bmdb.Tx) error {
		return tx.SetAgentStarted(ctx, w.MachineID, key)
	})
	fmt.Println("finished:", err)

	_, err = s.Work(ctx, bmdb.ProcessAgentStart, candidates)
	fmt.Println("next claim:", err)
	printHistory(ctx, db, m)
	// Output:
	// claimed m1: true m1
	// finished: <nil>
	// next claim: bmdb: nothing to do
	//   AgentStart Started
	//   AgentStart Finished
}

// A failure backs the machine off for the process by the policy; after
// MaxAttempts failures in a row it is quarantined until an operator resets
// it. Either way, the process leaves it alone meanwhile.
func ExampleWork_Fail() {
	ctx := context.Background()
	db, s, done := exampleSession(ctx, "initializer")
	defer done()
	m := exampleMachine(ctx, s, "m1")
	candidates := bmdb.AgentStartCandidates("example")

	w, err := s.Work(ctx, bmdb.ProcessAgentStart, candidates)
	if err != nil {
		panic(err)
	}
	policy := bmdb.BackoffPolicy{Initial: 5 * time.Minute, Maximum: time.Hour, Exponent: 2, MaxAttempts: 1}
	b, err := w.Fail(ctx, policy, "ssh: connection refused")
	if err != nil {
		panic(err)
	}
	fmt.Printf("attempts %d, interval %s, quarantined %v\n", b.Attempts, b.Interval, b.Quarantined)
	fmt.Println("next 3 intervals:", policy.Next(b.Interval), policy.Next(policy.Next(b.Interval)), policy.Next(time.Hour))

	_, err = s.Work(ctx, bmdb.ProcessAgentStart, candidates)
	fmt.Println("next claim:", err)
	printHistory(ctx, db, m)
	// Output:
	// attempts 1, interval 5m0s, quarantined true
	// next 3 intervals: 10m0s 20m0s 1h0m0s
	// next claim: bmdb: nothing to do
	//   AgentStart Started
	//   AgentStart Failed: ssh: connection refused
	//   AgentStart Quarantined: 1 failures in a row; last: ssh: connection refused
}

// An operator's reset clears a backoff or quarantine, with who asked and
// why in the history, and the machine is a candidate again.
func ExampleDB_ResetBackoff() {
	ctx := context.Background()
	db, s, done := exampleSession(ctx, "initializer")
	defer done()
	m := exampleMachine(ctx, s, "m1")
	candidates := bmdb.AgentStartCandidates("example")
	w, err := s.Work(ctx, bmdb.ProcessAgentStart, candidates)
	if err != nil {
		panic(err)
	}
	if _, err := w.Fail(ctx, bmdb.AgentStartBackoff(), "ssh: connection refused"); err != nil {
		panic(err)
	}

	err = db.ResetBackoff(ctx, m, bmdb.ProcessAgentStart, "reset by alice: cable replaced")
	fmt.Println("reset:", err)
	_, err = db.GetBackoff(ctx, m, bmdb.ProcessAgentStart)
	fmt.Println("backoff:", err)
	w, err = s.Work(ctx, bmdb.ProcessAgentStart, candidates)
	fmt.Println("claimed again:", err == nil && w.MachineID == m)
	if err := w.Cancel(ctx); err != nil {
		panic(err)
	}
	printHistory(ctx, db, m)
	// Output:
	// reset: <nil>
	// backoff: bmdb: not found
	// claimed again: true
	//   AgentStart Started
	//   AgentStart Failed: ssh: connection refused
	//   AgentStart Reset: reset by alice: cable replaced
	//   AgentStart Started
	//   AgentStart Canceled: canceled
}
