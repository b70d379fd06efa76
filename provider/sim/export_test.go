package sim

import (
	"os"
	"path/filepath"
	"slices"
)

// DiskPath returns the file that is machine id's simulated block device
// dev (such as "nvme0n1"), and whether an installation created it.
func (f *Fleet) DiskPath(id, dev string) (string, bool) {
	i, ok := f.index(id)
	if !ok || !slices.Contains(simDisks, dev) {
		return "", false
	}
	f.mu.Lock()
	root := f.disks
	f.mu.Unlock()
	if root == "" {
		return "", false
	}
	p := filepath.Join(root, f.id(i), dev)
	if _, err := os.Stat(p); err != nil {
		return "", false
	}
	return p, true
}
