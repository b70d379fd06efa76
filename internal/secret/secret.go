// Package secret holds passwords and tokens so that they cannot reach a log
// line, an error, a page or a metric by accident: every way Go formats or
// encodes a value prints REDACTED, and only Reveal gives the value back, at
// the one place that hands it to a peer.
package secret

import (
	"fmt"
	"io"
	"log/slog"
)

// String is a secret text. The zero value is the empty secret.
type String struct{ value string }

// New wraps value.
func New(value string) String { return String{value} }

// Reveal returns the secret itself; call it only where the value goes to
// the peer that checks it.
func (s String) Reveal() string { return s.value }

// Empty reports whether no secret is set.
func (s String) Empty() bool { return s.value == "" }

// String, GoString, Format, LogValue and MarshalText print REDACTED for
// fmt's verbs, slog, and encoders (JSON, YAML, templates).
func (String) String() string { return "REDACTED" }

// GoString keeps %#v from printing the value.
func (String) GoString() string { return "REDACTED" }

// LogValue keeps slog from printing the value.
func (String) LogValue() slog.Value { return slog.StringValue("REDACTED") }

// Format keeps every fmt verb (%s, %v, %q, %x, %+v) from printing the value.
func (String) Format(f fmt.State, _ rune) { _, _ = io.WriteString(f, "REDACTED") }

// MarshalText keeps encoders from printing the value.
func (String) MarshalText() ([]byte, error) { return []byte("REDACTED"), nil }
