package power_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/shepherd/shepherd/power"
)

// bmc is a scripted in-memory BMC for the Controller's shared logic; the
// drivers themselves are tested against real BMC simulators in their
// packages. Its clock is synctest's.
type bmc struct {
	mu sync.Mutex
	// state is what State reports; pending becomes state at switchAt.
	state, pending power.State
	switchAt       time.Time
	// delay is how long a command takes to show in State.
	delay time.Duration
	// drop makes the BMC accept this many commands and never act on them.
	drop int
	// fail, when set, answers each call before it acts.
	fail func(op string) error
	// block makes every call wait until its context ends.
	block bool

	calls  []string
	starts []time.Time
	active int
	// overlap is set when two calls ran at once.
	overlap bool
}

func (b *bmc) begin(ctx context.Context, op string) error {
	b.mu.Lock()
	b.calls = append(b.calls, op)
	b.starts = append(b.starts, time.Now())
	b.active++
	if b.active > 1 {
		b.overlap = true
	}
	b.mu.Unlock()
	if b.block {
		<-ctx.Done()
		b.end()
		return ctx.Err()
	}
	time.Sleep(100 * time.Millisecond) // the BMC takes its time to answer
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.fail != nil {
		if err := b.fail(op); err != nil {
			b.active--
			return err
		}
	}
	return nil
}

func (b *bmc) end() {
	b.mu.Lock()
	b.active--
	b.mu.Unlock()
}

func (b *bmc) current() power.State {
	if b.pending != "" && !time.Now().Before(b.switchAt) {
		b.state, b.pending = b.pending, ""
	}
	return b.state
}

func (b *bmc) State(ctx context.Context) (power.State, error) {
	if err := b.begin(ctx, "state"); err != nil {
		return "", err
	}
	defer b.end()
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.current(), nil
}

func (b *bmc) command(ctx context.Context, s power.State) error {
	if err := b.begin(ctx, string(s)); err != nil {
		return err
	}
	defer b.end()
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.current() == s && b.pending == "" {
		return fmt.Errorf("chassis control: completion code 0xd5: %w", power.ErrWrongState)
	}
	if b.drop > 0 {
		b.drop--
		return nil
	}
	b.pending, b.switchAt = s, time.Now().Add(b.delay)
	return nil
}

func (b *bmc) On(ctx context.Context) error  { return b.command(ctx, power.On) }
func (b *bmc) Off(ctx context.Context) error { return b.command(ctx, power.Off) }

func (b *bmc) log() []string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]string(nil), b.calls...)
}

type bootBMC struct {
	*bmc
	dev power.BootDevice
}

func (b *bootBMC) SetNextBoot(ctx context.Context, dev power.BootDevice) error {
	if err := b.begin(ctx, "boot"); err != nil {
		return err
	}
	defer b.end()
	b.dev = dev
	return nil
}

// TestControllerPacesCalls: calls from many goroutines reach the BMC one at a
// time, each starting at least MinInterval after the one before.
func TestControllerPacesCalls(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := &bmc{state: power.On}
		c := power.NewController(b, power.Config{})
		var wg sync.WaitGroup
		for range 6 {
			wg.Go(func() {
				if _, err := c.State(t.Context()); err != nil {
					t.Error(err)
				}
			})
		}
		wg.Wait()
		if b.overlap {
			t.Error("two calls reached the BMC at once")
		}
		if len(b.starts) != 6 {
			t.Fatalf("%d calls, want 6", len(b.starts))
		}
		for i := 1; i < len(b.starts); i++ {
			if gap := b.starts[i].Sub(b.starts[i-1]); gap != power.DefaultMinInterval {
				t.Errorf("call %d started %s after the one before, want %s", i, gap, power.DefaultMinInterval)
			}
		}
	})
}

// TestControllerFirstCallAtOnce: the first call, and one made after the
// interval has passed, do not wait.
func TestControllerFirstCallAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := &bmc{state: power.On}
		c := power.NewController(b, power.Config{MinInterval: 2 * time.Second})
		start := time.Now()
		if _, err := c.State(t.Context()); err != nil {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Second)
		if _, err := c.State(t.Context()); err != nil {
			t.Fatal(err)
		}
		if b.starts[0] != start || b.starts[1] != start.Add(10*time.Second+100*time.Millisecond) {
			t.Errorf("calls started at +%s and +%s, want +0s and +10.1s", b.starts[0].Sub(start), b.starts[1].Sub(start))
		}
	})
}

