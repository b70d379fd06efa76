package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/manager"
	"github.com/shepherd/shepherd/provider/equinix"
	"github.com/shepherd/shepherd/provider/equinix/metal"
)

// equinixCLI is what every `shepherd equinix` command shares: the provider
// configuration file (the one `shepherd run --provider equinix` reads, so
// the CLI sees the same project with the same token), the BMDB whose
// request budget the fleet's processes share, and the confirmation switch
// of destructive commands.
type equinixCLI struct {
	configPath string
	db         databaseFlags
	yes        bool
	// stdin reads the answers to questions; one reader for all of them, so
	// that none reads ahead into the next one's answer.
	stdin *bufio.Reader
}

// open reads the configuration and returns a client of its account, and
// what to call when done with it. With a database (--database-url or
// SHEPHERD_DATABASE_URL) the client takes its requests from the budget the
// fleet's processes share in the BMDB, so that the CLI cannot push the
// account over its limit while they run; without one it has a budget of
// its own, which is right only while nothing else uses the account. A
// database that is named but cannot be opened is an error, not a reason to
// fall back.
func (e *equinixCLI) open(ctx context.Context) (*metal.Client, equinix.Config, func(), error) {
	if e.configPath == "" {
		return nil, equinix.Config{}, nil, errors.New("--config is required: the equinix provider's YAML configuration")
	}
	data, err := os.ReadFile(e.configPath)
	if err != nil {
		return nil, equinix.Config{}, nil, err
	}
	fc, err := equinix.ParseConfig(data, nil)
	if err != nil {
		return nil, equinix.Config{}, nil, fmt.Errorf("%s: %w", e.configPath, err)
	}
	done := func() {}
	if e.db.configured() {
		db, err := e.db.open(ctx, bmdb.SchemaRequireCurrent)
		if err != nil {
			return nil, equinix.Config{}, nil, fmt.Errorf("opening the BMDB for the shared request budget: %w", err)
		}
		fc.Client.SharedBudget = equinix.SharedBudget(manager.RequestBudgets(db))
		done = db.Close
	}
	c, err := metal.New(fc.Client)
	if err != nil {
		done()
		return nil, equinix.Config{}, nil, err
	}
	return c, fc.Provider, func() { c.CloseIdleConnections(); done() }, nil
}

// confirm asks before a destructive action unless --yes was given.
func (e *equinixCLI) confirm(cmd *cobra.Command, what string) error {
	if e.yes {
		return nil
	}
	fmt.Fprintf(cmd.ErrOrStderr(), "%s\nProceed? [y/N] ", what)
	if a := strings.ToLower(e.answer(cmd)); a != "y" && a != "yes" {
		return errors.New("not confirmed; nothing changed (pass --yes to skip the question)")
	}
	return nil
}

// answer reads one line of the operator's answer, trimmed; "" at the end
// of the input.
func (e *equinixCLI) answer(cmd *cobra.Command) string {
	if e.stdin == nil {
		e.stdin = bufio.NewReader(cmd.InOrStdin())
	}
	line, _ := e.stdin.ReadString('\n')
	return strings.TrimSpace(line)
}

// deleteDevices deletes the devices named. Each is looked up first: one
// that is not Shepherd's (equinix.Config.Ours) is deleted only with
// includeForeign and once the operator has typed its hostname, --yes or
// not, since a wrong id there deletes someone else's server. Otherwise
// nothing at all is deleted. A device whose lookup failed is reported as
// failed and not deleted.
func (e *equinixCLI) deleteDevices(cmd *cobra.Command, ids []string, includeForeign bool) error {
	c, cfg, done, err := e.open(cmd.Context())
	if err != nil {
		return err
	}
	defer done()
	lookups := make(map[string]error, len(ids))
	var foreign []metal.Device
	for _, id := range ids {
		d, err := c.GetDevice(cmd.Context(), id)
		switch {
		case err != nil:
			lookups[id] = fmt.Errorf("looking the device up: %w", err)
		case !cfg.Ours(d):
			foreign = append(foreign, d)
		}
	}
	if len(foreign) > 0 && !includeForeign {
		names := make([]string, len(foreign))
		for i, d := range foreign {
			names[i] = fmt.Sprintf("%s (%s)", d.ID, d.Hostname)
		}
		return fmt.Errorf("not Shepherd's (hostname without the prefix %q): %s; nothing deleted. "+
			"To delete them anyway, add --include-foreign and type each one's hostname when asked",
			cfg.HostnamePrefix(), strings.Join(names, ", "))
	}
	for _, d := range foreign {
		fmt.Fprintf(cmd.ErrOrStderr(), "Device %s is not Shepherd's. Type its hostname (%s) to delete it: ", d.ID, d.Hostname)
		if e.answer(cmd) != d.Hostname {
			return fmt.Errorf("the hostname of device %s was not typed; nothing deleted", d.ID)
		}
	}
	if err := e.confirm(cmd, fmt.Sprintf("delete %d device(s): %s?", len(ids), strings.Join(ids, ", "))); err != nil {
		return err
	}
	return bulk(cmd, "delete", ids, func(ctx context.Context, id string) error {
		if err := lookups[id]; err != nil {
			return err
		}
		return c.DeleteDevice(ctx, id)
	})
}

