//go:build amd64 || arm64

package install

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"syscall"
	"testing"
	"unsafe"
)

// TestInstallVerifiesWhatTheTargetGivesBack: a target that does not give
// back what was written to it (a device that loses or garbles writes) fails
// the installation with the read-back's error, although every write and
// the fsync succeeded.
//
// A file target stands in for such a device: fanotify (which needs root,
// as the block device tests do) holds the first read of the target, which
// is the read-back's, and the test changes a byte of the file before
// letting it go on.
func TestInstallVerifiesWhatTheTargetGivesBack(t *testing.T) {
	img, sum := testImage(t)
	srv := newServer(t, serveImage(img))
	target := existingTarget(t, []byte("old"))
	cfg := allowing(t, target)

	corrupted := make(chan error, 1) // how changing the file went, at the first read
	stop := interceptFirstRead(t, target, func(f *os.File) error {
		_, err := f.WriteAt([]byte{img[0] ^ 0xff}, 0)
		return err
	}, corrupted)
	report := Install(t.Context(), cfg, request(srv.URL, sum, target))
	stop()

	select {
	case err := <-corrupted:
		if err != nil {
			t.Fatalf("changing the target at its first read: %v", err)
		}
	default:
		t.Fatal("nothing read the target back")
	}
	assertError(t, report, 7, "verifying "+target+" after writing: checksum mismatch", "want "+sum)
}

// Linux's fanotify ABI (linux/fanotify.h), for what syscall does not have.
const (
	fanCloexec      = 0x1
	fanNonblock     = 0x2
	fanClassContent = 0x4
	fanMarkAdd      = 0x1
	fanAccessPerm   = 0x20000
	fanAllow        = 0x1
	fanEventSize    = 24 // struct fanotify_event_metadata
)

// interceptFirstRead holds every read of path until it is answered: the
// first one after running change on the file (its error goes to done),
// the others at once. stop ends the interception and waits for it.
func interceptFirstRead(t *testing.T, path string, change func(*os.File) error, done chan<- error) (stop func()) {
	t.Helper()
	fd, _, errno := syscall.Syscall(syscall.SYS_FANOTIFY_INIT, fanCloexec|fanNonblock|fanClassContent, uintptr(os.O_RDWR), 0)
	if errno != 0 {
		t.Fatalf("fanotify_init (the test needs root): %v", errno)
	}
	group := os.NewFile(fd, "fanotify") // non-blocking: Close wakes a Read
	p, err := syscall.BytePtrFromString(path)
	if err != nil {
		t.Fatal(err)
	}
	dirFD := -100 // AT_FDCWD, unused for an absolute path
	if _, _, errno := syscall.Syscall6(syscall.SYS_FANOTIFY_MARK, fd, fanMarkAdd, fanAccessPerm, uintptr(dirFD), uintptr(unsafe.Pointer(p)), 0); errno != 0 {
		group.Close()
		t.Fatalf("fanotify_mark %s: %v", path, errno)
	}
	answered := make(chan struct{})
	go func() {
		defer close(answered)
		first := true
		buf := make([]byte, 4096)
		for {
			n, err := group.Read(buf)
			if err != nil {
				if !errors.Is(err, os.ErrClosed) {
					t.Errorf("reading fanotify events: %v", err)
				}
				return
			}
			for ev := buf[:n]; len(ev) >= fanEventSize; ev = ev[binary.NativeEndian.Uint32(ev):] {
				eventFD := int32(binary.NativeEndian.Uint32(ev[16:]))
				f := os.NewFile(uintptr(eventFD), path) // reads and writes on it raise no events
				if first {
					first = false
					done <- change(f)
				}
				var resp bytes.Buffer
				_ = binary.Write(&resp, binary.NativeEndian, struct{ FD, Response int32 }{eventFD, fanAllow})
				if _, err := group.Write(resp.Bytes()); err != nil {
					t.Errorf("answering a fanotify event: %v", err)
				}
				f.Close()
			}
		}
	}()
	return func() {
		group.Close() // lets any held read go on
		<-answered
	}
}
