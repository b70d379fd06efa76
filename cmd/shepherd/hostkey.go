package main

import (
	"errors"
	"fmt"
	"regexp"
	"time"

	"github.com/spf13/cobra"

	"github.com/shepherd/shepherd/bmdb"
)

// fingerprintRE matches an SSH key's SHA-256 fingerprint as ssh-keygen -l
// and Shepherd print it: "SHA256:" and 43 characters of unpadded base64.
var fingerprintRE = regexp.MustCompile(`^SHA256:[A-Za-z0-9+/]{43}$`)

func (c *machineCLI) hostKeyCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "host-key",
		Short: "Accept a machine's changed SSH host key",
	}
	cmd.AddCommand(c.hostKeyAcceptCommand())
	return cmd
}

func (c *machineCLI) hostKeyAcceptCommand() *cobra.Command {
	var fingerprint, reason string
	cmd := &cobra.Command{
		Use:   "accept ID --fingerprint SHA256:...",
		Short: "Make the SSH host key a machine presented instead of its recorded one the recorded key",
		Long: "A machine whose SSH host key changed (reinstalled) fails its agent start with a host key\n" +
			"mismatch that names the key it presented; Shepherd keeps that key. Check its fingerprint out\n" +
			"of band (the machine's console: ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub), then\n" +
			"accept it here: it replaces the recorded key, the machine's AgentStart and Recovery backoffs\n" +
			"and quarantines are cleared so that it is taken over again at once, and history records which\n" +
			"key replaced which, who asked and why. A key the provider pins (a static inventory's host_key)\n" +
			"is changed at the provider instead: its pin wins at the next takeover.",
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if fingerprint == "" {
				return errors.New("--fingerprint is required: the SHA256:... fingerprint of the key to accept, as the mismatch named it")
			}
			if !fingerprintRE.MatchString(fingerprint) {
				return fmt.Errorf("--fingerprint %q is not an SSH key's SHA-256 fingerprint (SHA256: and 43 base64 characters)", fingerprint)
			}
			reason, err := cleanReason(reason)
			if err != nil {
				return err
			}
			db, err := c.open(cmd.Context())
			if err != nil {
				return err
			}
			defer db.Close()
			d, _, err := findMachine(cmd.Context(), db, args[0])
			if err != nil {
				return err
			}
			id := d.MachineID
			ch, err := db.AcceptHostKey(cmd.Context(), id, fingerprint, operator()+" with the shepherd CLI", reason)
			switch {
			case errors.Is(err, bmdb.ErrNotFound):
				return fmt.Errorf("machine %s has no SSH host key recorded: there is nothing to replace (its next takeover records the key it presents)", id)
			case errors.Is(err, bmdb.ErrNoOfferedHostKey):
				return fmt.Errorf("machine %s has presented no SSH host key other than its recorded one: nothing to accept (nothing changed)", id)
			case errors.Is(err, bmdb.ErrOfferedHostKeyDiffers):
				return fmt.Errorf("machine %s: %w; nothing changed: check the key it presents now (shepherd machine show %s) before accepting it", id, err, id)
			case err != nil:
				return err
			}
			out := cmd.OutOrStdout()
			fmt.Fprintf(out, "machine %s: SSH host key %s replaced by %s (presented %s); cleared the %s and %s backoffs and wrote history Reset; the initializer takes the machine over again\n",
				id, ch.OldFingerprint, ch.NewFingerprint, ch.OfferedAt.UTC().Format(time.RFC3339), bmdb.ProcessAgentStart, bmdb.ProcessRecovery)
			if ch.OldPinned {
				fmt.Fprintf(out, "note: the replaced key had been pinned by the provider; if the provider still pins it, the pin wins at the next takeover: change it there\n")
			}
			return nil
		},
	}
	cmd.Flags().StringVar(&fingerprint, "fingerprint", "", "SHA-256 fingerprint of the presented key to accept, as the host key mismatch names it (required)")
	cmd.Flags().StringVar(&reason, "reason", "", "why, for the history")
	return cmd
}
