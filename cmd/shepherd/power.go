package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/power"
	"github.com/shepherd/shepherd/provider"
)

// Power actions of `machine power`.
const (
	powerStatus = "status"
	powerOn     = "on"
	powerOff    = "off"
	powerCycle  = "cycle"
)

var powerActions = []string{powerStatus, powerOn, powerOff, powerCycle}

// powerSettle bounds how long on and off wait for the BMC to report the
// state they asked for, polling at the BMC's pace; power.Controller's Cycle
// waits as long (power.DefaultSettle) before it sends a command again.
const powerSettle = power.DefaultSettle

// powerFlags are the flags of `machine power`.
type powerFlags struct {
	provider, providerConfig string
	yes                      bool
	timeout                  time.Duration
}

func (c *machineCLI) powerCommand() *cobra.Command {
	var f powerFlags
	cmd := &cobra.Command{
		Use:   "power status|on|off|cycle ID --provider KIND --provider-config FILE",
		Short: "Read or switch a machine's power through its BMC, out of band",
		Long: "Reaches the machine's BMC through its provider (a static inventory's bmc: block; SPEC §5.5),\n" +
			"built from --provider and --provider-config as `shepherd run` builds it, and records what it\n" +
			"read as the machine's last known power state (shown by `machine show`).\n" +
			"  status  reads the power state.\n" +
			"  on      powers the machine on and waits until the BMC reports it on.\n" +
			"  off     powers the machine off at once, without a shutdown, and waits until the BMC reports it off.\n" +
			"  cycle   powers it off and on again (a machine found off is only powered on).\n" +
			"on, off and cycle hold the machine for the process Power while they run, so that no control loop\n" +
			"(agent start, recovery, reinstall, decommission) acts on it meanwhile; a machine one of them holds\n" +
			"is refused, and nothing is done. History records who asked (Started) and what was found and done\n" +
			"(Finished), or why it failed (Failed, with the error's class: auth, unreachable, busy, ...).\n" +
			"off and cycle ask for confirmation unless --yes.",
		Args:      cobra.ExactArgs(2),
		ValidArgs: powerActions,
		RunE: func(cmd *cobra.Command, args []string) error {
			action := args[0]
			if !slices.Contains(powerActions, action) {
				return fmt.Errorf("%q is not a power action: use %s", action, strings.Join(powerActions, ", "))
			}
			id, err := parseMachineID(args[1])
			if err != nil {
				return err
			}
			if f.timeout <= 0 {
				return fmt.Errorf("--timeout must be positive, got %s", f.timeout)
			}
			if f.provider == "" {
				return fmt.Errorf("--provider is required: the provider of the machine (%s), with --provider-config as for shepherd run",
					strings.Join(providers().Names(), ", "))
			}
			var config []byte
			if f.providerConfig != "" {
				if config, err = os.ReadFile(f.providerConfig); err != nil {
					return fmt.Errorf("--provider-config: %w", err)
				}
			}
			db, err := c.open(cmd.Context())
			if err != nil {
				return err
			}
			defer db.Close()
			pm, err := openPowerMachine(cmd, db, id, f, config)
			if err != nil {
				return err
			}
			defer pm.close()
			if action == powerStatus {
				return pm.status(cmd, f.timeout)
			}
			return pm.act(cmd, action, f)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.provider, "provider", "", "provider of the machine, as for shepherd run: "+strings.Join(providers().Names(), ", ")+" (required)")
	fl.StringVar(&f.providerConfig, "provider-config", "", "YAML configuration file of the provider, as for shepherd run")
	fl.BoolVarP(&f.yes, "yes", "y", false, "do not ask for confirmation")
	fl.DurationVar(&f.timeout, "timeout", 5*time.Minute, "give up on the BMC after this long")
	return cmd
}

// powerMachine is a machine of the BMDB with its BMC, reached through the
// provider the flags built.
type powerMachine struct {
	db    *bmdb.DB
	id    uuid.UUID
	name  string // "static m3": provider and provider id, for operators
	bmc   provider.BMC
	close func()
}

// openPowerMachine finds machine id in the BMDB, builds the provider from
// the flags, checks that the machine is that provider's, and gets its BMC.
func openPowerMachine(cmd *cobra.Command, db *bmdb.DB, id uuid.UUID, f powerFlags, config []byte) (*powerMachine, error) {
	ctx := cmd.Context()
	d, err := db.GetMachine(ctx, id)
	if errors.Is(err, bmdb.ErrNotFound) {
		return nil, fmt.Errorf("machine %s does not exist", id)
	} else if err != nil {
		return nil, err
	}
	if d.Provided.MachineID == uuid.Nil {
		return nil, fmt.Errorf("machine %s is %s: it has no provider machine, so no BMC to reach", id, d.State)
	}
	env := provider.Env{
		// Only warnings: the CLI's output is its own.
		Logger:     slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: slog.LevelWarn})).With("provider", f.provider),
		Registerer: prometheus.NewRegistry(),
	}
	p, err := providers().New(ctx, f.provider, env, config)
	if err != nil {
		return nil, err
	}
	closeProvider := func() {
		if c, ok := p.(io.Closer); ok {
			_ = c.Close() // a provider that holds nothing of the machine's
		}
	}
	pm := &powerMachine{db: db, id: id, name: d.Provider + " " + d.ProviderID, close: closeProvider}
	fail := func(err error) (*powerMachine, error) {
		closeProvider()
		return nil, err
	}
	if p.Name() != d.Provider {
		return fail(fmt.Errorf("machine %s belongs to provider %q, but --provider %s --provider-config %q builds provider %q: pass the configuration of %q",
			id, d.Provider, f.provider, f.providerConfig, p.Name(), d.Provider))
	}
	pc, ok := p.(provider.PowerController)
	if !ok {
		return fail(fmt.Errorf("provider %s (%s) has no out-of-band power control", p.Name(), f.provider))
	}
	pm.bmc, err = pc.BMC(ctx, d.ProviderID)
	switch {
	case errors.Is(err, provider.ErrNoBMC):
		return fail(fmt.Errorf("machine %s (%s) has no BMC: add a bmc: block (driver, address, username, password_file) to its entry in the inventory that %s names, then try again",
			id, pm.name, f.providerConfig))
	case errors.Is(err, provider.ErrNotFound):
		return fail(fmt.Errorf("machine %s: provider %s does not know its provider id %q (left the inventory?)", id, p.Name(), d.ProviderID))
	case err != nil:
		return fail(fmt.Errorf("machine %s (%s): %w", id, pm.name, err))
	}
	return pm, nil
}

