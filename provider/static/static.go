// Package static is the static inventory provider (SPEC §5.2): machines
// listed in a YAML file and reached over SSH. It is stateless: every
// machine of the file is PossiblyUsed, "creating" one only records it in
// the BMDB, and a reboot runs a command on the machine over SSH.
//
// # Inventory format
//
//	defaults:                      # optional; each machine may override
//	  port: 22
//	  ssh_user: root
//	  reboot_command: systemctl reboot
//	  trust_on_first_use: false
//	  bmc:                         # optional; shared fields of the machines' bmc blocks
//	    driver: ipmi
//	    username: ADMIN
//	    password_file: /etc/shepherd/bmc.pw
//	  recovery_rungs: [agent, reboot]   # optional; see Recovery ladder
//	machines:
//	  - id: rack1-node7            # required; 1-128 bytes; unique; any string (not a UUID)
//	    address: 10.0.0.7          # required; an IP address (v4 or v6), no host names
//	    port: 2222                 # optional; default defaults.port, else 22
//	    location: fra1/rack1       # optional; free text shown to operators
//	    ssh_user: admin            # optional; default defaults.ssh_user, else Shepherd's SSH user
//	    ssh_password_file: /etc/shepherd/node7.pw   # optional password, read from a file...
//	    ssh_password_env: NODE7_PASSWORD            # ...or an environment variable (never both)
//	    ssh_key_file: /etc/shepherd/node7.key       # optional extra private key (file or env,
//	    ssh_key_env: NODE7_KEY                      # never both; no passphrase)
//	    host_key: "ssh-ed25519 AAAAC3Nz..."         # optional pinned host key, authorized_keys format
//	                                                # (ed25519, ECDSA or RSA)
//	    trust_on_first_use: true                    # optional; default defaults.trust_on_first_use,
//	                                                # else false: see Host keys and secrets
//	    reboot_command: "ipmitool power cycle"      # optional; default defaults.reboot_command,
//	                                                # else "systemctl reboot"
//	    bmc:                       # optional; the machine's BMC, for out-of-band power
//	      driver: ipmi             # ipmi or redfish
//	      address: 10.1.0.7        # the BMC's IP address or host name
//	      port: 623                # optional; default 623 (ipmi), 443 (redfish)
//	      username: ADMIN
//	      password_file: /etc/shepherd/bmc.pw   # or password_env (never both, never inline)
//	      cipher_suite: 17         # ipmi only; 3 (the default) or 17
//	      ca_file: /etc/shepherd/bmc-ca.pem     # redfish only; default the system's CAs
//	      insecure_skip_verify: false           # redfish only; true accepts any certificate
//	      auth: session            # redfish only; basic, session, or unset: a session when
//	                               # the BMC offers one
//	    recovery_rungs: [agent, reboot, power]   # optional; replaces defaults.recovery_rungs
//	  - id: n2
//	    address: "2001:db8::2"
//
// Secrets are never written in the inventory: fields such as password,
// ssh_password, key, ssh_key or private_key are rejected, as is any field
// the format does not know. A password file's single trailing newline is
// not part of the password. Do not put secrets in reboot_command either: it
// appears in error messages.
//
// A machine's bmc block is laid over the defaults' bmc block field by field;
// the defaults' cipher_suite applies only to ipmi machines, their ca_file,
// insecure_skip_verify and auth only to redfish ones. A machine without a
// bmc block has no BMC, whatever the defaults say. BMC passwords follow the
// rules of SSH secrets: a file or a variable, never in a log, error, page or
// metric; a changed password file is noticed like any secret file.
//
// # Recovery ladder
//
// recovery_rungs lists the rungs of the recovery ladder (package ladder)
// the recoverer may take for a machine: agent, reboot and power, in any
// order (the ladder climbs cheapest first). A machine's list replaces the
// defaults' list as a whole, and the defaults' list replaces the provider
// config's recovery_rungs (Config.RecoveryRungs); without any, the
// recoverer's default applies. A list may be neither empty nor name a rung
// twice. reinstall is refused: a static inventory cannot reinstall a
// machine. A machine's own list may name power only with a bmc block; a
// list it inherits (defaults, provider config) is the fleet's, and a machine
// without a BMC takes the rest of it.
// RecoveryRungs reads the inventory in force, so a reload applies at once.
//
// # Host keys and secrets
//
// A machine's SSH host key is verified against its host_key, or else
// against the key the BMDB recorded when Shepherd first took the machine
// over (trust on first use; `shepherd machine host-key accept` replaces a
// recorded key after a reinstall, a pinned one is changed here). Shepherd's
// own SSH key may go to a machine whose key is neither pinned nor recorded
// yet: it proves only that we are Shepherd. The machine's own password and
// key may not, because whoever answers at its address would get them: until
// its key is pinned or recorded they are withheld, and a login that needs
// them fails with a cause that says so. trust_on_first_use: true sends them
// anyway, for machines that accept nothing else and whose host key cannot
// be learnt out of band; the first key seen is then recorded as usual.
//
// # Reboots
//
// RebootMachine runs reboot_command over SSH within SSHTimeout. Until the
// machine confirms that it started the command, any failure fails the
// reboot, and the recoverer tries again after its backoff. Once it
// confirmed, only a non-zero exit status fails the reboot; a zero status,
// a connection cut, or a machine that stops answering until SSHTimeout (one
// that reset at once, without closing the connection) count as a reboot
// issued: that is what a reboot looks like from outside. Whether the machine
// came back is for its agent's heartbeat to tell, and a reboot counted as
// failed would be repeated on a machine that is booting already.
//
// An empty file is an error rather than an empty fleet, because a
// half-written file must not make every machine disappear; write
// "machines: []" for an inventory without machines. Replace the file
// atomically (write a new file, then rename it over the old one) so that
// Run never sees it half-written.
//
// # Reloading
//
// Run checks the file, and every secret file it names, every
// ReloadInterval. A changed inventory, or a secret file that changed (its
// content or its identity: modification time, size, inode, as when a
// rotated secret is renamed over the old file), makes it parse the
// inventory and read its secrets again; if they are good they replace the
// inventory in force at once, otherwise the error (which names FILE:LINE)
// is logged and counted and the last good inventory stays in force.
// Reload does the same at once, whatever changed; shepherd run calls it on
// SIGHUP. Secrets from environment variables are read with the inventory;
// a process's environment does not change. A machine that leaves the file
// disappears from ListMachines; the provisioner then marks it Missing.
//
// # Metrics
//
//	shepherd_static_inventory_machines              machines in force
//	shepherd_static_inventory_valid                 1 if the last read of the file was good, else 0
//	shepherd_static_inventory_reload_errors_total   failed reads or parses of the file
//
// Each carries the label provider, the provider's Name.
package static

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/shepherd/shepherd/ladder"
	"github.com/shepherd/shepherd/power"
	"github.com/shepherd/shepherd/provider"
)

