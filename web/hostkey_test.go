package web_test

import (
	"html"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/internal/sshtest"
	"github.com/shepherd/shepherd/web"
)

var fingerprintField = regexp.MustCompile(`name="fingerprint" value="([^"]+)"`)

// TestHostKeyAcceptAction accepts, through the confirmation page, the host
// key the quarantined machine presented instead of its recorded one: the
// page shows both keys, a key presented since the page was shown is not
// accepted, and the accepted one replaces the recorded key and clears the
// quarantine, with history naming the web UI.
func TestHostKeyAcceptAction(t *testing.T) {
	t.Parallel()
	f := newFleet(t)
	s := newServer(t, f.db.DB, web.Config{Actions: true, OperatorToken: mustToken(t)})
	ctx := t.Context()
	q := f.quarantined
	path := "/machines/" + q.String() + "/host-key"
	old, offered, later := sshtest.NewKey(t).PublicKey(), sshtest.NewKey(t).PublicKey(), sshtest.NewKey(t).PublicKey()
	if _, _, err := f.db.RecordHostKey(ctx, q, old.Marshal(), false); err != nil {
		t.Fatal(err)
	}
	if resp, _ := s.do(t, http.MethodGet, path, nil); resp.StatusCode != http.StatusNotFound {
		t.Errorf("confirmation page with no key presented: %s, want 404", resp.Status)
	}
	if page := s.get(t, "/machines/"+q.String()); strings.Contains(page, path) {
		t.Error("the machine page offers to accept a key though none was presented")
	}
	if _, err := f.db.OfferHostKey(ctx, q, offered.Marshal()); err != nil {
		t.Fatal(err)
	}
	// html/template writes "+", which fingerprints hold, as "&#43;".
	page := html.UnescapeString(s.get(t, "/machines/"+q.String()))
	if !strings.Contains(page, `href="`+path+`"`) || !strings.Contains(page, ssh.FingerprintSHA256(offered)) ||
		!strings.Contains(page, bmdb.AcceptHostKeyCommand(q, ssh.FingerprintSHA256(offered))) {
		t.Errorf("the machine page does not show the presented key, the accept action and the command:\n%s", page)
	}
	if ro := newServer(t, f.db.DB, web.Config{}).get(t, "/machines/"+q.String()); strings.Contains(ro, `href="`+path+`"`) {
		t.Error("the read-only machine page links the accept action")
	}
	confirm := html.UnescapeString(s.get(t, path))
	if !strings.Contains(confirm, ssh.FingerprintSHA256(old)) || !strings.Contains(confirm, ssh.FingerprintSHA256(offered)) {
		t.Errorf("the confirmation page does not show both keys:\n%s", confirm)
	}
	csrf := s.confirmForm(t, path)
	fp := fingerprintField.FindStringSubmatch(confirm)
	if fp == nil || fp[1] != ssh.FingerprintSHA256(offered) {
		t.Fatalf("the form carries fingerprint %v, want the presented key's", fp)
	}
	form := url.Values{"csrf": {csrf}, "token": {operatorToken}, "fingerprint": {fp[1]}, "reason": {"reinstalled"}}

	if resp, _ := s.do(t, http.MethodPost, path, url.Values{"csrf": {csrf}, "token": {"wrong-" + operatorToken}, "fingerprint": {fp[1]}}); resp.StatusCode != http.StatusForbidden {
		t.Errorf("wrong token: %s, want 403", resp.Status)
	}
	// The machine presents yet another key before the operator confirms.
	if _, err := f.db.OfferHostKey(ctx, q, later.Marshal()); err != nil {
		t.Fatal(err)
	}
	resp, body := s.do(t, http.MethodPost, path, form)
	if resp.StatusCode != http.StatusConflict || !strings.Contains(html.UnescapeString(body), ssh.FingerprintSHA256(later)) {
		t.Errorf("accepting a key no longer presented: %s, want 409 showing the new key:\n%s", resp.Status, body)
	}
	if key, _, _ := f.db.HostKey(ctx, q); string(key) != string(old.Marshal()) {
		t.Fatal("a refused accept changed the recorded key")
	}

	form.Set("fingerprint", ssh.FingerprintSHA256(later))
	resp, body = s.do(t, http.MethodPost, path, form)
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/machines/"+q.String()+"?done=host-key" {
		t.Fatalf("accept: %s (Location %q), want 303 to the machine page:\n%s", resp.Status, resp.Header.Get("Location"), body)
	}
	if key, pinned, err := f.db.HostKey(ctx, q); err != nil || string(key) != string(later.Marshal()) || pinned {
		t.Errorf("after the accept the key is %x (pinned %v, %v), want the accepted one", key, pinned, err)
	}
	if b, err := backoff(t, f.db, q); err == nil {
		t.Errorf("after the accept the quarantine is still there: %+v", b)
	}
	hist, err := f.db.History(ctx, bmdb.HistoryFilter{MachineID: q, Process: bmdb.ProcessAgentStart})
	if err != nil {
		t.Fatal(err)
	}
	if last := hist[len(hist)-1]; last.Event != bmdb.EventReset || !strings.Contains(last.Cause, "web UI") || !strings.Contains(last.Cause, "reinstalled") ||
		!strings.Contains(last.Cause, ssh.FingerprintSHA256(later)) {
		t.Errorf("last history row %+v, want Reset by the web UI naming the key", last)
	}
	if page := s.get(t, "/machines/"+q.String()+"?done=host-key"); !strings.Contains(page, "SSH host key accepted") {
		t.Error("the machine page does not confirm the accept")
	}
	if resp, _ := s.do(t, http.MethodPost, path, form); resp.StatusCode != http.StatusNotFound {
		t.Errorf("accepting again: %s, want 404", resp.Status)
	}
}
