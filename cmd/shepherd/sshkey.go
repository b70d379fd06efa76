package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/cobra"

	"github.com/shepherd/shepherd/internal/sshx"
)

// sshKeyFile is where shepherd run and shepherd dev keep the SSH client
// key of the initializer, recoverer and decommissioner: in the data
// directory.
func sshKeyFile(dataDir string) string { return filepath.Join(dataDir, "ssh_key") }

// devDataDir is shepherd dev's default --data-dir.
func devDataDir() string {
	return filepath.Join(os.TempDir(), fmt.Sprintf("shepherd-dev-%d", os.Getuid()))
}

func newSSHKeyCommand() *cobra.Command {
	var dataDir string
	var dev bool
	cmd := &cobra.Command{
		Use:   "ssh-key --data-dir DIR",
		Short: "Print the authorized_keys line of Shepherd's SSH key, for the machines to take over",
		Long: "Prints the line to add to ~/.ssh/authorized_keys of the SSH user (--ssh-user, default root) on\n" +
			"every machine Shepherd is to take over: the public half of DIR/ssh_key, the key shepherd run\n" +
			"--data-dir DIR uses (the same line is in DIR/ssh_key.pub). The key is created, as shepherd run\n" +
			"would create it, if it does not exist yet, so machines can be prepared before the first run.\n" +
			"--dev reads shepherd dev's default data directory.",
		Example: "  shepherd ssh-key --data-dir /var/lib/shepherd | ssh root@m3 'cat >> ~/.ssh/authorized_keys'",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			switch {
			case dev && dataDir != "":
				return errors.New("--dev and --data-dir are exclusive")
			case dev:
				dataDir = devDataDir()
			case dataDir == "":
				return errors.New("--data-dir is required: the --data-dir of shepherd run (or --dev for shepherd dev's)")
			}
			path := sshKeyFile(dataDir)
			_, statErr := os.Stat(path)
			if _, err := sshx.LoadOrCreateKey(path); err != nil {
				return err
			}
			if errors.Is(statErr, os.ErrNotExist) {
				fmt.Fprintf(cmd.ErrOrStderr(), "created the SSH key %s\n", path)
			}
			pub, err := os.ReadFile(path + ".pub")
			if err != nil {
				return fmt.Errorf("reading the public key: %w", err)
			}
			_, err = cmd.OutOrStdout().Write(pub)
			return err
		},
	}
	cmd.Flags().StringVar(&dataDir, "data-dir", "", "shepherd run's --data-dir, which holds ssh_key")
	cmd.Flags().BoolVar(&dev, "dev", false, "use shepherd dev's default data directory ("+devDataDir()+")")
	return cmd
}
