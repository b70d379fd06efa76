package main

import (
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// TestMachineResetSelected: machine reset --state/--provider/--all selects
// the machines with a backoff for --process that machine list would show
// with those filters, lists them and asks; a selection of none is refused;
// names (ids or provider ids) still work, several at once.
func TestMachineResetSelected(t *testing.T) {
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "initializer", time.Minute)
	var rack []uuid.UUID // static, quarantined for AgentStart
	for range 3 {
		bmdbtest.AddMachine(t, db, s, "static")
		rack = append(rack, quarantine(t, db, s, "static"))
	}
	bmdbtest.AddMachine(t, db, s, "lab")
	labQ := quarantine(t, db, s, "lab")
	// In backoff, not quarantined: not Quarantined.
	backedOff := bmdbtest.AddMachine(t, db, s, "static")
	w, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("static"))
	if err != nil || w.MachineID != backedOff {
		t.Fatalf("claimed %v (%v), want %s", w, err, backedOff)
	}
	if _, err := w.Fail(t.Context(), bmdb.BackoffPolicy{Initial: time.Hour}, "ssh: no route to host"); err != nil {
		t.Fatal(err)
	}
	untouched := bmdbtest.AddMachine(t, db, s, "static")
	url := "--database-url=" + db.URL
	hasBackoff := func(id uuid.UUID) bool {
		_, err := db.GetBackoff(t.Context(), id, bmdb.ProcessAgentStart)
		return err == nil
	}

	for name, c := range map[string]struct {
		args []string
		want string
	}{
		"names and a filter": {[]string{"machine", "reset", rack[0].String(), "--all", "--process", "AgentStart"}, "not both"},
		"nothing selected":   {[]string{"machine", "reset", "--process", "AgentStart"}, "name the machines to reset"},
		"all and a filter":   {[]string{"machine", "reset", "--all", "--provider", "lab", "--process", "AgentStart"}, "leave out --state and --provider, or --all"},
		"bad state":          {[]string{"machine", "reset", "--state", "Sleepy", "--process", "AgentStart"}, `--state "Sleepy" is not a machine state`},
		"no process":         {[]string{"machine", "reset", "--all"}, "--process is required"},
		"matches none":       {[]string{"machine", "reset", "--state", "Quarantined", "--provider", "other", "--process", "AgentStart", "--yes"}, "no machine matches (a backoff for AgentStart, state Quarantined, provider other): nothing to reset"},
		"other process":      {[]string{"machine", "reset", "--all", "--process", "Recovery", "--yes"}, "no machine matches (a backoff for Recovery, all): nothing to reset"},
	} {
		out, err := runWithInput(t, "y\n", append(c.args, url)...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error saying %q\n%s", name, err, c.want, out)
		}
	}

	// Refused at the prompt: nothing happens, but the operator saw the list.
	before := historyCount(t, db)
	sel := []string{"machine", "reset", "--state", "Quarantined", "--provider", "static", "--process", "AgentStart", "--reason", "keys installed", url}
	out, err := runWithInput(t, "n\n", sel...)
	if err == nil || !strings.Contains(err.Error(), "not confirmed") || !strings.Contains(out, "3 machines match (a backoff for AgentStart, state Quarantined, provider static)") {
		t.Errorf("answered n: %v\n%s", err, out)
	}
	for _, id := range rack {
		if !strings.Contains(out, id.String()) {
			t.Errorf("the list before the question lacks %s:\n%s", id, out)
		}
	}
	if strings.Contains(out, labQ.String()) || strings.Contains(out, backedOff.String()) {
		t.Errorf("the list names machines the filter leaves out:\n%s", out)
	}
	if n := historyCount(t, db); n != before {
		t.Fatalf("a refused reset wrote %d history rows", n-before)
	}

	out, err = runWithInput(t, "y\n", sel...)
	if err != nil || !strings.Contains(out, "cleared the AgentStart backoffs of 3 machines") {
		t.Fatalf("answered y: %v\n%s", err, out)
	}
	for _, id := range rack {
		if hasBackoff(id) {
			t.Errorf("rack machine %s still has its quarantine", id)
		}
		events, err := db.History(t.Context(), bmdb.HistoryFilter{MachineID: id})
		if err != nil {
			t.Fatal(err)
		}
		if last := events[len(events)-1]; last.Event != bmdb.EventReset || !strings.Contains(last.Cause, "keys installed") {
			t.Errorf("last history of %s: %+v, want Reset with the reason", id, last)
		}
	}
	if !hasBackoff(labQ) || !hasBackoff(backedOff) {
		t.Error("the reset cleared backoffs its filter left out")
	}
	if _, err := runWithInput(t, "y\n", sel...); err == nil || !strings.Contains(err.Error(), "no machine matches") {
		t.Errorf("the same reset again: %v, want no machine matches", err)
	}

	// --all --yes: every machine with a backoff for the process, without asking.
	out, err = run(t, "machine", "reset", "--all", "--process", "AgentStart", "--yes", url)
	if err != nil || !strings.Contains(out, "2 machines match") || !strings.Contains(out, "cleared the AgentStart backoffs of 2 machines") {
		t.Fatalf("reset --all --yes: %v\n%s", err, out)
	}
	if hasBackoff(labQ) || hasBackoff(backedOff) {
		t.Error("reset --all left a backoff")
	}

	// Several machines by name, provider ids among them.
	var failed []uuid.UUID
	for range 2 {
		failed = append(failed, quarantine(t, db, s, "static"))
	}
	db.Exec(t, "UPDATE machine_provided SET provider_id = 'm1' WHERE machine_id = $1", failed[0])
	out, err = run(t, "machine", "reset", "m1", failed[1].String(), "--process", "AgentStart", url)
	if err != nil || strings.Count(out, "cleared the AgentStart quarantine") != 2 {
		t.Fatalf("reset m1 %s: %v\n%s", failed[1], err, out)
	}
	for _, id := range failed {
		if hasBackoff(id) {
			t.Errorf("named machine %s still has its quarantine", id)
		}
	}
	if hasBackoff(untouched) {
		t.Error("a machine never claimed has a backoff")
	}

	// A name of no machine among them: none is reset.
	q := quarantine(t, db, s, "static")
	unknown := uuid.NewString()
	if out, err := run(t, "machine", "reset", q.String(), unknown, "--process", "AgentStart", url); err == nil || !strings.Contains(err.Error(), "machine "+unknown+" does not exist") {
		t.Errorf("reset %s %s: %v, want machine %s does not exist\n%s", q, unknown, err, unknown, out)
	}
	if !hasBackoff(q) {
		t.Errorf("machine %s was reset, though another name was of no machine", q)
	}
}
