package manager

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"golang.org/x/time/rate"
)

// Limit is a token-bucket rate limit: at most one event per Every on
// average, with bursts of up to Burst. Flags spell it "duration,burst", as
// in "250ms,8".
type Limit struct {
	Every time.Duration
	Burst int
}

// ParseLimit parses "duration,burst" (for example "250ms,8").
func ParseLimit(s string) (Limit, error) {
	d, b, ok := strings.Cut(strings.TrimSpace(s), ",")
	if !ok {
		return Limit{}, fmt.Errorf("limit %q: want duration,burst (for example 250ms,8)", s)
	}
	every, err := time.ParseDuration(strings.TrimSpace(d))
	if err != nil || every <= 0 {
		return Limit{}, fmt.Errorf("limit %q: %q is not a positive duration", s, d)
	}
	burst, err := strconv.Atoi(strings.TrimSpace(b))
	if err != nil || burst < 1 {
		return Limit{}, fmt.Errorf("limit %q: burst %q is not a positive integer", s, b)
	}
	return Limit{Every: every, Burst: burst}, nil
}

// DefaultLimit is the rate a loop's candidate queries and the provisioner's
// creations keep to when their config names none: 10 at once, then one
// every 100 ms.
func DefaultLimit() Limit { return Limit{Every: 100 * time.Millisecond, Burst: 10} }

// String formats l as ParseLimit reads it.
func (l Limit) String() string { return fmt.Sprintf("%s,%d", l.Every, l.Burst) }

// Set implements flag.Value (and pflag.Value), so a Limit binds to a flag.
func (l *Limit) Set(s string) error {
	v, err := ParseLimit(s)
	if err != nil {
		return err
	}
	*l = v
	return nil
}

// Type implements pflag.Value.
func (l *Limit) Type() string { return "duration,burst" }

func (l Limit) validate(what string) error {
	if l.Every < 0 || l.Burst < 0 {
		return fmt.Errorf("%s: limit %s must not be negative", what, l)
	}
	return nil
}

func (l Limit) limiter(def Limit) *rate.Limiter {
	if l.Every == 0 {
		l.Every = def.Every
	}
	if l.Burst == 0 {
		l.Burst = def.Burst
	}
	return rate.NewLimiter(rate.Every(l.Every), l.Burst)
}
