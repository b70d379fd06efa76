package main

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/poweraction"
	"github.com/shepherd/shepherd/provider"
)

// powerActions are the actions of `machine power`, as operators write them.
var powerActions = func() []string {
	names := make([]string, len(poweraction.Actions))
	for i, a := range poweraction.Actions {
		names[i] = string(a)
	}
	return names
}()

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
			action, err := poweraction.Parse(args[0])
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
			d, _, err := findMachine(cmd.Context(), db, args[1])
			if err != nil {
				return err
			}
			m, closeProvider, err := openPowerMachine(cmd, d, f, config)
			if err != nil {
				return err
			}
			defer closeProvider()
			return runPower(cmd, db, m, action, f)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.provider, "provider", "", "provider of the machine, as for shepherd run: "+strings.Join(providers().Names(), ", ")+" (required)")
	fl.StringVar(&f.providerConfig, "provider-config", "", "YAML configuration file of the provider, as for shepherd run")
	fl.BoolVarP(&f.yes, "yes", "y", false, "do not ask for confirmation")
	fl.DurationVar(&f.timeout, "timeout", 5*time.Minute, "give up on the BMC after this long")
	return cmd
}

// openPowerMachine builds the provider from the flags, checks that machine
// d is that provider's, and gets its BMC. closeProvider releases the
// provider.
func openPowerMachine(cmd *cobra.Command, d bmdb.MachineDetail, f powerFlags, config []byte) (m poweraction.Machine, closeProvider func(), err error) {
	ctx := cmd.Context()
	// Before the provider is built: the machine may be no provider's.
	if err := poweraction.CheckProvided(d); err != nil {
		return m, nil, err
	}
	env := provider.Env{
		// Only warnings: the CLI's output is its own.
		Logger:     slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: slog.LevelWarn})).With("provider", f.provider),
		Registerer: prometheus.NewRegistry(),
	}
	p, err := providers().New(ctx, f.provider, env, config)
	if err != nil {
		return m, nil, err
	}
	closeProvider = func() {
		if c, ok := p.(io.Closer); ok {
			_ = c.Close() // a provider that holds nothing of the machine's
		}
	}
	fail := func(err error) (poweraction.Machine, func(), error) {
		closeProvider()
		return poweraction.Machine{}, nil, err
	}
	if p.Name() != d.Provider {
		return fail(fmt.Errorf("machine %s belongs to provider %q, but --provider %s --provider-config %q builds provider %q: pass the configuration of %q",
			d.MachineID, d.Provider, f.provider, f.providerConfig, p.Name(), d.Provider))
	}
	pc, ok := p.(provider.PowerController)
	if !ok {
		return fail(fmt.Errorf("provider %s (%s) has no out-of-band power control", p.Name(), f.provider))
	}
	if m, err = poweraction.Find(ctx, pc, d); err != nil {
		return fail(err)
	}
	return m, closeProvider, nil
}

// runPower carries out action on m, after confirmation for those that stop
// the machine, and prints the result.
func runPower(cmd *cobra.Command, db *bmdb.DB, m poweraction.Machine, action poweraction.Action, f powerFlags) error {
	ctx := cmd.Context()
	if what := action.Consequence(); what != "" && !f.yes {
		fmt.Fprintf(cmd.ErrOrStderr(), "Power %s machine %s (%s) through %s?\n%s Proceed? [y/N] ", action, m.ID, m.Name, m.BMC.Name, what)
		if !confirmed(cmd) {
			return errors.New("not confirmed; nothing done (pass --yes to skip the question)")
		}
	}
	job, err := poweraction.Begin(ctx, db, m, poweraction.Request{
		Action:    action,
		By:        operator() + " with the shepherd CLI",
		Component: "cli",
		Timeout:   f.timeout,
		Warn:      func(err error) { fmt.Fprintf(cmd.ErrOrStderr(), "warning: %v\n", err) },
	})
	if errors.Is(err, bmdb.ErrMachineBusy) {
		return fmt.Errorf("%w; nothing done: try again once that work has ended (shepherd machine show %s)", err, m.ID)
	} else if err != nil {
		return err
	}
	r, err := job.Run(ctx)
	if err != nil {
		return err
	}
	if action == poweraction.Status {
		fmt.Fprintf(cmd.OutOrStdout(), "machine %s (%s): BMC %s: power %s\n", m.ID, m.Name, m.BMC.Name, r.Now)
	} else {
		fmt.Fprintf(cmd.OutOrStdout(), "machine %s (%s): %s (BMC %s)\n", m.ID, m.Name, r.Cause, m.BMC.Name)
	}
	return nil
}
