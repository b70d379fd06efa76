package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestRelativeGit: through the wrapper, `git diff --merge-base REF` names the
// changed files of the package from the package's directory, as gremlins
// looks them up, and leaves out files elsewhere; other git commands are
// untouched. Without it every mutant of a -diff run was skipped.
func TestRelativeGit(t *testing.T) {
	repo := t.TempDir()
	gitIn := func(env []string, args ...string) string {
		t.Helper()
		// Through sh, so that git is looked up in env's PATH, as gremlins
		// (a process started with that environment) looks it up.
		cmd := exec.Command("sh", append([]string{"-c", `exec git "$@"`, "git"}, args...)...)
		cmd.Dir = repo
		cmd.Env = append(os.Environ(), "GIT_AUTHOR_NAME=t", "GIT_AUTHOR_EMAIL=t@t", "GIT_COMMITTER_NAME=t", "GIT_COMMITTER_EMAIL=t@t")
		cmd.Env = append(cmd.Env, env...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
		return string(out)
	}
	write := func(name, text string) {
		t.Helper()
		p := filepath.Join(repo, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	gitIn(nil, "init", "-q", "-b", "main")
	write("pkg/sub/a.go", "package sub\n")
	write("other/b.go", "package other\n")
	gitIn(nil, "add", ".")
	gitIn(nil, "commit", "-qm", "one")
	write("pkg/sub/a.go", "package sub\n\nvar x = 1\n")
	write("other/b.go", "package other\n\nvar y = 2\n")

	bin, err := relativeGit("pkg/sub")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(bin)
	path := []string{"PATH=" + bin + string(os.PathListSeparator) + os.Getenv("PATH")}
	out := gitIn(path, "diff", "--merge-base", "main")
	if !strings.Contains(out, "+++ b/a.go\n") || strings.Contains(out, "pkg/sub/a.go") || strings.Contains(out, "b.go") {
		t.Errorf("git diff through the wrapper:\n%s\nwant only a.go, named from pkg/sub", out)
	}
	if got := gitIn(path, "rev-parse", "--abbrev-ref", "HEAD"); strings.TrimSpace(got) != "main" {
		t.Errorf("git rev-parse through the wrapper = %q, want main", got)
	}
}
