// Command mutate runs mutation testing (gremlins) on Shepherd's packages and
// judges the result: it prints every mutant that lived and is not recorded in
// mutate/equivalent.txt as changing no behaviour, and one figure line per
// package in the bench format:
//
//	R mutate pkg=server efficacy=97.1 mcover=85.3 killed=101 lived=3 equivalent=2 not_covered=18 timed_out=0 not_viable=1
//
// Efficacy counts equivalent mutants out; mcover is the share of mutants the
// package's own tests reach. It exits 1 when a mutant lives unexplained or an
// entry of the equivalent list no longer matches the source. Run it with
// `make mutate` (every package below), `make mutate PKG=server`, or
// `make mutate DIFF=main` to mutate only the lines changed since a git ref.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"

	"github.com/shepherd/shepherd/internal/shellquote"
)

// target is a package under mutation testing and the part of it that is.
type target struct {
	// dir is the package directory from the repository root.
	dir string
	// only, when set, limits mutation to these files of dir.
	only []string
	// run, when set, is the -run pattern of the tests that judge the
	// mutants (and measure coverage): those that exercise the mutated files.
	run string
}

// targets are the packages whose tests issue 16 holds to efficacy >= 95 %
// and coverage >= 80 %. A change to one of them is made with its mutants run.
//
// A package may be listed in parts, each a set of its files (only) judged by
// the tests that exercise them (run): a mutant is then judged by those
// tests alone, not the whole suite, which for manager is what makes a run
// take one hour instead of six. A mutant only another test would kill
// counts as lived, so a part's figure errs low, never high. The parts of a
// package share its one figure line; their files are disjoint.
var targets = []target{
	{dir: "server"},
	{dir: "internal/sshx"},
	{dir: "agent/install"},
	{dir: "provider/static"},
	// Out-of-band power (issue 12): the shared pacing and cycle logic, and
	// the drivers, judged against real ipmi_sim and the Redfish fake.
	{dir: "power"},
	{dir: "power/ipmi"},
	{dir: "power/redfish"},
	// bmdb's whole suite takes minutes per mutant; the tests of sessions,
	// work and backoff judge these files (TestHold: work.go's claim loop,
	// FinishWithCause and FailWithoutBackoff serve Hold too), and the
	// recovery ladder's admissions (issue 12) theirs.
	{dir: "bmdb", only: []string{"backoff.go", "session.go", "work.go", "recovery.go"},
		run: "^(TestBackoff|TestJitter|TestParseBackoff|TestSession|TestWork|TestMutualExclusion|TestKeepSession|TestCrash|TestEnd|TestAmbiguous|TestReconciliation|TestFailStores|TestUnavailable|TestDeleteSessions|TestConcurrentWorkers|TestPostgresRestart|TestTransact|TestProcessesMatchDatabase|TestHold|TestAdmitReboot|TestRebootBudget|TestRebootStreak|TestLadderClimbs|TestMissingAndStopped)"},
	{dir: "ladder"},
	// manager, in parts: its whole suite takes 100 s of CPU per mutant.
	{dir: "manager", only: []string{"loop.go", "limit.go", "metrics.go"},
		run: "^(TestRunner|TestJitter|TestSleep|TestRetryEnd|TestWorkEnd|TestWorkHeld|TestParseLimit|TestLimitFlag|TestDefaults|TestProvisionerConfig|TestProvisionerLimits|TestProvisionerRun|TestJanitorRun|TestUpdaterRun|TestUpdaterWait|TestBreaker)"},
	{dir: "manager", only: []string{"recoverer.go", "budget.go"},
		run: "^(TestReadBreaker|TestRecoverer|TestRequestBudgets|TestSimFleetRecovers|TestCircuitBreaker|TestRebootStreak|TestUnreached|TestBreaker|TestRunnerAdmit|TestDefaults|TestLadder)"},
	{dir: "manager", only: []string{"initializer.go", "hostkeys.go", "sshtarget.go"},
		run: "^(TestHostKey|TestExplainMismatch|TestMachineTarget|TestStopAgent|TestCheckTakeover|TestRemotePaths|TestInitializerConfig|TestSecrets|TestTrustOnFirstUse|TestAccepted|TestTakeover|TestDecommissionStopsAgentOverSSH|TestSimFleetRecovers|TestSmallFleet|TestBrokenInventory|TestDefaults)"},
	{dir: "manager", only: []string{"decommissioner.go"},
		run: "^(TestDecommission|TestStopAgent|TestDefaults)"},
	{dir: "manager", only: []string{"provisioner.go", "listing.go"},
		run: "^(TestProvisioner|TestListing|TestAcceptSuspect|TestInChunks|TestBrokenInventory|TestSmallFleet|TestUpdater|TestDefaults)"},
	{dir: "manager", only: []string{"updater.go"},
		run: "^(TestUpdater|TestDefaults)"},
	{dir: "manager", only: []string{"janitor.go"},
		run: "^(TestJanitor|TestDefaults)"},
}

