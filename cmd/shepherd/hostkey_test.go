package main

import (
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/sshtest"
)

// TestMachineHostKeyAccept accepts the host key a quarantined machine
// presented instead of its recorded one: refused without the exact
// fingerprint, and then the key is replaced, the machine a candidate
// again, and history says who replaced which key by which.
func TestMachineHostKeyAccept(t *testing.T) {
	db := bmdbtest.New(t)
	s := bmdbtest.Session(t, db, "initializer", time.Minute)
	m := bmdbtest.AddMachine(t, db, s, "p")
	old, offered := sshtest.NewKey(t).PublicKey(), sshtest.NewKey(t).PublicKey()
	if _, _, err := db.RecordHostKey(t.Context(), m, old.Marshal(), false); err != nil {
		t.Fatal(err)
	}
	if got := quarantine(t, db, s, "p"); got != m {
		t.Fatalf("claimed %s, want %s", got, m)
	}
	fp := ssh.FingerprintSHA256(offered)
	before := historyCount(t, db)
	if _, err := run(t, "machine", "host-key", "accept", m.String(), "--fingerprint", fp, "--database-url", db.URL); err == nil ||
		!strings.Contains(err.Error(), "no SSH host key other than") {
		t.Errorf("accept before any key was presented: %v", err)
	}
	if _, err := db.OfferHostKey(t.Context(), m, offered.Marshal()); err != nil {
		t.Fatal(err)
	}

	out, err := run(t, "machine", "show", m.String(), "--database-url", db.URL)
	want := "shepherd machine host-key accept " + m.String() + " --fingerprint " + fp
	if err != nil || !strings.Contains(out, "Presented instead") || !strings.Contains(out, want) {
		t.Errorf("machine show does not name the presented key and %q: %v\n%s", want, err, out)
	}
	out, err = run(t, "machine", "show", m.String(), "--output", "json", "--database-url", db.URL)
	var js machineDetailJSON
	if err != nil || json.Unmarshal([]byte(out), &js) != nil || js.HostKey == nil || js.HostKey.Offered == nil ||
		js.HostKey.Offered.Fingerprint != fp || js.HostKey.Offered.Accept != want {
		t.Errorf("machine show --output json: %v\n%s", err, out)
	}

	other, unknown, keyless := ssh.FingerprintSHA256(sshtest.NewKey(t).PublicKey()), uuid.NewString(), bmdbtest.AddMachine(t, db, s, "p").String()
	presented := "machine " + m.String() + ": bmdb: the SSH host key the machine presented has another fingerprint: it presented " + fp + ", not "
	for name, c := range map[string]struct {
		args []string
		want string // in the error the operator is shown
	}{
		"no fingerprint":    {[]string{"machine", "host-key", "accept", m.String()}, "--fingerprint is required"},
		"not a fingerprint": {[]string{"machine", "host-key", "accept", m.String(), "--fingerprint", "MD5:00:11"}, `--fingerprint "MD5:00:11" is not an SSH key's SHA-256 fingerprint`},
		"another fingerprint": {[]string{"machine", "host-key", "accept", m.String(), "--fingerprint", other},
			presented + other + "; nothing changed: check the key it presents now (shepherd machine show " + m.String() + ")"},
		"the recorded key's": {[]string{"machine", "host-key", "accept", m.String(), "--fingerprint", ssh.FingerprintSHA256(old)},
			presented + ssh.FingerprintSHA256(old) + "; nothing changed"},
		"not a uuid":            {[]string{"machine", "host-key", "accept", "m-1", "--fingerprint", fp}, `no machine has the id or provider id "m-1"`},
		"unknown machine":       {[]string{"machine", "host-key", "accept", unknown, "--fingerprint", fp}, "machine " + unknown + " does not exist"},
		"machine without a key": {[]string{"machine", "host-key", "accept", keyless, "--fingerprint", fp}, "machine " + keyless + " has no SSH host key recorded: there is nothing to replace"},
	} {
		out, err := run(t, append(c.args, "--database-url", db.URL)...)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error saying %q\n%s", name, err, c.want, out)
		}
	}
	if n := historyCount(t, db); n != before {
		t.Fatalf("refused accepts wrote %d history rows", n-before)
	}
	if key, _, _ := db.HostKey(t.Context(), m); string(key) != string(old.Marshal()) {
		t.Fatal("a refused accept changed the recorded key")
	}

	out, err = run(t, "machine", "host-key", "accept", m.String(), "--fingerprint", fp, "--reason", "reinstalled, checked on the console", "--database-url", db.URL)
	if err != nil || !strings.Contains(out, ssh.FingerprintSHA256(old)+" replaced by "+fp) {
		t.Fatalf("machine host-key accept: %v\n%s", err, out)
	}
	if key, pinned, err := db.HostKey(t.Context(), m); err != nil || string(key) != string(offered.Marshal()) || pinned {
		t.Errorf("after the accept the key is %x pinned %v (%v), want the accepted key", key, pinned, err)
	}
	ids, err := db.ListCandidates(t.Context(), bmdb.ProcessAgentStart, bmdb.AgentStartCandidates("p"), 10)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(ids, m) {
		t.Errorf("after the accept the quarantined machine is no candidate: %v", ids)
	}
	events, err := db.History(t.Context(), bmdb.HistoryFilter{MachineID: m, Process: bmdb.ProcessAgentStart})
	if err != nil {
		t.Fatal(err)
	}
	last := events[len(events)-1]
	if last.Event != bmdb.EventReset || !strings.Contains(last.Cause, "shepherd CLI") || !strings.Contains(last.Cause, "reinstalled, checked on the console") ||
		!strings.Contains(last.Cause, ssh.FingerprintSHA256(old)+" replaced by "+fp) {
		t.Errorf("last history row %+v, want Reset naming both keys, the CLI and the reason", last)
	}
}
