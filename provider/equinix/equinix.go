// Package equinix is the Equinix Metal provider (SPEC §5.3): hardware
// reservations without a device are capacity, devices whose hostname
// starts with the configured prefix are ours, everything else in the
// project is foreign. It speaks to the API through package metal, whose
// client keeps the account's request budget for every caller.
//
// # Machine ids
//
// A reservation without a device is listed under the reservation's id;
// creating a machine from it turns it into a device, listed under the
// device's id. Both are the API's opaque ids.
//
// # SSH keys
//
// Every process registers its own SSH key as a project key labelled with
// ssh_key_label and the key's SHA-256 fingerprint ("shepherd SHA256:…"),
// and creates devices with every project key so labelled: processes with
// different keys (each data directory has its own) all stay trusted on
// every device, whichever process created it, and none overwrites another's
// key. The keys are listed for every creation (one more request), so a
// process that started a moment ago is trusted by the next device. Keys
// of processes that are gone for good stay trusted until an operator
// deletes them from the project; keys under other labels are never used.
//
// # Request budget
//
// requests_per_second and burst are the API account's budget, whichever
// processes use it: run by `shepherd run` (and by `shepherd equinix` given
// the BMDB), the provider takes its requests from a token bucket in the
// BMDB that every process with the same API URL and token shares
// (provider.Env.RequestBudget), and a 429 any of them gets pauses them
// all. Give every process the same values. Without the BMDB the budget is
// the process's own.
//
// # Configuration
//
//	project: 4f0b…                 # required: the Metal project
//	token_file: /etc/shepherd/metal-token   # the API token, from a file...
//	token_env: METAL_AUTH_TOKEN             # ...or an environment variable (never both)
//	api_url: https://api.equinix.com/metal/v1   # default
//	prefix: shepherd-              # hostname prefix of our devices; default "shepherd-"
//	operating_system: ubuntu_22_04 # required: the OS devices are created (and reinstalled) with
//	ssh_key_label: shepherd        # label prefix of Shepherd's project SSH keys; default "shepherd"
//	ssh_port: 22                   # port of the devices' SSH servers; default 22
//	requests_per_second: 5         # the account's request budget; default 5
//	burst: 10                      # default 10; both: see "Request budget"
//	max_concurrency: 8             # requests in flight; default 8
//	failed_reservation_penalty: 1h # a reservation whose device failed is not used again for this long
//	state_poll_interval: 5s        # how often a reboot or reinstall polls the device's state
package equinix

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"strings"
	"sync"
	"time"

	"go.yaml.in/yaml/v3"
	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/provider"
	"github.com/shepherd/shepherd/provider/equinix/metal"
)

// Name is the provider's default name in the BMDB and the registry.
const Name = "equinix"

// Defaults of Config.
const (
	defaultPrefix        = "shepherd-"
	defaultSSHKeyLabel   = "shepherd"
	defaultSSHPort       = 22
	defaultPenalty       = time.Hour
	defaultPollInterval  = 5 * time.Second
	defaultRebootSettle  = 30 * time.Second
	hostnameReservLength = 8
)

// Config configures the provider. Zero values mean defaults.
type Config struct {
	// Name is the provider name recorded in the BMDB; default "equinix".
	Name string
	// Project is the Metal project whose reservations and devices are used.
	Project string
	// Client talks to the API; required. One client per account, shared
	// with every other user of that account in the process.
	Client *metal.Client
	// Prefix marks our devices' hostnames; default "shepherd-".
	Prefix string
	// OperatingSystem is the OS slug devices are created and reinstalled with.
	OperatingSystem string
	// SSHKeyLabel starts the labels of Shepherd's project SSH keys (see
	// "SSH keys" in the package comment); default "shepherd".
	SSHKeyLabel string
	// SSHKey is Shepherd's public SSH key, put on every device; required.
	SSHKey ssh.PublicKey
	// SSHPort is the devices' SSH port; default 22.
	SSHPort uint16
	// FailedReservationPenalty keeps a reservation whose device failed (or
	// whose creation failed for good) out of use this long; default 1h.
	FailedReservationPenalty time.Duration
	// StatePollInterval is how often a reboot or reinstall polls the
	// device until it is active again; default 5s.
	StatePollInterval time.Duration
	// RebootSettle is how long a reboot waits to see the device leave
	// active before it believes an active state; default 30s.
	RebootSettle time.Duration
	// Logger receives the provider's logs; nil discards them.
	Logger *slog.Logger
	// Now is the clock; nil means time.Now.
	Now func() time.Time
}