// TestControllerCallTimeout: a BMC that never answers fails the call as
// unreachable after CallTimeout, then after each retry.
func TestControllerCallTimeout(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := &bmc{block: true}
		c := power.NewController(b, power.Config{CallTimeout: 7 * time.Second, MinInterval: time.Second, Attempts: 2})
		start := time.Now()
		_, err := c.State(t.Context())
		if !errors.Is(err, power.ErrUnreachable) || !strings.Contains(err.Error(), "no answer within 7s") {
			t.Errorf("State() = %v, want unreachable after 7s", err)
		}
		if got := time.Since(start); got != 14*time.Second {
			t.Errorf("gave up after %s, want 2 calls of 7s", got)
		}
		if n := len(b.log()); n != 2 {
			t.Errorf("%d calls, want 2", n)
		}
	})
}

// TestControllerWaitingEndsWithContext: a caller waiting for its turn gives
// up when its context ends, without reaching the BMC.
func TestControllerWaitingEndsWithContext(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := &bmc{block: true}
		c := power.NewController(b, power.Config{})
		go func() { _, _ = c.State(t.Context()) }()
		synctest.Wait()
		ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
		defer cancel()
		start := time.Now()
		if _, err := c.State(ctx); !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("State() = %v, want the caller's deadline", err)
		}
		if got := time.Since(start); got != 3*time.Second {
			t.Errorf("waited %s, want 3s", got)
		}
		if n := len(b.log()); n != 1 {
			t.Errorf("%d calls reached the BMC, want only the first", n)
		}
		// A caller whose deadline ends during the interval after a call.
		b.block = false
		c2 := power.NewController(b, power.Config{})
		if _, err := c2.State(t.Context()); err != nil {
			t.Fatal(err)
		}
		ctx2, cancel2 := context.WithTimeout(t.Context(), time.Second)
		defer cancel2()
		if _, err := c2.State(ctx2); !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("State() during the interval = %v, want the caller's deadline", err)
		}
	})
}

// TestControllerNeverRetriesAuth: a refused login is sent once: BMCs lock
// accounts after a few failures.
func TestControllerNeverRetriesAuth(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := &bmc{state: power.On, fail: func(string) error { return fmt.Errorf("RAKP 2: %w", power.ErrAuth) }}
		c := power.NewController(b, power.Config{})
		if _, err := c.Cycle(t.Context()); !errors.Is(err, power.ErrAuth) {
			t.Errorf("Cycle() = %v, want ErrAuth", err)
		}
		if got := b.log(); len(got) != 1 {
			t.Errorf("calls %v, want exactly one", got)
		}
	})
}

// TestControllerRetriesBusy: a busy or silent BMC is asked again, up to
// Attempts times in all.
func TestControllerRetriesBusy(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		n := 0
		b := &bmc{state: power.On, fail: func(string) error {
			if n++; n <= 2 {
				return fmt.Errorf("node busy: %w", power.ErrBusy)
			}
			return nil
		}}
		c := power.NewController(b, power.Config{})
		if s, err := c.State(t.Context()); err != nil || s != power.On {
			t.Errorf("State() = %q, %v; want on after two busy answers", s, err)
		}
		if got := len(b.log()); got != 3 {
			t.Errorf("%d calls, want 3", got)
		}
		n = -10
		if _, err := c.State(t.Context()); !errors.Is(err, power.ErrBusy) {
			t.Errorf("State() = %v, want ErrBusy after 3 busy answers", err)
		}
		if got := len(b.log()); got != 6 {
			t.Errorf("%d calls in all, want 6", got)
		}
		// Other errors are not retried.
		b.fail = func(string) error { return fmt.Errorf("invalid command: %w", power.ErrUnsupported) }
		if _, err := c.State(t.Context()); !errors.Is(err, power.ErrUnsupported) {
			t.Errorf("State() = %v, want ErrUnsupported", err)
		}
		if got := len(b.log()); got != 7 {
			t.Errorf("%d calls in all, want 7", got)
		}
	})
}

// TestControllerCycle: off, wait for off, on, wait for on, polling at the
// BMC's pace.
func TestControllerCycle(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := &bmc{state: power.On, delay: 12 * time.Second}
		c := power.NewController(b, power.Config{})
		found, err := c.Cycle(t.Context())
		if err != nil || found != power.On {
			t.Fatalf("Cycle() = %q, %v; want found on, no error", found, err)
		}
		want := []string{"state", "off", "state", "state", "state", "on", "state", "state", "state"}
		if got := b.log(); strings.Join(got, " ") != strings.Join(want, " ") {
			t.Errorf("calls %v, want %v", got, want)
		}
		if b.state != power.On || b.overlap {
			t.Errorf("ended %s (overlap %v), want on", b.state, b.overlap)
		}
	})
}

