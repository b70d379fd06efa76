package metal

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"net/url"
	"strings"
	"time"
	"unicode"

	"github.com/prometheus/client_golang/prometheus"
)

// Defaults of Config; a zero field means "use the default".
const (
	DefaultBaseURL           = "https://api.equinix.com/metal/v1"
	DefaultRequestsPerSecond = 5
	DefaultBurst             = 10
	DefaultMaxConcurrency    = 8
	DefaultCallTimeout       = 30 * time.Second
	DefaultRetryDeadline     = 2 * time.Minute
	DefaultPerPage           = 100
)

// MaxPerPage is the largest page size the API serves.
const MaxPerPage = 1000

// redacted replaces the token wherever a value holding it is printed.
const redacted = "REDACTED"

// Config configures a Client. The zero value of every field but Token
// means its default.
type Config struct {
	// BaseURL is the API root, an absolute http(s) URL without user info,
	// query or fragment; default DefaultBaseURL. Page links the API returns
	// are followed only on this scheme, host and path prefix.
	BaseURL string
	// Token authenticates every request (X-Auth-Token); required. It never
	// appears in logs, errors, metrics or printed values.
	Token string `json:"-"`
	// RequestsPerSecond is the account's request budget, a token bucket
	// shared by every caller of the client; default 5.
	RequestsPerSecond float64
	// Burst is the token bucket's size; default 10.
	Burst int
	// MaxConcurrency bounds requests in flight at once; default 8.
	MaxConcurrency int
	// CallTimeout bounds one HTTP attempt, from sending the request to
	// reading the whole response; default 30s.
	CallTimeout time.Duration
	// RetryDeadline bounds a call including its retries and waits; default
	// 2m. A list call applies it to each page.
	RetryDeadline time.Duration
	// PerPage is the page size asked for when listing; default 100, at most
	// MaxPerPage.
	PerPage int
	// SharedBudget, if set, gives the client the request budget that every
	// process using the account shares (the BMDB's, SPEC §5.3) instead of a
	// token bucket of its own: New calls it once with the account's name
	// (Account), RequestsPerSecond and Burst. Nil keeps the budget in the
	// process, which is right only while one process uses the account.
	SharedBudget func(account string, requestsPerSecond float64, burst int) (Budget, error)
	// HTTPClient sends the requests; default a client whose transport has
	// dial and TLS handshake timeouts. The Client uses a copy that does not
	// follow redirects, so the token never goes to another host.
	HTTPClient *http.Client
	// Registerer receives the client's metrics; nil keeps them private.
	Registerer prometheus.Registerer
	// Logger receives debug lines about retries; nil discards them.
	Logger *slog.Logger
}

// Validate names the first bad field and its value (never the token's).
// It changes nothing.
func (c Config) Validate() error {
	switch {
	case c.Token == "":
		return errors.New("metal: Token is required")
	case strings.ContainsFunc(c.Token, isCtlOrSpace):
		// Do not echo the token, not even a part of it.
		return errors.New("metal: Token contains spaces or control characters")
	case c.BaseURL != "" && strings.Contains(c.BaseURL, c.Token):
		return errors.New("metal: BaseURL must not contain the token")
	}
	if c.BaseURL != "" {
		if err := validateBaseURL(c.BaseURL); err != nil {
			return err
		}
	}
	switch {
	case math.IsNaN(c.RequestsPerSecond) || math.IsInf(c.RequestsPerSecond, 0) || c.RequestsPerSecond < 0:
		return fmt.Errorf("metal: RequestsPerSecond must be a finite number >= 0 (0 = default %d), got %v",
			DefaultRequestsPerSecond, c.RequestsPerSecond)
	case c.Burst < 0:
		return fmt.Errorf("metal: Burst must be >= 0 (0 = default %d), got %d", DefaultBurst, c.Burst)
	case c.MaxConcurrency < 0:
		return fmt.Errorf("metal: MaxConcurrency must be >= 0 (0 = default %d), got %d",
			DefaultMaxConcurrency, c.MaxConcurrency)
	case c.CallTimeout < 0:
		return fmt.Errorf("metal: CallTimeout must be >= 0 (0 = default %s), got %s", DefaultCallTimeout, c.CallTimeout)
	case c.RetryDeadline < 0:
		return fmt.Errorf("metal: RetryDeadline must be >= 0 (0 = default %s), got %s",
			DefaultRetryDeadline, c.RetryDeadline)
	case c.PerPage < 0 || c.PerPage > MaxPerPage:
		return fmt.Errorf("metal: PerPage must be between 0 (default %d) and %d, got %d",
			DefaultPerPage, MaxPerPage, c.PerPage)
	}
	return nil
}