// Validate names the first missing or bad field. It changes nothing.
func (c Config) Validate() error {
	switch {
	case c.Project == "":
		return errors.New("equinix: project is required")
	case c.Client == nil:
		return errors.New("equinix: a Metal API client is required")
	case c.OperatingSystem == "":
		return errors.New("equinix: operating_system is required")
	case c.SSHKey == nil:
		return errors.New("equinix: Shepherd's SSH key is required (it is put on every device)")
	case c.FailedReservationPenalty < 0 || c.StatePollInterval < 0 || c.RebootSettle < 0:
		return errors.New("equinix: durations must be >= 0 (0 = default)")
	}
	return nil
}

// Provider is the Equinix Metal provider.
type Provider struct {
	cfg Config
	api *metal.Client
	log *slog.Logger
	// sshKey is this process's key in authorized_keys form, sshKeyLabel
	// the label it is registered under.
	sshKey, sshKeyLabel string

	mu        sync.Mutex
	penalised map[string]time.Time // reservation id → until
}

var (
	_ provider.Provider  = (*Provider)(nil)
	_ provider.Recoverer = (*Provider)(nil)
	_ provider.Releaser  = (*Provider)(nil)
)

// New checks cfg, ensures this process's SSH key is a project key under
// its own label, and returns the provider.
func New(ctx context.Context, cfg Config) (*Provider, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.Name = cmp.Or(cfg.Name, Name)
	cfg.Prefix = cmp.Or(cfg.Prefix, defaultPrefix)
	cfg.SSHKeyLabel = cmp.Or(cfg.SSHKeyLabel, defaultSSHKeyLabel)
	cfg.SSHPort = cmp.Or(cfg.SSHPort, defaultSSHPort)
	cfg.FailedReservationPenalty = cmp.Or(cfg.FailedReservationPenalty, defaultPenalty)
	cfg.StatePollInterval = cmp.Or(cfg.StatePollInterval, defaultPollInterval)
	cfg.RebootSettle = cmp.Or(cfg.RebootSettle, defaultRebootSettle)
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	p := &Provider{
		cfg: cfg, api: cfg.Client, log: log.With("provider", cfg.Name), penalised: map[string]time.Time{},
		sshKey:      strings.TrimSpace(string(ssh.MarshalAuthorizedKey(cfg.SSHKey))),
		sshKeyLabel: sshKeyLabel(cfg.SSHKeyLabel, cfg.SSHKey),
	}
	k, err := p.api.EnsureSSHKey(ctx, cfg.Project, p.sshKeyLabel, p.sshKey)
	if err != nil {
		return nil, fmt.Errorf("equinix: ensuring project SSH key %q: %w", p.sshKeyLabel, err)
	}
	p.log.Info("project SSH key in place", "label", p.sshKeyLabel, "ssh_key_id", k.ID)
	return p, nil
}

// sshKeyLabel is the label a process registers its SSH key under: the
// configured label and the key's SHA-256 fingerprint. Each key has a label
// of its own, so that processes with different keys (data directories of
// their own) never overwrite each other's key, and a process that restarts
// with its key finds it registered already.
func sshKeyLabel(label string, key ssh.PublicKey) string {
	return label + " " + ssh.FingerprintSHA256(key)
}

// isOurSSHKey reports whether a project key is one a Shepherd process with
// the configured label registered: its label is sshKeyLabel of the key it
// holds. A key someone labelled so by hand, but holding another key, is
// not.
func (p *Provider) isOurSSHKey(k metal.SSHKey) bool {
	fp, ok := strings.CutPrefix(k.Label, p.cfg.SSHKeyLabel+" ")
	if !ok || !strings.HasPrefix(fp, "SHA256:") {
		return false
	}
	pub, _, _, _, err := ssh.ParseAuthorizedKey([]byte(k.Key))
	return err == nil && ssh.FingerprintSHA256(pub) == fp
}

