package sshx

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/crypto/ssh"
)

// TestLoadOrCreateKey creates Shepherd's client key where none is, with a
// directory and a file only its owner can read, and loads the same key
// from it afterwards.
func TestLoadOrCreateKey(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "new", "dir", "ssh_key")
	created, err := LoadOrCreateKey(path)
	if err != nil {
		t.Fatalf("creating %s: %v", path, err)
	}
	if created.PublicKey().Type() != ssh.KeyAlgoED25519 {
		t.Errorf("created a %s key, want ed25519", created.PublicKey().Type())
	}
	for p, want := range map[string]os.FileMode{path: 0o600, filepath.Dir(path): 0o700 | os.ModeDir} {
		if fi, err := os.Stat(p); err != nil || fi.Mode() != want {
			t.Errorf("%s: mode %v (%v), want %v", p, fi.Mode(), err, want)
		}
	}
	loaded, err := LoadOrCreateKey(path)
	if err != nil {
		t.Fatalf("loading %s: %v", path, err)
	}
	if string(loaded.PublicKey().Marshal()) != string(created.PublicKey().Marshal()) {
		t.Errorf("loaded %s, want the key created there, %s", Describe(loaded.PublicKey()), Describe(created.PublicKey()))
	}
}

// TestLoadOrCreateKeyErrors: a key that cannot be read, parsed or created
// is an error that names the file, and nothing is written over it.
func TestLoadOrCreateKeyErrors(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	garbage := write("garbage", "not a key\n")
	notDir := write("file", "")
	dangling, danglingDir := filepath.Join(dir, "dangling"), filepath.Join(dir, "dangling-dir")
	if err := os.Symlink(filepath.Join(dir, "nowhere", "key"), dangling); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(dir, "nowhere"), danglingDir); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, path, want string
	}{
		{"not a key", garbage, "parsing SSH key " + garbage + ": "},
		{"a directory", dir, "reading SSH key " + dir + ": "},
		{"under a file", filepath.Join(notDir, "key"), "reading SSH key " + filepath.Join(notDir, "key") + ": "},
		// The links' targets do not exist, so there is no key to read,
		// but neither a directory nor a key is created through a link.
		{"a dangling link", dangling, "creating SSH key " + dangling + ": "},
		{"under a dangling link", filepath.Join(danglingDir, "key"), "creating SSH key " + filepath.Join(danglingDir, "key") + ": "},
	} {
		if _, err := LoadOrCreateKey(tc.path); err == nil || !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error beginning %q", tc.name, err, tc.want)
		}
	}
	if data, err := os.ReadFile(garbage); err != nil || string(data) != "not a key\n" {
		t.Errorf("the unparsable key was changed: %q, %v", data, err)
	}
	if _, err := os.Lstat(filepath.Join(dir, "nowhere")); !os.IsNotExist(err) {
		t.Errorf("a key was created through the dangling link: %v", err)
	}
}
