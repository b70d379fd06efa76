package power

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Config bounds how a Controller talks to one BMC. The zero value of a field
// means its default.
type Config struct {
	// MinInterval is the least time between the start of one call to the
	// BMC and the next (default 5 s): several BMCs in service crash or
	// lock up when commands come faster.
	MinInterval time.Duration
	// CallTimeout bounds each call, session set-up and close included
	// (default 30 s).
	CallTimeout time.Duration
	// Settle is how long Cycle waits, polling the state every MinInterval,
	// for an accepted Off or On to show before it sends the command again
	// (default 60 s).
	Settle time.Duration
	// Attempts bounds how often Cycle sends one command, and how often it
	// retries a call that failed with ErrBusy or ErrUnreachable (default 3).
	Attempts int
}

// Defaults for Config.
const (
	DefaultMinInterval = 5 * time.Second
	DefaultCallTimeout = 30 * time.Second
	DefaultSettle      = 60 * time.Second
	DefaultAttempts    = 3
)

// WithDefaults returns c with every zero field set to its default.
func (c Config) WithDefaults() Config {
	if c.MinInterval == 0 {
		c.MinInterval = DefaultMinInterval
	}
	if c.CallTimeout == 0 {
		c.CallTimeout = DefaultCallTimeout
	}
	if c.Settle == 0 {
		c.Settle = DefaultSettle
	}
	if c.Attempts == 0 {
		c.Attempts = DefaultAttempts
	}
	return c
}

// Validate checks c (zero fields are defaults and valid).
func (c Config) Validate() error {
	var errs []error
	if c.MinInterval < 0 {
		errs = append(errs, fmt.Errorf("power min interval %s: want 0 (default %s) or more", c.MinInterval, DefaultMinInterval))
	}
	if c.CallTimeout < 0 {
		errs = append(errs, fmt.Errorf("power call timeout %s: want 0 (default %s) or more", c.CallTimeout, DefaultCallTimeout))
	}
	if c.Settle < 0 {
		errs = append(errs, fmt.Errorf("power settle %s: want 0 (default %s) or more", c.Settle, DefaultSettle))
	}
	if c.Attempts < 0 {
		errs = append(errs, fmt.Errorf("power attempts %d: want 0 (default %d) or more", c.Attempts, DefaultAttempts))
	}
	return errors.Join(errs...)
}

// Controller is the one way Shepherd talks to a BMC: it serialises calls,
// spaces them by MinInterval, bounds each by CallTimeout, and power-cycles
// with one shared sequence. Keep one Controller per BMC (NewController does
// not share pacing between Controllers of the same BMC). Safe for
// concurrent use.
type Controller struct {
	d   Driver
	cfg Config
	// turn holds the right to call the BMC: a channel, not a mutex, so a
	// waiter gives up when its context ends.
	turn chan struct{}
	last time.Time // start of the latest call; guarded by turn
}

// NewController returns a Controller for d. cfg must be valid.
func NewController(d Driver, cfg Config) *Controller {
	return &Controller{d: d, cfg: cfg.WithDefaults(), turn: make(chan struct{}, 1)}
}

// call runs f as the BMC's only call in progress, at least MinInterval after
// the previous call started, within CallTimeout. A call that ran out of its
// own time (while ctx did not) fails with ErrUnreachable.
func (c *Controller) call(ctx context.Context, what string, f func(context.Context) error) error {
	select {
	case c.turn <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("%s: waiting for the BMC's previous call: %w", what, context.Cause(ctx))
	}
	defer func() { <-c.turn }()
	if !c.last.IsZero() {
		if wait := time.Until(c.last.Add(c.cfg.MinInterval)); wait > 0 {
			t := time.NewTimer(wait)
			select {
			case <-t.C:
			case <-ctx.Done():
				t.Stop()
				return fmt.Errorf("%s: %w", what, context.Cause(ctx))
			}
		}
	}
	c.last = time.Now()
	cctx, cancel := context.WithTimeoutCause(ctx, c.cfg.CallTimeout, errCallTimeout)
	defer cancel()
	err := f(cctx)
	if err == nil {
		return nil
	}
	if ctx.Err() == nil && errors.Is(context.Cause(cctx), errCallTimeout) && !errors.Is(err, ErrUnreachable) {
		return fmt.Errorf("%s: no answer within %s: %w (%w)", what, c.cfg.CallTimeout, ErrUnreachable, err)
	}
	return fmt.Errorf("%s: %w", what, err)
}