// deviceSSHKeys returns the ids of the project SSH keys a new device gets:
// every Shepherd process's key (isOurSSHKey), since any process's
// initializer may be the one that takes the device over. They are listed
// for every creation, so that a device created just after another process
// started trusts that process too. This process's key is registered again
// if someone deleted it meanwhile.
func (p *Provider) deviceSSHKeys(ctx context.Context) ([]string, error) {
	keys, err := p.api.ListSSHKeys(ctx, p.cfg.Project)
	if err != nil {
		return nil, fmt.Errorf("equinix: listing project SSH keys: %w", err)
	}
	var ids []string
	own := false
	for _, k := range keys {
		if p.isOurSSHKey(k) {
			ids = append(ids, k.ID)
			own = own || strings.TrimSpace(k.Key) == p.sshKey
		}
	}
	if !own {
		k, err := p.api.EnsureSSHKey(ctx, p.cfg.Project, p.sshKeyLabel, p.sshKey)
		if err != nil {
			return nil, fmt.Errorf("equinix: registering project SSH key %q again: %w", p.sshKeyLabel, err)
		}
		p.log.Warn("project SSH key was gone; registered it again", "label", p.sshKeyLabel, "ssh_key_id", k.ID)
		ids = append(ids, k.ID)
	}
	return ids, nil
}

// Name returns the provider name.
func (p *Provider) Name() string { return p.cfg.Name }

// Close closes the idle connections of the provider's API client, whose
// goroutines would otherwise outlive a stopped process's components until
// the transport's idle timeout. The provider stays usable.
func (p *Provider) Close() error {
	p.api.CloseIdleConnections()
	return nil
}

// machine is a reservation (capacity) or a device as the provider reports it.
type machine struct {
	id           string
	addr         netip.AddrPort
	availability provider.Availability
	failed       bool
	location     string
	reservation  string
	status       provider.Status
}

var _ provider.Described = (*machine)(nil)

func (m *machine) ID() string                          { return m.id }
func (m *machine) Addr() netip.AddrPort                { return m.addr }
func (m *machine) Availability() provider.Availability { return m.availability }
func (m *machine) Failed() bool                        { return m.failed }
func (m *machine) Location() string                    { return m.location }
func (m *machine) ReservationID() string               { return m.reservation }
func (m *machine) Status() provider.Status             { return m.status }

// Ours reports whether a device is one of Shepherd's: its hostname starts
// with the configured prefix (default "shepherd-"). The provider never acts
// on other devices, and the CLI deletes one only when told twice.
func (c Config) Ours(d metal.Device) bool { return strings.HasPrefix(d.Hostname, c.HostnamePrefix()) }

// HostnamePrefix is the hostname prefix of Shepherd's devices: Prefix, or
// its default.
func (c Config) HostnamePrefix() string { return cmp.Or(c.Prefix, defaultPrefix) }

// ours reports whether a device is one of Shepherd's.
func (p *Provider) ours(d metal.Device) bool { return p.cfg.Ours(d) }

// deviceMachine describes a device.
func (p *Provider) deviceMachine(d metal.Device) *machine {
	m := &machine{id: d.ID, availability: provider.Foreign, location: location(d.Metro.Code, d.Facility.Code), status: deviceStatus(d.State)}
	if p.ours(d) {
		m.availability = provider.KnownUsed
	}
	if ip, ok := d.PublicIPv4(); ok {
		m.addr = netip.AddrPortFrom(ip, p.cfg.SSHPort)
	}
	if d.HardwareReservation != nil {
		m.reservation = d.HardwareReservation.ID
	}
	m.failed = m.status == provider.StatusProvisioningFailedPermanent
	return m
}

// reservationMachine describes a reservation without a device.
func (p *Provider) reservationMachine(r metal.HardwareReservation) *machine {
	return &machine{
		id:           r.ID,
		availability: provider.KnownUnused,
		failed:       !r.Provisionable || p.isPenalised(r.ID),
		location:     location(r.Metro.Code, r.Facility.Code),
		reservation:  r.ID,
		status:       provider.StatusUnknown,
	}
}