// Goals printed next to each figure (never a reason to fail by
// themselves: a run on a diff mutates too little for a percentage).
const (
	goalEfficacy = 95.0
	goalCoverage = 80.0
)

type config struct {
	gremlins    string
	diff        string
	workers     int
	coefficient int
	equivalents string
	// files, when set, limits mutation to these files of the chosen
	// packages (and a package in parts to the parts that hold them).
	files []string
	pkgs  []string
}

func main() {
	var c config
	flag.StringVar(&c.gremlins, "gremlins", "", "path of the gremlins binary (make mutate builds the pinned one)")
	flag.StringVar(&c.diff, "diff", "", "mutate only the lines changed since this git ref")
	flag.IntVar(&c.workers, "workers", 1, "mutants tested at once (each runs a package's tests)")
	flag.IntVar(&c.coefficient, "timeout-coefficient", 8, "a mutant's tests time out after this many times the unmutated run")
	flag.StringVar(&c.equivalents, "equivalents", "mutate/equivalent.txt", "the list of mutants that change no behaviour")
	files := flag.String("files", "", "comma-separated file names: mutate only these files of the chosen packages")
	flag.Parse()
	if *files != "" {
		c.files = strings.Split(*files, ",")
	}
	c.pkgs = flag.Args()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ok, err := run(ctx, c, os.Stdout)
	if err != nil {
		fmt.Fprintln(os.Stderr, "mutate:", err)
		os.Exit(2)
	}
	if !ok {
		os.Exit(1)
	}
}

// check says what is wrong with a configuration.
func (c config) check() error {
	switch {
	case c.gremlins == "":
		return errors.New("-gremlins is required")
	case c.workers < 1:
		return fmt.Errorf("-workers %d: want at least 1", c.workers)
	case c.coefficient < 1:
		return fmt.Errorf("-timeout-coefficient %d: want at least 1", c.coefficient)
	}
	return nil
}

// chosen returns the targets named on the command line (all when none is),
// every part of a package; a package not in the table is mutated whole.
func chosen(pkgs []string) []target {
	if len(pkgs) == 0 {
		return targets
	}
	var out []target
	for _, p := range pkgs {
		p = path.Clean(strings.TrimPrefix(filepath.ToSlash(p), "./"))
		n := len(out)
		for _, t := range targets {
			if t.dir == p {
				out = append(out, t)
			}
		}
		if len(out) == n {
			out = append(out, target{dir: p})
		}
	}
	return out
}

// only limits targets to files (names within their package): a target in
// parts keeps the parts that hold one of them, each limited to those; a
// whole package is limited to them. No files: targets as they are. A run
// on some files, like one on a diff, mutates too little for its figure to
// be the package's.
//
// A file that no chosen package has is an error: gremlins would mutate
// nothing and the run would report a perfect figure for it.
func only(targets []target, files []string, exists func(path string) bool) ([]target, error) {
	if len(files) == 0 {
		return targets, nil
	}
	var out []target
	found := map[string]bool{}
	for _, t := range targets {
		var keep []string
		for _, f := range files {
			if (len(t.only) == 0 || slices.Contains(t.only, f)) && exists(path.Join(t.dir, f)) {
				keep = append(keep, f)
				found[f] = true
			}
		}
		if len(keep) > 0 {
			t.only = keep
			out = append(out, t)
		}
	}
	var missing []string
	for _, f := range files {
		if !found[f] {
			missing = append(missing, f)
		}
	}
	if len(missing) > 0 {
		var dirs []string
		for _, t := range targets {
			if !slices.Contains(dirs, t.dir) {
				dirs = append(dirs, t.dir)
			}
		}
		return nil, fmt.Errorf("-files: %s: no such file in %s", strings.Join(missing, ", "), strings.Join(dirs, ", "))
	}
	return out, nil
}

