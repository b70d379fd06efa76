// Package poweraction carries out an operator's out-of-band power action on
// a machine of the BMDB (SPEC §5.5): read its power state, or switch it on,
// off or through a cycle. `shepherd machine power` and the web UI's power
// actions both go through it, so that both hold the machine the same way,
// call the BMC through the provider's paced controller, record what the BMC
// said as the machine's power state and write the same history.
//
// An action is a Job: Begin takes the machine (for every action but Status,
// a hold for process Power, refused while another machine-exclusive process
// works on the machine), Run talks to the BMC and ends the hold. The two are
// apart so that a caller can report a busy machine at once and run the BMC
// part, which takes a while at the BMC's pace, where it suits it (the web UI
// in the background).
package poweraction

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/power"
	"github.com/shepherd/shepherd/provider"
)

// Action is a power action.
type Action string

// Power actions.
const (
	// Status reads the power state. It does not hold the machine.
	Status Action = "status"
	// On powers the machine on and waits until the BMC reports it on.
	On Action = "on"
	// Off powers the machine off at once, without a shutdown, and waits
	// until the BMC reports it off.
	Off Action = "off"
	// Cycle powers the machine off and on again (one found off is only
	// powered on), as power.Controller.Cycle does.
	Cycle Action = "cycle"
)

// Actions are the power actions in the order operators see them.
var Actions = []Action{Status, On, Off, Cycle}

// Parse returns the action named s.
func Parse(s string) (Action, error) {
	if a := Action(s); slices.Contains(Actions, a) {
		return a, nil
	}
	names := make([]string, len(Actions))
	for i, a := range Actions {
		names[i] = string(a)
	}
	return "", fmt.Errorf("%q is not a power action: use %s", s, strings.Join(names, ", "))
}

// Holds reports whether a switches the power and so holds the machine for
// process Power while it runs: every action but Status.
func (a Action) Holds() bool { return a != Status }

// Consequence says what a does to a running machine, for the question an
// operator answers first; "" for an action that does not stop it.
func (a Action) Consequence() string {
	switch a {
	case Off:
		return "The machine stops at once, without a shutdown."
	case Cycle:
		return "The machine stops at once, without a shutdown, and boots again."
	}
	return ""
}

// Settle bounds how long On and Off wait for the BMC to report the state
// they asked for, polling at the BMC's pace; power.Controller's Cycle waits
// as long (power.DefaultSettle) before it sends a command again.
const Settle = power.DefaultSettle

// Machine is a machine of the BMDB with its BMC.
type Machine struct {
	ID uuid.UUID
	// Name is the machine's provider and provider id ("static m3"), for
	// operators.
	Name string
	BMC  provider.BMC
}

// Find returns machine d with its BMC, which pc, the power control of d's
// provider, knows. Its errors say what to do, and match provider.ErrNoBMC
// (the machine has no BMC) and provider.ErrNotFound (the provider does not
// know the machine) with errors.Is.
func Find(ctx context.Context, pc provider.PowerController, d bmdb.MachineDetail) (Machine, error) {
	if err := CheckProvided(d); err != nil {
		return Machine{}, err
	}
	m := Machine{ID: d.MachineID, Name: d.Provider + " " + d.ProviderID}
	var err error
	m.BMC, err = pc.BMC(ctx, d.ProviderID)
	switch {
	case errors.Is(err, provider.ErrNoBMC):
		return Machine{}, explained(fmt.Sprintf("machine %s (%s) has no BMC: add a bmc: block (driver, address, username, password_file) to its entry in provider %s's inventory, then try again",
			m.ID, m.Name, d.Provider), err)
	case errors.Is(err, provider.ErrNotFound):
		return Machine{}, explained(fmt.Sprintf("machine %s: provider %s does not know its provider id %q (left the inventory?)", m.ID, d.Provider, d.ProviderID), err)
	case err != nil:
		return Machine{}, fmt.Errorf("machine %s (%s): %w", m.ID, m.Name, err)
	}
	return m, nil
}

// CheckProvided returns an error unless machine d has a provider machine,
// which a BMC belongs to: a decommissioned machine has none.
func CheckProvided(d bmdb.MachineDetail) error {
	if d.Provided.MachineID == uuid.Nil {
		return fmt.Errorf("machine %s is %s: it has no provider machine, so no BMC to reach", d.MachineID, d.State)
	}
	return nil
}

// explainedError is an error with a message of its own that still matches
// its cause with errors.Is: the cause's text would only repeat it.
type explainedError struct {
	msg   string
	cause error
}

func explained(msg string, cause error) error { return &explainedError{msg: msg, cause: cause} }

