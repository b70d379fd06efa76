// Command checkfiles fails when a file tracked by git looks like a build
// product or is larger than 1 MB: binaries, object files and archives
// belong in no commit (a 33 MB build of shepherd once sat at the root), and
// a file that large is almost always one too. `make lint` runs it.
//
// Usage: go run ./scripts/checkfiles [dir]
//
// It checks the tracked files of the repository at dir (default: the
// current directory) as they are in the working tree, prints one line per
// offender ("path: why") and exits 1 if there is any.
package main

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
)

// maxSize is the largest tracked file allowed.
const maxSize = 1 << 20

// productSuffixes are the names of build products: Go test binaries,
// object files, static and shared libraries, executables.
var productSuffixes = []string{".test", ".o", ".a", ".so", ".dylib", ".dll", ".exe", ".wasm", ".pyc", ".class"}

// problem is one offending file.
type problem struct {
	path, why string
}

func main() {
	dir := "."
	if len(os.Args) > 2 {
		fmt.Fprintln(os.Stderr, "usage: checkfiles [dir]")
		os.Exit(2)
	}
	if len(os.Args) == 2 {
		dir = os.Args[1]
	}
	problems, err := check(dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, "checkfiles:", err)
		os.Exit(2)
	}
	if len(problems) == 0 {
		return
	}
	fmt.Fprintln(os.Stderr, "tracked files that look like build products or exceed 1 MB (git rm --cached them and add them to .gitignore):")
	for _, p := range problems {
		fmt.Fprintf(os.Stderr, "  %s: %s\n", p.path, p.why)
	}
	os.Exit(1)
}

// check returns the offenders among the files git tracks in dir.
func check(dir string) ([]problem, error) {
	cmd := exec.Command("git", "ls-files", "-z")
	cmd.Dir = dir
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("git ls-files in %s: %w: %s", dir, err, bytes.TrimSpace(stderr.Bytes()))
	}
	var problems []problem
	for name := range strings.SplitSeq(strings.TrimSuffix(string(out), "\x00"), "\x00") {
		if name == "" {
			continue
		}
		why, err := inspect(filepath.Join(dir, filepath.FromSlash(name)), name)
		if err != nil {
			return nil, err
		}
		if why != "" {
			problems = append(problems, problem{name, why})
		}
	}
	return problems, nil
}

// inspect says why the file at file (tracked as name) must not be
// tracked, or "" if it may be.
func inspect(file, name string) (string, error) {
	fi, err := os.Lstat(file)
	if errors.Is(err, fs.ErrNotExist) {
		return "", nil // deleted in the working tree: no longer a problem
	}
	if err != nil {
		return "", err
	}
	if !fi.Mode().IsRegular() {
		return "", nil // a symbolic link or a submodule
	}
	var why []string
	if fi.Size() > maxSize {
		why = append(why, fmt.Sprintf("%d bytes, more than 1 MB", fi.Size()))
	}
	if s := productSuffix(path.Base(name)); s != "" {
		why = append(why, "named like a build product (*"+s+")")
	}
	f, err := os.Open(file)
	if err != nil {
		return "", err
	}
	defer f.Close()
	head := make([]byte, 512)
	n, err := io.ReadFull(f, head)
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
		return "", fmt.Errorf("reading %s: %w", file, err)
	}
	if kind := binaryKind(head[:n]); kind != "" {
		why = append(why, "a compiled "+kind)
	}
	return strings.Join(why, "; "), nil
}

// productSuffix returns the build product suffix base ends in, if any
// (shared libraries also as lib.so.1).
func productSuffix(base string) string {
	for _, s := range productSuffixes {
		if strings.HasSuffix(base, s) || (s == ".so" && strings.Contains(base, ".so.")) {
			return s
		}
	}
	return ""
}

// binaryKind recognizes executables, objects and archives by their first
// bytes: ELF, Mach-O (and universal binaries), PE and ar archives.
func binaryKind(head []byte) string {
	switch {
	case bytes.HasPrefix(head, []byte("\x7fELF")):
		return "ELF binary"
	case bytes.HasPrefix(head, []byte("!<arch>\n")):
		return "ar archive (Go package archive or static library)"
	case bytes.HasPrefix(head, []byte("\x00asm")):
		return "WebAssembly module"
	case len(head) >= 4:
		switch binary.BigEndian.Uint32(head) {
		case 0xfeedface, 0xfeedfacf, 0xcefaedfe, 0xcffaedfe:
			return "Mach-O binary"
		case 0xcafebabe:
			return "Mach-O universal binary or Java class"
		}
	}
	// PE: "MZ", and at offset 0x3c the offset of the "PE\0\0" signature.
	if len(head) >= 0x40 && bytes.HasPrefix(head, []byte("MZ")) {
		off := int(binary.LittleEndian.Uint32(head[0x3c:]))
		if off+4 <= len(head) && bytes.Equal(head[off:off+4], []byte("PE\x00\x00")) {
			return "PE (Windows) binary"
		}
	}
	return ""
}