// bulk runs fn for every id, printing progress, and reports how many
// failed; one failure does not stop the others.
func bulk(cmd *cobra.Command, verb string, ids []string, fn func(ctx context.Context, id string) error) error {
	failed := 0
	for i, id := range ids {
		err := fn(cmd.Context(), id)
		status := "ok"
		if err != nil {
			status = "FAILED: " + err.Error()
			failed++
		}
		fmt.Fprintf(cmd.ErrOrStderr(), "[%d/%d] %s %s: %s\n", i+1, len(ids), verb, id, status)
		if cmd.Context().Err() != nil {
			return cmd.Context().Err()
		}
	}
	if failed > 0 {
		return fmt.Errorf("%d of %d %s failed", failed, len(ids), verb)
	}
	return nil
}

func newEquinixCommand() *cobra.Command {
	e := &equinixCLI{}
	cmd := &cobra.Command{
		Use:   "equinix",
		Short: "Operate on the Equinix Metal project of the equinix provider",
		Long: "Lists and acts on the devices and hardware reservations of the project named in the\n" +
			"equinix provider's configuration (--config), with its token and request budget. Given the\n" +
			"BMDB (--database-url or SHEPHERD_DATABASE_URL), it takes its requests from the budget every\n" +
			"process of the fleet shares; without it, from a budget of its own.",
	}
	cmd.PersistentFlags().StringVar(&e.configPath, "config", "", "the equinix provider's YAML configuration (required)")
	e.db.bind(cmd)
	cmd.PersistentFlags().BoolVarP(&e.yes, "yes", "y", false, "do not ask before destructive actions")

	devices := &cobra.Command{Use: "devices", Short: "List, delete and reboot devices"}
	devices.AddCommand(&cobra.Command{
		Use:   "list",
		Short: "List the project's devices (ours are those with the provider's hostname prefix)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, cfg, done, err := e.open(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			ds, err := c.ListDevices(cmd.Context(), cfg.Project)
			if err != nil {
				return err
			}
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "ID\tHOSTNAME\tSTATE\tOURS\tIP\tRESERVATION\tMETRO")
			for _, d := range ds {
				ip, _ := d.PublicIPv4()
				res := ""
				if d.HardwareReservation != nil {
					res = d.HardwareReservation.ID
				}
				ipText := ""
				if ip.IsValid() {
					ipText = ip.String()
				}
				fmt.Fprintf(w, "%s\t%s\t%s\t%v\t%s\t%s\t%s\n", d.ID, d.Hostname, d.State, cfg.Ours(d), ipText, res, d.Metro.Code)
			}
			return w.Flush()
		},
	})
	// deviceAction is a destructive command on the devices named.
	deviceAction := func(verb, short string, act func(c *metal.Client) func(ctx context.Context, id string) error) *cobra.Command {
		return &cobra.Command{
			Use:   verb + " ID...",
			Short: short,
			Args:  cobra.MinimumNArgs(1),
			RunE: func(cmd *cobra.Command, ids []string) error {
				c, _, done, err := e.open(cmd.Context())
				if err != nil {
					return err
				}
				defer done()
				if err := e.confirm(cmd, fmt.Sprintf("%s %d device(s): %s?", verb, len(ids), strings.Join(ids, ", "))); err != nil {
					return err
				}
				return bulk(cmd, verb, ids, act(c))
			},
		}
	}
	var includeForeign bool
	deleteCmd := &cobra.Command{
		Use:   "delete ID...",
		Short: "Delete devices (their reservations become free capacity)",
		Long: "Deletes the devices named. A device that is not Shepherd's (its hostname lacks the\n" +
			"provider's prefix) is refused, --yes or not, and then nothing is deleted; with\n" +
			"--include-foreign it is deleted once its hostname has been typed when asked.",
		Args: cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, ids []string) error { return e.deleteDevices(cmd, ids, includeForeign) },
	}
	deleteCmd.Flags().BoolVar(&includeForeign, "include-foreign", false,
		"also delete devices that are not Shepherd's, each once its hostname is typed (--yes does not skip that)")
	devices.AddCommand(
		deleteCmd,
		deviceAction("reboot", "Reboot devices",
			func(c *metal.Client) func(context.Context, string) error { return c.RebootDevice }),
	)

	reservations := &cobra.Command{Use: "reservations", Short: "List and move hardware reservations"}
	reservations.AddCommand(&cobra.Command{
		Use:   "list",
		Short: "List the project's hardware reservations",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, cfg, done, err := e.open(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			rs, err := c.ListHardwareReservations(cmd.Context(), cfg.Project)
			if err != nil {
				return err
			}
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(w, "ID\tPLAN\tMETRO\tPROVISIONABLE\tSPARE\tDEVICE")
			for _, r := range rs {
				dev := ""
				if r.Device != nil {
					dev = r.Device.ID
				}
				fmt.Fprintf(w, "%s\t%s\t%s\t%v\t%v\t%s\n", r.ID, r.Plan.Slug, r.Metro.Code, r.Provisionable, r.Spare, dev)
			}
			return w.Flush()
		},
	})
	var moveTo string
	move := &cobra.Command{
		Use:   "move ID...",
		Short: "Move hardware reservations (without devices) to another project",
		Args:  cobra.MinimumNArgs(1),
		RunE: func(cmd *cobra.Command, ids []string) error {
			if moveTo == "" {
				return errors.New("--to is required: the project to move the reservations to")
			}
			c, _, done, err := e.open(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			if err := e.confirm(cmd, fmt.Sprintf("Move %d reservation(s) to project %s?", len(ids), moveTo)); err != nil {
				return err
			}
			return bulk(cmd, "move", ids, func(ctx context.Context, id string) error {
				_, err := c.MoveHardwareReservation(ctx, id, moveTo)
				return err
			})
		},
	}
	move.Flags().StringVar(&moveTo, "to", "", "destination project id (required)")
	reservations.AddCommand(move)

	var yoinkFrom string
	var yoinkCount int
	yoink := &cobra.Command{
		Use:   "yoink",
		Short: "Move free reservations from another project into the provider's project",
		Long: "Moves provisionable hardware reservations that have no device from --from into the\n" +
			"project of the configuration, at most --count of them (0: all), so that the provider\n" +
			"can use them as capacity.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if yoinkFrom == "" {
				return errors.New("--from is required: the project to take reservations from")
			}
			if yoinkCount < 0 {
				return fmt.Errorf("--count must be >= 0, got %d", yoinkCount)
			}
			c, cfg, done, err := e.open(cmd.Context())
			if err != nil {
				return err
			}
			defer done()
			if yoinkFrom == cfg.Project {
				return fmt.Errorf("--from %s is the configured project already", yoinkFrom)
			}
			rs, err := c.ListHardwareReservations(cmd.Context(), yoinkFrom)
			if err != nil {
				return err
			}
			var ids []string
			for _, r := range rs {
				if r.Device == nil && r.Provisionable && !r.Spare && (yoinkCount == 0 || len(ids) < yoinkCount) {
					ids = append(ids, r.ID)
				}
			}
			if len(ids) == 0 {
				fmt.Fprintf(cmd.OutOrStdout(), "project %s has no free reservations\n", yoinkFrom)
				return nil
			}
			if err := e.confirm(cmd, fmt.Sprintf("Move %d free reservation(s) from project %s to %s?", len(ids), yoinkFrom, cfg.Project)); err != nil {
				return err
			}
			return bulk(cmd, "move", ids, func(ctx context.Context, id string) error {
				_, err := c.MoveHardwareReservation(ctx, id, cfg.Project)
				return err
			})
		},
	}
	yoink.Flags().StringVar(&yoinkFrom, "from", "", "project to take free reservations from (required)")
	yoink.Flags().IntVar(&yoinkCount, "count", 0, "how many reservations to move at most (0: all free ones)")

	cmd.AddCommand(devices, reservations, yoink)
	return cmd
}
