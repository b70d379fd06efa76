package main

import (
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
)

func TestParseEquivalents(t *testing.T) {
	in := `# a comment

server/a.go|CONDITIONALS_BOUNDARY|  if n > max {  |n is capped at max+1 before
`
	got, err := parseEquivalents(strings.NewReader(in), "eq.txt")
	if err != nil {
		t.Fatal(err)
	}
	want := equivalent{File: "server/a.go", Type: "CONDITIONALS_BOUNDARY", Source: "if n > max {", Why: "n is capped at max+1 before", At: "eq.txt:3"}
	if len(got) != 1 || got[0] != want {
		t.Fatalf("got %+v, want [%+v]", got, want)
	}
}

func TestParseEquivalentsRefusesIncompleteEntries(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"server/a.go|ARITHMETIC_BASE|x := a + b\n", "eq.txt:1: want path|MUTATOR|source line|why, got 3 fields"},
		{"#\nserver/a.go|ARITHMETIC_BASE|x := a + b|  \n", "eq.txt:2: says no reason"},
		{"server/a.go||x := a + b|why\n", "eq.txt:1: path, mutator and source line must not be empty"},
	} {
		_, err := parseEquivalents(strings.NewReader(tc.in), "eq.txt")
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("parsing %q: got error %v, want one containing %q", tc.in, err, tc.want)
		}
	}
}

// fakeSource serves file contents from a map, as the source tree would.
func fakeSource(files map[string]string) sourceLines {
	return func(file string) ([]string, error) {
		s, ok := files[file]
		if !ok {
			return nil, fmt.Errorf("open %s: %w", file, os.ErrNotExist)
		}
		return strings.Split(s, "\n"), nil
	}
}

const gremlinsOutput = `{"go_module":"m","files":[{"file_name":"a.go","mutations":[
{"type":"CONDITIONALS_BOUNDARY","status":"LIVED","line":2,"column":7},
{"type":"CONDITIONALS_NEGATION","status":"LIVED","line":2,"column":7},
{"type":"ARITHMETIC_BASE","status":"KILLED","line":3,"column":9},
{"type":"ARITHMETIC_BASE","status":"KILLED","line":3,"column":12},
{"type":"INCREMENT_DECREMENT","status":"NOT COVERED","line":4,"column":3},
{"type":"INVERT_NEGATIVES","status":"TIMED OUT","line":3,"column":9},
{"type":"INVERT_NEGATIVES","status":"NOT VIABLE","line":3,"column":5},
{"type":"CONDITIONALS_BOUNDARY","status":"SKIPPED","line":2,"column":7}]}]}`

func TestCountSeparatesEquivalentsFromSurvivors(t *testing.T) {
	res, err := decode(strings.NewReader(gremlinsOutput))
	if err != nil {
		t.Fatal(err)
	}
	src := fakeSource(map[string]string{"server/a.go": "package a\n\tif n > max {\n\tx := a + b * c\n\ti++\n"})
	eqs := []equivalent{{File: "server/a.go", Type: "CONDITIONALS_BOUNDARY", Source: "if n > max {", Why: "w"}}
	tl, err := count(res, "server", eqs, src)
	if err != nil {
		t.Fatal(err)
	}
	if tl.Killed != 2 || tl.Lived != 2 || tl.Equivalent != 1 || tl.NotCovered != 1 || tl.TimedOut != 1 || tl.NotViable != 1 {
		t.Fatalf("tally %+v", tl)
	}
	if len(tl.Survivors) != 1 {
		t.Fatalf("survivors %+v, want the negation only", tl.Survivors)
	}
	s := tl.Survivors[0]
	if s.File != "server/a.go" || s.Type != "CONDITIONALS_NEGATION" || s.Line != 2 || s.Source != "if n > max {" {
		t.Fatalf("survivor %+v", s)
	}
	// 2 killed of the 3 that can change behaviour; 5 of 6 reached (a
	// timeout was reached by a test). A mutant -diff skipped (outside the
	// changed lines) counts nowhere.
	if got := fmt.Sprintf("%.1f %.1f", tl.Efficacy(), tl.Coverage()); got != "66.7 83.3" {
		t.Fatalf("efficacy, coverage = %s, want 66.7 83.3", got)
	}
}

func TestCountRefusesWhatItCannotJudge(t *testing.T) {
	src := fakeSource(map[string]string{"server/a.go": "package a\n"})
	for _, tc := range []struct{ json, want string }{
		{`{"files":[{"file_name":"a.go","mutations":[{"type":"X","status":"LIVED","line":9}]}]}`, "server/a.go:9: gremlins reports a line the file does not have"},
		{`{"files":[{"file_name":"a.go","mutations":[{"type":"X","status":"ODD","line":1,"column":2}]}]}`, `server/a.go:1:2: unknown mutant status "ODD"`},
		{`{"files":[{"file_name":"b.go","mutations":[{"type":"X","status":"LIVED","line":1}]}]}`, "reading the source of a lived mutant"},
	} {
		res, err := decode(strings.NewReader(tc.json))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := count(res, "server", nil, src); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("got %v, want an error containing %q", err, tc.want)
		}
	}
}