// Defaults of Config and of the inventory.
const (
	defaultName           = "static"
	defaultReloadInterval = 5 * time.Second
	defaultSSHTimeout     = 30 * time.Second
	defaultPort           = 22
	defaultRebootCommand  = "systemctl reboot"
)

// Config configures the provider. Zero values mean defaults.
type Config struct {
	Inventory      string        // path of the YAML inventory; required
	Name           string        // provider name recorded in the BMDB; default "static"
	ReloadInterval time.Duration // how often the file is checked for changes; default 5s
	SSHTimeout     time.Duration // bounds a reboot's SSH connection and command; default 30s
	Env            provider.Env  // logger, registerer, host key checker, SSH signer and default user
	// Power paces and bounds the calls to the machines' BMCs.
	Power power.Config
	// OpenBMC opens the driver of a machine's BMC; nil means bmc.Open,
	// every driver Shepherd has.
	OpenBMC func(power.Spec) (power.Driver, error)
	// RecoveryRungs is the recovery ladder of every machine for which
	// neither it nor the inventory's defaults give recovery_rungs; nil
	// means the recoverer's default. Reinstall is refused, and so is Power
	// when a machine it applies to has no bmc block.
	RecoveryRungs []ladder.Rung
}

// Validate names the field and the bad value. It changes nothing.
func (c Config) Validate() error {
	if c.Inventory == "" {
		return errors.New("static: Inventory is required")
	}
	if c.ReloadInterval < 0 {
		return fmt.Errorf("static: ReloadInterval must be >= 0 (0 = default), got %s", c.ReloadInterval)
	}
	if c.SSHTimeout < 0 {
		return fmt.Errorf("static: SSHTimeout must be >= 0 (0 = default), got %s", c.SSHTimeout)
	}
	if err := c.Power.Validate(); err != nil {
		return fmt.Errorf("static: %w", err)
	}
	if len(c.RecoveryRungs) > 0 {
		if _, err := checkRungs(c.RecoveryRungs); err != nil {
			return fmt.Errorf("static: RecoveryRungs: %w", err)
		}
	}
	return nil
}