func location(metro, facility string) string {
	switch {
	case metro != "" && facility != "":
		return metro + "/" + facility
	default:
		return metro + facility
	}
}

// deviceStatus maps a device state to a provider status.
func deviceStatus(state string) provider.Status {
	switch state {
	case "queued", "provisioning":
		return provider.StatusProvisioning
	case "active", "powering_on", "powering_off", "reinstalling":
		return provider.StatusRunning
	case "inactive":
		return provider.StatusStopped
	case "failed":
		return provider.StatusProvisioningFailedPermanent
	}
	return provider.StatusUnknown
}

func (p *Provider) isPenalised(reservation string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	until, ok := p.penalised[reservation]
	if ok && !p.cfg.Now().Before(until) {
		delete(p.penalised, reservation)
		return false
	}
	return ok
}

func (p *Provider) penalise(reservation string, why error) {
	p.mu.Lock()
	p.penalised[reservation] = p.cfg.Now().Add(p.cfg.FailedReservationPenalty)
	p.mu.Unlock()
	p.log.Warn("reservation penalised", "reservation_id", reservation, "for", p.cfg.FailedReservationPenalty, "err", why)
}

// ListMachines lists the project's devices (ours and foreign) and its
// reservations that have no device (capacity): two paginated listings.
func (p *Provider) ListMachines(ctx context.Context) ([]provider.Machine, error) {
	devices, err := p.api.ListDevices(ctx, p.cfg.Project)
	if err != nil {
		return nil, fmt.Errorf("equinix: listing devices: %w", err)
	}
	reservations, err := p.api.ListHardwareReservations(ctx, p.cfg.Project)
	if err != nil {
		return nil, fmt.Errorf("equinix: listing hardware reservations: %w", err)
	}
	out := make([]provider.Machine, 0, len(devices)+len(reservations))
	for _, d := range devices {
		m := p.deviceMachine(d)
		if m.failed && m.reservation != "" && m.availability == provider.KnownUsed {
			// A device of ours that failed to provision: its reservation
			// is not tried again for a while.
			p.penaliseOnce(m.reservation, fmt.Errorf("device %s failed", d.ID))
		}
		out = append(out, m)
	}
	for _, r := range reservations {
		if r.Device == nil && !r.Spare {
			out = append(out, p.reservationMachine(r))
		}
	}
	return out, nil
}

// penaliseOnce penalises a reservation unless it already is.
func (p *Provider) penaliseOnce(reservation string, why error) {
	if !p.isPenalised(reservation) {
		p.penalise(reservation, why)
	}
}

// GetMachine returns a device, or a reservation without a device, by id.
func (p *Provider) GetMachine(ctx context.Context, id string) (provider.Machine, error) {
	d, err := p.api.GetDevice(ctx, id)
	if err == nil {
		return p.deviceMachine(d), nil
	}
	if !errors.Is(err, metal.ErrNotFound) {
		return nil, fmt.Errorf("equinix: getting device %s: %w", id, err)
	}
	r, err := p.api.GetHardwareReservation(ctx, id)
	switch {
	case errors.Is(err, metal.ErrNotFound):
		return nil, fmt.Errorf("equinix: machine %s: %w", id, provider.ErrNotFound)
	case err != nil:
		return nil, fmt.Errorf("equinix: getting hardware reservation %s: %w", id, err)
	case r.Spare:
		return nil, fmt.Errorf("equinix: reservation %s is a spare: %w", id, provider.ErrNotFound)
	case r.Device != nil:
		// The capacity became a device since it was listed: the machine
		// made from it is that device.
		d, err := p.api.GetDevice(ctx, r.Device.ID)
		if errors.Is(err, metal.ErrNotFound) {
			return nil, fmt.Errorf("equinix: reservation %s: its device %s is gone: %w", id, r.Device.ID, provider.ErrNotFound)
		} else if err != nil {
			return nil, fmt.Errorf("equinix: getting device %s of reservation %s: %w", r.Device.ID, id, err)
		}
		return p.deviceMachine(d), nil
	}
	return p.reservationMachine(r), nil
}

