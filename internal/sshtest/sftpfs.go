package sshtest

import (
	"errors"
	"io"
	"os"
	"syscall"

	"github.com/pkg/sftp"
)

// sftpFS serves the Gliderlabs servers' SFTP requests on the real
// filesystem. It exists for one reason: a Gliderlabs server writes uploads
// in the test process, and a child the process forks (another session's
// command, another test's exec) while an upload is open for writing holds a
// copy of that descriptor until its exec has closed it; running the upload
// meanwhile fails with "Text file busy", which no real sshd causes (its
// sftp-server is a process of its own). Go forks holding syscall.ForkLock
// for writing, so sftpFS opens a file for writing only while it holds the
// lock for reading and closes it before letting go: every write opens,
// writes and closes. No child can then hold an upload, and a command that
// runs one after the client closed it always can.
//
// Paths arrive absolute: the request server resolves relative ones against
// its start directory (Host.Dir). A rename replaces an existing target, as
// rename(2) does (OpenSSH's sftp-server refuses; see the package comment).
type sftpFS struct{}

// withoutForks runs f, which opens and closes a file for writing, while no
// child can be forked.
func withoutForks(f func() error) error {
	syscall.ForkLock.RLock()
	defer syscall.ForkLock.RUnlock()
	return f()
}

// Fileread opens a file for reading; the request server closes it.
func (sftpFS) Fileread(r *sftp.Request) (io.ReaderAt, error) {
	return os.Open(r.Filepath)
}

// Filewrite creates or truncates the file as the open asks and returns a
// writer that opens it for each write.
func (fs sftpFS) Filewrite(r *sftp.Request) (io.WriterAt, error) {
	return fs.open(r)
}

// OpenFile is Filewrite for a handle that is read too (sftp.Client.Create
// opens read-write).
func (fs sftpFS) OpenFile(r *sftp.Request) (sftp.WriterAtReaderAt, error) {
	return fs.open(r)
}

func (sftpFS) open(r *sftp.Request) (*uploadFile, error) {
	pf := r.Pflags()
	// Like pkg/sftp's own server: no O_APPEND (it conflicts with WriteAt;
	// the client sends the offsets) and mode 0644 for a new file.
	flags := os.O_WRONLY
	if pf.Creat {
		flags |= os.O_CREATE
	}
	if pf.Trunc {
		flags |= os.O_TRUNC
	}
	if pf.Excl {
		flags |= os.O_EXCL
	}
	err := withoutForks(func() error {
		f, err := os.OpenFile(r.Filepath, flags, 0o644)
		if err != nil {
			return err
		}
		return f.Close()
	})
	if err != nil {
		return nil, err
	}
	return &uploadFile{path: r.Filepath}, nil
}

// uploadFile is an open SFTP handle for writing that holds no descriptor.
type uploadFile struct{ path string }

// WriteAt writes p at off, opening and closing the file around it.
func (u *uploadFile) WriteAt(p []byte, off int64) (int, error) {
	var n int
	err := withoutForks(func() error {
		f, err := os.OpenFile(u.path, os.O_WRONLY, 0)
		if err != nil {
			return err
		}
		n, err = f.WriteAt(p, off)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		return err
	})
	return n, err
}

// ReadAt reads from the file at off.
func (u *uploadFile) ReadAt(p []byte, off int64) (int, error) {
	f, err := os.Open(u.path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	return f.ReadAt(p, off)
}

// Filecmd changes attributes and names.
func (sftpFS) Filecmd(r *sftp.Request) error {
	p := r.Filepath
	switch r.Method {
	case "Setstat":
		a, fl := r.Attributes(), r.AttrFlags()
		if fl.Size {
			if err := os.Truncate(p, int64(a.Size)); err != nil {
				return err
			}
		}
		if fl.Permissions {
			if err := os.Chmod(p, a.FileMode()); err != nil {
				return err
			}
		}
		if fl.UidGid {
			if err := os.Chown(p, int(a.UID), int(a.GID)); err != nil {
				return err
			}
		}
		if fl.Acmodtime {
			return os.Chtimes(p, a.AccessTime(), a.ModTime())
		}
		return nil
	case "Rename":
		return os.Rename(p, r.Target)
	case "Rmdir":
		return syscall.Rmdir(p)
	case "Remove":
		return syscall.Unlink(p)
	case "Mkdir":
		return os.Mkdir(p, 0o755)
	case "Link":
		return os.Link(p, r.Target)
	case "Symlink":
		// Filepath is the link's target, Target the link (pkg/sftp's naming).
		return os.Symlink(p, r.Target)
	}
	return errors.New("sshtest: unsupported SFTP command " + r.Method)
}

// PosixRename renames over an existing target (posix-rename@openssh.com).
func (sftpFS) PosixRename(r *sftp.Request) error { return os.Rename(r.Filepath, r.Target) }

// Filelist lists a directory or stats a path (following links).
func (sftpFS) Filelist(r *sftp.Request) (sftp.ListerAt, error) {
	switch r.Method {
	case "List":
		ents, err := os.ReadDir(r.Filepath)
		if err != nil {
			return nil, err
		}
		infos := make(fileInfos, 0, len(ents))
		for _, e := range ents {
			fi, err := e.Info()
			if errors.Is(err, os.ErrNotExist) {
				continue // removed since it was read
			}
			if err != nil {
				return nil, err
			}
			infos = append(infos, fi)
		}
		return infos, nil
	case "Stat":
		fi, err := os.Stat(r.Filepath)
		if err != nil {
			return nil, err
		}
		return fileInfos{fi}, nil
	}
	return nil, errors.New("sshtest: unsupported SFTP listing " + r.Method)
}

// Lstat stats a path without following a link.
func (sftpFS) Lstat(r *sftp.Request) (sftp.ListerAt, error) {
	fi, err := os.Lstat(r.Filepath)
	if err != nil {
		return nil, err
	}
	return fileInfos{fi}, nil
}

// Readlink returns a link's target.
func (sftpFS) Readlink(p string) (string, error) { return os.Readlink(p) }

// fileInfos is a listing the request server pages through.
type fileInfos []os.FileInfo

// ListAt copies the entries from offset into buf.
func (l fileInfos) ListAt(buf []os.FileInfo, offset int64) (int, error) {
	if offset >= int64(len(l)) {
		return 0, io.EOF
	}
	n := copy(buf, l[offset:])
	if n < len(buf) {
		return n, io.EOF
	}
	return n, nil
}
