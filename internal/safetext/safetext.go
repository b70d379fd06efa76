// Package safetext makes untrusted text acceptable to every store and wire
// Shepherd puts it on: PostgreSQL text (which refuses NUL bytes and invalid
// UTF-8, and with them a whole batch of parameters) and protobuf strings
// (which must be valid UTF-8 or the message cannot be marshalled). The
// agent, the callback server and the BMDB clean error texts with it, so an
// honest error message in any encoding never poisons anything.
package safetext

import (
	"strings"
	"unicode/utf8"
)

// replacement stands for each invalid byte sequence and each NUL.
const replacement = "\uFFFD"

// cutMark ends a text that Cut shortened.
const cutMark = "..."

// Clean returns s as valid UTF-8 without NUL bytes: each invalid byte
// sequence and each NUL becomes U+FFFD.
func Clean(s string) string {
	return strings.ReplaceAll(strings.ToValidUTF8(s, replacement), "\x00", replacement)
}

// Storable reports whether s is text PostgreSQL takes as it is: valid
// UTF-8 without NUL bytes. Input that must be refused rather than cleaned
// (a filter the operator typed) is checked with it.
func Storable(s string) bool {
	return utf8.ValidString(s) && !strings.ContainsRune(s, 0)
}

// Cut returns Clean(s) cut to at most n bytes on a character boundary,
// ending in "..." if it was cut (as much of the mark as fits when n < 3).
func Cut(s string, n int) string {
	s = Clean(s)
	if len(s) <= n {
		return s
	}
	cut := max(n-len(cutMark), 0)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + cutMark[:min(len(cutMark), max(n, 0))]
}
