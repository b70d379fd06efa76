package bmdb_test

import (
	"context"
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// TestHold: an operator's Hold takes the named machine exclusively, with the
// cause in history, and keeps every other machine-exclusive process off it
// until it ends; and it is kept off a machine another one holds, with an
// error that names the holder.
func TestHold(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	loop := bmdbtest.Session(t, db, "initializer", time.Minute)
	cli := bmdbtest.Session(t, db, "cli", time.Minute)
	var m uuid.UUID
	err := loop.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		var err error
		m, err = tx.AddMachine(ctx, bmdb.Provided{Provider: "p", ProviderID: "m3", ReservationID: "r1",
			Address: netip.MustParseAddr("10.0.0.3"), Location: "fra1/rack1", Status: bmdb.ProviderStatusRunning})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	other := bmdbtest.AddMachine(t, db, loop, "p")

	w, err := cli.Hold(t.Context(), bmdb.ProcessPower, m, "power off by alice@host")
	if err != nil {
		t.Fatalf("Hold: %v", err)
	}
	provided, err := db.GetProvided(t.Context(), m)
	if err != nil {
		t.Fatal(err)
	}
	if w.MachineID != m || w.Process != bmdb.ProcessPower || provided.Location != "fra1/rack1" {
		t.Errorf("Hold returned %+v", w)
	}
	if diff := cmp.Diff(provided, w.Provided, cmpopts.EquateComparable(netip.Addr{})); diff != "" {
		t.Errorf("Hold's Provided tag differs from the machine's (-machine +hold):\n%s", diff)
	}
	if diff := cmp.Diff([]string{"Power Started power off by alice@host"}, bmdbtest.History(t, db, m)); diff != "" {
		t.Errorf("history (-want +got):\n%s", diff)
	}

	// The control loops' claims pass the held machine by.
	ids, err := db.ListCandidates(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"), 10)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]uuid.UUID{other}, ids); diff != "" {
		t.Errorf("agent start candidates while Power holds %s (-want +got):\n%s", m, diff)
	}
	aw, err := loop.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"))
	if err != nil || aw.MachineID != other {
		t.Fatalf("agent start claimed %v, %v; want %s, the machine Power does not hold", aw, err, other)
	}
	if _, err := loop.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p")); !errors.Is(err, bmdb.ErrNothingToDo) {
		t.Errorf("a second agent start claim: %v, want ErrNothingToDo", err)
	}

	// A second Hold of the machine, from any session, finds it busy.
	for _, s := range []*bmdb.Session{cli, loop} {
		_, err := s.Hold(t.Context(), bmdb.ProcessPower, m, "power on by bob@host")
		if !errors.Is(err, bmdb.ErrMachineBusy) || !strings.Contains(err.Error(), "held by Power") {
			t.Errorf("second Hold from %s: %v, want ErrMachineBusy held by Power", s.Component(), err)
		}
	}
	// A Hold of a machine agent start holds finds it busy, named.
	_, err = cli.Hold(t.Context(), bmdb.ProcessPower, other, "power off by alice@host")
	if !errors.Is(err, bmdb.ErrMachineBusy) || !strings.Contains(err.Error(), "held by AgentStart") {
		t.Errorf("Hold of a machine agent start holds: %v, want ErrMachineBusy held by AgentStart", err)
	}
	if diff := cmp.Diff([]string{"AgentStart Started"}, bmdbtest.History(t, db, other)); diff != "" {
		t.Errorf("the refused Hold wrote history (-want +got):\n%s", diff)
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work"); n != 2 {
		t.Errorf("%d work rows, want 2 (Power and AgentStart)", n)
	}

	// Once the hold ends, the loops can have the machine again.
	if err := w.FinishWithCause(t.Context(), "power off: found on, now off", nil); err != nil {
		t.Fatal(err)
	}
	if _, err := loop.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p")); err != nil {
		t.Errorf("agent start after the hold ended: %v", err)
	}
}