// Provider is the static inventory provider. It implements
// provider.Provider, provider.Recoverer, provider.SSHAccessor,
// provider.PowerController, provider.RungChooser and provider.Runner; all
// methods are safe for concurrent use.
type Provider struct {
	cfg       Config
	log       *slog.Logger
	metrics   *metrics
	lookupEnv func(string) (string, bool) // os.LookupEnv; replaced in tests

	// inv is the inventory in force. It is replaced whole, never changed,
	// so readers need no lock.
	inv atomic.Pointer[inventory]

	reloadMu sync.Mutex // serializes loads of the file; guards seen
	seen     fileState  // the file as last read, good or not

	bmcMu sync.Mutex
	// bmcs are the controllers of the BMCs used so far, by endpoint, so
	// that calls to one BMC are paced however many machines name it.
	bmcs map[string]bmcController
}

var (
	_ provider.Provider        = (*Provider)(nil)
	_ provider.Recoverer       = (*Provider)(nil)
	_ provider.SSHAccessor     = (*Provider)(nil)
	_ provider.Runner          = (*Provider)(nil)
	_ provider.PowerController = (*Provider)(nil)
	_ provider.RungChooser     = (*Provider)(nil)
)

// New loads the inventory; a broken file is an error that names file:line.
// The provider serves that inventory until Run sees the file change.
func New(cfg Config) (*Provider, error) {
	return newProvider(cfg, os.LookupEnv)
}

func newProvider(cfg Config, lookupEnv func(string) (string, bool)) (*Provider, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Name = cmp.Or(cfg.Name, defaultName) // cfg is a copy; the caller's value is untouched
	cfg.ReloadInterval = cmp.Or(cfg.ReloadInterval, defaultReloadInterval)
	cfg.SSHTimeout = cmp.Or(cfg.SSHTimeout, defaultSSHTimeout)
	if len(cfg.RecoveryRungs) > 0 {
		// In ladder order, and a copy the caller cannot change under us.
		cfg.RecoveryRungs, _ = checkRungs(cfg.RecoveryRungs) // validated above
	} else {
		cfg.RecoveryRungs = nil
	}
	log := cfg.Env.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	p := &Provider{
		cfg:       cfg,
		log:       log.With(slog.String("component", "provider"), slog.String("provider", cfg.Name)),
		lookupEnv: lookupEnv,
		bmcs:      map[string]bmcController{},
	}
	// Load before registering metrics, so a broken file leaves the
	// registerer untouched and New can simply be called again.
	p.reloadMu.Lock()
	inv, err := p.load()
	p.reloadMu.Unlock()
	if err != nil {
		return nil, err
	}
	m, err := newMetrics(cfg.Env.Registerer, cfg.Name)
	if err != nil {
		return nil, err
	}
	p.metrics = m
	p.use(inv)
	p.log.Info("inventory loaded", slog.String("file", cfg.Inventory), slog.Int("machines", len(inv.list)))
	return p, nil
}

// factoryKeys are the keys of the Factory's configuration, for messages.
const factoryKeys = "inventory, name, reload_interval, ssh_timeout, bmc_min_interval, bmc_call_timeout, bmc_settle, bmc_attempts, recovery_rungs"

// Factory is the provider.Factory for the registry: config is YAML
// {inventory: PATH, name: NAME, reload_interval: 5s, ssh_timeout: 30s}
// (unknown keys rejected). Only inventory is required. The keys
// bmc_min_interval, bmc_call_timeout, bmc_settle and bmc_attempts set
// Config.Power (power.Config), for BMCs that need slower pacing than the
// defaults or tolerate faster. recovery_rungs, a list such as [agent,
// reboot], sets Config.RecoveryRungs: the ladder of the machines for which
// the inventory gives none.
func Factory(_ context.Context, env provider.Env, config []byte) (provider.Provider, error) {
	cfg, err := parseFactoryConfig(config)
	if err != nil {
		return nil, err
	}
	cfg.Env = env
	p, err := New(cfg)
	if err != nil {
		return nil, err
	}
	return p, nil
}