// fileExists says whether the file at path (from the repository root) exists.
func fileExists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// run mutates each chosen package and reports; ok is false when a mutant
// lives unexplained or the equivalent list is stale.
func run(ctx context.Context, c config, w io.Writer) (ok bool, err error) {
	if err := c.check(); err != nil {
		return false, err
	}
	if _, err := os.Stat("go.mod"); err != nil {
		return false, errors.New("run from the repository root (no go.mod here)")
	}
	f, err := os.Open(c.equivalents)
	if err != nil {
		return false, err
	}
	eqs, err := parseEquivalents(f, c.equivalents)
	f.Close()
	if err != nil {
		return false, err
	}
	tmp, err := os.MkdirTemp("", "shepherd-mutate-")
	if err != nil {
		return false, err
	}
	defer os.RemoveAll(tmp)

	chosenTargets, err := only(chosen(c.pkgs), c.files, fileExists)
	if err != nil {
		return false, err
	}
	ok = true
	// The parts of a package add up to its one figure, in the order the
	// packages first appear.
	var dirs []string
	sums := map[string]*tally{}
	for i, t := range chosenTargets {
		out := filepath.Join(tmp, fmt.Sprintf("%s-%d.json", strings.ReplaceAll(t.dir, "/", "_"), i))
		if err := unleash(ctx, c, t, out, w); err != nil {
			return false, fmt.Errorf("mutating %s: %w", t.dir, err)
		}
		rf, err := os.Open(out)
		if err != nil {
			return false, fmt.Errorf("mutating %s: %w", t.dir, err)
		}
		res, err := decode(rf)
		rf.Close()
		if err != nil {
			return false, fmt.Errorf("mutating %s: %w", t.dir, err)
		}
		tl, err := count(res, t.dir, eqs, readLines)
		if err != nil {
			return false, fmt.Errorf("mutating %s: %w", t.dir, err)
		}
		stale, unused, err := audit(t, eqs, tl, readLines)
		if err != nil {
			return false, err
		}
		for _, s := range tl.Survivors {
			fmt.Fprintf(w, "LIVED %s at %s:%d:%d  %s\n", s.Type, s.File, s.Line, s.Column, s.Source)
		}
		if tl.TimedOut > 0 {
			fmt.Fprintf(w, "mutate: %d mutants of %s timed out (counted neither killed nor lived); on a busy machine, rerun with a larger -timeout-coefficient\n", tl.TimedOut, t.dir)
		}
		for _, e := range stale {
			fmt.Fprintf(w, "STALE %s: %s %s no longer has the line %q\n", e.At, e.Type, e.File, e.Source)
		}
		// Only a whole run can tell that an entry's mutant no longer lives.
		if c.diff == "" {
			for _, e := range unused {
				fmt.Fprintf(w, "UNUSED %s: %s at %s %q did not live; remove the entry\n", e.At, e.Type, e.File, e.Source)
			}
		}
		if len(tl.Survivors) > 0 || len(stale) > 0 {
			ok = false
		}
		if sums[t.dir] == nil {
			dirs = append(dirs, t.dir)
			sums[t.dir] = &tally{}
		}
		sums[t.dir].add(tl)
	}
	// The figures come last, together, where a reader of a long run looks.
	for _, d := range dirs {
		tl := sums[d]
		fmt.Fprintf(w, "R mutate pkg=%s efficacy=%.1f mcover=%.1f killed=%d lived=%d equivalent=%d not_covered=%d timed_out=%d not_viable=%d goal_efficacy=%.0f goal_mcover=%.0f\n",
			d, tl.Efficacy(), tl.Coverage(), tl.Killed, tl.Lived, tl.Equivalent, tl.NotCovered, tl.TimedOut, tl.NotViable, goalEfficacy, goalCoverage)
	}
	return ok, nil
}

