// Package atomicfile writes files so that a reader sees the old content or
// the new, never a part, and the new file has exactly the mode asked for.
package atomicfile

import (
	"fmt"
	"os"
	"path/filepath"
)

// Write replaces path with data and mode perm: it writes a temporary file in
// the same directory, sets its mode, syncs it, renames it over path and syncs
// the directory. Unlike os.WriteFile, an existing file's mode does not
// survive (a secret written 0600 over a 0644 file is 0600), a crash leaves
// the old file whole, and once Write returns nil the new content survives a
// crash (the agent's installation state relies on it).
func Write(path string, data []byte, perm os.FileMode) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	tmp := f.Name()
	// Chmod before the data: a secret is never readable under the temporary
	// name with a wider mode.
	err = f.Chmod(perm)
	if err == nil {
		_, err = f.Write(data)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("writing %s: %w", path, err)
	}
	if err := SyncDir(filepath.Dir(path)); err != nil {
		return fmt.Errorf("writing %s: %w", path, err)
	}
	return nil
}

// SyncDir makes the entries of dir (a rename, a removal) durable.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("syncing directory %s: %w", dir, err)
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("syncing directory %s: %w", dir, err)
	}
	return nil
}
