package sim

import (
	"io"
	"os"
	"path"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/pkg/sftp"
)

// memFS is a simulated machine's file system as SFTP sees it: names, sizes
// and modes, never contents. An upload of the agent (write to a temporary
// name, chmod 0755, rename over the target) works on it and costs a few
// hundred bytes, however large the binary. Reads return zeros. Directories
// are implicit: "/" and every parent of a file exist, and Mkdir adds more.
type memFS struct {
	mu    sync.Mutex
	nodes map[string]*memNode
}

// memNode is one file or directory. Open handles keep pointing at their
// node across a rename, as they keep pointing at an inode.
type memNode struct {
	size  int64
	mode  os.FileMode
	mtime time.Time
}

func newMemFS() *memFS { return &memFS{nodes: map[string]*memNode{}} }

func (fs *memFS) handlers() sftp.Handlers {
	return sftp.Handlers{FileGet: fs, FilePut: fs, FileCmd: fs, FileList: fs}
}

func clean(p string) string { return path.Clean("/" + p) }

// lookupLocked returns the node at p, a synthetic directory node if p is
// an implicit directory, or nil. fs.mu must be held.
func (fs *memFS) lookupLocked(p string) *memNode {
	if n := fs.nodes[p]; n != nil {
		return n
	}
	if p == "/" {
		return &memNode{mode: os.ModeDir | 0o755}
	}
	prefix := p + "/"
	for name := range fs.nodes {
		if strings.HasPrefix(name, prefix) {
			return &memNode{mode: os.ModeDir | 0o755}
		}
	}
	return nil
}

func pathError(op, p string, err error) error { return &os.PathError{Op: op, Path: p, Err: err} }

// Fileread opens an existing file for reading.
func (fs *memFS) Fileread(r *sftp.Request) (io.ReaderAt, error) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	p := clean(r.Filepath)
	n := fs.lookupLocked(p)
	switch {
	case n == nil:
		return nil, pathError("open", p, syscall.ENOENT)
	case n.mode.IsDir():
		return nil, pathError("open", p, syscall.EISDIR)
	}
	return &memHandle{fs: fs, node: n}, nil
}

// Filewrite opens a file for writing, creating or truncating it as the
// request's flags say.
func (fs *memFS) Filewrite(r *sftp.Request) (io.WriterAt, error) { return fs.OpenFile(r) }

// OpenFile opens a file for reading and writing (what sftp.Client.Create
// asks for).
func (fs *memFS) OpenFile(r *sftp.Request) (sftp.WriterAtReaderAt, error) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	p := clean(r.Filepath)
	flags := r.Pflags()
	n := fs.lookupLocked(p)
	switch {
	case n != nil && n.mode.IsDir():
		return nil, pathError("open", p, syscall.EISDIR)
	case n != nil && flags.Creat && flags.Excl:
		return nil, pathError("open", p, syscall.EEXIST)
	case n == nil && !flags.Creat:
		return nil, pathError("open", p, syscall.ENOENT)
	case n == nil:
		mode := os.FileMode(0o644)
		if r.AttrFlags().Permissions {
			mode = r.Attributes().FileMode().Perm()
		}
		n = &memNode{mode: mode, mtime: time.Now()}
		fs.nodes[p] = n
	case flags.Trunc:
		n.size, n.mtime = 0, time.Now()
	}
	return &memHandle{fs: fs, node: n}, nil
}

// memHandle is an open file: writes only move its size.
type memHandle struct {
	fs   *memFS
	node *memNode
}

// WriteAt discards b and grows the file to cover it.
func (h *memHandle) WriteAt(b []byte, off int64) (int, error) {
	h.fs.mu.Lock()
	defer h.fs.mu.Unlock()
	if end := off + int64(len(b)); end > h.node.size {
		h.node.size = end
	}
	h.node.mtime = time.Now()
	return len(b), nil
}

// ReadAt reads zeros up to the file's size.
func (h *memHandle) ReadAt(b []byte, off int64) (int, error) {
	h.fs.mu.Lock()
	size := h.node.size
	h.fs.mu.Unlock()
	if off >= size {
		return 0, io.EOF
	}
	n := int(min(int64(len(b)), size-off))
	clear(b[:n])
	if n < len(b) {
		return n, io.EOF
	}
	return n, nil
}

