package main

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// A target's -run pattern names its tests by prefix: a test renamed or
// removed would quietly leave the mutants to fewer tests. Every alternative
// must still match a test of the package, and every file it limits mutation
// to must exist.
func TestTargetsNameExistingTestsAndFiles(t *testing.T) {
	for _, tg := range targets {
		root := filepath.Join("..", filepath.FromSlash(tg.dir))
		for _, f := range tg.only {
			if _, err := parser.ParseFile(token.NewFileSet(), filepath.Join(root, f), nil, parser.PackageClauseOnly); err != nil {
				t.Errorf("target %s: file %s: %v", tg.dir, f, err)
			}
		}
		if tg.run == "" {
			continue
		}
		if _, err := regexp.Compile(tg.run); err != nil {
			t.Errorf("target %s: -run %q: %v", tg.dir, tg.run, err)
			continue
		}
		names, err := filepath.Glob(filepath.Join(root, "*_test.go"))
		if err != nil {
			t.Fatal(err)
		}
		var tests []string
		for _, n := range names {
			f, err := parser.ParseFile(token.NewFileSet(), n, nil, parser.SkipObjectResolution)
			if err != nil {
				t.Fatal(err)
			}
			for _, d := range f.Decls {
				if fd, ok := d.(*ast.FuncDecl); ok && fd.Recv == nil && strings.HasPrefix(fd.Name.Name, "Test") {
					tests = append(tests, fd.Name.Name)
				}
			}
		}
		inner := strings.TrimSuffix(strings.TrimPrefix(tg.run, "^("), ")")
		for _, alt := range strings.Split(inner, "|") {
			re := regexp.MustCompile("^" + alt)
			found := false
			for _, name := range tests {
				found = found || re.MatchString(name)
			}
			if !found {
				t.Errorf("target %s: -run alternative %q matches no test of the package", tg.dir, alt)
			}
		}
	}
}

// The parts of a package mutate each of its files once: no file in two
// parts (its mutants would count twice), and none left out when a package
// is split (its mutants would go unjudged). A package of one part may
// limit itself to some files, as bmdb does.
func TestPartsCoverTheirPackageOnce(t *testing.T) {
	parts := map[string][]target{}
	for _, tg := range targets {
		parts[tg.dir] = append(parts[tg.dir], tg)
	}
	for dir, ps := range parts {
		if len(ps) < 2 {
			continue
		}
		in := map[string]int{}
		for _, p := range ps {
			if len(p.only) == 0 {
				t.Errorf("package %s: a part without files would mutate the whole package again", dir)
			}
			for _, f := range p.only {
				in[f]++
			}
		}
		names, err := filepath.Glob(filepath.Join("..", filepath.FromSlash(dir), "*.go"))
		if err != nil {
			t.Fatal(err)
		}
		for _, n := range names {
			base := filepath.Base(n)
			if strings.HasSuffix(base, "_test.go") {
				continue
			}
			if in[base] != 1 {
				t.Errorf("package %s: file %s is in %d parts, want 1", dir, base, in[base])
			}
			delete(in, base)
		}
		for f := range in {
			t.Errorf("package %s: a part names %s, which the package does not have", dir, f)
		}
	}
}
