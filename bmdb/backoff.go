package bmdb

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
)

// DefaultJitter is the jitter fraction used when BackoffPolicy.Jitter is zero.
const DefaultJitter = 0.1

// BackoffPolicy says how long a process leaves a machine alone after a failure
// (SPEC §2.5). Zero values mean defaults where one is given.
type BackoffPolicy struct {
	// Initial is the wait after the first failure; required.
	Initial time.Duration
	// Maximum caps the wait; 0 means no cap. Must not be below Initial.
	Maximum time.Duration
	// Exponent multiplies the last interval on every further failure; the
	// result is rounded up to whole seconds, so it grows at least a second at
	// a time until the cap. 1 or less (or 0) keeps the interval at Initial.
	Exponent float64
	// Jitter stretches each wait by a random fraction in [0, Jitter), so that
	// machines that failed together are retried apart. 0 means DefaultJitter.
	Jitter float64
	// MaxAttempts quarantines the machine for the process after this many
	// failures in a row, until an operator resets it; 0 means never.
	MaxAttempts int
}

// AgentStartBackoff is the default policy of agent start: 5 s, doubling,
// up to 4 h; quarantined after 20 failures in a row (about a day and a half
// of trying). The first retries come within seconds, so that an operator
// who fixed what failed (a key missing from authorized_keys, a wrong
// --agent-dir or --ssh-user) sees the machine taken over at once; the wait
// reaches 5 min by the 7th failure and the cap by the 13th.
func AgentStartBackoff() BackoffPolicy {
	return BackoffPolicy{Initial: 5 * time.Second, Maximum: 4 * time.Hour, Exponent: 2, MaxAttempts: 20}
}

// RecoveryBackoff is the default policy of recovery: 1 min, ×1.2, up to 1 h;
// quarantined after 20 failed reboots in a row.
func RecoveryBackoff() BackoffPolicy {
	return BackoffPolicy{Initial: time.Minute, Maximum: time.Hour, Exponent: 1.2, MaxAttempts: 20}
}

// Validate reports the first problem with the policy. It changes nothing.
// The checks are ifs rather than a switch: gremlins 0.6.0 cannot see tests
// reach a case expression (Go's coverage blocks start after the colon), so
// as cases these boundaries would never be mutation-tested.
func (p BackoffPolicy) Validate() error {
	if p.Initial <= 0 {
		return fmt.Errorf("bmdb: backoff Initial must be > 0, got %s", p.Initial)
	}
	if p.Maximum < 0 {
		return fmt.Errorf("bmdb: backoff Maximum must be >= 0 (0 = no cap), got %s", p.Maximum)
	}
	if p.Maximum != 0 && p.Maximum < p.Initial {
		return fmt.Errorf("bmdb: backoff Maximum %s is below Initial %s", p.Maximum, p.Initial)
	}
	if math.IsNaN(p.Exponent) || math.IsInf(p.Exponent, 0) || p.Exponent < 0 {
		return fmt.Errorf("bmdb: backoff Exponent must be a finite number >= 0, got %v", p.Exponent)
	}
	if math.IsNaN(p.Jitter) || p.Jitter < 0 || p.Jitter > 1 {
		return fmt.Errorf("bmdb: backoff Jitter must be within [0, 1], got %v", p.Jitter)
	}
	if p.MaxAttempts < 0 {
		return fmt.Errorf("bmdb: backoff MaxAttempts must be >= 0 (0 = never quarantine), got %d", p.MaxAttempts)
	}
	return nil
}

// Next returns the interval to wait after a failure, given the interval of
// the previous failure in a row (0 for the first).
func (p BackoffPolicy) Next(last time.Duration) time.Duration {
	if last <= 0 || p.Exponent <= 1 {
		return p.Initial
	}
	// The epsilon keeps float error (300 s × 1.2 = 360.00000000000006 s) from
	// rounding an exact result up by a whole second.
	secs := math.Ceil(last.Seconds()*p.Exponent - 1e-9)
	next := time.Duration(secs) * time.Second
	if secs >= math.MaxInt64/float64(time.Second) {
		next = math.MaxInt64
	}
	if p.Maximum > 0 && next > p.Maximum {
		next = p.Maximum
	}
	return next
}

// jittered stretches interval by the policy's jitter; u is uniform in [0, 1).
func (p BackoffPolicy) jittered(interval time.Duration, u float64) time.Duration {
	j := p.Jitter
	if j == 0 {
		j = DefaultJitter
	}
	return interval + time.Duration(float64(interval)*j*u)
}

// quarantines reports whether the attempts-th failure in a row quarantines.
func (p BackoffPolicy) quarantines(attempts int) bool {
	return p.MaxAttempts > 0 && attempts >= p.MaxAttempts
}

// Backoff is the state of a (machine, process) after failures.
type Backoff struct {
	// Interval is the un-jittered interval of the last failure, the one the
	// next failure grows from.
	Interval time.Duration
	// Until is when the process may touch the machine again (database time).
	Until time.Time
	// Attempts counts failures in a row.
	Attempts int
	// Quarantined means the process leaves the machine alone until an
	// operator resets it, whatever Until says.
	Quarantined bool
	// Cause is the error text of the last failure.
	Cause string
}

// String formats p as ParseBackoff reads it: initial,maximum,exponent,attempts.
func (p BackoffPolicy) String() string {
	return fmt.Sprintf("%s,%s,%s,%d", p.Initial, p.Maximum, strconv.FormatFloat(p.Exponent, 'g', -1, 64), p.MaxAttempts)
}

// ParseBackoff reads a policy written "initial,maximum,exponent,attempts"
// (e.g. "5m,4h,1.2,20": wait 5 min after the first failure, ×1.2 after each
// further one up to 4 h, quarantine after 20 failures in a row; a maximum of
// 0 means no cap, 0 attempts never quarantine). Jitter keeps its default.
func ParseBackoff(s string) (BackoffPolicy, error) {
	parts := strings.Split(s, ",")
	if len(parts) != 4 {
		return BackoffPolicy{}, fmt.Errorf("backoff %q: want initial,maximum,exponent,attempts (e.g. 5m,4h,1.2,20)", s)
	}
	for i := range parts {
		parts[i] = strings.TrimSpace(parts[i])
	}
	var p BackoffPolicy
	var err error
	if p.Initial, err = time.ParseDuration(parts[0]); err != nil {
		return BackoffPolicy{}, fmt.Errorf("backoff %q: initial %q is not a duration", s, parts[0])
	}
	if p.Maximum, err = time.ParseDuration(parts[1]); err != nil {
		return BackoffPolicy{}, fmt.Errorf("backoff %q: maximum %q is not a duration", s, parts[1])
	}
	if p.Exponent, err = strconv.ParseFloat(parts[2], 64); err != nil {
		return BackoffPolicy{}, fmt.Errorf("backoff %q: exponent %q is not a number", s, parts[2])
	}
	if p.MaxAttempts, err = strconv.Atoi(parts[3]); err != nil {
		return BackoffPolicy{}, fmt.Errorf("backoff %q: attempts %q is not a whole number", s, parts[3])
	}
	if err := p.Validate(); err != nil {
		return BackoffPolicy{}, fmt.Errorf("backoff %q: %w", s, err)
	}
	return p, nil
}

// Set implements pflag.Value, so a policy binds to a flag.
func (p *BackoffPolicy) Set(s string) error {
	v, err := ParseBackoff(s)
	if err != nil {
		return err
	}
	*p = v
	return nil
}

// Type implements pflag.Value.
func (p *BackoffPolicy) Type() string { return "initial,max,exp,attempts" }
