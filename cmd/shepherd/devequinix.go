package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/shepherd/shepherd/internal/atomicfile"
	"github.com/shepherd/shepherd/provider"
	"github.com/shepherd/shepherd/provider/equinix"
	"github.com/shepherd/shepherd/provider/equinix/fakemetal"
	"github.com/shepherd/shepherd/provider/equinix/metal"
	"github.com/shepherd/shepherd/provider/sim"
)

// devProject is the Metal project of `shepherd dev --provider=equinix`,
// and devOperatingSystem the operating system of its devices.
const (
	devProject         = "shepherd-dev"
	devOperatingSystem = "ubuntu_22_04"
)

// devEquinix is the equinix provider as `shepherd dev --provider=equinix`
// runs it: the real provider and API client, talking HTTP to an in-process
// fake Metal API, with a simulated fleet standing in for the hardware.
// The fake gives the n-th device the address of the n-th simulated
// machine, and SSH to a device goes to that machine through the
// simulator's in-process transport, so the real initializer takes the
// devices over and simulated agents heartbeat for them.
type devEquinix struct {
	*equinix.Provider
	hw  *sim.Fleet
	api *fakemetal.Server
	srv *http.Server
	ln  net.Listener

	// slots maps a simulated machine's address to its id.
	slots map[netip.Addr]string
}

var (
	_ provider.SSHAccessor = (*devEquinix)(nil)
	_ provider.Runner      = (*devEquinix)(nil)
	_ provider.Recoverer   = (*devEquinix)(nil)
)

// devEquinixAPI says where the fake Metal API of `shepherd dev
// --provider=equinix` is, so that the equinix CLI can be tried against
// it: the API's URL, the file holding its token, and a configuration file
// for `shepherd equinix --config` naming both (and the dev project).
type devEquinixAPI struct {
	URL, TokenFile, ConfigFile string
}

// devEquinixFactory returns the factory of the dev provider with the given
// number of hardware reservations (and simulated machines behind them). It
// writes the fake API's token and a configuration of the equinix CLI for
// it into dir, and fills in api.
func devEquinixFactory(machines int, simYAML, dir string, api *devEquinixAPI) provider.Factory {
	return func(ctx context.Context, env provider.Env, _ []byte) (provider.Provider, error) {
		if env.SSHSigner == nil {
			return nil, errors.New("dev equinix: no SSH key")
		}
		simCfg, err := sim.ParseConfig([]byte(simYAML))
		if err != nil {
			return nil, err
		}
		simCfg.Name, simCfg.Machines, simCfg.Logger, simCfg.Registerer = "equinix-hardware", machines, env.Logger, env.Registerer
		hw, err := sim.New(simCfg)
		if err != nil {
			return nil, err
		}
		ms, err := hw.ListMachines(ctx)
		if err != nil {
			return nil, err
		}
		d := &devEquinix{hw: hw, slots: map[netip.Addr]string{}}
		addrs := make([]netip.Addr, len(ms))
		for i, m := range ms {
			addrs[i] = m.Addr().Addr()
			d.slots[addrs[i]] = m.ID()
		}
		var secret [16]byte
		_, _ = rand.Read(secret[:])
		token := hex.EncodeToString(secret[:])
		d.api, err = fakemetal.New(fakemetal.Config{
			Token:          token,
			ProvisionDelay: 3 * time.Second,
			RebootDelay:    2 * time.Second,
			ReinstallDelay: 5 * time.Second,
			Budget:         100,
			Burst:          50,
			Address:        func(_ string, n int) netip.Addr { return addrs[(n-1)%len(addrs)] },
		})
		if err != nil {
			return nil, err
		}
		d.api.AddProject(devProject)
		d.api.AddReservations(devProject, "c3.small.x86", "da11", "da", machines)
		if d.ln, err = net.Listen("tcp", "127.0.0.1:0"); err != nil {
			return nil, err
		}
		d.srv = &http.Server{Handler: d.api, ReadHeaderTimeout: 10 * time.Second}
		go func() { _ = d.srv.Serve(d.ln) }() // ends with Shutdown in Run or in the error path below
		baseURL := "http://" + d.ln.Addr().String() + "/metal/v1"
		if err := writeDevEquinixConfig(dir, baseURL, token, api); err != nil {
			d.shutdown()
			return nil, err
		}
		client, err := metal.New(metal.Config{
			BaseURL: baseURL, Token: token,
			RequestsPerSecond: 80, Burst: 40, Logger: env.Logger, Registerer: env.Registerer,
			// The BMDB's budget, as in production, though dev is one process.
			SharedBudget: equinix.SharedBudget(env.RequestBudget),
		})
		if err == nil {
			d.Provider, err = equinix.New(ctx, equinix.Config{
				Project: devProject, Client: client, OperatingSystem: devOperatingSystem,
				SSHKey: env.SSHSigner.PublicKey(), Logger: env.Logger, StatePollInterval: 500 * time.Millisecond,
			})
		}
		if err != nil {
			d.shutdown()
			return nil, err
		}
		return d, nil
	}
}

