package secret_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"github.com/shepherd/shepherd/internal/secret"
)

// TestSecretNeverPrinted: every way a value is formatted, logged or encoded
// prints REDACTED, and only Reveal returns the value.
func TestSecretNeverPrinted(t *testing.T) {
	const pw = "hunter2-very-secret"
	s := secret.New(pw)
	type holder struct {
		Name     string
		Password secret.String
	}
	h := holder{"bmc", s}
	var out []string
	for _, verb := range []string{"%s", "%v", "%+v", "%#v", "%q", "%x", "%X", "%d"} {
		out = append(out, fmt.Sprintf(verb, s), fmt.Sprintf(verb, h), fmt.Sprintf(verb, &h))
	}
	j, err := json.Marshal(h)
	if err != nil {
		t.Fatal(err)
	}
	out = append(out, string(j), fmt.Sprint(fmt.Errorf("wrapping %v", h)))
	var logs bytes.Buffer
	logger := slog.New(slog.NewJSONHandler(&logs, nil))
	logger.Info("x", "secret", s, "holder", h)
	slog.New(slog.NewTextHandler(&logs, nil)).Info("x", "secret", s, "holder", h)
	out = append(out, logs.String())
	for _, o := range out {
		if strings.Contains(o, pw) || strings.Contains(o, fmt.Sprintf("%x", pw)) {
			t.Errorf("secret printed: %s", o)
		}
		if !strings.Contains(o, "REDACTED") {
			t.Errorf("no REDACTED in %s", o)
		}
	}
	if got := s.Reveal(); got != pw {
		t.Errorf("Reveal() = %q, want %q", got, pw)
	}
	if s.Empty() || !secret.New("").Empty() || !(secret.String{}).Empty() {
		t.Error("Empty() wrong")
	}
}