// TestHoldRefusals: Hold claims nothing it must not.
func TestHoldRefusals(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "cli", time.Minute)
	m := bmdbtest.AddMachine(t, db, s, "p")

	if _, err := s.Hold(t.Context(), bmdb.ProcessProviderUpdate, m, "x"); err == nil || !strings.Contains(err.Error(), "machine-exclusive") {
		t.Errorf("Hold for ProviderUpdate: %v, want an error: it does not act on the machine", err)
	}
	if _, err := s.Hold(t.Context(), bmdb.Process("Nap"), m, "x"); err == nil {
		t.Error("Hold for an unknown process succeeded")
	}
	unknown := uuid.New()
	if _, err := s.Hold(t.Context(), bmdb.ProcessPower, unknown, "x"); !errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("Hold of an unknown machine: %v, want ErrNotFound", err)
	}

	dead := bmdbtest.Session(t, db, "cli", time.Minute)
	db.Exec(t, "UPDATE sessions SET deadline = now() - interval '1 second' WHERE session_id = $1", dead.ID())
	if _, err := dead.Hold(t.Context(), bmdb.ProcessPower, m, "x"); !errors.Is(err, bmdb.ErrSessionExpired) {
		t.Errorf("Hold under a dead session: %v, want ErrSessionExpired", err)
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work_history"); n != 0 {
		t.Errorf("refused holds wrote %d history rows", n)
	}
}

// TestHoldExpiresDeadWork: a machine held by a session that died is free
// for Hold, which expires the dead work on the way, as Work does.
func TestHoldExpiresDeadWork(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	crashed := bmdbtest.Session(t, db, "recoverer", time.Minute)
	m := bmdbtest.AddMachine(t, db, crashed, "p")
	if _, err := crashed.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p")); err != nil {
		t.Fatal(err)
	}
	db.Exec(t, "UPDATE sessions SET deadline = now() - interval '1 second' WHERE session_id = $1", crashed.ID())

	cli := bmdbtest.Session(t, db, "cli", time.Minute)
	w, err := cli.Hold(t.Context(), bmdb.ProcessPower, m, "power cycle by alice@host")
	if err != nil {
		t.Fatalf("Hold of a machine a dead session held: %v", err)
	}
	host := bmdbtest.Scalar[string](t, db, "SELECT hostname || ', pid ' || pid FROM sessions WHERE session_id = $1", crashed.ID())
	deadline := bmdbtest.Scalar[time.Time](t, db, "SELECT deadline FROM sessions WHERE session_id = $1", crashed.ID())
	want := []string{
		"AgentStart Started",
		"AgentStart Expired session " + crashed.ID().String() + " (recoverer on " + host + ") expired: its lease ran out at " +
			deadline.UTC().Format(time.RFC3339) + " (the process stopped renewing it: it died, hung or lost the database)",
		"Power Started power cycle by alice@host",
	}
	if diff := cmp.Diff(want, bmdbtest.History(t, db, m)); diff != "" {
		t.Errorf("history (-want +got):\n%s", diff)
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work WHERE machine_id = $1", m); n != 1 {
		t.Errorf("%d work rows on the machine, want Power's only", n)
	}
	if err := w.Cancel(t.Context()); err != nil {
		t.Fatal(err)
	}
}

// TestHoldEnds: a hold ends Finished with its cause, or Failed with its
// cause and without a backoff, which would keep the operator out.
func TestHoldEnds(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "cli", time.Minute)
	m := bmdbtest.AddMachine(t, db, s, "p")

	w, err := s.Hold(t.Context(), bmdb.ProcessPower, m, "power cycle by alice@host")
	if err != nil {
		t.Fatal(err)
	}
	if err := w.FinishWithCause(t.Context(), "power cycle: found on, now on", nil); err != nil {
		t.Fatal(err)
	}
	if err := w.FailWithoutBackoff(t.Context(), "late"); !errors.Is(err, bmdb.ErrWorkEnded) {
		t.Errorf("ending a finished hold again: %v, want ErrWorkEnded", err)
	}
	w, err = s.Hold(t.Context(), bmdb.ProcessPower, m, "power off by bob@host")
	if err != nil {
		t.Fatalf("Hold after a finished hold: %v", err)
	}
	if err := w.FailWithoutBackoff(t.Context(), "power off: BMC refused the credentials (class auth)\x00"); err != nil {
		t.Fatal(err)
	}
	if _, err := db.GetBackoff(t.Context(), m, bmdb.ProcessPower); !errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("a failed hold left a backoff: %v", err)
	}
	// Nothing keeps the operator out after a failure.
	w, err = s.Hold(t.Context(), bmdb.ProcessPower, m, "power on by bob@host")
	if err != nil {
		t.Fatalf("Hold after a failed hold: %v", err)
	}
	if err := w.Finish(t.Context(), nil); err != nil {
		t.Fatal(err)
	}
	want := []string{
		"Power Started power cycle by alice@host",
		"Power Finished power cycle: found on, now on",
		"Power Started power off by bob@host",
		"Power Failed power off: BMC refused the credentials (class auth)",
		"Power Started power on by bob@host",
		"Power Finished",
	}
	got := bmdbtest.History(t, db, m)
	for i := range got {
		got[i] = strings.ReplaceAll(got[i], "\uFFFD", "")
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("history (-want +got):\n%s", diff)
	}
	if n := bmdbtest.Scalar[int64](t, db, "SELECT count(*) FROM work"); n != 0 {
		t.Errorf("%d work rows after every hold ended", n)
	}
}