// audit finds the equivalent entries of t's files that name a line the
// source no longer has (stale) and those no lived mutant matched (unused).
func audit(t target, eqs []equivalent, tl tally, lines sourceLines) (stale, unused []equivalent, err error) {
	for _, e := range eqs {
		if !inScope(t, e.File) {
			continue
		}
		src, err := lines(e.File)
		if errors.Is(err, os.ErrNotExist) {
			stale = append(stale, e)
			continue
		}
		if err != nil {
			return nil, nil, fmt.Errorf("checking %s: %w", e.At, err)
		}
		if !slices.ContainsFunc(src, func(l string) bool { return strings.TrimSpace(l) == e.Source }) {
			stale = append(stale, e)
			continue
		}
		if !tl.Used[e.key()] {
			unused = append(unused, e)
		}
	}
	return stale, unused, nil
}

// inScope says whether file (from the repository root) is mutated by t.
func inScope(t target, file string) bool {
	dir, name := path.Split(file)
	if path.Clean(dir) != t.dir {
		return false
	}
	return len(t.only) == 0 || slices.Contains(t.only, name)
}

// unleash runs gremlins on one target, its progress going to w and its
// results to out.
func unleash(ctx context.Context, c config, t target, out string, w io.Writer) error {
	args := []string{"unleash",
		"--workers", fmt.Sprint(c.workers),
		"--timeout-coefficient", fmt.Sprint(c.coefficient),
		"--output", out,
		// Mutants of subpackages would be judged by the subpackages'
		// own tests: they are not this target's.
		"--exclude-files", "/",
	}
	if len(t.only) > 0 {
		names, err := filepath.Glob(filepath.Join(t.dir, "*.go"))
		if err != nil {
			return err
		}
		for _, n := range names {
			base := filepath.Base(n)
			if !strings.HasSuffix(base, "_test.go") && !slices.Contains(t.only, base) {
				args = append(args, "--exclude-files", "^"+regexp.QuoteMeta(base)+"$")
			}
		}
	}
	if c.diff != "" {
		args = append(args, "--diff", c.diff)
	}
	args = append(args, "./"+t.dir)
	cmd := exec.CommandContext(ctx, c.gremlins, args...)
	cmd.Stdout, cmd.Stderr = w, w
	// A cached coverage run would take no time, and gremlins times each
	// mutant out at a multiple of it: every test run must really run.
	goflags := os.Getenv("GOFLAGS") + " -count=1"
	if t.run != "" {
		goflags += " -run=" + t.run
	}
	cmd.Env = append(os.Environ(), "GOFLAGS="+strings.TrimSpace(goflags))
	if c.diff != "" {
		bin, err := relativeGit(t.dir)
		if err != nil {
			return err
		}
		defer os.RemoveAll(bin)
		// The last PATH in Env is the one the command gets.
		cmd.Env = append(cmd.Env, "PATH="+bin+string(os.PathListSeparator)+os.Getenv("PATH"))
	}
	fmt.Fprintf(w, "mutate: %s %s\n", c.gremlins, strings.Join(args, " "))
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("gremlins: %w", err)
	}
	return nil
}

// relativeGit returns a directory holding a git that gremlins runs instead of
// the real one, so that --diff works on a package below the module root:
// gremlins takes the changed lines from `git diff --merge-base REF`, which
// names files from the repository root (bmdb/work.go), and looks them up by
// their names within the package it mutates (work.go), so without this no
// line ever counts as changed and every mutant is skipped. The wrapper adds
// --relative=DIR/ to git diff, which names files from DIR and leaves out
// the others; any other git command runs unchanged. The caller removes the
// directory.
func relativeGit(dir string) (string, error) {
	real, err := exec.LookPath("git")
	if err != nil {
		return "", fmt.Errorf("-diff needs git: %w", err)
	}
	bin, err := os.MkdirTemp("", "shepherd-mutate-git-")
	if err != nil {
		return "", err
	}
	script := fmt.Sprintf("#!/bin/sh\nif [ \"$1\" = diff ]; then\n\tshift\n\texec %s diff --relative=%s/ \"$@\"\nfi\nexec %s \"$@\"\n",
		shellquote.Quote(real), shellquote.Quote(path.Clean(dir)), shellquote.Quote(real))
	if err := os.WriteFile(filepath.Join(bin, "git"), []byte(script), 0o755); err != nil {
		os.RemoveAll(bin)
		return "", err
	}
	return bin, nil
}
