// Command shepherd is the Shepherd binary: every long-running component and
// every operator command is a subcommand of it.
package main

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/shepherd/shepherd/bmdb"
)

func main() {
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	ctx, stop := shutdownOnSignal(context.Background(), sigs, os.Stderr, os.Exit)
	err := newRootCommand().ExecuteContext(ctx)
	signal.Stop(sigs)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "shepherd:", err)
		os.Exit(1)
	}
}

// shutdownOnSignal returns a context that the first signal on sigs
// (SIGINT or SIGTERM) cancels: a clean shutdown, in which work in flight is
// canceled and recorded and sessions are closed, bounded by each
// component's own timeouts. A second signal exits at once through exit,
// with status 128+signal and one line on stderr saying so: an operator who
// presses Ctrl-C again, or a supervisor that signals twice, means "now".
// stop ends the watch; call it once the command returned.
func shutdownOnSignal(parent context.Context, sigs <-chan os.Signal, stderr io.Writer, exit func(int)) (ctx context.Context, stop func()) {
	ctx, cancel := context.WithCancel(parent)
	done := make(chan struct{})
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		first := true
		for {
			select {
			case <-done:
				return
			case sig := <-sigs:
				if first {
					first = false
					fmt.Fprintf(stderr, "shepherd: %v: shutting down cleanly (signal again to exit at once)\n", sig)
					cancel()
					continue
				}
				fmt.Fprintf(stderr, "shepherd: %v again: exiting at once, without a clean shutdown\n", sig)
				exit(128 + signalNumber(sig))
				return
			}
		}
	}()
	return ctx, func() {
		close(done)
		<-watched
		cancel()
	}
}

// signalNumber is sig's number, for the exit status; 0 if it has none.
func signalNumber(sig os.Signal) int {
	if s, ok := sig.(syscall.Signal); ok {
		return int(s)
	}
	return 0
}

func newRootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:           "shepherd",
		Short:         "Shepherd keeps bare-metal fleets under management",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newRunCommand(), newDevCommand(), newMigrateCommand(), newInstallCommand(), newEquinixCommand(), newVersionCommand(), newSSHKeyCommand())
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
