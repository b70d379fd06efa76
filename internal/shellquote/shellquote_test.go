package shellquote_test

import (
	"os/exec"
	"testing"

	"github.com/shepherd/shepherd/internal/shellquote"
)

// hostile are words a shell would expand, split or run if they were not
// quoted well.
var hostile = []string{"plain", "", "it's", "two words", "$(touch /tmp/shellquote-pwned)", "`id`", "$HOME", "a\nb",
	"'", `\`, "*", "~", "!x", "--flag=1", "é", ";", "a&b|c>d"}

// TestShellReadsTheWordsBack has a real sh print every quoted word back, one
// per line, and checks it got exactly the words: nothing expanded, split or
// run.
func TestShellReadsTheWordsBack(t *testing.T) {
	for name, quote := range map[string]func(string) string{"Quote": shellquote.Quote, "Readable": shellquote.Readable} {
		for _, w := range hostile {
			out, err := exec.Command("sh", "-c", "printf '%s' "+quote(w)).Output()
			if err != nil {
				t.Fatalf("%s(%q): sh: %v", name, w, err)
			}
			if string(out) != w {
				t.Errorf("%s(%q) read back by sh as %q", name, w, out)
			}
		}
	}
	out, err := exec.Command("sh", "-c", "printf '[%s]' "+shellquote.Join(hostile...)).Output()
	if err != nil {
		t.Fatal(err)
	}
	want := ""
	for _, w := range hostile {
		want += "[" + w + "]"
	}
	if string(out) != want {
		t.Errorf("Join read back by sh as %q, want %q", out, want)
	}
}

// TestReadableLeavesPlainWords checks Readable quotes only what needs it.
func TestReadableLeavesPlainWords(t *testing.T) {
	for w, want := range map[string]string{
		"postgres://u@h:5432/db": "postgres://u@h:5432/db",
		"a b":                    "'a b'",
		"":                       "''",
		"x=1,y+2%":               "x=1,y+2%",
	} {
		if got := shellquote.Readable(w); got != want {
			t.Errorf("Readable(%q) = %s, want %s", w, got, want)
		}
	}
}
