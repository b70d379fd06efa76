package equinix_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/provider"
	"github.com/shepherd/shepherd/provider/equinix"
	"github.com/shepherd/shepherd/provider/equinix/fakemetal"
)

// TestBudgetSharedAcrossProcesses runs three equinix providers as three
// processes would (each from the registry's factory, with its own client,
// SSH key, metrics and BMDB connection pool), against one fake API account
// and one BMDB, all calling the API as fast as their budget lets them. Each
// is configured with the account's budget; the account must see it kept
// (SPEC §5.3, §8 R4): the fake's Check finds no request over budget. With
// injected 429s, every process must also keep away from the API until the
// Retry-After one of them was given has passed.
func TestBudgetSharedAcrossProcesses(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name   string
		faults fakemetal.Faults
		calls  int // per process
		// tolerance is the fake's slack for requests in flight. Another
		// process learns of a 429 only once the process that got it has
		// written the pause to the BMDB; on a loaded machine (this test
		// under -race next to others) that write takes up to ~100 ms, and
		// a request sent in the meantime is in flight, not disobedient.
		tolerance time.Duration
	}{
		{"budget", fakemetal.Faults{}, 16, 0},
		{"429s", fakemetal.Faults{Rate: 0.05, TooManyRequests: 1, RetryAfter: time.Second}, 16, 250 * time.Millisecond},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			// The account allows 25 requests a second; each process is
			// told 20, the margin absorbing the jitter between taking a
			// token and the request's arrival.
			fake, err := fakemetal.New(fakemetal.Config{Token: token, Budget: 25, Burst: 5, Faults: tt.faults, Seed: 1, Tolerance: tt.tolerance})
			if err != nil {
				t.Fatal(err)
			}
			fake.AddProject(project)
			fake.AddReservations(project, "c3.small.x86", "fr2", "fr", 3)
			srv := httptest.NewServer(fake)
			t.Cleanup(srv.Close)
			t.Cleanup(fake.Close)
			dir := t.TempDir()
			tokenFile := filepath.Join(dir, "token")
			if err := os.WriteFile(tokenFile, []byte(token), 0o600); err != nil {
				t.Fatal(err)
			}
			config := fmt.Appendf(nil, "project: %s\napi_url: %s/metal/v1\ntoken_file: %s\noperating_system: ubuntu_22_04\nrequests_per_second: 20\nburst: 5\n",
				project, srv.URL, tokenFile)
			db := bmdbtest.New(t)

			var ps []provider.Provider
			for range 3 {
				pdb, err := bmdb.Open(t.Context(), bmdb.Config{URL: db.URL})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(pdb.Close)
				p, err := equinix.Factory(t.Context(), provider.Env{
					Logger:        slog.New(slog.DiscardHandler),
					Registerer:    prometheus.NewRegistry(),
					SSHSigner:     newSigner(t),
					RequestBudget: manager.RequestBudgets(pdb),
				}, config)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { p.(*equinix.Provider).Close() })
				ps = append(ps, p)
			}

			var wg sync.WaitGroup
			errs := make(chan error, len(ps)*tt.calls)
			for _, p := range ps {
				for range 2 { // two loops of each process at once
					wg.Go(func() {
						for range tt.calls / 2 {
							ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
							_, err := p.ListMachines(ctx)
							cancel()
							if err != nil {
								errs <- err
							}
						}
					})
				}
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Errorf("listing: %v", err)
			}
			if v := fake.Check(); len(v) > 0 {
				t.Errorf("the processes broke the account's budget (%d violations), first: %s", len(v), v[0])
			}
			faults := map[string]int{}
			for _, r := range fake.Requests() {
				faults[r.Fault]++
			}
			t.Logf("requests by fault: %v", faults)
			if tt.faults.Rate > 0 && faults[fakemetal.FaultTooManyRequests] == 0 {
				t.Error("no 429 was injected: the run did not test the shared pause")
			}
		})
	}
}
