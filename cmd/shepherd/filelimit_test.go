package main

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
)

// fileLimitChildEnv makes TestStartRaisesFileLimit the child process that
// runs the commands with a lowered limit.
const fileLimitChildEnv = "SHEPHERD_TEST_FILE_LIMIT_CHILD"

// lowSoftLimit is the soft open-file limit the child starts each command
// with.
const lowSoftLimit = 256

// `shepherd run` and `shepherd dev` raise a low soft open-file limit to the
// hard limit and log both figures at start. The commands run in a child
// process (this test binary again), since lowering the limit here would
// starve the tests running in parallel; each is started without what it
// needs to go on (no --data-dir, no machines), so that it stops right
// after logging.
func TestStartRaisesFileLimit(t *testing.T) {
	if os.Getenv(fileLimitChildEnv) != "" {
		fileLimitChild(t)
		return
	}
	t.Parallel()
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	if lim.Max <= lowSoftLimit {
		t.Fatalf("the hard open-file limit is %d: the test needs one above %d to see it raised", lim.Max, lowSoftLimit)
	}
	cmd := exec.CommandContext(t.Context(), os.Args[0], "-test.run=^TestStartRaisesFileLimit$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), fileLimitChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	want := fmt.Sprintf(`msg="open-file limit" soft=%d hard=%d`, lim.Max, lim.Max)
	for _, command := range []string{"run", "dev"} {
		_, section, ok := strings.Cut(string(out), "child: "+command+" ")
		if !ok {
			t.Fatalf("the child did not run %s:\n%s", command, out)
		}
		section, _, _ = strings.Cut(section, "child: done "+command)
		if !strings.HasPrefix(section, fmt.Sprintf("soft limit %d", lowSoftLimit)) {
			t.Errorf("shepherd %s did not start with the lowered limit:\n%s", command, section)
		}
		if !strings.Contains(section, want) {
			t.Errorf("shepherd %s logged no %s:\n%s", command, want, section)
		}
	}
}

// fileLimitChild runs `shepherd run` and `shepherd dev`, each with the soft
// open-file limit lowered to lowSoftLimit, and marks their output.
func fileLimitChild(t *testing.T) {
	for _, args := range [][]string{
		{"run", "--components=janitor", "--database-url=postgres://127.0.0.1:1/unused"},
		// dev logs at warn unless told otherwise.
		{"dev", "--machines=0", "--data-dir=" + t.TempDir(), "--log-level=info"},
	} {
		var lim syscall.Rlimit
		if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
			t.Fatal(err)
		}
		lim.Cur = lowSoftLimit
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(os.Stderr, "child: %s soft limit %d\n", args[0], lim.Cur)
		cmd := newRootCommand()
		cmd.SetArgs(args)
		cmd.SetOut(os.Stderr)
		cmd.SetErr(os.Stderr)
		// Both stop at a missing flag, after the start.
		err := cmd.ExecuteContext(t.Context())
		fmt.Fprintf(os.Stderr, "child: done %s: %v\n", args[0], err)
		if err == nil {
			t.Errorf("shepherd %s went on without what it needs", args[0])
		}
	}
}
