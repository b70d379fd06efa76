package main

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestMain runs main instead of the tests when the test binary is started
// by TestExitStatus as the command.
func TestMain(m *testing.M) {
	if os.Getenv("CHECKFILES_RUN_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// gitRepo makes a git repository in a temporary directory with files
// (path → contents) tracked, and returns its directory.
func gitRepo(t *testing.T, files map[string][]byte) string {
	t.Helper()
	dir := t.TempDir()
	git(t, dir, "init", "-q")
	for name, data := range files {
		p := filepath.Join(dir, filepath.FromSlash(name))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	git(t, dir, "add", "-A")
	return dir
}

func git(t *testing.T, dir string, args ...string) {
	t.Helper()
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("git %s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// peHeader is the start of a PE executable: "MZ", the offset of the PE
// signature at 0x3c, and the signature there.
func peHeader() []byte {
	b := make([]byte, 0x100)
	copy(b, "MZ")
	binary.LittleEndian.PutUint32(b[0x3c:], 0x80)
	copy(b[0x80:], "PE\x00\x00")
	return b
}

func TestCheck(t *testing.T) {
	self, err := os.Executable() // this test binary: a real ELF of several MB
	if err != nil {
		t.Fatal(err)
	}
	binaryData, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	big := bytes.Repeat([]byte("0123456789abcdef\n"), maxSize/17+1)
	exactlyMax := bytes.Repeat([]byte("x"), maxSize)
	dir := gitRepo(t, map[string][]byte{
		"shepherd":              binaryData,
		"testdata/small-elf":    []byte("\x7fELF\x02\x01\x01\x00"),
		"data/fleet.csv":        big,
		"pkg/pkg.a":             []byte("!<arch>\n__.PKGDEF"),
		"obj/hello.o":           []byte("not really an object, but named like one"),
		"lib/libfoo.so.1":       []byte("a shared library by name"),
		"web.test":              []byte("a test binary by name"),
		"win/tool":              peHeader(),
		"mac/tool":              {0xcf, 0xfa, 0xed, 0xfe, 7, 0, 0, 1},
		"mac/fat":               {0xca, 0xfe, 0xba, 0xbe, 0, 0, 0, 2},
		"web/module":            []byte("\x00asm\x01\x00\x00\x00"),
		"README.md":             []byte("# A clean file\n"),
		"main.go":               []byte("package main\n\nfunc main() {}\n"),
		"notes/MZ.txt":          []byte("MZ is not a binary without its PE signature, even in a long enough file: " + strings.Repeat(".", 100)),
		"testdata/exactly-1mb":  exactlyMax,
		"docs/so-called.md":     []byte("not a shared library"),
		"deleted/was-a-binary":  []byte("\x7fELF"),
		"scripts/require-thing": []byte("#!/bin/sh\n"),
	})
	// An untracked binary is not the check's business; a tracked file
	// deleted from the working tree is no longer a problem.
	if err := os.WriteFile(filepath.Join(dir, "untracked"), binaryData, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(dir, "deleted", "was-a-binary")); err != nil {
		t.Fatal(err)
	}

	problems, err := check(dir)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, p := range problems {
		got[p.path] = p.why
	}
	want := map[string][]string{
		"shepherd":           {"a compiled ELF binary", "more than 1 MB"},
		"testdata/small-elf": {"a compiled ELF binary"},
		"data/fleet.csv":     {"more than 1 MB"},
		"pkg/pkg.a":          {"ar archive", "(*.a)"},
		"obj/hello.o":        {"(*.o)"},
		"lib/libfoo.so.1":    {"(*.so)"},
		"web.test":           {"(*.test)"},
		"win/tool":           {"PE (Windows) binary"},
		"mac/tool":           {"Mach-O binary"},
		"mac/fat":            {"Mach-O universal binary or Java class"},
		"web/module":         {"WebAssembly module"},
	}
	for name, parts := range want {
		why, ok := got[name]
		if !ok {
			t.Errorf("%s is not reported", name)
			continue
		}
		for _, p := range parts {
			if !strings.Contains(why, p) {
				t.Errorf("%s: %q, want it to say %q", name, why, p)
			}
		}
		delete(got, name)
	}
	for name, why := range got {
		t.Errorf("%s is reported (%s), but is fine", name, why)
	}

	clean := gitRepo(t, map[string][]byte{"README.md": []byte("# clean\n"), "go.mod": []byte("module x\n")})
	if problems, err := check(clean); err != nil || len(problems) != 0 {
		t.Errorf("check on a clean repository = %v, %v; want no problems", problems, err)
	}
	if _, err := check(t.TempDir()); err == nil {
		t.Error("check outside a git repository succeeded")
	}
}

// TestExitStatus runs the command: it exits 1 and names each offender, or
// 0 on a clean repository.
func TestExitStatus(t *testing.T) {
	dirty := gitRepo(t, map[string][]byte{"a.out.o": []byte("x"), "ok.txt": []byte("fine")})
	clean := gitRepo(t, map[string][]byte{"ok.txt": []byte("fine")})
	for _, tt := range []struct {
		dir      string
		wantCode int
		want     []string
	}{
		{dirty, 1, []string{"a.out.o: named like a build product (*.o)"}},
		{clean, 0, nil},
	} {
		cmd := exec.Command(os.Args[0], tt.dir)
		cmd.Env = append(os.Environ(), "CHECKFILES_RUN_MAIN=1")
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		err := cmd.Run()
		code := 0
		if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		if code != tt.wantCode {
			t.Errorf("checkfiles %s: exit %d, want %d; stderr:\n%s", tt.dir, code, tt.wantCode, &stderr)
		}
		for _, w := range tt.want {
			if !strings.Contains(stderr.String(), w) {
				t.Errorf("checkfiles %s: stderr does not name %q:\n%s", tt.dir, w, &stderr)
			}
		}
		if tt.want == nil && stderr.Len() != 0 {
			t.Errorf("checkfiles %s printed:\n%s", tt.dir, &stderr)
		}
	}
}

// TestRepository checks this repository's own tracked files.
func TestRepository(t *testing.T) {
	problems, err := check(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	if len(problems) != 0 {
		t.Errorf("tracked files that must not be: %v", problems)
	}
}
