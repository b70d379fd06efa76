package web

import (
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"unicode"
)

// Token is the operator token that authorizes actions. It prints as
// REDACTED everywhere (fmt, slog, templates, JSON), so that it cannot reach a
// page, a log line or an error by accident (SPEC §8 R8); only Matches looks
// at its value.
type Token struct{ digest *[sha256.Size]byte }

// MinTokenLength is the shortest operator token NewToken accepts: a token
// guards fleet-wide actions, so it must not be guessable.
const MinTokenLength = 16

// NewToken returns the token s, which must be at least MinTokenLength bytes
// without spaces or control characters. Only its SHA-256 digest is kept. The
// zero Token is empty and matches nothing.
func NewToken(s string) (Token, error) {
	if len(s) < MinTokenLength {
		return Token{}, fmt.Errorf("web: the operator token must be at least %d characters long", MinTokenLength)
	}
	if strings.ContainsFunc(s, func(r rune) bool { return unicode.IsSpace(r) || unicode.IsControl(r) }) {
		return Token{}, errors.New("web: the operator token contains spaces or control characters")
	}
	d := sha256.Sum256([]byte(s))
	return Token{digest: &d}, nil
}

// Empty reports whether no token is set.
func (t Token) Empty() bool { return t.digest == nil }

// Matches reports whether candidate is the token. It compares SHA-256
// digests in constant time, so neither the contents nor the length of the
// token leak through timing.
func (t Token) Matches(candidate string) bool {
	if t.digest == nil || candidate == "" {
		return false
	}
	c := sha256.Sum256([]byte(candidate))
	return subtle.ConstantTimeCompare(t.digest[:], c[:]) == 1
}

// String returns "REDACTED".
func (Token) String() string { return "REDACTED" }

// GoString returns "REDACTED".
func (Token) GoString() string { return "REDACTED" }

// Format writes "REDACTED" whatever the verb.
func (Token) Format(f fmt.State, _ rune) { _, _ = io.WriteString(f, "REDACTED") }

// LogValue returns "REDACTED".
func (Token) LogValue() slog.Value { return slog.StringValue("REDACTED") }

// MarshalText returns "REDACTED".
func (Token) MarshalText() ([]byte, error) { return []byte("REDACTED"), nil }