func parseFactoryConfig(config []byte) (Config, error) {
	var cfg Config
	var doc yaml.Node
	if err := yaml.NewDecoder(bytes.NewReader(config)).Decode(&doc); errors.Is(err, io.EOF) || err == nil && len(doc.Content) == 0 {
		return cfg, nil // empty: Validate will ask for the inventory
	} else if err != nil {
		return cfg, fmt.Errorf("static: config: %s", yamlErrorText(err))
	}
	root := doc.Content[0]
	if root.Kind != yaml.MappingNode {
		return cfg, fmt.Errorf("static: config line %d: want a mapping with keys %s", root.Line, factoryKeys)
	}
	seen := map[string]int{}
	for i := 0; i+1 < len(root.Content); i += 2 {
		k, v := root.Content[i], resolve(root.Content[i+1])
		if first, dup := seen[k.Value]; dup {
			return cfg, fmt.Errorf("static: config line %d: %s given twice (first at line %d)", k.Line, k.Value, first)
		}
		seen[k.Value] = k.Line
		if k.Value == "recovery_rungs" { // the only key that takes a list
			if isNull(v) {
				continue // left out, as in the inventory
			}
			rungs, _, line, err := readRungs(k.Value, v)
			if err != nil {
				return cfg, fmt.Errorf("static: config line %d: %w", line, err)
			}
			cfg.RecoveryRungs = rungs
			continue
		}
		if v.Kind != yaml.ScalarNode {
			return cfg, fmt.Errorf("static: config line %d: %s must be a single value", v.Line, k.Value)
		}
		var err error
		switch k.Value {
		case "inventory":
			cfg.Inventory = v.Value
		case "name":
			cfg.Name = v.Value
		case "reload_interval":
			cfg.ReloadInterval, err = time.ParseDuration(v.Value)
		case "ssh_timeout":
			cfg.SSHTimeout, err = time.ParseDuration(v.Value)
		case "bmc_min_interval":
			cfg.Power.MinInterval, err = time.ParseDuration(v.Value)
		case "bmc_call_timeout":
			cfg.Power.CallTimeout, err = time.ParseDuration(v.Value)
		case "bmc_settle":
			cfg.Power.Settle, err = time.ParseDuration(v.Value)
		case "bmc_attempts":
			cfg.Power.Attempts, err = strconv.Atoi(v.Value)
		default:
			return cfg, fmt.Errorf("static: config line %d: unknown key %q (known: %s)", k.Line, k.Value, factoryKeys)
		}
		if err != nil {
			return cfg, fmt.Errorf("static: config line %d: %s: %w", v.Line, k.Value, err)
		}
	}
	return cfg, nil
}

// Name is the provider's name as recorded in the BMDB.
func (p *Provider) Name() string { return p.cfg.Name }

// ListMachines returns every machine of the inventory in force, sorted by
// id. It never fails: the inventory is in memory.
func (p *Provider) ListMachines(context.Context) ([]provider.Machine, error) {
	inv := p.inv.Load()
	out := make([]provider.Machine, len(inv.list))
	for i, m := range inv.list {
		out[i] = m
	}
	return out, nil
}

// GetMachine returns the machine with provider id id, or an error wrapping
// provider.ErrNotFound if the inventory in force does not list it.
func (p *Provider) GetMachine(_ context.Context, id string) (provider.Machine, error) {
	e, err := p.entry(id)
	if err != nil {
		return nil, err
	}
	return e.m, nil
}

// CreateMachine returns req.From as it stands in the inventory. The
// provider is stateless: "creating" a machine only records it in the BMDB,
// nothing happens at the machine, so a retried request is harmless.
func (p *Provider) CreateMachine(_ context.Context, req provider.CreateRequest) (provider.Machine, error) {
	if req.From == nil {
		return nil, fmt.Errorf("%s: creating a machine: the request names no machine of the inventory", p.cfg.Name)
	}
	e, err := p.entry(req.From.ID())
	if err != nil {
		return nil, err
	}
	return e.m, nil
}

// entry returns the inventory's entry for id, or an error wrapping
// provider.ErrNotFound.
func (p *Provider) entry(id string) (*entry, error) {
	e, ok := p.inv.Load().byID[id]
	if !ok {
		return nil, fmt.Errorf("%s: machine %q is not in the inventory: %w", p.cfg.Name, id, provider.ErrNotFound)
	}
	return e, nil
}

// machine is a machine of the inventory as the rest of Shepherd sees it. It
// holds no secret, so printing it with %v cannot leak one.
type machine struct {
	id       string
	location string
	addr     netip.AddrPort
}

var _ provider.Described = (*machine)(nil)

func (m *machine) ID() string                          { return m.id }
func (m *machine) Addr() netip.AddrPort                { return m.addr }
func (m *machine) Availability() provider.Availability { return provider.PossiblyUsed }
func (m *machine) Failed() bool                        { return false }
func (m *machine) Location() string                    { return m.location }
func (m *machine) ReservationID() string               { return "" }

// Status is always Running: the file cannot tell otherwise, and whether the
// machine answers is the agent's heartbeat's business.
func (m *machine) Status() provider.Status { return provider.StatusRunning }
