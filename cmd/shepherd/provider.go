package main

import (
	"errors"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/shepherd/shepherd/bmdb"
)

// newProviderCommand is `shepherd provider`: what an operator tells the
// control loops about a provider as a whole.
func newProviderCommand() *cobra.Command {
	var db databaseFlags
	cmd := &cobra.Command{
		Use:   "provider",
		Short: "Act on how the control loops treat a provider's listings",
	}
	db.bind(cmd)

	var (
		name       string
		maxMissing int
		validFor   time.Duration
	)
	accept := &cobra.Command{
		Use:   "accept-listing --provider NAME --max-missing N",
		Short: "Believe the next listing that lacks too many machines: they are really gone",
		Long: "The provisioner and the updater do not believe a listing that lacks more than\n" +
			"--suspect-fraction and more than --suspect-min-missing of the provider's machines: such a\n" +
			"listing is suspect and changes nothing, and they log how many machines it lacks. When those\n" +
			"machines really are gone, this records that the next suspect listing of the provider that\n" +
			"lacks at most --max-missing machines is right: the first pass that finds one marks them\n" +
			"Missing and uses the acceptance up. An acceptance no pass used within --valid-for lapses.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			switch {
			case name == "":
				return errors.New("--provider is required: the provider whose listing to accept")
			case maxMissing < 1:
				return fmt.Errorf("--max-missing must be at least 1 (the number of machines the suspect listing lacks, from the log), got %d", maxMissing)
			case validFor <= 0 || validFor > bmdb.MaxListingAcceptance:
				return fmt.Errorf("--valid-for must be within (0, %s], got %s", bmdb.MaxListingAcceptance, validFor)
			}
			d, err := db.open(cmd.Context(), bmdb.SchemaRequireCurrent)
			if err != nil {
				return err
			}
			defer d.Close()
			acc, err := d.AcceptListing(cmd.Context(), name, maxMissing, validFor, operator())
			if err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(),
				"accepted: the next listing of %s that lacks at most %d machines is believed, if a pass finds it by %s\n",
				acc.Provider, acc.MaxMissing, acc.Until.UTC().Format(time.RFC3339))
			return nil
		},
	}
	fl := accept.Flags()
	fl.StringVar(&name, "provider", "", "provider name, as in the BMDB (required)")
	fl.IntVar(&maxMissing, "max-missing", 0, "most machines the accepted listing may lack (required; the log of the suspect pass names it)")
	fl.DurationVar(&validFor, "valid-for", time.Hour, "the acceptance lapses if no pass uses it within this time")
	cmd.AddCommand(accept)
	return cmd
}
