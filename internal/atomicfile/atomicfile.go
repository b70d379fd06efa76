// Package atomicfile writes files so that a reader sees the old content or
// the new, never a part, and the new file has exactly the mode asked for.
package atomicfile

import (
	"fmt"
	"os"
	"path/filepath"
)

// Write replaces path with data and mode perm: it writes a temporary file in
// the same directory, sets its mode, syncs it and renames it over path. Unlike
// os.WriteFile, an existing file's mode does not survive (a secret written
// 0600 over a 0644 file is 0600), and a crash leaves the old file whole.
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
	return nil
}
