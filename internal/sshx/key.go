package sshx

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/shepherd/shepherd/internal/atomicfile"
	"golang.org/x/crypto/ssh"
)

// LoadOrCreateKey loads the SSH client key from path (PEM: OpenSSH, PKCS#8
// or PKCS#1), or creates an ed25519 key there in OpenSSH's format with mode
// 0600 if the file does not exist, so that OpenSSH's own tools read it
// (ssh-keygen -y -f path). Either way it makes sure path+".pub" holds the
// key's authorized_keys line (authorizedKey), writing it when it is missing
// or names another key: a key created by an older Shepherd, in PKCS#8, gets
// its .pub on the first load.
func LoadOrCreateKey(path string) (ssh.Signer, error) {
	signer, err := loadOrCreate(path)
	if err != nil {
		return nil, err
	}
	if err := ensurePublicKey(path+".pub", signer.PublicKey()); err != nil {
		return nil, err
	}
	return signer, nil
}

func loadOrCreate(path string) (ssh.Signer, error) {
	data, err := os.ReadFile(path)
	if err == nil {
		signer, err := ssh.ParsePrivateKey(data)
		if err != nil {
			return nil, fmt.Errorf("parsing SSH key %s: %w", path, err)
		}
		return signer, nil
	}
	if !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("reading SSH key %s: %w", path, err)
	}
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, err
	}
	block, err := ssh.MarshalPrivateKey(priv, keyComment())
	if err != nil {
		return nil, fmt.Errorf("encoding SSH key %s: %w", path, err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("creating SSH key %s: %w", path, err)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, fmt.Errorf("creating SSH key %s: %w", path, err)
	}
	if _, err := f.Write(pem.EncodeToMemory(block)); err != nil {
		f.Close()
		return nil, fmt.Errorf("writing SSH key %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return nil, fmt.Errorf("writing SSH key %s: %w", path, err)
	}
	return ssh.NewSignerFromKey(priv)
}

// keyComment is the comment of the keys Shepherd creates and of their
// authorized_keys lines: shepherd@ and the host name, so that an operator
// reading a machine's authorized_keys sees whose key it is.
func keyComment() string {
	h, err := os.Hostname()
	if err != nil || h == "" {
		return "shepherd"
	}
	return "shepherd@" + h
}

// authorizedKey returns pub's line for an authorized_keys file, with
// keyComment as its comment, ending in a newline.
func authorizedKey(pub ssh.PublicKey) string {
	return strings.TrimSuffix(string(ssh.MarshalAuthorizedKey(pub)), "\n") + " " + keyComment() + "\n"
}

// ensurePublicKey writes pub's authorized_keys line to path unless path
// holds a line for that key already (with any comment). It writes a
// temporary file and renames it, so a reader never sees half a line.
func ensurePublicKey(path string, pub ssh.PublicKey) error {
	if data, err := os.ReadFile(path); err == nil {
		if have, _, _, _, err := ssh.ParseAuthorizedKey(data); err == nil && bytes.Equal(have.Marshal(), pub.Marshal()) {
			return nil
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("reading SSH public key %s: %w", path, err)
	}
	if err := atomicfile.Write(path, []byte(authorizedKey(pub)), 0o644); err != nil {
		return fmt.Errorf("writing SSH public key: %w", err)
	}
	return nil
}
