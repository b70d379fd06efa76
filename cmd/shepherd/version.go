package main

import (
	"fmt"
	"runtime/debug"

	"github.com/spf13/cobra"
)

func newVersionCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Print the version of this binary",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			version, goVersion := "unknown", "unknown"
			if bi, ok := debug.ReadBuildInfo(); ok {
				version, goVersion = bi.Main.Version, bi.GoVersion
			}
			fmt.Fprintf(cmd.OutOrStdout(), "shepherd %s (%s)\n", version, goVersion)
			return nil
		},
	}
}