// TestRecordPowerState: the machine detail carries the last look at the
// machine's power; a failed look keeps the last state read through the
// same BMC and says why it failed.
func TestRecordPowerState(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "cli", time.Minute)
	m := bmdbtest.AddMachine(t, db, s, "p")
	const bmc = "ipmi://admin@10.1.0.7:623"

	power := func() *bmdb.PowerStatus {
		t.Helper()
		d, err := db.GetMachine(t.Context(), m)
		if err != nil {
			t.Fatal(err)
		}
		return d.Power
	}
	if p := power(); p != nil {
		t.Fatalf("power state of a machine never checked: %+v", p)
	}
	record := func(r bmdb.PowerReading) {
		t.Helper()
		if err := db.RecordPowerState(t.Context(), m, r); err != nil {
			t.Fatal(err)
		}
	}
	type view struct {
		BMC, State, ErrorClass, Error string
		HasStateAt                    bool
	}
	check := func(step string, want view) *bmdb.PowerStatus {
		t.Helper()
		p := power()
		if p == nil {
			t.Fatalf("%s: no power state", step)
		}
		got := view{p.BMC, p.State, p.ErrorClass, p.Error, p.StateAt != nil}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("%s: power state (-want +got):\n%s", step, diff)
		}
		if time.Since(p.CheckedAt).Abs() > time.Minute {
			t.Errorf("%s: checked at %s, not now", step, p.CheckedAt)
		}
		return p
	}

	record(bmdb.PowerReading{BMC: bmc, State: bmdb.PowerOn})
	first := check("on", view{BMC: bmc, State: "on", HasStateAt: true})
	record(bmdb.PowerReading{BMC: bmc, ErrorClass: "auth", Error: "BMC refused the credentials"})
	p := check("failed check", view{BMC: bmc, State: "on", ErrorClass: "auth", Error: "BMC refused the credentials", HasStateAt: true})
	if !p.StateAt.Equal(*first.StateAt) || p.CheckedAt.Before(first.CheckedAt) {
		t.Errorf("a failed check moved the state's time (%s to %s) or not the check's (%s to %s)",
			first.StateAt, p.StateAt, first.CheckedAt, p.CheckedAt)
	}
	record(bmdb.PowerReading{BMC: bmc, State: bmdb.PowerOff})
	check("off", view{BMC: bmc, State: "off", HasStateAt: true})
	const other = "redfish://admin@10.1.0.8:443"
	record(bmdb.PowerReading{BMC: other, ErrorClass: "unreachable", Error: "no answer"})
	check("failed check through another BMC", view{BMC: other, ErrorClass: "unreachable", Error: "no answer"})

	for name, r := range map[string]bmdb.PowerReading{
		"no BMC":    {State: bmdb.PowerOn},
		"bad state": {BMC: bmc, State: "standby"},
	} {
		if err := db.RecordPowerState(t.Context(), m, r); err == nil {
			t.Errorf("%s: recorded %+v", name, r)
		}
	}
	if err := db.RecordPowerState(t.Context(), uuid.New(), bmdb.PowerReading{BMC: bmc, State: bmdb.PowerOn}); !errors.Is(err, bmdb.ErrNotFound) {
		t.Errorf("power state of an unknown machine: %v, want ErrNotFound", err)
	}
	check("after refused records", view{BMC: other, ErrorClass: "unreachable", Error: "no answer"})
}
