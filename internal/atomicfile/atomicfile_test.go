package atomicfile_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/shepherd/shepherd/internal/atomicfile"
)

// TestWriteReplacesContentAndMode writes over a file of another mode: the content
// and the mode are the new ones, and no temporary file is left.
func TestWriteReplacesContentAndMode(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "token")
	if err := os.WriteFile(path, []byte("old"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := atomicfile.Write(path, []byte("new"), 0o640); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(path); err != nil || string(got) != "new" {
		t.Errorf("content %q (%v), want new", got, err)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o640 {
		t.Errorf("mode %v (%v), want 0640 (neither the old file's nor the temporary file's)", fi.Mode().Perm(), err)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 1 {
		t.Errorf("%d files in the directory, want only the written one", len(entries))
	}
}

// TestWriteFailureLeavesNothing: a write into a missing directory fails,
// naming the path.
func TestWriteFailureLeavesNothing(t *testing.T) {
	path := filepath.Join(t.TempDir(), "missing", "f")
	err := atomicfile.Write(path, []byte("x"), 0o600)
	if err == nil || !strings.Contains(err.Error(), path) {
		t.Errorf("Write into a missing directory: %v, want an error naming %s", err, path)
	}
}