// Hostname is the hostname of the device made from a reservation.
func (p *Provider) Hostname(reservation string) string {
	short := strings.ReplaceAll(reservation, "-", "")
	if len(short) > hostnameReservLength {
		short = short[:hostnameReservLength]
	}
	return p.cfg.Prefix + short
}

// CreateMachine creates a device on the reservation req.From names, with
// the reservation's plan, the configured OS and every Shepherd project SSH
// key. The
// witness is the creating session and the reservation: a retried request
// finds the device its earlier attempt made instead of making a second.
func (p *Provider) CreateMachine(ctx context.Context, req provider.CreateRequest) (provider.Machine, error) {
	if req.From == nil {
		return nil, errors.New("equinix: creating a machine: the request names no reservation")
	}
	r, err := p.api.GetHardwareReservation(ctx, req.From.ID())
	if errors.Is(err, metal.ErrNotFound) {
		return nil, fmt.Errorf("equinix: reservation %s: %w", req.From.ID(), provider.ErrNotFound)
	} else if err != nil {
		return nil, fmt.Errorf("equinix: getting reservation %s: %w", req.From.ID(), err)
	}
	keys, err := p.deviceSSHKeys(ctx)
	if err != nil {
		return nil, err
	}
	witness := req.Session.String() + "/" + r.ID
	d, err := p.api.CreateDevice(ctx, p.cfg.Project, metal.CreateDeviceRequest{
		Hostname:              p.Hostname(r.ID),
		Plan:                  r.Plan.Slug,
		Metro:                 r.Metro.Code,
		OperatingSystem:       p.cfg.OperatingSystem,
		HardwareReservationID: r.ID,
		ProjectSSHKeys:        keys,
	}, witness)
	switch {
	case errors.Is(err, metal.ErrRaceLost):
		return nil, fmt.Errorf("equinix: creating a device on reservation %s: %w", r.ID, provider.ErrRaceLost)
	case err != nil && metal.IsPermanent(err):
		p.penalise(r.ID, err)
		return nil, fmt.Errorf("equinix: creating a device on reservation %s: %w", r.ID, err)
	case err != nil:
		return nil, fmt.Errorf("equinix: creating a device on reservation %s: %w", r.ID, err)
	}
	p.log.Info("device created", "device_id", d.ID, "reservation_id", r.ID, "hostname", d.Hostname)
	return p.deviceMachine(d), nil
}

// RebootMachine reboots a device of ours and waits until it reports active
// again. An error before the reboot action was sent (the device is gone,
// not ours, never became active) or a 404 answer to it wraps
// provider.ErrNotReached: nothing was done to the device. Any other failure
// of the action may have rebooted it.
func (p *Provider) RebootMachine(ctx context.Context, id string) error {
	if err := p.readyOurs(ctx, id, "reboot"); err != nil {
		return fmt.Errorf("%w (%w)", err, provider.ErrNotReached)
	}
	if err := p.api.RebootDevice(ctx, id); errors.Is(err, metal.ErrNotFound) {
		return fmt.Errorf("equinix: rebooting device %s: %w (%w)", id, err, provider.ErrNotReached)
	} else if err != nil {
		return fmt.Errorf("equinix: rebooting device %s: %w", id, err)
	}
	return p.waitActive(ctx, id, "reboot", false)
}

// ReinstallMachine reinstalls a device of ours with the configured OS and
// waits until it reports active again.
func (p *Provider) ReinstallMachine(ctx context.Context, id string) error {
	if err := p.readyOurs(ctx, id, "reinstall"); err != nil {
		return err
	}
	if err := p.api.ReinstallDevice(ctx, id, metal.ReinstallRequest{OperatingSystem: p.cfg.OperatingSystem}); err != nil {
		return fmt.Errorf("equinix: reinstalling device %s: %w", id, err)
	}
	return p.waitActive(ctx, id, "reinstall", false)
}

