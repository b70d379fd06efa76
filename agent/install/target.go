package install

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// target is an installation target that passed checkTarget: an existing
// block device, or a regular file under one of Config.FileTargetDirs.
type target struct {
	name string // as the request gave it (target_device)
	path string // name with every symlink resolved: what gets written
	// f is the open target. A block device is opened for reading and
	// writing when it is checked (exclusively, on Linux) and held until
	// the installation ends, so that nothing can mount or claim it during
	// the download and what is written is the device that was checked. A
	// file is opened only to be written (openForWriting).
	f *os.File
	// size is the block device's size in bytes; -1 for a file, which
	// grows to the image's size.
	size int64
	// file is the checked regular file (nil if it is to be created), to
	// make sure the file written is the one checked.
	file fs.FileInfo
}

// String names the target as the request did and, when symlinks lead
// elsewhere, what it resolves to.
func (t *target) String() string {
	return describeTarget(t.name, t.path)
}

// describeTarget names a target for messages: "/dev/sda", or
// "/dev/disk/by-id/x (-> /dev/sdb)" for a symlink.
func describeTarget(name, path string) string {
	if path == "" || path == name {
		return name
	}
	return name + " (-> " + path + ")"
}

// targetError is the error of a target that failed its check.
func targetError(name, path, format string, args ...any) error {
	return fmt.Errorf("checking target %s: "+format, append([]any{describeTarget(name, path)}, args...)...)
}