func (e *explainedError) Error() string { return e.msg }
func (e *explainedError) Unwrap() error { return e.cause }

// Request is an action as an operator asked for it.
type Request struct {
	Action Action
	// By says who asked, and how, for history ("power off by BY"):
	// "alice@host with the shepherd CLI"; required.
	By string
	// Component names the BMDB session that holds the machine for an
	// action that switches the power ("cli", "web"); required for them.
	Component string
	// Timeout bounds the action's BMC calls; required.
	Timeout time.Duration
	// Warn receives what went wrong around the BMC's answer that the action
	// carries on without: a power state or a history row that was not
	// recorded. nil drops them.
	Warn func(error)
}

// Validate reports the first problem with r. It changes nothing.
func (r Request) Validate() error {
	if _, err := Parse(string(r.Action)); err != nil {
		return err
	}
	switch {
	case r.By == "":
		return errors.New("poweraction: Request.By is required: who asked")
	case r.Action.Holds() && r.Component == "":
		return fmt.Errorf("poweraction: Request.Component is required for power %s: the session that holds the machine", r.Action)
	case r.Timeout <= 0:
		return fmt.Errorf("poweraction: Request.Timeout must be positive, got %s", r.Timeout)
	}
	return nil
}

// Result is what an action found and left.
type Result struct {
	// Found is the state the action found (not set by Status); Now is the
	// state the BMC reported at the end.
	Found, Now power.State
	// Cause is what history records with Finished: "power off: found on,
	// now off" (not set by Status).
	Cause string
}

// Job is one action on one machine, begun and not yet run.
type Job struct {
	db   *bmdb.DB
	m    Machine
	req  Request
	sess *bmdb.Session // nil for Status
	work *bmdb.Work    // nil for Status
}

// Begin begins req on m. An action that switches the power holds the
// machine for process Power, in a BMDB session of its own started under
// ctx, with history Started naming who asked: while another
// machine-exclusive process works on the machine, it fails with an error
// wrapping bmdb.ErrMachineBusy that names the holder, and nothing is done.
// The session, and with it the job, ends when ctx ends: pass the context the
// job should live in, not a request's. Follow with Run, or Cancel.
func Begin(ctx context.Context, db *bmdb.DB, m Machine, req Request) (*Job, error) {
	if err := req.Validate(); err != nil {
		return nil, err
	}
	if m.BMC.Controller == nil {
		return nil, fmt.Errorf("poweraction: machine %s has no BMC controller", m.ID)
	}
	j := &Job{db: db, m: m, req: req}
	if !req.Action.Holds() {
		return j, nil
	}
	sess, err := db.StartSession(ctx, bmdb.SessionConfig{Component: req.Component})
	if err != nil {
		return nil, err
	}
	w, err := sess.Hold(ctx, bmdb.ProcessPower, m.ID, fmt.Sprintf("power %s by %s", req.Action, req.By))
	if err != nil {
		j.sess = sess
		j.closeSession(ctx)
		return nil, err
	}
	j.sess, j.work = sess, w
	return j, nil
}

// Machine is the machine the job acts on.
func (j *Job) Machine() Machine { return j.m }

// Cancel ends a job that will not run: the hold ends with history
// Canceled. It works even when ctx is done.
func (j *Job) Cancel(ctx context.Context) {
	if j.work == nil {
		return
	}
	ectx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	if err := j.work.Cancel(ectx); err != nil {
		j.warn(fmt.Errorf("history Canceled was not written: %w", err))
	}
	j.closeSession(ctx)
}