// ReleaseMachine deletes a device of ours; its hardware reservation
// becomes capacity again. A device that is gone already is reported as
// such (an error wrapping provider.ErrNotFound), which the decommissioner
// takes as released; a device that is not ours is never deleted.
func (p *Provider) ReleaseMachine(ctx context.Context, id string) error {
	d, err := p.api.GetDevice(ctx, id)
	if errors.Is(err, metal.ErrNotFound) {
		return fmt.Errorf("equinix: device %s: %w", id, provider.ErrNotFound)
	} else if err != nil {
		return fmt.Errorf("equinix: getting device %s: %w", id, err)
	}
	if !p.ours(d) {
		return fmt.Errorf("equinix: device %s (%s) is not ours (hostname prefix %q); not deleting it", id, d.Hostname, p.cfg.Prefix)
	}
	err = p.api.DeleteDevice(ctx, id)
	if errors.Is(err, metal.ErrNotFound) {
		return fmt.Errorf("equinix: device %s: %w", id, provider.ErrNotFound)
	} else if err != nil {
		return fmt.Errorf("equinix: deleting device %s: %w", id, err)
	}
	p.log.Info("device deleted", "device_id", id, "hostname", d.Hostname)
	return nil
}

// readyOurs refuses to act on devices that are not Shepherd's, and waits
// for one that is still provisioning (or busy with an earlier action) to be
// active: the API refuses actions on devices in other states.
func (p *Provider) readyOurs(ctx context.Context, id, action string) error {
	d, err := p.api.GetDevice(ctx, id)
	if errors.Is(err, metal.ErrNotFound) {
		return fmt.Errorf("equinix: device %s: %w", id, provider.ErrNotFound)
	} else if err != nil {
		return fmt.Errorf("equinix: getting device %s: %w", id, err)
	}
	if !p.ours(d) {
		return fmt.Errorf("equinix: device %s (%s) is not ours (hostname prefix %q)", id, d.Hostname, p.cfg.Prefix)
	}
	if d.State != "active" {
		return p.waitActive(ctx, id, "waiting to "+action, true)
	}
	return nil
}

// waitActive polls the device until it is active again after an action:
// once it was seen in another state (left says it was already), or, if it
// never was (the API was faster than the first poll), once RebootSettle
// has passed.
func (p *Provider) waitActive(ctx context.Context, id, action string, left bool) error {
	start := p.cfg.Now()
	t := time.NewTicker(p.cfg.StatePollInterval)
	defer t.Stop()
	for {
		d, err := p.api.GetDevice(ctx, id)
		switch {
		case errors.Is(err, metal.ErrNotFound):
			return fmt.Errorf("equinix: device %s vanished during %s: %w", id, action, provider.ErrNotFound)
		case err != nil:
			return fmt.Errorf("equinix: waiting for device %s after %s: %w", id, action, err)
		case d.State == "failed":
			return fmt.Errorf("equinix: device %s failed during %s", id, action)
		case d.State != "active":
			left = true
		case left || p.cfg.Now().Sub(start) >= p.cfg.RebootSettle:
			p.log.Info("device active again", "device_id", id, "action", action, "took", p.cfg.Now().Sub(start).Round(time.Millisecond))
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("equinix: waiting for device %s after %s: %w", id, action, ctx.Err())
		case <-t.C:
		}
	}
}

// yamlConfig is the provider's YAML configuration.
type yamlConfig struct {
	Name                     string        `yaml:"name"`
	Project                  string        `yaml:"project"`
	TokenFile                string        `yaml:"token_file"`
	TokenEnv                 string        `yaml:"token_env"`
	APIURL                   string        `yaml:"api_url"`
	Prefix                   string        `yaml:"prefix"`
	OperatingSystem          string        `yaml:"operating_system"`
	SSHKeyLabel              string        `yaml:"ssh_key_label"`
	SSHPort                  uint16        `yaml:"ssh_port"`
	RequestsPerSecond        float64       `yaml:"requests_per_second"`
	Burst                    int           `yaml:"burst"`
	MaxConcurrency           int           `yaml:"max_concurrency"`
	FailedReservationPenalty time.Duration `yaml:"failed_reservation_penalty"`
	StatePollInterval        time.Duration `yaml:"state_poll_interval"`
}

// FileConfig is the provider's YAML configuration, parsed: the provider
// settings and what the API client needs.
type FileConfig struct {
	Provider Config
	Client   metal.Config
}

