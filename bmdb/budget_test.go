package bmdb_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
)

func TestRequestBudgetValidates(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	for _, tt := range []struct {
		account string
		rate    float64
		burst   int
		want    string
	}{
		{"", 1, 1, "needs an account name"},
		{"a", 0, 1, "rate must be a finite number > 0, got 0"},
		{"a", -1, 1, "rate must be"},
		{"a", 1, 0, "burst must be >= 1, got 0"},
	} {
		if _, err := db.RequestBudget(tt.account, tt.rate, tt.burst); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("RequestBudget(%q, %v, %d) = %v, want an error containing %q", tt.account, tt.rate, tt.burst, err, tt.want)
		}
	}
}

// TestRequestBudgetShared takes an account's budget from two processes'
// connection pools: the burst is the account's, not each process's, and a
// request that cannot have a token before its deadline gives up at once,
// taking nothing.
func TestRequestBudgetShared(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	other, err := bmdb.Open(t.Context(), bmdb.Config{URL: db.URL})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(other.Close)
	// A token an hour: the burst is all there is during the test.
	const rate = 1.0 / 3600
	a, err := db.RequestBudget("metal:acct", rate, 2)
	if err != nil {
		t.Fatal(err)
	}
	b, err := other.RequestBudget("metal:acct", rate, 2)
	if err != nil {
		t.Fatal(err)
	}
	elsewhere, err := other.RequestBudget("metal:another", rate, 1)
	if err != nil {
		t.Fatal(err)
	}
	for i, budget := range []*bmdb.RequestBudget{a, b, elsewhere} {
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		if err := budget.Wait(ctx); err != nil {
			t.Errorf("Wait %d within the burst: %v", i, err)
		}
		cancel()
	}
	tokens := func() float64 {
		return bmdbtest.Scalar[float64](t, db, "SELECT tokens FROM provider_request_budgets WHERE account = 'metal:acct'")
	}
	before := tokens()
	for name, budget := range map[string]*bmdb.RequestBudget{"first": a, "second": b} {
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		err := budget.Wait(ctx)
		cancel()
		if err == nil || !strings.Contains(err.Error(), "past the call's deadline") {
			t.Errorf("Wait of the %s process past the shared burst: %v, want it refused before its deadline", name, err)
		}
	}
	if after := tokens(); after < before-1e-6 {
		t.Errorf("refused Waits took tokens: %v before, %v after", before, after)
	}
	// Without a deadline, a cancelled wait gives its token back too.
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- a.Wait(ctx) }()
	bmdbtest.WaitFor(t, 10*time.Second, "the wait to take its token", func(context.Context) (bool, error) {
		return tokens() < before-0.5, nil
	})
	cancel()
	if err := <-done; err == nil {
		t.Error("a cancelled Wait returned nil")
	}
	if after := tokens(); after < before-1e-6 {
		t.Errorf("a cancelled Wait kept its token: %v before, %v after", before, after)
	}
}

// TestRequestBudgetPause: a 429 one process got holds every process's
// requests until its Retry-After has passed, and takes nothing meanwhile.
func TestRequestBudgetPause(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	a, err := db.RequestBudget("metal:acct", 1000, 10)
	if err != nil {
		t.Fatal(err)
	}
	b, err := db.RequestBudget("metal:acct", 1000, 10)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Wait(t.Context()); err != nil {
		t.Fatal(err)
	}
	if err := a.Pause(t.Context(), time.Hour); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), time.Second)
	defer cancel()
	if err := b.Wait(ctx); err == nil || !strings.Contains(err.Error(), "past the call's deadline") {
		t.Errorf("Wait during another process's pause: %v, want it refused", err)
	}
	if n := bmdbtest.Scalar[float64](t, db, "SELECT tokens FROM provider_request_budgets WHERE account = 'metal:acct'"); n > 0 {
		t.Errorf("the bucket holds %v tokens during the pause; it starts again empty after it", n)
	}
	// A shorter pause does not shorten a longer one.
	if err := b.Pause(t.Context(), time.Second); err != nil {
		t.Fatal(err)
	}
	if ok := bmdbtest.Scalar[bool](t, db, "SELECT paused_until > now() + interval '59 minutes' FROM provider_request_budgets WHERE account = 'metal:acct'"); !ok {
		t.Error("a shorter pause shortened the account's pause")
	}
}
