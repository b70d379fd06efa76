package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestSSHKeyCommand: shepherd ssh-key prints the .pub line of the key in
// --data-dir, creating the key as shepherd run would; OpenSSH's ssh-keygen
// reads the key and derives the same public key.
func TestSSHKeyCommand(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data")
	out, err := run(t, "ssh-key", "--data-dir", dir)
	if err != nil {
		t.Fatalf("ssh-key: %v\n%s", err, out)
	}
	key := filepath.Join(dir, "ssh_key")
	pub, err := os.ReadFile(key + ".pub")
	if err != nil {
		t.Fatal(err)
	}
	if want := "created the SSH key " + key + "\n" + string(pub); out != want {
		t.Errorf("first ssh-key printed %q, want %q", out, want)
	}
	if !strings.HasPrefix(string(pub), "ssh-ed25519 ") || !strings.Contains(string(pub), " shepherd") {
		t.Errorf(".pub %q is no ed25519 authorized_keys line with Shepherd's comment", pub)
	}
	derived, err := exec.Command("ssh-keygen", "-y", "-f", key).Output()
	if err != nil {
		t.Fatalf("ssh-keygen -y -f %s: %v", key, err)
	}
	if got, want := strings.Fields(string(derived))[:2], strings.Fields(string(pub))[:2]; got[0] != want[0] || got[1] != want[1] {
		t.Errorf("ssh-keygen derives %v, the .pub holds %v", got, want)
	}
	again, err := run(t, "ssh-key", "--data-dir", dir)
	if err != nil || again != string(pub) {
		t.Errorf("second ssh-key printed %q (%v), want the .pub line %q alone", again, err, pub)
	}

	if _, err := run(t, "ssh-key"); err == nil || !strings.Contains(err.Error(), "--data-dir is required") {
		t.Errorf("ssh-key without --data-dir: %v", err)
	}
	if _, err := run(t, "ssh-key", "--dev", "--data-dir", dir); err == nil || !strings.Contains(err.Error(), "exclusive") {
		t.Errorf("ssh-key --dev --data-dir: %v", err)
	}
	garbage := filepath.Join(t.TempDir(), "ssh_key")
	if err := os.WriteFile(garbage, []byte("not a key\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := run(t, "ssh-key", "--data-dir", filepath.Dir(garbage)); err == nil || !strings.Contains(err.Error(), garbage) {
		t.Errorf("ssh-key over an unreadable key: %v, want an error naming %s", err, garbage)
	}
}