// ParseConfig reads the YAML configuration (see the package comment),
// reading the token from its file or environment variable (getenv; nil
// means os.Getenv). Unknown keys are errors. Errors never contain the token.
func ParseConfig(data []byte, getenv func(string) string) (FileConfig, error) {
	if getenv == nil {
		getenv = os.Getenv
	}
	var y yamlConfig
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&y); err != nil {
		return FileConfig{}, fmt.Errorf("equinix: config: %w", err)
	}
	var token string
	switch {
	case y.TokenFile != "" && y.TokenEnv != "":
		return FileConfig{}, errors.New("equinix: config: token_file and token_env are exclusive")
	case y.TokenFile != "":
		b, err := os.ReadFile(y.TokenFile)
		if err != nil {
			return FileConfig{}, fmt.Errorf("equinix: config: token_file: %w", err)
		}
		token = strings.TrimSuffix(strings.TrimSuffix(string(b), "\n"), "\r")
	case y.TokenEnv != "":
		token = getenv(y.TokenEnv)
		if token == "" {
			return FileConfig{}, fmt.Errorf("equinix: config: token_env: the environment variable %s is empty or unset", y.TokenEnv)
		}
	default:
		return FileConfig{}, errors.New("equinix: config: token_file or token_env is required")
	}
	if token == "" || strings.ContainsAny(token, " \t\r\n") {
		return FileConfig{}, errors.New("equinix: config: the API token is empty or contains white space")
	}
	fc := FileConfig{
		Provider: Config{
			Name:                     y.Name,
			Project:                  y.Project,
			Prefix:                   y.Prefix,
			OperatingSystem:          y.OperatingSystem,
			SSHKeyLabel:              y.SSHKeyLabel,
			SSHPort:                  y.SSHPort,
			FailedReservationPenalty: y.FailedReservationPenalty,
			StatePollInterval:        y.StatePollInterval,
		},
		Client: metal.Config{
			BaseURL:           y.APIURL,
			Token:             token,
			RequestsPerSecond: y.RequestsPerSecond,
			Burst:             y.Burst,
			MaxConcurrency:    y.MaxConcurrency,
		},
	}
	if fc.Provider.Project == "" {
		return FileConfig{}, errors.New("equinix: config: project is required")
	}
	if fc.Provider.OperatingSystem == "" {
		return FileConfig{}, errors.New("equinix: config: operating_system is required")
	}
	if err := fc.Client.Validate(); err != nil {
		return FileConfig{}, fmt.Errorf("equinix: config: %w", err)
	}
	return fc, nil
}

// SharedBudget is the metal client's hook (metal.Config.SharedBudget) for
// budgets, a process's source of budgets shared by every process
// (provider.Env.RequestBudget); nil for nil, which leaves the client its
// budget in memory.
func SharedBudget(budgets func(account string, rate float64, burst int) (provider.RequestBudget, error)) func(string, float64, int) (metal.Budget, error) {
	if budgets == nil {
		return nil
	}
	return func(account string, rate float64, burst int) (metal.Budget, error) {
		return budgets(account, rate, burst)
	}
}

// Factory is the provider.Factory for the registry: config is the YAML of
// the package comment. The provider's client gets the process's logger,
// metrics registerer and, if the process has one (env.RequestBudget), the
// request budget every process using the account shares.
func Factory(ctx context.Context, env provider.Env, config []byte) (provider.Provider, error) {
	fc, err := ParseConfig(config, nil)
	if err != nil {
		return nil, err
	}
	if env.SSHSigner == nil {
		return nil, errors.New("equinix: the process has no SSH key to put on devices")
	}
	fc.Client.Logger, fc.Client.Registerer = env.Logger, env.Registerer
	fc.Client.SharedBudget = SharedBudget(env.RequestBudget)
	client, err := metal.New(fc.Client)
	if err != nil {
		return nil, err
	}
	fc.Provider.Client = client
	fc.Provider.SSHKey = env.SSHSigner.PublicKey()
	fc.Provider.Logger = env.Logger
	p, err := New(ctx, fc.Provider)
	if err != nil {
		client.CloseIdleConnections() // nobody will Close a provider that is not there
		return nil, err
	}
	return p, nil
}
