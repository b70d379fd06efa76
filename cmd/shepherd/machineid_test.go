package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

// TestMachineByProviderID: every command that takes a machine takes its
// provider id as well as its UUID, provider/id where two providers have
// the id, and a provider id that is itself a UUID (Equinix's devices); an
// id at two providers, or at none, is refused with what to do.
func TestMachineByProviderID(t *testing.T) {
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "initializer", time.Minute)
	named := func(provider, pid string) uuid.UUID {
		t.Helper()
		id := bmdbtest.AddMachine(t, db, s, provider)
		db.Exec(t, "UPDATE machine_provided SET provider_id = $1 WHERE machine_id = $2", pid, id)
		return id
	}
	m3 := named("static", "m3")
	m3lab := named("lab", "m3")
	m7 := named("static", "rack/m7")
	device := uuid.New()
	dev := named("equinix", device.String())
	gone := named("static", "old1")
	if err := s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		_, err := tx.Decommission(ctx, gone, false)
		return err
	}); err != nil {
		t.Fatal(err)
	}

	resolve := func(arg string) (uuid.UUID, error) {
		return resolveMachine(t.Context(), db.DB, arg)
	}
	for arg, want := range map[string]uuid.UUID{
		m3.String():                  m3,
		"static/m3":                  m3,
		"lab/m3":                     m3lab,
		"rack/m7":                    m7, // a provider id with a slash
		"static/rack/m7":             m7,
		device.String():              dev,
		"equinix/" + device.String(): dev,
		"old1":                       gone, // decommissioned machines keep their provider id
	} {
		if got, err := resolve(arg); err != nil || got != want {
			t.Errorf("resolveMachine(%q) = %s, %v; want %s", arg, got, err, want)
		}
	}
	unknown := uuid.New()
	if got, err := resolve(unknown.String()); err != nil || got != unknown {
		t.Errorf("an unknown UUID resolves to %s, %v; want itself (the command says it does not exist)", got, err)
	}
	_, err := resolve("m3")
	for _, want := range []string{`"m3" names 2 machines`, "lab/m3 (machine " + m3lab.String() + ")",
		"static/m3 (machine " + m3.String() + ")", "name one as provider/id or by its machine id"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ambiguous m3: %v, want an error saying %q", err, want)
		}
	}
	for _, arg := range []string{"m9", "other/m3", "static/", "/m3", "bad\x00id"} {
		if _, err := resolve(arg); err == nil || !strings.Contains(err.Error(), "no machine has the id or provider id") {
			t.Errorf("resolveMachine(%q): %v, want no machine", arg, err)
		}
	}

	// Each command, given a provider id, acts on that machine.
	w, err := s.Work(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("static"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.Fail(t.Context(), bmdb.BackoffPolicy{Initial: time.Hour}, "ssh: connection refused"); err != nil {
		t.Fatal(err)
	}
	failed := map[uuid.UUID]string{m3: "static/m3", m7: "rack/m7"}[w.MachineID]
	if failed == "" {
		t.Fatalf("the initializer claimed %s, want m3 or rack/m7", w.MachineID)
	}
	url := "--database-url=" + db.URL
	for _, c := range []struct {
		args []string
		want string // in the output, or in the error
	}{
		{[]string{"machine", "show", "static/m3", "-o", "json"}, `"machine_id": "` + m3.String() + `"`},
		{[]string{"machine", "show", "old1"}, gone.String()},
		{[]string{"machine", "history", failed}, "ssh: connection refused"},
		{[]string{"machine", "reset", failed, "--process", "AgentStart"}, "machine " + w.MachineID.String() + ": cleared the AgentStart backoff"},
		{[]string{"machine", "host-key", "accept", "rack/m7", "--fingerprint", "SHA256:" + strings.Repeat("A", 43)}, "machine " + m7.String() + " has no SSH host key recorded"},
		{[]string{"machine", "decommission", "lab/m3", "--reason", "rack move", "--yes"}, "machine " + m3lab.String()},
		{[]string{"install", "request", "--machine", device.String(), "--image-url", "https://img.example/os.img",
			"--sha256", strings.Repeat("ab", 32), "--target-device", "/dev/sda"}, "on machine " + dev.String()},
		{[]string{"install", "status", "--machine", "equinix/" + device.String()}, "machine " + dev.String() + ": generation 1"},
		{[]string{"machine", "show", "m3"}, `"m3" names 2 machines`},
		{[]string{"machine", "history", "m9"}, `no machine has the id or provider id "m9"`},
	} {
		out, err := run(t, append(c.args, url)...)
		if got := out + errText(err); !strings.Contains(got, c.want) {
			t.Errorf("%v: %v\n%s\nwant %q", c.args, err, out, c.want)
		}
	}
	if d, err := db.GetMachine(t.Context(), m3lab); err != nil || d.DecommissionRequested == nil {
		t.Errorf("lab/m3 was not asked to decommission: %+v, %v", d.DecommissionRequested, err)
	}
	if d, err := db.GetMachine(t.Context(), m3); err != nil || d.DecommissionRequested != nil {
		t.Errorf("static/m3 was asked to decommission: %v", err)
	}
}

// errText is err's text, or "" for nil.
func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

// TestReasonIsBounded: an operator's --reason longer than maxReason is
// refused, naming the flag, before anything is opened or changed.
func TestReasonIsBounded(t *testing.T) {
	long := strings.Repeat("why ", maxReason/4+1)
	for _, args := range [][]string{
		{"machine", "decommission", "m3", "--yes", "--reason", long},
		{"machine", "host-key", "accept", "m3", "--fingerprint", "SHA256:" + strings.Repeat("A", 43), "--reason", long},
	} {
		// No database at this address: the refusal comes first.
		_, err := run(t, append(args, "--database-url=postgres://nobody@127.0.0.1:1/none")...)
		if want := fmt.Sprintf("--reason is %d bytes, at most %d", len(strings.TrimSpace(long)), maxReason); errText(err) != want {
			t.Errorf("%v: %v, want %q", args[:2], err, want)
		}
	}
}
