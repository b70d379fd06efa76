package web_test

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/web"
)

// TestOverviewCountsAgree: on a fleet with silent, backed-off, recovering
// and quarantined machines, each number of the overview is defined once:
// the cards are the states table's All column, every machine is counted in
// one state, and the breaker's silent agents (read as the recoverer reads
// them) are the machines whose agent is silent, listed by the state they
// are in. A backed-off machine whose agent is silent shows that on its
// page rather than its tag phase Heartbeating.
func TestOverviewCountsAgree(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "p", Healthy: 30, Stale: 6, AwaitingAgent: 2, NeverHeartbeat: 2})
	stale := column[uuid.UUID](t, db, `SELECT machine_id FROM machine_agent_heartbeat
		WHERE agent_heartbeat_at < now() - interval '10 minutes' ORDER BY machine_id LIMIT 3`)
	if len(stale) != 3 {
		t.Fatalf("%d stale machines, want 3", len(stale))
	}
	// Silent machines elsewhere than in state Silent: one backed off for
	// Recovery (its reboot failed), one quarantined for Recovery, one being
	// recovered by a live session.
	backedOff, quarantined, recovering := stale[0], stale[1], stale[2]
	db.Exec(t, `INSERT INTO work_backoff (machine_id, process, backoff_until, cause, last_interval_ms, attempts)
		VALUES ($1, 'Recovery', now() + interval '1 hour', 'reboot failed', 3600000, 1)`, backedOff)
	db.Exec(t, `INSERT INTO work_backoff (machine_id, process, backoff_until, cause, last_interval_ms, attempts, quarantined_at)
		VALUES ($1, 'Recovery', now() + interval '1 hour', 'every rung failed', 3600000, 3, now())`, quarantined)
	holder := bmdbtest.Session(t, db, "recoverer", 0)
	db.Exec(t, `INSERT INTO work (machine_id, process, machine_exclusive, session_id) VALUES ($1, 'Recovery', true, $2)`,
		recovering, holder.ID())
	// A machine backed off for agent start, whose agent is not started.
	db.Exec(t, `INSERT INTO work_backoff (machine_id, process, backoff_until, cause, last_interval_ms, attempts)
		SELECT machine_id, 'AgentStart', now() + interval '1 hour', 'ssh refused', 3600000, 1
		FROM machine_provided WHERE agent_phase = 'AwaitingAgent' ORDER BY machine_id LIMIT 1`)

	s := newServer(t, db.DB, web.Config{Providers: []string{"p"},
		Breaker: func(ctx context.Context, provider string, to bmdb.SilenceTimeouts) (web.BreakerState, error) {
			b, err := manager.ReadBreaker(ctx, db.DB, provider,
				manager.RecovererConfig{FirstHeartbeatTimeout: to.FirstHeartbeat, HeartbeatTimeout: to.Heartbeat})
			return web.BreakerState{Started: b.Started, Silent: b.Silent, SilentFraction: b.SilentFraction,
				RebootsInWindow: b.RebootsInWindow, Budget: b.Budget, Window: b.Window, Paused: b.Paused}, err
		}})
	body := s.get(t, "/")

	// The states table's All column.
	cell := regexp.MustCompile(`data-provider="" data-state="([^"]*)"><a href="[^"]*">(\d+)</a>`)
	all := map[string]int64{}
	for _, m := range cell.FindAllStringSubmatch(body, -1) {
		all[m[1]], _ = strconv.ParseInt(m[2], 10, 64)
	}
	want := map[string]int64{"": 40, "Healthy": 30, "Silent": 5, "BackedOff": 2, "Quarantined": 1, "Recovering": 1, "Provided": 1}
	for st, n := range want {
		if all[st] != n {
			t.Errorf("states table: All %q = %d, want %d", st, all[st], n)
		}
	}
	var sum int64
	for st, n := range all {
		if st != "" {
			sum += n
		}
	}
	if sum != all[""] {
		t.Errorf("the states add up to %d machines, the total is %d: a machine is counted twice or not at all", sum, all[""])
	}
	// Each card is the All column's number of its state.
	for id, st := range map[string]string{"total": "", "healthy": "Healthy", "silent": "Silent", "backedoff": "BackedOff", "quarantined": "Quarantined"} {
		card := regexp.MustCompile(`id="` + id + `"><span class="n">(\d+)</span>`).FindStringSubmatch(body)
		if card == nil || card[1] != fmt.Sprint(all[st]) {
			t.Errorf("card %s = %v, the states table says %d", id, card, all[st])
		}
	}
	// The breaker's silent agents: 5 in state Silent (3 stale, 2 without a
	// first heartbeat) and the 3 elsewhere, each in its state.
	row := regexp.MustCompile(`(?s)<tr data-provider="p">.*?</tr>`).FindString(body)
	ratio := regexp.MustCompile(`<td class="num">(\d+) / (\d+)</td>`).FindStringSubmatch(row)
	if ratio == nil || ratio[1] != "8" {
		t.Fatalf("breaker row: silent agents %v, want 8:\n%s", ratio, row)
	}
	byState := map[string]string{}
	for _, m := range regexp.MustCompile(`data-state="([^"]+)"><span class="badge[^"]*">[^<]*</span> (\d+)</a>`).FindAllStringSubmatch(row, -1) {
		byState[m[1]] = m[2]
	}
	if fmt.Sprint(byState) != fmt.Sprint(map[string]string{"Silent": "5", "BackedOff": "1", "Quarantined": "1", "Recovering": "1"}) {
		t.Errorf("silent agents by state = %v, want Silent 5, BackedOff 1, Quarantined 1, Recovering 1:\n%s", byState, row)
	}

	// The backed-off machine's page: its agent is silent, whatever the tag
	// phase says.
	page := s.get(t, "/machines/"+backedOff.String())
	if !strings.Contains(page, `id="machine-state">BackedOff<`) {
		t.Errorf("machine %s is not shown BackedOff", backedOff)
	}
	phase := regexp.MustCompile(`<td id="agent-phase">(.*?)</td>`).FindStringSubmatch(page)
	if phase == nil || !strings.Contains(phase[1], "Silent") || strings.HasPrefix(phase[1], "Heartbeating") {
		t.Errorf("the backed-off machine's agent phase is %v, want Silent", phase)
	}
	healthy := bmdbtest.Scalar[uuid.UUID](t, db, `SELECT machine_id FROM machine_agent_heartbeat
		WHERE agent_heartbeat_at > now() - interval '1 minute' ORDER BY machine_id LIMIT 1`)
	if phase := regexp.MustCompile(`<td id="agent-phase">(.*?)</td>`).FindStringSubmatch(s.get(t, "/machines/"+healthy.String())); phase == nil || phase[1] != "Heartbeating" {
		t.Errorf("a healthy machine's agent phase is %v, want Heartbeating", phase)
	}
}

