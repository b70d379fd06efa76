package bmdb

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/shepherd/shepherd/bmdb/model"
)

// giveBackTimeout bounds returning a token of a request that was not sent.
// It runs after the caller's context ended, so it needs a bound of its own;
// a token not given back only delays the account's next request by one
// token's worth.
const giveBackTimeout = 5 * time.Second

// RequestBudget is the request budget of one provider API account, shared
// by every process that uses the account (SPEC §5.3): a token bucket in the
// BMDB, refilled by database time. Each request takes its token with one
// statement, so the budget costs a round trip to the database per request;
// provider APIs allow a few requests a second, which the database does not
// notice, and no process holds tokens it might later spend in a burst the
// account does not allow. A request that finds the bucket empty takes a
// token ahead of time and waits until it is due, so waiting requests of
// all processes go in the order they asked.
//
// Every process must give an account the same rate and burst (they share
// one configuration file); the bucket follows the caller's. While the
// database is unreachable, Wait fails, and so do the provider calls that
// need it.
type RequestBudget struct {
	db      *DB
	account string
	rate    float64
	burst   int
}

// RequestBudget returns the shared budget of account (a name that does not
// reveal the account's credentials): rate requests a second on average,
// burst at once.
func (db *DB) RequestBudget(account string, rate float64, burst int) (*RequestBudget, error) {
	switch {
	case account == "":
		return nil, errors.New("bmdb: a request budget needs an account name")
	case rate <= 0 || math.IsNaN(rate) || math.IsInf(rate, 0):
		return nil, fmt.Errorf("bmdb: request budget of %s: the rate must be a finite number > 0, got %v", account, rate)
	case burst < 1:
		return nil, fmt.Errorf("bmdb: request budget of %s: the burst must be >= 1, got %d", account, burst)
	}
	return &RequestBudget{db: db, account: account, rate: rate, burst: burst}, nil
}

// Wait returns once a request of the account may be sent: at once if the
// bucket has a token, else when the token it took is due, or once a pause
// the API asked for has ended. It returns an error, having taken nothing,
// if ctx ends first or its deadline would pass while waiting.
func (b *RequestBudget) Wait(ctx context.Context) error {
	for {
		var r model.RequestBudgetTakeRow
		err := b.db.retry(ctx, func(ctx context.Context) error {
			var err error
			r, err = b.db.q.RequestBudgetTake(ctx, model.RequestBudgetTakeParams{
				Account: b.account, Burst: float64(b.burst), Rate: b.rate})
			return err
		})
		if err != nil {
			return fmt.Errorf("bmdb: taking from the request budget of %s: %w", b.account, err)
		}
		wait := seconds(r.WaitSeconds)
		if wait <= 0 {
			return nil
		}
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) < wait {
			b.giveBack(ctx, r.Paused)
			return fmt.Errorf("bmdb: the request budget of %s has no token for %s, past the call's deadline", b.account, wait.Round(time.Millisecond))
		}
		if !sleep(ctx, wait) {
			b.giveBack(ctx, r.Paused)
			return fmt.Errorf("bmdb: waiting for the request budget of %s: %w", b.account, context.Cause(ctx))
		}
		if r.Paused {
			continue // the pause is over: take a token now
		}
		// The token is due; but a 429 may have paused the account while we
		// waited for it, and then the pause comes first.
		var paused float64
		err = b.db.retry(ctx, func(ctx context.Context) error {
			var err error
			paused, err = b.db.q.RequestBudgetPausedFor(ctx, b.account)
			return err
		})
		if err != nil {
			return fmt.Errorf("bmdb: reading the pause of the request budget of %s: %w", b.account, err)
		}
		if paused <= 0 {
			return nil
		}
		// The pause emptied the bucket, and our token with it: take another
		// once the pause is over.
	}
}

// giveBack returns the token Wait took for a request it gives up on, so
// that it does not hold up the requests queued after it; nothing was taken
// during a pause.
func (b *RequestBudget) giveBack(ctx context.Context, paused bool) {
	if paused {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), giveBackTimeout)
	defer cancel()
	err := b.db.q.RequestBudgetGiveBack(ctx, model.RequestBudgetGiveBackParams{Account: b.account, Burst: float64(b.burst)})
	if err != nil {
		b.db.log.DebugContext(ctx, "giving back a request budget token", "account", b.account, "err", err)
	}
}

// Pause holds every request of the account, in every process, until d
// from now: the API answered 429 with Retry-After d. The bucket starts
// again empty when the pause ends.
func (b *RequestBudget) Pause(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	err := b.db.retry(ctx, func(ctx context.Context) error {
		return b.db.q.RequestBudgetPause(ctx, model.RequestBudgetPauseParams{Account: b.account, Seconds: d.Seconds()})
	})
	if err != nil {
		return fmt.Errorf("bmdb: pausing the request budget of %s: %w", b.account, err)
	}
	return nil
}

// seconds converts a wait in seconds from the database to a Duration,
// rounded up to the microsecond (the database's resolution) so that a
// token is never used before it is due.
func seconds(s float64) time.Duration {
	if s <= 0 || math.IsNaN(s) {
		return 0
	}
	if s >= (24 * time.Hour).Seconds() {
		return 24 * time.Hour
	}
	return time.Duration(math.Ceil(s*1e6)) * time.Microsecond
}