// record records a look at the machine's power: the state read, or err.
// A failure to record is reported on stderr: the BMC's answer matters more.
func (pm *powerMachine) record(cmd *cobra.Command, state power.State, err error) {
	r := bmdb.PowerReading{BMC: pm.bmc.Name, State: string(state)}
	if err != nil {
		r.State, r.ErrorClass, r.Error = "", power.Class(err), err.Error()
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(cmd.Context()), 10*time.Second)
	defer cancel()
	if rerr := pm.db.RecordPowerState(ctx, pm.id, r); rerr != nil {
		fmt.Fprintf(cmd.ErrOrStderr(), "warning: the power state was not recorded: %v\n", rerr)
	}
}

// status reads the power state, prints and records it.
func (pm *powerMachine) status(cmd *cobra.Command, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(cmd.Context(), timeout)
	defer cancel()
	s, err := pm.bmc.State(ctx)
	pm.record(cmd, s, err)
	if err != nil {
		return fmt.Errorf("machine %s (%s): BMC %s: %w (class %s)", pm.id, pm.name, pm.bmc.Name, err, power.Class(err))
	}
	fmt.Fprintf(cmd.OutOrStdout(), "machine %s (%s): BMC %s: power %s\n", pm.id, pm.name, pm.bmc.Name, s)
	return nil
}

