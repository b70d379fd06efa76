package redfish

import (
	"strings"
	"testing"
	"time"

	"github.com/shepherd/shepherd/internal/secret"
	"github.com/shepherd/shepherd/power"
)

// TestNewDefaults: a zero Config gets the documented defaults, and the
// dialer is bounded by DialTimeout.
func TestNewDefaults(t *testing.T) {
	t.Parallel()
	d, err := New(power.Spec{Driver: power.DriverRedfish, Address: "bmc", Username: "u", Password: secret.New("p")})
	if err != nil {
		t.Fatal(err)
	}
	if d.cfg.Logger == nil {
		t.Error("Logger is nil, want slog.Default()")
	}
	if d.cfg.LogoutTimeout != 5*time.Second {
		t.Errorf("LogoutTimeout = %s, want 5s", d.cfg.LogoutTimeout)
	}
	if d.cfg.DialTimeout != 10*time.Second || d.dialer.Timeout != 10*time.Second {
		t.Errorf("DialTimeout = %s, dialer timeout %s; want 10s", d.cfg.DialTimeout, d.dialer.Timeout)
	}
}

// TestTruncate: a string of n bytes or fewer is kept whole; a longer one is
// cut to n bytes, never inside a UTF-8 sequence, and the cut is marked.
func TestTruncate(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		s    string
		n    int
		want string
	}{
		{"", 3, ""},
		{"abc", 3, "abc"},
		{"abcd", 3, "abc…"},
		{"aé", 2, "a…"}, // é is 2 bytes: cut inside it, the half is dropped
		{strings.Repeat("x", maxWords+1), maxWords, strings.Repeat("x", maxWords) + "…"},
	} {
		if got := truncate(tc.s, tc.n); got != tc.want {
			t.Errorf("truncate(%q, %d) = %q, want %q", tc.s, tc.n, got, tc.want)
		}
	}
}

// TestSuccess: every 2xx is a success, and nothing outside it.
func TestSuccess(t *testing.T) {
	t.Parallel()
	for status, want := range map[int]bool{
		199: false, 200: true, 201: true, 202: true, 204: true, 299: true, 300: false, 404: false,
	} {
		if got := success(status); got != want {
			t.Errorf("success(%d) = %v, want %v", status, got, want)
		}
	}
}
