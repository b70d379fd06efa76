package safetext

import (
	"strings"
	"testing"
	"unicode/utf8"
)

func TestClean(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"checksum mismatch", "checksum mismatch"},
		{"disk\x00gone", "disk\uFFFDgone"},
		{"bad \xff byte", "bad \uFFFD byte"},
		{"é"[:1], "\uFFFD"}, // half a character
	} {
		if got := Clean(c.in); got != c.want {
			t.Errorf("Clean(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

// TestCut holds the cases of the two places that cut error texts before
// this package existed: the callback server (4096 bytes stored) and the
// agent (4096 bytes sent).
func TestCut(t *testing.T) {
	long := strings.Repeat("€", 2000) // 6,000 bytes of 3-byte characters
	for _, c := range []struct {
		name string
		in   string
		n    int
		want string
	}{
		{"plain", "plain", 10, "plain"},
		{"NUL and invalid UTF-8", "a\xffb\x00c", 20, "a\uFFFDb\uFFFDc"},
		{"cut", "abcdefghij", 8, "abcde..."},
		{"2-byte characters", "ééééé", 8, "éé..."}, // 4 bytes of é fit before the mark, a fifth byte would split one
		{"2-byte characters, odd limit", "éééé", 7, "éé..."},
		{"limit shorter than the mark", "abc", 2, ".."},
		{"cut on a character boundary", long, 4096, long[:4092] + "..."},
		{"exactly the limit", long[:4095] + "a", 4096, long[:4095] + "a"},
	} {
		got := Cut(c.in, c.n)
		if got != c.want {
			t.Errorf("%s: Cut(%.20q, %d) = %.40q (%d bytes), want %.40q (%d bytes)", c.name, c.in, c.n, got, len(got), c.want, len(c.want))
		}
		if !utf8.ValidString(got) || len(got) > c.n || strings.ContainsRune(got, 0) {
			t.Errorf("%s: %d bytes, valid UTF-8 %v", c.name, len(got), utf8.ValidString(got))
		}
	}
}

func TestStorable(t *testing.T) {
	for s, want := range map[string]bool{
		"":                       true,
		"fra1":                   true,
		"m\u00e9t\u00e9o \uFFFD": true, // a replacement character is text like any other
		"m\x00":                  false,
		"\xff\xfe":               false,
		"caf\xc3":                false, // half a character
	} {
		if got := Storable(s); got != want {
			t.Errorf("Storable(%q) = %v, want %v", s, got, want)
		}
		if want && Clean(s) != s {
			t.Errorf("Clean(%q) changed text Storable accepts", s)
		}
	}
}
