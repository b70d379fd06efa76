package main

import (
	"errors"
	"fmt"
	"strings"

	"github.com/spf13/cobra"
	"google.golang.org/protobuf/proto"

	"github.com/shepherd/shepherd/agent/install"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb"
)

func newInstallCommand() *cobra.Command {
	var db databaseFlags
	cmd := &cobra.Command{
		Use:   "install",
		Short: "Request OS installations and look at their state",
	}
	db.bind(cmd)

	var machine string
	var opts install.RequestOptions
	req := &agentv1.OSInstallationRequest{}
	request := &cobra.Command{
		Use:   "request",
		Short: "Ask a machine's agent to install an image (a new generation)",
		Long: "Stores an installation request under the machine's next generation. The agent picks it up\n" +
			"with its next heartbeat, checks the target, downloads the image, checks its SHA-256, writes it\n" +
			"to the target and reports; see `shepherd install status`. The target must be a block device\n" +
			"path under /dev (such as /dev/sda or /dev/disk/by-id/NAME); the agent refuses one that does\n" +
			"not exist, is not a block device, or is mounted or in use, before downloading anything.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			req.ImageSha256 = strings.ToLower(req.ImageSha256)
			if err := install.CheckRequest(req, opts); err != nil {
				return fmt.Errorf("invalid installation request: %w", err)
			}
			raw, err := proto.Marshal(req)
			if err != nil {
				return err
			}
			d, err := db.open(cmd.Context(), bmdb.SchemaRequireCurrent)
			if err != nil {
				return err
			}
			defer d.Close()
			id, err := resolveMachine(cmd.Context(), d, machine)
			if err != nil {
				return fmt.Errorf("--machine: %w", err)
			}
			gen, err := d.RequestInstallation(cmd.Context(), id, operator(), raw)
			switch {
			case errors.Is(err, bmdb.ErrDecommissioned):
				if _, derr := d.GetDecommissioned(cmd.Context(), id); derr == nil {
					return fmt.Errorf("machine %s was decommissioned: it takes no installations (see `shepherd machine show`)", id)
				}
				return fmt.Errorf("machine %s is being decommissioned: it takes no installations", id)
			case errors.Is(err, bmdb.ErrNotFound):
				return fmt.Errorf("machine %s does not exist or is not provided", id)
			case err != nil:
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "requested installation generation %d on machine %s\n", gen, id)
			return nil
		},
	}
	f := request.Flags()
	f.StringVar(&machine, "machine", "", "machine id, or its provider id (m3, or provider/m3) (required)")
	f.StringVar(&req.ImageUrl, "image-url", "", "http or https URL of the raw disk image (required)")
	f.StringVar(&req.ImageSha256, "sha256", "", "hex SHA-256 of the image (required)")
	f.StringVar(&req.TargetDevice, "target-device", "", "block device to write the image to, under /dev (required)")
	f.BoolVar(&opts.FileTarget, "file-target", false, "accept a --target-device outside /dev: a regular file, for test machines whose agent\nwas started with --allow-file-target-dir covering it")
	f.BoolVar(&req.RebootAfter, "reboot", false, "reboot the machine after a successful installation")
	for _, name := range []string{"machine", "image-url", "sha256", "target-device"} {
		_ = request.MarkFlagRequired(name)
	}

	var statusMachine string
	status := &cobra.Command{
		Use:   "status",
		Short: "Show a machine's installation request and the agent's report",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			d, err := db.open(cmd.Context(), bmdb.SchemaRequireCurrent)
			if err != nil {
				return err
			}
			defer d.Close()
			id, err := resolveMachine(cmd.Context(), d, statusMachine)
			if err != nil {
				return fmt.Errorf("--machine: %w", err)
			}
			in, err := d.GetInstallation(cmd.Context(), id)
			if errors.Is(err, bmdb.ErrNotFound) {
				return fmt.Errorf("machine %s does not exist", id)
			} else if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if in.RequestGeneration == 0 {
				fmt.Fprintf(out, "machine %s: no installation requested\n", id)
				return nil
			}
			var r agentv1.OSInstallationRequest
			if err := proto.Unmarshal(in.Request, &r); err != nil {
				return fmt.Errorf("stored request of machine %s is corrupt: %w", id, err)
			}
			fmt.Fprintf(out, "machine %s: generation %d requested at %s by %s: %s (sha256 %s) to %s, reboot %v\n",
				id, in.RequestGeneration, in.RequestedAt.UTC().Format("2006-01-02T15:04:05Z"), orDash(in.RequestedBy),
				r.GetImageUrl(), r.GetImageSha256(), r.GetTargetDevice(), r.GetRebootAfter())
			switch {
			case in.Report == nil:
				fmt.Fprintln(out, "state: pending (no report yet)")
			case in.Installed():
				fmt.Fprintf(out, "state: installed (reported at %s)\n", in.ReportedAt.UTC().Format("2006-01-02T15:04:05Z"))
			case in.Report.Generation != in.RequestGeneration:
				fmt.Fprintf(out, "state: pending (last report is for generation %d)\n", in.Report.Generation)
			default:
				fmt.Fprintf(out, "state: failed: %s (request a new generation to retry)\n", in.Report.Error)
			}
			return nil
		},
	}
	status.Flags().StringVar(&statusMachine, "machine", "", "machine id, or its provider id (m3, or provider/m3) (required)")
	_ = status.MarkFlagRequired("machine")
	cmd.AddCommand(request, status)
	return cmd
}
