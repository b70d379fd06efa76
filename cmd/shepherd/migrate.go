package main

import (
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/shepherd/shepherd/bmdb"
)

func newMigrateCommand() *cobra.Command {
	var db databaseFlags
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Apply or inspect BMDB schema migrations",
	}
	db.bind(cmd)
	cmd.AddCommand(&cobra.Command{
		Use:   "up",
		Short: "Apply every migration the database lacks",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			d, err := db.open(cmd.Context(), bmdb.SchemaIgnore)
			if err != nil {
				return err
			}
			defer d.Close()
			out := cmd.OutOrStdout()
			fmt.Fprintf(out, "schema at version %d\n", d.SchemaVersion())
			v, err := d.Migrate(cmd.Context(), func(m bmdb.MigrationState, took time.Duration) {
				fmt.Fprintf(out, "applied %s (version %d) in %s\n", m.Name, m.Version, took.Round(time.Millisecond))
			})
			if err != nil {
				return err
			}
			fmt.Fprintf(out, "schema at version %d\n", v)
			return nil
		},
	})
	cmd.AddCommand(&cobra.Command{
		Use:   "status",
		Short: "List the migrations this binary knows and whether the database has them",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			d, err := db.open(cmd.Context(), bmdb.SchemaIgnore)
			if err != nil {
				return err
			}
			defer d.Close()
			st, err := d.MigrationStatus(cmd.Context())
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			fmt.Fprintf(out, "%-8s  %-8s  %-25s  %s\n", "VERSION", "STATE", "APPLIED AT", "NAME")
			for _, m := range st {
				state, at := "pending", ""
				if m.Applied {
					state, at = "applied", m.AppliedAt.UTC().Format(time.RFC3339)
				}
				fmt.Fprintf(out, "%-8d  %-8s  %-25s  %s\n", m.Version, state, at, m.Name)
			}
			return nil
		},
	})
	return cmd
}