func isCtlOrSpace(r rune) bool { return unicode.IsSpace(r) || unicode.IsControl(r) }

func validateBaseURL(s string) error {
	u, err := url.Parse(s)
	if err != nil {
		// url.Parse's error quotes the URL; the token check comes later, so
		// do not quote what may be a mistyped token.
		return errors.New("metal: BaseURL is not a valid URL")
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return fmt.Errorf("metal: BaseURL must be an http or https URL, got scheme %q", u.Scheme)
	case u.Host == "":
		return errors.New("metal: BaseURL has no host")
	case u.User != nil:
		return errors.New("metal: BaseURL must not contain user info")
	case u.RawQuery != "" || u.ForceQuery || u.Fragment != "":
		return errors.New("metal: BaseURL must not have a query or fragment")
	}
	return nil
}

// Account names the API account c speaks for, for a budget shared by every
// process using it: "metal:" and the first 128 bits of the SHA-256 of the
// base URL and the token, in hex. The token cannot be recovered from it, so
// it may be stored and logged; processes with the same URL and token get
// the same name.
func (c Config) Account() string {
	h := sha256.Sum256([]byte(strings.TrimRight(cmp.Or(c.BaseURL, DefaultBaseURL), "/") + "\x00" + c.Token))
	return "metal:" + hex.EncodeToString(h[:16])
}

// withDefaults returns a copy of c with every zero field set to its
// default.
func (c Config) withDefaults() Config {
	c.BaseURL = strings.TrimRight(cmp.Or(c.BaseURL, DefaultBaseURL), "/")
	c.RequestsPerSecond = cmp.Or(c.RequestsPerSecond, DefaultRequestsPerSecond)
	c.Burst = cmp.Or(c.Burst, DefaultBurst)
	c.MaxConcurrency = cmp.Or(c.MaxConcurrency, DefaultMaxConcurrency)
	c.CallTimeout = cmp.Or(c.CallTimeout, DefaultCallTimeout)
	c.RetryDeadline = cmp.Or(c.RetryDeadline, DefaultRetryDeadline)
	c.PerPage = cmp.Or(c.PerPage, DefaultPerPage)
	return c
}

// String describes the configuration with the token redacted.
func (c Config) String() string {
	tok := "unset"
	if c.Token != "" {
		tok = redacted
	}
	return fmt.Sprintf("metal.Config{BaseURL:%q Token:%s RequestsPerSecond:%v Burst:%d MaxConcurrency:%d "+
		"CallTimeout:%s RetryDeadline:%s PerPage:%d}",
		c.BaseURL, tok, c.RequestsPerSecond, c.Burst, c.MaxConcurrency, c.CallTimeout, c.RetryDeadline, c.PerPage)
}

// GoString is String, so that %#v does not print the token either.
func (c Config) GoString() string { return c.String() }

// Format prints String for every verb (%v, %+v, %#v, %s, %q, %x, ...), so
// no verb reaches the token through reflection.
func (c Config) Format(f fmt.State, _ rune) { _, _ = io.WriteString(f, c.String()) }

// LogValue logs the configuration without the token.
func (c Config) LogValue() slog.Value { return slog.StringValue(c.String()) }

// secret holds the token inside the Client. Whatever prints it gets
// REDACTED.
type secret string

func newSecret(s string) *secret { return (*secret)(&s) }

func (secret) String() string               { return redacted }
func (secret) GoString() string             { return redacted }
func (secret) Format(f fmt.State, _ rune)   { _, _ = io.WriteString(f, redacted) }
func (secret) LogValue() slog.Value         { return slog.StringValue(redacted) }
func (secret) MarshalText() ([]byte, error) { return []byte(redacted), nil }
func (s secret) scrub(msg string) string    { return scrub(msg, string(s)) }
func scrub(msg, token string) string {
	if token == "" {
		return msg
	}
	return strings.ReplaceAll(msg, token, redacted)
}