// act runs on, off or cycle under a hold of the machine for Power, after
// confirmation for off and cycle.
func (pm *powerMachine) act(cmd *cobra.Command, action string, f powerFlags) error {
	ctx := cmd.Context()
	if !f.yes && action != powerOn {
		what := "The machine stops at once, without a shutdown."
		if action == powerCycle {
			what = "The machine stops at once, without a shutdown, and boots again."
		}
		fmt.Fprintf(cmd.ErrOrStderr(), "Power %s machine %s (%s) through %s?\n%s Proceed? [y/N] ", action, pm.id, pm.name, pm.bmc.Name, what)
		if !confirmed(cmd) {
			return errors.New("not confirmed; nothing done (pass --yes to skip the question)")
		}
	}
	sess, err := pm.db.StartSession(ctx, bmdb.SessionConfig{Component: "cli"})
	if err != nil {
		return err
	}
	defer func() {
		// The work has ended by then; a failed close only lets the lease
		// run out by itself.
		if err := sess.Close(ctx); err != nil && !sess.Lost() {
			fmt.Fprintf(cmd.ErrOrStderr(), "warning: %v\n", err)
		}
	}()
	w, err := sess.Hold(ctx, bmdb.ProcessPower, pm.id, fmt.Sprintf("power %s by %s with the shepherd CLI", action, operator()))
	if errors.Is(err, bmdb.ErrMachineBusy) {
		return fmt.Errorf("%w; nothing done: try again once that work has ended (shepherd machine show %s)", err, pm.id)
	} else if err != nil {
		return err
	}
	// The action stops when the session is lost: the machine may then be
	// someone else's.
	actx, cancel := context.WithTimeout(sess.Context(), f.timeout)
	defer cancel()
	found, now, err := pm.run(actx, cmd, action)
	// The work ends even when ctx ended (Ctrl-C): history says how far it got.
	ectx, ecancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer ecancel()
	if err != nil {
		class := power.Class(err)
		pm.record(cmd, "", err)
		if ferr := w.FailWithoutBackoff(ectx, fmt.Sprintf("power %s failed (class %s): %v", action, class, err)); ferr != nil {
			fmt.Fprintf(cmd.ErrOrStderr(), "warning: history Failed was not written: %v\n", ferr)
		}
		return fmt.Errorf("power %s of machine %s (%s) through %s failed (class %s): %w", action, pm.id, pm.name, pm.bmc.Name, class, err)
	}
	pm.record(cmd, now, nil)
	cause := fmt.Sprintf("power %s: found %s, now %s", action, found, now)
	if err := w.FinishWithCause(ectx, cause, nil); err != nil {
		return fmt.Errorf("machine %s: %s, but history Finished was not written: %w", pm.id, cause, err)
	}
	fmt.Fprintf(cmd.OutOrStdout(), "machine %s (%s): %s (BMC %s)\n", pm.id, pm.name, cause, pm.bmc.Name)
	return nil
}

// run carries out action and returns the state it found and the state the
// BMC reports at the end.
func (pm *powerMachine) run(ctx context.Context, cmd *cobra.Command, action string) (found, now power.State, err error) {
	if action == powerCycle {
		found, err := pm.bmc.Cycle(ctx)
		return found, power.On, err // Cycle returns once the BMC reports on
	}
	want, send := power.On, pm.bmc.On
	if action == powerOff {
		want, send = power.Off, pm.bmc.Off
	}
	if found, err = pm.bmc.State(ctx); err != nil {
		return "", "", err
	}
	pm.record(cmd, found, nil)
	if err := send(ctx); err != nil {
		return found, "", err
	}
	deadline := time.Now().Add(powerSettle)
	for {
		// Each State waits its turn at the BMC (power.Config.MinInterval), so
		// this polls at the BMC's pace.
		if now, err = pm.bmc.State(ctx); err != nil {
			return found, "", fmt.Errorf("power %s sent, then %w", want, err)
		}
		if now == want {
			return found, now, nil
		}
		if !time.Now().Before(deadline) {
			return found, now, fmt.Errorf("power %s sent, state still %s after %s: %w", want, now, powerSettle, power.ErrNotReached)
		}
	}
}