// Filecmd carries out Setstat (mode, size), Rename and PosixRename (both
// replace an existing target, as the upload's final rename needs), Mkdir,
// Rmdir and Remove. Links are not supported.
func (fs *memFS) Filecmd(r *sftp.Request) error {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	p := clean(r.Filepath)
	switch r.Method {
	case "Setstat":
		n := fs.nodes[p]
		if n == nil {
			if fs.lookupLocked(p) != nil {
				return nil // an implicit directory: nothing to record
			}
			return pathError("setstat", p, syscall.ENOENT)
		}
		attrs, flags := r.Attributes(), r.AttrFlags()
		if flags.Permissions {
			n.mode = n.mode&os.ModeType | attrs.FileMode().Perm()
		}
		if flags.Size && !n.mode.IsDir() {
			n.size = int64(attrs.Size)
		}
		return nil
	case "Rename", "PosixRename":
		n := fs.nodes[p]
		if n == nil {
			return pathError("rename", p, syscall.ENOENT)
		}
		target := clean(r.Target)
		if t := fs.nodes[target]; t != nil && t.mode.IsDir() {
			return pathError("rename", target, syscall.EISDIR)
		}
		delete(fs.nodes, p)
		fs.nodes[target] = n
		return nil
	case "Mkdir":
		if fs.lookupLocked(p) != nil {
			return pathError("mkdir", p, syscall.EEXIST)
		}
		fs.nodes[p] = &memNode{mode: os.ModeDir | 0o755, mtime: time.Now()}
		return nil
	case "Rmdir":
		n := fs.lookupLocked(p)
		switch {
		case n == nil:
			return pathError("rmdir", p, syscall.ENOENT)
		case !n.mode.IsDir():
			return pathError("rmdir", p, syscall.ENOTDIR)
		case fs.nodes[p] == nil || len(fs.childrenLocked(p)) > 0:
			return pathError("rmdir", p, syscall.ENOTEMPTY)
		}
		delete(fs.nodes, p)
		return nil
	case "Remove":
		n := fs.nodes[p]
		switch {
		case n == nil:
			return pathError("remove", p, syscall.ENOENT)
		case n.mode.IsDir():
			return pathError("remove", p, syscall.EISDIR)
		}
		delete(fs.nodes, p)
		return nil
	}
	return sftp.ErrSSHFxOpUnsupported
}

// childrenLocked lists the direct children of directory dir, sorted.
func (fs *memFS) childrenLocked(dir string) []os.FileInfo {
	prefix := dir + "/"
	if dir == "/" {
		prefix = "/"
	}
	seen := map[string]bool{}
	var out []os.FileInfo
	for name := range fs.nodes {
		rest, ok := strings.CutPrefix(name, prefix)
		if !ok || rest == "" {
			continue
		}
		child, _, _ := strings.Cut(rest, "/")
		if seen[child] {
			continue
		}
		seen[child] = true
		out = append(out, fs.infoLocked(prefix+child))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name() < out[j].Name() })
	return out
}

func (fs *memFS) infoLocked(p string) os.FileInfo {
	n := fs.lookupLocked(p)
	return fileInfo{name: path.Base(p), size: n.size, mode: n.mode, mtime: n.mtime}
}

// Filelist answers Stat, Lstat and List.
func (fs *memFS) Filelist(r *sftp.Request) (sftp.ListerAt, error) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	p := clean(r.Filepath)
	n := fs.lookupLocked(p)
	if n == nil {
		return nil, pathError(strings.ToLower(r.Method), p, syscall.ENOENT)
	}
	switch r.Method {
	case "Stat", "Lstat":
		return listerAt{fs.infoLocked(p)}, nil
	case "List":
		if !n.mode.IsDir() {
			return nil, pathError("readdir", p, syscall.ENOTDIR)
		}
		return listerAt(fs.childrenLocked(p)), nil
	}
	return nil, sftp.ErrSSHFxOpUnsupported
}

type listerAt []os.FileInfo

func (l listerAt) ListAt(out []os.FileInfo, off int64) (int, error) {
	if off >= int64(len(l)) {
		return 0, io.EOF
	}
	n := copy(out, l[off:])
	if n+int(off) >= len(l) {
		return n, io.EOF
	}
	return n, nil
}

// fileInfo is a memNode as os.FileInfo.
type fileInfo struct {
	name  string
	size  int64
	mode  os.FileMode
	mtime time.Time
}

func (fi fileInfo) Name() string       { return fi.name }
func (fi fileInfo) Size() int64        { return fi.size }
func (fi fileInfo) Mode() os.FileMode  { return fi.mode }
func (fi fileInfo) ModTime() time.Time { return fi.mtime }
func (fi fileInfo) IsDir() bool        { return fi.mode.IsDir() }
func (fi fileInfo) Sys() any           { return nil }