// Run carries out the job's action, records what the BMC said as the
// machine's power state (an error, with its class, too) and ends the hold:
// history Finished with what was found and done (a power off also holds
// the machine's Recovery, a power on or cycle ends that hold), or Failed, without a
// backoff, with the error's class (auth, unreachable, busy, ...). The BMC
// calls stop at Request.Timeout, when ctx ends, or when the session is
// lost (the machine may then be someone else's); the hold ends all the
// same, and history says how far it got. Call it once.
func (j *Job) Run(ctx context.Context) (Result, error) {
	if j.work == nil {
		actx, cancel := context.WithTimeout(ctx, j.req.Timeout)
		defer cancel()
		s, err := j.m.BMC.State(actx)
		j.record(ctx, s, err)
		if err != nil {
			return Result{}, fmt.Errorf("machine %s (%s): BMC %s: %w (class %s)", j.m.ID, j.m.Name, j.m.BMC.Name, err, power.Class(err))
		}
		return Result{Now: s}, nil
	}
	defer j.closeSession(ctx)
	actx, cancel := context.WithTimeout(j.sess.Context(), j.req.Timeout)
	defer cancel()
	stop := context.AfterFunc(ctx, cancel)
	defer stop()
	found, now, err := j.run(actx)
	// The work ends even when ctx ended (Ctrl-C, a server shutting down).
	ectx, ecancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer ecancel()
	a := j.req.Action
	if err != nil {
		class := power.Class(err)
		j.record(ctx, "", err)
		if ferr := j.work.FailWithoutBackoff(ectx, fmt.Sprintf("power %s failed (class %s): %v", a, class, err)); ferr != nil {
			j.warn(fmt.Errorf("history Failed was not written: %w", ferr))
		}
		return Result{Found: found}, fmt.Errorf("power %s of machine %s (%s) through %s failed (class %s): %w", a, j.m.ID, j.m.Name, j.m.BMC.Name, class, err)
	}
	j.record(ctx, now, nil)
	r := Result{Found: found, Now: now, Cause: fmt.Sprintf("power %s: found %s, now %s", a, found, now)}
	// A machine an operator switched off is silent on purpose: its
	// Recovery is held, or the recovery ladder would power it back on,
	// until an operator powers it on again.
	// A machine that was off, or was power-cycled, has lost its agent:
	// its agent tags are cleared, so that the initializer takes it over
	// once it has booted, and the recovery ladder does not take the
	// booting machine for a silent one and cycle it again.
	recovery := func(ctx context.Context, tx *bmdb.Tx) error {
		if a == Off {
			return tx.HoldRecoveryPoweredOff(ctx, j.m.ID, j.sess.ID(), "by "+j.req.By)
		}
		if _, err := tx.ReleaseRecoveryPowerOffHold(ctx, j.m.ID, j.sess.ID(), fmt.Sprintf("power %s by %s", a, j.req.By)); err != nil {
			return err
		}
		if a == Cycle || found == power.Off {
			return tx.ClearAgent(ctx, j.m.ID)
		}
		return nil
	}
	if err := j.work.FinishWithCause(ectx, r.Cause, recovery); err != nil {
		return r, fmt.Errorf("machine %s: %s, but history Finished was not written: %w", j.m.ID, r.Cause, err)
	}
	return r, nil
}

// run carries out the action and returns the state it found and the state
// the BMC reports at the end.
func (j *Job) run(ctx context.Context) (found, now power.State, err error) {
	b := j.m.BMC
	if j.req.Action == Cycle {
		found, err := b.Cycle(ctx)
		return found, power.On, err // Cycle returns once the BMC reports on
	}
	want, send := power.On, b.On
	if j.req.Action == Off {
		want, send = power.Off, b.Off
	}
	if found, err = b.State(ctx); err != nil {
		return "", "", err
	}
	j.record(ctx, found, nil)
	if err := send(ctx); err != nil {
		return found, "", err
	}
	deadline := time.Now().Add(Settle)
	for {
		// Each State waits its turn at the BMC (power.Config.MinInterval), so
		// this polls at the BMC's pace.
		if now, err = b.State(ctx); err != nil {
			return found, "", fmt.Errorf("power %s sent, then %w", want, err)
		}
		if now == want {
			return found, now, nil
		}
		if !time.Now().Before(deadline) {
			return found, now, fmt.Errorf("power %s sent, state still %s after %s: %w", want, now, Settle, power.ErrNotReached)
		}
	}
}

// record records a look at the machine's power: the state read, or err.
// A failure to record is a warning: the BMC's answer matters more.
func (j *Job) record(ctx context.Context, state power.State, err error) {
	r := Reading(j.m.BMC.Name, state, err)
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if rerr := j.db.RecordPowerState(rctx, j.m.ID, r); rerr != nil {
		j.warn(fmt.Errorf("the power state was not recorded: %w", rerr))
	}
}

// closeSession closes the job's session once its work has ended. A failed
// close only lets the lease run out by itself.
func (j *Job) closeSession(ctx context.Context) {
	if err := j.sess.Close(context.WithoutCancel(ctx)); err != nil && !j.sess.Lost() {
		j.warn(err)
	}
}

func (j *Job) warn(err error) {
	if j.req.Warn != nil {
		j.req.Warn(err)
	}
}

// Reading is what BMC bmc answered as the machine's power state to record
// (bmdb.RecordPowerState): the state, or err with its class.
func Reading(bmc string, state power.State, err error) bmdb.PowerReading {
	if err != nil {
		return bmdb.PowerReading{BMC: bmc, ErrorClass: power.Class(err), Error: err.Error()}
	}
	return bmdb.PowerReading{BMC: bmc, State: string(state)}
}
