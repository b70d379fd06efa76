// Command shepherd is the Shepherd binary: every long-running component and
// every operator command is a subcommand of it.
package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/shepherd/shepherd/bmdb"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := newRootCommand().ExecuteContext(ctx)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "shepherd:", err)
		os.Exit(1)
	}
}

func newRootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:           "shepherd",
		Short:         "Shepherd keeps bare-metal fleets under management",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newRunCommand(), newDevCommand(), newMigrateCommand(), newInstallCommand(), newEquinixCommand(), newVersionCommand())
	root.AddCommand(newMachineCommand(), newSessionCommand(), newProviderCommand())
	return root
}

// databaseFlags binds the database connection flag of commands that use the
// BMDB; the URL may also come from SHEPHERD_DATABASE_URL.
type databaseFlags struct {
	url string
}

func (f *databaseFlags) bind(cmd *cobra.Command) {
	cmd.PersistentFlags().StringVar(&f.url, "database-url", "",
		"PostgreSQL connection URL of the BMDB (default $SHEPHERD_DATABASE_URL)")
}

// resolvedURL is the database URL of the flag, else of the environment.
func (f *databaseFlags) resolvedURL() string {
	return cmp.Or(f.url, os.Getenv("SHEPHERD_DATABASE_URL"))
}

// configured reports whether a database is named, by flag or environment.
func (f *databaseFlags) configured() bool { return f.resolvedURL() != "" }

// open opens the configured BMDB, or says how to configure one.
func (f *databaseFlags) open(ctx context.Context, schema bmdb.SchemaPolicy) (*bmdb.DB, error) {
	return f.openConfig(ctx, bmdb.Config{Schema: schema})
}

// openConfig opens the configured BMDB with cfg's other settings.
func (f *databaseFlags) openConfig(ctx context.Context, cfg bmdb.Config) (*bmdb.DB, error) {
	cfg.URL = f.resolvedURL()
	if cfg.URL == "" {
		return nil, errors.New("no database: pass --database-url or set SHEPHERD_DATABASE_URL")
	}
	return bmdb.Open(ctx, cfg)
}
