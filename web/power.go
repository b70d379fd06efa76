package web

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/power"
	"github.com/shepherd/shepherd/poweraction"
	"github.com/shepherd/shepherd/provider"
)

// powerBy is who history names as asking for a power action from the web
// UI ("power cycle by ..."): the token says an operator asked, not which one.
const powerBy = "an operator in the web UI"

// powerMachine returns machine d with its BMC, or, if power actions cannot
// reach it, a sentence for the page saying why.
func (s *Server) powerMachine(ctx context.Context, d bmdb.MachineDetail) (poweraction.Machine, string) {
	if err := poweraction.CheckProvided(d); err != nil {
		return poweraction.Machine{}, "Power is not available: " + err.Error() + "."
	}
	var pc provider.PowerController
	if s.cfg.Power != nil {
		pc = s.cfg.Power(d.Provider)
	}
	if pc == nil {
		return poweraction.Machine{}, fmt.Sprintf("Power is not available: this process runs no out-of-band power control for provider %s.", d.Provider)
	}
	m, err := poweraction.Find(ctx, pc, d)
	if err != nil {
		if !errors.Is(err, provider.ErrNoBMC) && !errors.Is(err, provider.ErrNotFound) {
			s.log.WarnContext(ctx, "finding a machine's BMC", "machine_id", d.MachineID.String(), "err", err)
		}
		return poweraction.Machine{}, "Power is not available: " + err.Error() + "."
	}
	return m, ""
}

// startPower begins power action a on machine id and runs it in the
// background, as `shepherd machine power` runs it: on, off and cycle hold
// the machine for Power first, so a machine another process works on is
// refused at once. It returns the status code and message of a refusal, or
// an error; neither when the action started.
//
// The action runs after the response, because it takes as long as the BMC
// does (a cycle is several calls at least power.Config.MinInterval apart,
// each waiting up to a minute for the state to show): the machine page
// shows the hold under live work, then the result in history and in the
// power state.
func (s *Server) startPower(ctx context.Context, log *slog.Logger, a action, id uuid.UUID, reason string) (int, string, error) {
	d, _, err := s.getMachine(ctx, id)
	if errors.Is(err, bmdb.ErrNotFound) {
		return http.StatusNotFound, fmt.Sprintf("Machine %s does not exist.", id), nil
	} else if err != nil {
		return 0, "", err
	}
	m, why := s.powerMachine(ctx, d)
	if why != "" {
		return http.StatusConflict, why, nil
	}
	if !s.jobs.add() {
		return http.StatusServiceUnavailable, "The web UI is shutting down: nothing done.", nil
	}
	by := powerBy
	if reason != "" {
		by += ": " + reason
	}
	log = log.With("bmc", m.BMC.Name)
	// The job lives in the server's context, not the request's: it runs
	// on after the response.
	job, err := poweraction.Begin(s.jobs.ctx, s.db, m, poweraction.Request{
		Action:    a.power,
		By:        by,
		Component: "web",
		Timeout:   s.cfg.PowerTimeout,
		Warn:      func(err error) { log.Warn("power action: not all of it was recorded", "err", err) },
	})
	if err != nil {
		s.jobs.done()
		switch {
		case errors.Is(err, bmdb.ErrMachineBusy):
			return http.StatusConflict, fmt.Sprintf("Nothing done: %v. Try again once that work has ended (see Live work on the machine's page).", err), nil
		case errors.Is(err, bmdb.ErrNotFound):
			return http.StatusNotFound, fmt.Sprintf("Machine %s does not exist or is not provided.", id), nil
		case s.jobs.ctx.Err() != nil:
			return http.StatusServiceUnavailable, "The web UI is shutting down: nothing done.", nil
		}
		return 0, "", err
	}
	go func() {
		defer s.jobs.done()
		r, err := job.Run(s.jobs.ctx)
		if err != nil {
			log.Warn("power action failed", "class", power.Class(err), "err", err)
			return
		}
		log.Info("power action done", "power", string(r.Now), "found", string(r.Found))
	}()
	return 0, "", nil
}

// jobs are the power actions a server runs in the background.
type jobs struct {
	ctx  context.Context // ends them
	stop context.CancelFunc

	mu     sync.Mutex
	closed bool
	wg     sync.WaitGroup
}

func newJobs() *jobs {
	ctx, stop := context.WithCancel(context.Background())
	return &jobs{ctx: ctx, stop: stop}
}

// add counts a job about to start, unless close was called.
func (j *jobs) add() bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.closed {
		return false
	}
	j.wg.Add(1)
	return true
}

// done counts a job that ended (or never started).
func (j *jobs) done() { j.wg.Done() }

// close refuses new jobs, cancels those running and waits for them.
func (j *jobs) close() {
	j.mu.Lock()
	j.closed = true
	j.mu.Unlock()
	j.stop()
	j.wg.Wait()
}
