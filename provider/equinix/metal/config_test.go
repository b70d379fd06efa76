package metal

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

func TestConfigValidate(t *testing.T) {
	t.Parallel()
	ok := Config{Token: testToken}
	tests := []struct {
		name    string
		mod     func(*Config)
		wantErr string // substring; "" means valid
	}{
		{"minimal", func(*Config) {}, ""},
		{"everything set", func(c *Config) {
			*c = Config{BaseURL: "http://127.0.0.1:8080/metal/v1/", Token: testToken, RequestsPerSecond: 0.5,
				Burst: 1, MaxConcurrency: 1, CallTimeout: time.Second, RetryDeadline: time.Minute, PerPage: MaxPerPage}
		}, ""},
		{"no token", func(c *Config) { c.Token = "" }, "Token is required"},
		{"token with newline", func(c *Config) { c.Token = testToken + "\n" }, "Token contains"},
		{"token with space", func(c *Config) { c.Token = "a b" }, "Token contains"},
		{"token in base URL", func(c *Config) { c.BaseURL = "https://api.example/" + testToken }, "BaseURL must not contain the token"},
		{"relative base URL", func(c *Config) { c.BaseURL = "/metal/v1" }, "BaseURL must be an http or https URL"},
		{"ftp base URL", func(c *Config) { c.BaseURL = "ftp://host/metal/v1" }, "BaseURL must be an http or https URL"},
		{"base URL without host", func(c *Config) { c.BaseURL = "https:///metal/v1" }, "BaseURL has no host"},
		{"base URL with user", func(c *Config) { c.BaseURL = "https://u:p@host/metal/v1" }, "user info"},
		{"base URL with query", func(c *Config) { c.BaseURL = "https://host/metal/v1?x=1" }, "query or fragment"},
		{"unparsable base URL", func(c *Config) { c.BaseURL = "http://host:port:1/%zz" }, "BaseURL is not a valid URL"},
		{"negative rate", func(c *Config) { c.RequestsPerSecond = -1 }, "RequestsPerSecond"},
		{"NaN rate", func(c *Config) { c.RequestsPerSecond = math.NaN() }, "RequestsPerSecond"},
		{"infinite rate", func(c *Config) { c.RequestsPerSecond = math.Inf(1) }, "RequestsPerSecond"},
		{"negative burst", func(c *Config) { c.Burst = -1 }, "Burst must be >= 0"},
		{"negative concurrency", func(c *Config) { c.MaxConcurrency = -2 }, "MaxConcurrency must be >= 0"},
		{"negative call timeout", func(c *Config) { c.CallTimeout = -time.Second }, "CallTimeout must be >= 0"},
		{"negative retry deadline", func(c *Config) { c.RetryDeadline = -time.Second }, "RetryDeadline must be >= 0"},
		{"negative page size", func(c *Config) { c.PerPage = -1 }, "PerPage"},
		{"page size too large", func(c *Config) { c.PerPage = MaxPerPage + 1 }, "PerPage"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			cfg := ok
			tt.mod(&cfg)
			err := cfg.Validate()
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("Validate() = %v, want nil", err)
			case tt.wantErr != "" && err == nil:
				t.Fatalf("Validate() = nil, want an error containing %q", tt.wantErr)
			case err != nil && !strings.Contains(err.Error(), tt.wantErr):
				t.Fatalf("Validate() = %v, want an error containing %q", err, tt.wantErr)
			}
			if err != nil && strings.Contains(err.Error(), "SECRET") {
				t.Fatalf("Validate() = %v: names the token", err)
			}
			if _, nerr := New(cfg); (nerr == nil) != (err == nil) {
				t.Fatalf("New() = %v, but Validate() = %v", nerr, err)
			}
		})
	}
}

func TestConfigDefaults(t *testing.T) {
	t.Parallel()
	caller := Config{Token: testToken}
	c, err := New(caller)
	if err != nil {
		t.Fatal(err)
	}
	want := Config{BaseURL: DefaultBaseURL, RequestsPerSecond: DefaultRequestsPerSecond, Burst: DefaultBurst,
		MaxConcurrency: DefaultMaxConcurrency, CallTimeout: DefaultCallTimeout, RetryDeadline: DefaultRetryDeadline,
		PerPage: DefaultPerPage}
	// String shows every field but the token and the hooks, which New
	// drops from its copy.
	if c.cfg.String() != want.String() || c.cfg.SharedBudget != nil || c.cfg.HTTPClient != nil {
		t.Errorf("defaults = %v, want %v", c.cfg, want)
	}
	if caller.BaseURL != "" || caller.Token != testToken {
		t.Errorf("New changed the caller's config: %v", caller)
	}
}

// TestTokenNotPrinted prints Config and Client every way a caller might.
func TestTokenNotPrinted(t *testing.T) {
	t.Parallel()
	cfg := Config{BaseURL: "http://127.0.0.1:1/metal/v1", Token: testToken, Registerer: prometheus.NewRegistry()}
	c, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	holder := struct {
		Cfg    Config
		Client *Client
		Ptr    *Config
	}{cfg, c, &cfg}
	var out []string
	for _, verb := range []string{"%v", "%+v", "%#v", "%s", "%q", "%x", "%X", "%d", "%T"} {
		// reflect.ValueOf(c).Elem() is the Client value, printed by
		// reflection (copying it would copy its lock).
		for _, v := range []any{cfg, &cfg, c, reflect.ValueOf(c).Elem(), holder, c.token, *c.token} {
			out = append(out, fmt.Sprintf(verb, v))
		}
	}
	out = append(out, cfg.String(), cfg.GoString(), c.String())
	var logs bytes.Buffer
	for _, h := range []slog.Handler{slog.NewTextHandler(&logs, nil), slog.NewJSONHandler(&logs, nil)} {
		slog.New(h).Info("config", "cfg", cfg, "client", c, "holder", holder, "token", c.token, "tok", *c.token)
	}
	out = append(out, logs.String())
	if b, err := json.Marshal(struct{ Token *secret }{c.token}); err == nil {
		out = append(out, string(b))
	}
	for _, s := range out {
		if strings.Contains(s, testToken) || strings.Contains(s, fmt.Sprintf("%x", testToken)) {
			t.Fatalf("the token was printed: %s", s)
		}
	}
	if !strings.Contains(fmt.Sprintf("%+v", cfg), "Token:REDACTED") {
		t.Errorf("%%+v of Config = %+v, want it to say Token:REDACTED", cfg)
	}
}