// TestPagesJudgeSilenceByRecordedTimeouts: the overview, the list, the
// machine page and the breaker judge silence by the heartbeat timeouts the
// recoverers recorded in the BMDB, the defaults until one has, and say
// which.
func TestPagesJudgeSilenceByRecordedTimeouts(t *testing.T) {
	t.Parallel()
	db := bmdbtest.New(t)
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "p", Healthy: 3, Stale: 2}) // stale: a day without a heartbeat
	stale := column[uuid.UUID](t, db, `SELECT machine_id FROM machine_agent_heartbeat
		WHERE agent_heartbeat_at < now() - interval '1 hour' ORDER BY machine_id`)
	var mu sync.Mutex
	var breakerSaw []bmdb.SilenceTimeouts
	s := newServer(t, db.DB, web.Config{Providers: []string{"p"},
		Breaker: func(_ context.Context, _ string, to bmdb.SilenceTimeouts) (web.BreakerState, error) {
			mu.Lock()
			defer mu.Unlock()
			breakerSaw = append(breakerSaw, to)
			return web.BreakerState{}, nil
		}})
	card := regexp.MustCompile(`id="silent"><span class="n">(\d+)</span>`)
	hint := regexp.MustCompile(`id="timeouts">([^<]*)<`)
	check := func(silent, state, source string) {
		t.Helper()
		overview, list, page := s.get(t, "/"), s.get(t, "/machines?state=Silent"), s.get(t, "/machines/"+stale[0].String())
		if m := card.FindStringSubmatch(overview); m == nil || m[1] != silent {
			t.Errorf("overview: silent card %v, want %s", m, silent)
		}
		if !strings.Contains(list, `id="machine-count">`+silent+`<`) {
			t.Errorf("list of Silent machines does not count %s", silent)
		}
		if !strings.Contains(page, `id="machine-state">`+state+`<`) {
			t.Errorf("the page of a machine a day without a heartbeat does not show it %s", state)
		}
		for name, body := range map[string]string{"overview": overview, "list": list, "machine page": page} {
			if m := hint.FindStringSubmatch(body); m == nil || !strings.Contains(m[1], source) {
				t.Errorf("%s: timeouts hint %v, want it to contain %q", name, m, source)
			}
		}
	}
	check("2", "Silent", "heartbeat timeout "+bmdb.DefaultHeartbeatTimeout.String()+" (defaults")

	if err := db.RecordSilenceTimeouts(t.Context(), "p", "recoverer on test", 48*time.Hour, 48*time.Hour); err != nil {
		t.Fatal(err)
	}
	check("0", "Healthy", "heartbeat timeout 48h0m0s (recorded by the recoverer of provider p, recoverer on test")
	mu.Lock()
	defer mu.Unlock()
	if last := breakerSaw[len(breakerSaw)-1]; last.Heartbeat != 48*time.Hour || last.FirstHeartbeat != 48*time.Hour {
		t.Errorf("the breaker judged by %+v, want the recorded 48h", last)
	}
}