// TestControllerCycleFromOff: a machine found off is only powered on.
func TestControllerCycleFromOff(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := &bmc{state: power.Off}
		c := power.NewController(b, power.Config{})
		found, err := c.Cycle(t.Context())
		if err != nil || found != power.Off {
			t.Fatalf("Cycle() = %q, %v", found, err)
		}
		if got := strings.Join(b.log(), " "); got != "state on state" {
			t.Errorf("calls %q, want %q", got, "state on state")
		}
	})
}

// TestControllerCycleResendsDropped: a command the BMC accepted and dropped
// is sent again after Settle.
func TestControllerCycleResendsDropped(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := &bmc{state: power.On, drop: 1}
		c := power.NewController(b, power.Config{Settle: 20 * time.Second})
		start := time.Now()
		if _, err := c.Cycle(t.Context()); err != nil {
			t.Fatal(err)
		}
		offs := 0
		for _, op := range b.log() {
			if op == "off" {
				offs++
			}
		}
		if offs != 2 || b.state != power.On {
			t.Errorf("calls %v (state %s): want off sent twice, then on", b.log(), b.state)
		}
		// One Off, polls until Settle has passed (each 5 s apart), the second
		// Off, its poll, On, its poll.
		if took := time.Since(start); took < 20*time.Second || took > 60*time.Second {
			t.Errorf("took %s", took)
		}
	})
}

// TestControllerCycleNotReached: a state that never changes fails the cycle
// with ErrNotReached after Attempts sends.
func TestControllerCycleNotReached(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := &bmc{state: power.On, drop: 1000}
		c := power.NewController(b, power.Config{Settle: 15 * time.Second, Attempts: 2})
		_, err := c.Cycle(t.Context())
		if !errors.Is(err, power.ErrNotReached) || !strings.Contains(err.Error(), "power off sent 2 times") {
			t.Errorf("Cycle() = %v, want ErrNotReached after 2 sends", err)
		}
		offs := 0
		for _, op := range b.log() {
			switch op {
			case "off":
				offs++
			case "on":
				t.Error("sent on before the machine was off")
			}
		}
		if offs != 2 {
			t.Errorf("off sent %d times, want 2", offs)
		}
	})
}

// TestControllerAlreadyInState: Off of an off machine and On of an on one
// are no error.
func TestControllerAlreadyInState(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := &bmc{state: power.Off}
		c := power.NewController(b, power.Config{})
		if err := c.Off(t.Context()); err != nil {
			t.Errorf("Off() of an off machine = %v", err)
		}
		b.state = power.On
		if err := c.On(t.Context()); err != nil {
			t.Errorf("On() of an on machine = %v", err)
		}
		if got := strings.Join(b.log(), " "); got != "off on" {
			t.Errorf("calls %q", got)
		}
	})
}

// TestControllerSetNextBoot: passed to a driver that can, ErrUnsupported
// from one that cannot.
func TestControllerSetNextBoot(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		if err := power.NewController(&bmc{}, power.Config{}).SetNextBoot(t.Context(), power.BootPXE); !errors.Is(err, power.ErrUnsupported) {
			t.Errorf("SetNextBoot() without BootSetter = %v, want ErrUnsupported", err)
		}
		bb := &bootBMC{bmc: &bmc{}}
		if err := power.NewController(bb, power.Config{}).SetNextBoot(t.Context(), power.BootPXE); err != nil || bb.dev != power.BootPXE {
			t.Errorf("SetNextBoot() = %v, device %q", err, bb.dev)
		}
	})
}

func TestConfigValidate(t *testing.T) {
	if err := (power.Config{}).Validate(); err != nil {
		t.Errorf("zero Config: %v", err)
	}
	d := power.Config{}.WithDefaults()
	if d.MinInterval != 5*time.Second || d.CallTimeout != 30*time.Second || d.Settle != time.Minute || d.Attempts != 3 {
		t.Errorf("defaults %+v", d)
	}
	err := power.Config{MinInterval: -1, CallTimeout: -1, Settle: -1, Attempts: -1}.Validate()
	for _, want := range []string{"min interval -1ns", "call timeout -1ns", "settle -1ns", "attempts -1"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("Validate() = %v, want %q", err, want)
		}
	}
}