// checkTarget resolves name and checks, before anything is downloaded, that
// it is something an image may be written to: an existing block device
// that is neither mounted nor in use, or a regular file (existing or to
// be created) under one of fileDirs. It never creates or changes anything.
// A block device is returned open (see target.f); the caller must call
// close.
func checkTarget(name string, fileDirs []string) (*target, error) {
	path, err := filepath.EvalSymlinks(name)
	if errors.Is(err, fs.ErrNotExist) {
		return checkNewFile(name, fileDirs)
	}
	if err != nil {
		return nil, targetError(name, "", "resolving it: %w", err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		return nil, targetError(name, path, "%w", err)
	}
	switch mode := fi.Mode(); {
	case mode.Type() == fs.ModeDevice: // a block device: ModeCharDevice is not set
		return openDevice(name, path, fi)
	case mode.IsRegular():
		if !underFileDir(path, fileDirs) {
			return nil, targetError(name, path, "it is a regular file, not a block device; %s", fileDirsHint(fileDirs))
		}
		return &target{name: name, path: path, size: -1, file: fi}, nil
	default:
		return nil, targetError(name, path, "it is a %s, not a block device", modeName(mode))
	}
}

// checkNewFile checks a target that does not exist: refused, unless it is
// a file to be created directly in (or below) one of fileDirs.
func checkNewFile(name string, fileDirs []string) (*target, error) {
	if fi, err := os.Lstat(name); err == nil && fi.Mode().Type() == fs.ModeSymlink {
		dest, _ := os.Readlink(name)
		return nil, targetError(name, "", "it is a symlink to %s, which does not exist (a disk that is gone?)", dest)
	}
	const msg = "a target must be an existing block device, and the agent never creates one"
	dir, err := filepath.EvalSymlinks(filepath.Dir(name))
	if err != nil {
		return nil, targetError(name, "", "neither it nor its directory exists; %s", msg)
	}
	path := filepath.Join(dir, filepath.Base(name))
	if underFileDir(path, fileDirs) {
		return &target{name: name, path: path, size: -1}, nil
	}
	if len(fileDirs) > 0 {
		return nil, targetError(name, "", "it does not exist; %s (%s)", msg, fileDirsHint(fileDirs))
	}
	return nil, targetError(name, "", "it does not exist; %s", msg)
}

// fileDirsHint says where regular files may be written, for the error of a
// file target that is not allowed.
func fileDirsHint(fileDirs []string) string {
	if len(fileDirs) == 0 {
		return "this agent writes no files (it was started without --allow-file-target-dir)"
	}
	return "this agent writes files only under " + strings.Join(fileDirs, ", ")
}

// underFileDir reports whether path (resolved) lies under one of
// fileDirs. The directories are resolved too, so that a symlinked
// temporary directory still matches.
func underFileDir(path string, fileDirs []string) bool {
	for _, dir := range fileDirs {
		resolved, err := filepath.EvalSymlinks(dir)
		if err != nil {
			continue // Validate saw it exist; gone since: allows nothing
		}
		if rel, err := filepath.Rel(resolved, path); err == nil && rel != "." && filepath.IsLocal(rel) {
			return true
		}
	}
	return false
}

// modeName names a file type for messages.
func modeName(mode fs.FileMode) string {
	switch mode.Type() {
	case fs.ModeDir:
		return "directory"
	case fs.ModeDevice | fs.ModeCharDevice:
		return "character device"
	case fs.ModeNamedPipe:
		return "named pipe"
	case fs.ModeSocket:
		return "socket"
	}
	return "file of type " + mode.Type().String()
}

// openDevice checks and opens the block device path (fi is its Stat):
// refused if it, or a partition of it, is mounted, or if the kernel will
// not let us open it exclusively.
func openDevice(name, path string, fi fs.FileInfo) (*target, error) {
	if where := mountedAt(fi); where != "" {
		return nil, targetError(name, path, "it is in use: %s; the agent does not overwrite a mounted disk", where)
	}
	f, err := os.OpenFile(path, os.O_RDWR|exclusiveOpen, 0)
	if errors.Is(err, syscall.EBUSY) {
		return nil, targetError(name, path, "it is in use (by swap, LVM, RAID, device mapper, a mount, or a program that opened it exclusively): %w", err)
	}
	if err != nil {
		return nil, targetError(name, path, "opening it: %w", err)
	}
	t := &target{name: name, path: path, f: f}
	fail := func(format string, args ...any) (*target, error) {
		_ = f.Close() // read nothing, wrote nothing
		return nil, targetError(name, path, format, args...)
	}
	// path may have been replaced between Stat and OpenFile.
	if got, err := f.Stat(); err != nil {
		return fail("%w", err)
	} else if !os.SameFile(fi, got) {
		return fail("it changed while it was being checked")
	}
	if t.size, err = f.Seek(0, io.SeekEnd); err != nil {
		return fail("finding its size: %w", err)
	}
	if t.size == 0 {
		return fail("the device has no space (size 0)")
	}
	return t, nil
}

// openForWriting makes t.f the target, opened for reading and writing,
// empty if it is a file, and positioned at its start. A device is the fd
// held since checkTarget; a file is opened now, and must still be the
// regular file that was checked (or, if it did not exist, must still not
// exist).
func (t *target) openForWriting() error {
	if t.f != nil {
		if _, err := t.f.Seek(0, io.SeekStart); err != nil {
			return fmt.Errorf("rewinding %s: %w", t, err)
		}
		return nil
	}
	// O_NOFOLLOW: the path was resolved when checked; a symlink there now
	// is not what was checked.
	flags := os.O_RDWR | noFollow
	if t.file == nil {
		flags |= os.O_CREATE | os.O_EXCL
	}
	f, err := os.OpenFile(t.path, flags, 0o600)
	if err != nil {
		return fmt.Errorf("opening %s: %w", t, err)
	}
	if t.file != nil {
		if fi, err := f.Stat(); err != nil || !os.SameFile(t.file, fi) {
			_ = f.Close() // nothing written
			return fmt.Errorf("opening %s: it changed since it was checked", t)
		}
		if err := f.Truncate(0); err != nil {
			_ = f.Close() // the error to report is the truncation's
			return fmt.Errorf("truncating %s: %w", t, err)
		}
	}
	t.f = f
	return nil
}

// close closes the target if it is open. Calling it again does nothing.
func (t *target) close() error {
	if t.f == nil {
		return nil
	}
	err := t.f.Close()
	t.f = nil
	return err
}
