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
