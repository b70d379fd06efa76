// Command shepherd is the Shepherd binary: every long-running component and
// every operator command is a subcommand of it.
package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
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
	root.AddCommand(newMigrateCommand(), newVersionCommand())
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

// URL returns the configured database URL or an error that says how to set it.
func (f *databaseFlags) URL() (string, error) {
	if f.url != "" {
		return f.url, nil
	}
	if u := os.Getenv("SHEPHERD_DATABASE_URL"); u != "" {
		return u, nil
	}
	return "", errors.New("no database: pass --database-url or set SHEPHERD_DATABASE_URL")
}
