package sshx

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"os"
	"os/exec"
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

// TestCreatedKeyIsOpenSSHs: the key Shepherd creates is one OpenSSH's own
// ssh-keygen reads, and its .pub is the authorized_keys line of that key.
func TestCreatedKeyIsOpenSSHs(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "ssh_key")
	signer, err := LoadOrCreateKey(path)
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("ssh-keygen", "-y", "-f", path).CombinedOutput()
	if err != nil {
		t.Fatalf("ssh-keygen -y -f %s: %v: %s", path, err, out)
	}
	pub, err := os.ReadFile(path + ".pub")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := keyPart(string(out)), keyPart(string(pub)); got != want || want == "" {
		t.Errorf("ssh-keygen reads the key as %q, the .pub says %q", got, want)
	}
	if string(pub) != authorizedKey(signer.PublicKey()) {
		t.Errorf(".pub is %q, want %q", pub, authorizedKey(signer.PublicKey()))
	}
	if !strings.HasSuffix(strings.TrimSpace(string(pub)), " "+keyComment()) || !strings.HasPrefix(keyComment(), "shepherd") {
		t.Errorf(".pub %q does not end in the comment %q", pub, keyComment())
	}
	if fi, err := os.Stat(path + ".pub"); err != nil || fi.Mode() != 0o644 {
		t.Errorf(".pub mode %v (%v), want 0644", fi.Mode(), err)
	}
	// ssh-keygen -l reads the .pub: it is a valid public key file.
	if out, err := exec.Command("ssh-keygen", "-l", "-f", path+".pub").CombinedOutput(); err != nil {
		t.Errorf("ssh-keygen -l -f %s.pub: %v: %s", path, err, out)
	}
}

// TestOldKeyGetsItsPub: a key an older Shepherd wrote (PKCS#8 PEM, no .pub)
// still loads, unchanged, and gets its .pub; a .pub naming another key is
// replaced, one naming this key (any comment) is left alone.
func TestOldKeyGetsItsPub(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "ssh_key")
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalPKCS8PrivateKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	old := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})
	if err := os.WriteFile(path, old, 0o600); err != nil {
		t.Fatal(err)
	}
	signer, err := LoadOrCreateKey(path)
	if err != nil {
		t.Fatal(err)
	}
	want, err := ssh.NewPublicKey(priv.Public())
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(signer.PublicKey().Marshal(), want.Marshal()) {
		t.Fatal("loaded another key than the one in the file")
	}
	if data, _ := os.ReadFile(path); !bytes.Equal(data, old) {
		t.Error("the old key file was rewritten")
	}
	if pub, err := os.ReadFile(path + ".pub"); err != nil || string(pub) != authorizedKey(want) {
		t.Errorf(".pub = %q, %v; want %q", pub, err, authorizedKey(want))
	}

	other := sshtestKey(t)
	if err := os.WriteFile(path+".pub", ssh.MarshalAuthorizedKey(other), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadOrCreateKey(path); err != nil {
		t.Fatal(err)
	}
	if pub, _ := os.ReadFile(path + ".pub"); string(pub) != authorizedKey(want) {
		t.Errorf("a .pub of another key was kept: %q", pub)
	}
	mine := strings.TrimSpace(string(ssh.MarshalAuthorizedKey(want))) + " my own comment\n"
	if err := os.WriteFile(path+".pub", []byte(mine), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadOrCreateKey(path); err != nil {
		t.Fatal(err)
	}
	if pub, _ := os.ReadFile(path + ".pub"); string(pub) != mine {
		t.Errorf("a .pub of this key was rewritten: %q", pub)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 2 {
		t.Errorf("the directory holds %d files, want the key and its .pub (no temporary files)", len(entries))
	}
}

func sshtestKey(t *testing.T) ssh.PublicKey {
	t.Helper()
	pub, _, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	k, err := ssh.NewPublicKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// keyPart is the type and key of an authorized_keys line, without the
// comment.
func keyPart(line string) string {
	f := strings.Fields(line)
	if len(f) < 2 {
		return ""
	}
	return f[0] + " " + f[1]
}