var errCallTimeout = errors.New("BMC call timed out")

// retryable reports whether a failed call may be sent again: the BMC was busy
// or did not answer. Never an authentication failure.
func retryable(err error) bool {
	return !errors.Is(err, ErrAuth) && (errors.Is(err, ErrBusy) || errors.Is(err, ErrUnreachable))
}

// retry runs call up to Attempts times while it fails with a retryable
// error; pacing spaces the attempts.
func (c *Controller) retry(ctx context.Context, what string, f func(context.Context) error) error {
	var err error
	for range c.cfg.Attempts {
		if err = c.call(ctx, what, f); err == nil || !retryable(err) || ctx.Err() != nil {
			return err
		}
	}
	return err
}

// State reads the power state.
func (c *Controller) State(ctx context.Context) (State, error) {
	var s State
	err := c.retry(ctx, "reading power state", func(ctx context.Context) error {
		var err error
		s, err = c.d.State(ctx)
		return err
	})
	return s, err
}

// On powers the machine on; a machine already on is no error.
func (c *Controller) On(ctx context.Context) error { return c.set(ctx, On) }

// Off powers the machine off at once; a machine already off is no error.
func (c *Controller) Off(ctx context.Context) error { return c.set(ctx, Off) }

func (c *Controller) set(ctx context.Context, s State) error {
	send := c.d.On
	if s == Off {
		send = c.d.Off
	}
	err := c.retry(ctx, "power "+string(s), send)
	if errors.Is(err, ErrWrongState) {
		return nil
	}
	return err
}

// SetNextBoot chooses the device of the next boot, or fails with
// ErrUnsupported when the driver cannot.
func (c *Controller) SetNextBoot(ctx context.Context, dev BootDevice) error {
	b, ok := c.d.(BootSetter)
	if !ok {
		return fmt.Errorf("setting next boot device: %w", ErrUnsupported)
	}
	return c.retry(ctx, "setting next boot device to "+string(dev), func(ctx context.Context) error {
		return b.SetNextBoot(ctx, dev)
	})
}

// Cycle power-cycles the machine: it reads the state; if on, sends Off and
// waits for off; then sends On and waits for on. A command the BMC accepted
// whose state does not show within Settle is sent again, up to Attempts
// times; then Cycle fails with ErrNotReached. A machine found off is just
// powered on. It returns the state it found first.
func (c *Controller) Cycle(ctx context.Context) (found State, err error) {
	found, err = c.State(ctx)
	if err != nil {
		return "", fmt.Errorf("power cycle: %w", err)
	}
	if found != Off {
		if err := c.reach(ctx, Off); err != nil {
			return found, fmt.Errorf("power cycle: %w", err)
		}
	}
	if err := c.reach(ctx, On); err != nil {
		return found, fmt.Errorf("power cycle: %w", err)
	}
	return found, nil
}

// reach sends the command for s and polls until the BMC reports s, sending
// it again after each Settle without the state showing.
func (c *Controller) reach(ctx context.Context, s State) error {
	for attempt := 1; attempt <= c.cfg.Attempts; attempt++ {
		if err := c.set(ctx, s); err != nil {
			return err
		}
		deadline := time.Now().Add(c.cfg.Settle)
		for {
			got, err := c.State(ctx)
			if err != nil {
				return err
			}
			if got == s {
				return nil
			}
			// The next State call waits MinInterval after this one, so
			// this loop polls at the BMC's pace.
			if !time.Now().Before(deadline) {
				break
			}
		}
	}
	return fmt.Errorf("power %s sent %d times, state not %s after %s each: %w", s, c.cfg.Attempts, s, c.cfg.Settle, ErrNotReached)
}