// writeDevEquinixConfig writes the fake API's token (mode 0600) and a
// configuration of the equinix provider for it into dir, as `shepherd
// equinix --config` reads it, and fills in api.
func writeDevEquinixConfig(dir, baseURL, token string, api *devEquinixAPI) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("dev equinix: %w", err)
	}
	tokenFile := filepath.Join(dir, "token")
	// Not os.WriteFile: it would keep the mode of a token file left readable.
	if err := atomicfile.Write(tokenFile, []byte(token+"\n"), 0o600); err != nil {
		return fmt.Errorf("dev equinix: writing the API token: %w", err)
	}
	configFile := filepath.Join(dir, "equinix.yaml")
	config := fmt.Sprintf("# The fake Metal API of `shepherd dev --provider=equinix`; valid while it runs.\n"+
		"project: %s\ntoken_file: %s\napi_url: %s\noperating_system: %s\n", devProject, tokenFile, baseURL, devOperatingSystem)
	if err := os.WriteFile(configFile, []byte(config), 0o600); err != nil {
		return fmt.Errorf("dev equinix: writing the CLI configuration: %w", err)
	}
	*api = devEquinixAPI{URL: baseURL, TokenFile: tokenFile, ConfigFile: configFile}
	return nil
}

// Run runs the simulated hardware and serves the fake API until ctx ends.
func (d *devEquinix) Run(ctx context.Context) error {
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return d.hw.Run(gctx) })
	g.Go(func() error {
		<-gctx.Done()
		d.shutdown()
		return nil
	})
	return g.Wait()
}

func (d *devEquinix) shutdown() {
	d.api.Close() // releases requests held by injected timeouts
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = d.srv.Shutdown(sctx)
}

// slot returns the simulated machine behind device id, powered up.
func (d *devEquinix) slot(ctx context.Context, id string) (string, error) {
	m, err := d.Provider.GetMachine(ctx, id)
	if err != nil {
		return "", err
	}
	slot, ok := d.slots[m.Addr().Addr()]
	if !ok {
		return "", fmt.Errorf("dev equinix: device %s has no address of a simulated machine yet", id)
	}
	// Creating a simulated machine that is up already returns it as it is.
	hm, err := d.hw.GetMachine(ctx, slot)
	if err != nil {
		return "", err
	}
	if _, err := d.hw.CreateMachine(ctx, provider.CreateRequest{From: hm}); err != nil {
		return "", err
	}
	return slot, nil
}

// SSHAccess reaches a device's simulated machine.
func (d *devEquinix) SSHAccess(ctx context.Context, id string) (provider.SSHAccess, error) {
	slot, err := d.slot(ctx, id)
	if err != nil {
		return provider.SSHAccess{}, err
	}
	return d.hw.SSHAccess(ctx, slot)
}

// RebootMachine reboots the device through the API and restarts its
// simulated machine (which stops its agent, as a real reboot would).
func (d *devEquinix) RebootMachine(ctx context.Context, id string) error {
	if err := d.Provider.RebootMachine(ctx, id); err != nil {
		return err
	}
	slot, err := d.slot(ctx, id)
	if err != nil {
		return err
	}
	return d.hw.RebootMachine(ctx, slot)
}

// ReinstallMachine reinstalls the device through the API and its
// simulated machine.
func (d *devEquinix) ReinstallMachine(ctx context.Context, id string) error {
	if err := d.Provider.ReinstallMachine(ctx, id); err != nil {
		return err
	}
	slot, err := d.slot(ctx, id)
	if err != nil {
		return err
	}
	return d.hw.ReinstallMachine(ctx, slot)
}