func TestAuditFindsStaleAndUnusedEntries(t *testing.T) {
	src := fakeSource(map[string]string{"bmdb/work.go": "a\n  b := 1\n", "bmdb/machines.go": "c\n"})
	tg := target{dir: "bmdb", only: []string{"work.go"}}
	used := equivalent{File: "bmdb/work.go", Type: "T", Source: "b := 1"}
	unusedE := equivalent{File: "bmdb/work.go", Type: "U", Source: "a"}
	gone := equivalent{File: "bmdb/work.go", Type: "T", Source: "b := 2"}
	deleted := equivalent{File: "bmdb/session.go", Type: "T", Source: "x"}
	outOfScope := equivalent{File: "bmdb/machines.go", Type: "T", Source: "nope"}
	sub := equivalent{File: "bmdb/sub/work.go", Type: "T", Source: "nope"}
	tl := tally{Used: map[string]bool{used.key(): true}}
	stale, unused, err := audit(tg, []equivalent{used, unusedE, gone, deleted, outOfScope, sub}, tl, src)
	if err != nil {
		t.Fatal(err)
	}
	if len(stale) != 1 || stale[0] != gone {
		t.Errorf("stale = %+v, want only %+v (session.go is out of scope too)", stale, gone)
	}
	if len(unused) != 1 || unused[0] != unusedE {
		t.Errorf("unused = %+v, want only %+v", unused, unusedE)
	}
	tg.only = nil
	stale, _, err = audit(tg, []equivalent{deleted}, tl, src)
	if err != nil || len(stale) != 1 {
		t.Errorf("an entry of a deleted file in scope: stale=%+v err=%v, want it stale", stale, err)
	}
}

func TestChosenKeepsTheScopeOfKnownPackages(t *testing.T) {
	got := chosen([]string{"./bmdb", "web/"})
	if len(got) != 2 || got[0].dir != "bmdb" || len(got[0].only) == 0 || got[1].dir != "web" || got[1].only != nil {
		t.Fatalf("chosen = %+v", got)
	}
	if all := chosen(nil); len(all) != len(targets) {
		t.Fatalf("no package named chose %d targets, want all %d", len(all), len(targets))
	}
	parts := chosen([]string{"manager"})
	if len(parts) < 2 {
		t.Fatalf("chosen(manager) = %+v, want its parts", parts)
	}
	for _, p := range parts {
		if p.dir != "manager" || len(p.only) == 0 || p.run == "" {
			t.Errorf("a part of manager: %+v, want files and the tests that judge them", p)
		}
	}
}

// The parts of a package add up to its figure.
func TestTallyAdd(t *testing.T) {
	var sum tally
	sum.add(tally{Killed: 1, Lived: 2, Equivalent: 1, NotCovered: 3, TimedOut: 4, NotViable: 5})
	sum.add(tally{Killed: 10, Lived: 20, Equivalent: 10, NotCovered: 30, TimedOut: 40, NotViable: 50})
	want := tally{Killed: 11, Lived: 22, Equivalent: 11, NotCovered: 33, TimedOut: 44, NotViable: 55}
	if sum.Killed != want.Killed || sum.Lived != want.Lived || sum.Equivalent != want.Equivalent ||
		sum.NotCovered != want.NotCovered || sum.TimedOut != want.TimedOut || sum.NotViable != want.NotViable {
		t.Errorf("sum %+v, want %+v", sum, want)
	}
}

func TestConfigCheck(t *testing.T) {
	good := config{gremlins: "g", workers: 1, coefficient: 1}
	if err := good.check(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []config{{workers: 1, coefficient: 1}, {gremlins: "g", coefficient: 1}, {gremlins: "g", workers: 1}} {
		if c.check() == nil {
			t.Errorf("%+v passed the check", c)
		}
	}
}

// -files keeps the parts that hold the files, each limited to them, and
// limits a whole package to them; a file no chosen package has is an error
// that names it, not a run that mutates nothing.
func TestOnlyLimitsToFiles(t *testing.T) {
	ts := []target{
		{dir: "manager", only: []string{"loop.go", "limit.go"}, run: "^TestRunner"},
		{dir: "manager", only: []string{"updater.go"}, run: "^TestUpdater"},
		{dir: "server"},
	}
	have := map[string]bool{"manager/loop.go": true, "manager/limit.go": true, "manager/updater.go": true, "server/handler.go": true}
	exists := func(p string) bool { return have[p] }
	got, err := only(ts, []string{"limit.go", "handler.go"}, exists)
	if err != nil || len(got) != 2 || got[0].run != "^TestRunner" || !slices.Equal(got[0].only, []string{"limit.go"}) ||
		got[1].dir != "server" || !slices.Equal(got[1].only, []string{"handler.go"}) {
		t.Errorf("only = %+v, %v", got, err)
	}
	if !slices.Equal(ts[0].only, []string{"loop.go", "limit.go"}) {
		t.Errorf("only changed the table: %+v", ts[0])
	}
	if got, err := only(ts, nil, exists); err != nil || len(got) != 3 {
		t.Errorf("no files: %+v, %v; want every target", got, err)
	}
	_, err = only(ts, []string{"loop.go", "lopo.go", "handlr.go"}, exists)
	if want := "-files: lopo.go, handlr.go: no such file in manager, server"; err == nil || err.Error() != want {
		t.Errorf("misspelt files: %v, want %q", err, want)
	}
	if !fileExists("main.go") || fileExists("no-such-file.go") {
		t.Error("fileExists is wrong about this package's own files")
	}
}
