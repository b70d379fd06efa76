package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path"
	"strings"
)

// result is the part of gremlins' machine-readable output (-o) that the
// report reads. File names are relative to the directory gremlins ran on.
type result struct {
	Files []struct {
		Name      string     `json:"file_name"`
		Mutations []mutation `json:"mutations"`
	} `json:"files"`
}

// mutation is one mutant as gremlins reports it.
type mutation struct {
	Type   string `json:"type"`
	Status string `json:"status"`
	Line   int    `json:"line"`
	Column int    `json:"column"`
}

// Statuses gremlins writes into its JSON output.
const (
	statusKilled     = "KILLED"
	statusLived      = "LIVED"
	statusNotCovered = "NOT COVERED"
	statusTimedOut   = "TIMED OUT"
	statusNotViable  = "NOT VIABLE"
	// statusSkipped: outside the lines a -diff run mutates; judged by
	// nothing, counted nowhere.
	statusSkipped = "SKIPPED"
)

// equivalent is one line of mutate/equivalent.txt: a mutant that lives
// because it changes no behaviour, and why. It is matched by file, mutator
// and the text of the source line rather than by line number, so that an
// entry survives edits elsewhere in the file.
type equivalent struct {
	File, Type, Source, Why string
	// At is where the entry was read, for messages about it.
	At string
}

func (e equivalent) key() string { return e.File + "|" + e.Type + "|" + e.Source }

// parseEquivalents reads the equivalent-mutant list: one entry per line,
// `path|MUTATOR|source line|why`, blank lines and # comments ignored.
func parseEquivalents(r io.Reader, name string) ([]equivalent, error) {
	var out []equivalent
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.SplitN(line, "|", 4)
		if len(f) != 4 {
			return nil, fmt.Errorf("%s:%d: want path|MUTATOR|source line|why, got %d fields", name, n, len(f))
		}
		e := equivalent{File: strings.TrimSpace(f[0]), Type: strings.TrimSpace(f[1]),
			Source: strings.TrimSpace(f[2]), Why: strings.TrimSpace(f[3]), At: fmt.Sprintf("%s:%d", name, n)}
		switch {
		case e.File == "" || e.Type == "" || e.Source == "":
			return nil, fmt.Errorf("%s:%d: path, mutator and source line must not be empty", name, n)
		case e.Why == "":
			return nil, fmt.Errorf("%s:%d: says no reason why the mutant changes no behaviour", name, n)
		}
		out = append(out, e)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("reading %s: %w", name, err)
	}
	return out, nil
}

// survivor is a mutant that lived and is not recorded as equivalent.
type survivor struct {
	File   string // from the repository root
	Source string // the line it mutates, trimmed
	mutation
}

// tally is the outcome of one package's run.
type tally struct {
	Killed, Lived, Equivalent, NotCovered, TimedOut, NotViable int
	Survivors                                                  []survivor
	// Used are the equivalents that matched a lived mutant.
	Used map[string]bool
}

// add counts o's mutants into t (the parts of one package); survivors and
// used equivalents stay with each part, which reports them itself.
func (t *tally) add(o tally) {
	t.Killed += o.Killed
	t.Lived += o.Lived
	t.Equivalent += o.Equivalent
	t.NotCovered += o.NotCovered
	t.TimedOut += o.TimedOut
	t.NotViable += o.NotViable
}

// Efficacy is the percentage of mutants that can change behaviour and were
// killed: equivalent mutants are left out of the denominator, as are mutants
// that timed out (gremlins counts them neither way).
func (t tally) Efficacy() float64 {
	n := t.Killed + t.Lived - t.Equivalent
	if n == 0 {
		return 100
	}
	return 100 * float64(t.Killed) / float64(n)
}

// Coverage is the percentage of mutants that the package's own tests reach.
func (t tally) Coverage() float64 {
	n := t.Killed + t.Lived + t.NotCovered + t.TimedOut
	if n == 0 {
		return 100
	}
	return 100 * float64(t.Killed+t.Lived+t.TimedOut) / float64(n)
}

// sourceLines reads a file's lines for matching equivalents; it is a
// variable's worth of indirection so that tests need no files.
type sourceLines func(file string) ([]string, error)

func readLines(file string) ([]string, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	return strings.Split(string(b), "\n"), nil
}

// count classifies the mutants of a run on dir (a path from the repository
// root) against the equivalent list.
func count(res result, dir string, eqs []equivalent, lines sourceLines) (tally, error) {
	t := tally{Used: map[string]bool{}}
	byKey := map[string]bool{}
	for _, e := range eqs {
		byKey[e.key()] = true
	}
	for _, f := range res.Files {
		file := path.Join(dir, f.Name)
		var src []string
		for _, m := range f.Mutations {
			switch m.Status {
			case statusKilled:
				t.Killed++
			case statusNotCovered:
				t.NotCovered++
			case statusTimedOut:
				t.TimedOut++
			case statusNotViable:
				t.NotViable++
			case statusSkipped:
			case statusLived:
				t.Lived++
				if src == nil {
					var err error
					if src, err = lines(file); err != nil {
						return tally{}, fmt.Errorf("reading the source of a lived mutant: %w", err)
					}
				}
				if m.Line < 1 || m.Line > len(src) {
					return tally{}, fmt.Errorf("%s:%d: gremlins reports a line the file does not have", file, m.Line)
				}
				s := strings.TrimSpace(src[m.Line-1])
				k := file + "|" + m.Type + "|" + s
				if byKey[k] {
					t.Equivalent++
					t.Used[k] = true
					continue
				}
				t.Survivors = append(t.Survivors, survivor{File: file, Source: s, mutation: m})
			default:
				return tally{}, fmt.Errorf("%s:%d:%d: unknown mutant status %q", file, m.Line, m.Column, m.Status)
			}
		}
	}
	return t, nil
}

// decode reads gremlins' JSON output.
func decode(r io.Reader) (result, error) {
	var res result
	if err := json.NewDecoder(r).Decode(&res); err != nil {
		return result{}, fmt.Errorf("decoding gremlins output: %w", err)
	}
	return res, nil
}
