// Package provider defines what Shepherd needs from a source of bare-metal
// machines (SPEC §5.1): a bare-metal cloud API, a static inventory, a
// simulated fleet, later BMC power control. The control loops in manager
// speak only this interface; each provider lives in a package of its own and
// is made available with one line in a Registry.
package provider

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sort"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/ladder"
	"github.com/shepherd/shepherd/power"
)

// Availability says how the provisioner may use a machine a provider lists.
type Availability int

const (
	// PossiblyUsed machines come from stateless providers (a static
	// inventory): a machine is in use if the BMDB has it, capacity otherwise.
	PossiblyUsed Availability = iota
	// KnownUnused machines are capacity: CreateMachine turns one into a
	// machine of ours (a hardware reservation without a device, a free
	// simulated slot).
	KnownUnused
	// KnownUsed machines are ours (they carry our ownership marker). One the
	// BMDB lacks is adopted: it was created but never recorded.
	KnownUsed
	// Foreign machines belong to someone else; they are ignored and counted.
	Foreign
)

func (a Availability) String() string {
	switch a {
	case PossiblyUsed:
		return "PossiblyUsed"
	case KnownUnused:
		return "KnownUnused"
	case KnownUsed:
		return "KnownUsed"
	case Foreign:
		return "Foreign"
	}
	return fmt.Sprintf("Availability(%d)", int(a))
}

// Status is what the provider says about a machine; the values are those of
// the BMDB's provider_status.
type Status string

// Provider statuses.
const (
	StatusMissing                     Status = "Missing"
	StatusProvisioning                Status = "Provisioning"
	StatusProvisioningFailedPermanent Status = "ProvisioningFailedPermanent"
	StatusRunning                     Status = "Running"
	StatusStopped                     Status = "Stopped"
	StatusUnknown                     Status = "Unknown"
)

// Machine is one machine as a provider sees it.
type Machine interface {
	// ID is the provider's opaque id of the machine: 1–128 bytes, unique
	// within the provider, not necessarily a UUID.
	ID() string
	// Addr is the machine's SSH endpoint (port 22 unless the provider says
	// otherwise). The zero value means the provider does not know it yet.
	Addr() netip.AddrPort
	// Availability says how the provisioner may use the machine.
	Availability() Availability
	// Failed reports that the provider gave up on the machine for good.
	Failed() bool
}

// Described is implemented by machines that know more about themselves
// than Machine asks; the provisioner records it in the Provided tag.
type Described interface {
	Machine
	Location() string
	ReservationID() string
	Status() Status
}

// CreateRequest asks a provider for a new machine.
type CreateRequest struct {
	// From is the capacity to use: a KnownUnused or PossiblyUsed machine
	// from the provider's own listing.
	From Machine
	// Session is the BMDB session creating the machine. Providers may use it
	// to mark what they create (a witness tag), so that a creation whose
	// answer was lost can be recognised as ours later.
	Session uuid.UUID
}

// Provider is a source of machines.
type Provider interface {
	// Name is the provider's name as recorded in the BMDB (machine_provided.provider).
	Name() string
	// ListMachines returns every machine the provider knows about: ours,
	// capacity we could use, and foreign ones. An error means the listing
	// is incomplete and nothing may be concluded from it.
	ListMachines(ctx context.Context) ([]Machine, error)
	// GetMachine returns one machine by provider id, or an error wrapping
	// ErrNotFound.
	GetMachine(ctx context.Context, id string) (Machine, error)
	// CreateMachine turns capacity into a machine of ours and returns it
	// (KnownUsed). It may take a while (a provisioning cloud machine); it
	// must not create two machines for one request, even when retried.
	CreateMachine(ctx context.Context, req CreateRequest) (Machine, error)
}

// Recoverer is implemented by providers that can act on a machine's power
// or operating system; the recoverer needs it to reboot silent machines.
type Recoverer interface {
	// RebootMachine reboots the machine. It returns once the provider has
	// accepted (or, where it can tell, carried out) the reboot. An error
	// wrapping ErrNotReached says the request certainly never reached the
	// machine or the provider's API, so that nothing was done to the
	// machine; the recoverer's circuit breaker does not count such a
	// reboot. When in doubt, do not wrap it.
	RebootMachine(ctx context.Context, id string) error
	// ReinstallMachine reinstalls the machine's operating system from the
	// provider's side. Providers that cannot return an error wrapping
	// ErrUnsupported.
	ReinstallMachine(ctx context.Context, id string) error
}

// Releaser is implemented by providers that can give a machine back (delete
// a cloud device, free a simulated slot); the decommissioner (SPEC §3.8)
// asks them to. Providers that cannot (a static inventory of servers
// Shepherd does not own) do not implement it: their machines are only
// forgotten.
type Releaser interface {
	// ReleaseMachine gives the machine back to the provider and stops
	// whatever runs on it. It is idempotent: releasing a machine that is
	// released already returns nil or an error wrapping ErrNotFound.
	ReleaseMachine(ctx context.Context, id string) error
}

// PowerController is implemented by providers whose machines can have a
// BMC, for out-of-band power: the recovery ladder's power cycle and
// `shepherd machine power`.
type PowerController interface {
	// BMC returns the controller of machine id's BMC, or an error wrapping
	// ErrNoBMC (the machine has none) or ErrNotFound. Calls through one
	// BMC's controller are paced, also across machines that share it.
	BMC(ctx context.Context, id string) (BMC, error)
}

// BMC is a machine's baseboard management controller.
type BMC struct {
	// Name says which BMC it is, for operators: driver, user and endpoint,
	// never a password.
	Name string
	*power.Controller
}

// RungChooser is implemented by providers whose configuration says which
// rungs of the recovery ladder (SPEC §3.4) apply, per machine or for all of
// the provider's machines (a static inventory's recovery_rungs).
type RungChooser interface {
	// RecoveryRungs returns the rungs the recoverer may take for machine
	// id, in the ladder's order; nil means the recoverer's own default.
	// The recoverer still skips a rung the machine cannot take (Power on a
	// machine without a BMC).
	RecoveryRungs(ctx context.Context, id string) ([]ladder.Rung, error)
}

// SSHAccess says how to reach a machine's SSH server when Addr and the
// initializer's own user and key are not enough.
type SSHAccess struct {
	// User overrides the initializer's SSH user if not empty.
	User string
	// Signers are extra client keys (an inventory's key for the machine),
	// offered together with the initializer's own key: an SSH client does
	// not try the publickey method again once the server rejected it.
	// Like Auth they are the machine's secrets: they go only to a server
	// whose host key is pinned or recorded, unless SecretsOnFirstUse.
	Signers []ssh.Signer
	// Auth are extra non-key authentication methods (a password from an
	// inventory's secret file), tried after the keys.
	Auth []ssh.AuthMethod
	// SecretsOnFirstUse lets Signers and Auth go to a server whose host
	// key is not verified yet (none pinned or recorded): the operator opted
	// the machine into trust on first use. Without it only Shepherd's own
	// key is offered until a key is recorded.
	SecretsOnFirstUse bool
	// HostKey is the machine's pinned host key; nil means trust on first use.
	HostKey ssh.PublicKey
	// Dial connects to the machine's SSH server; nil means TCP to Addr.
	// The simulator uses it to hand out in-process connections.
	Dial func(ctx context.Context) (net.Conn, error)
}

// SSHAccessor is implemented by providers that know more than Addr about
// reaching their machines over SSH.
type SSHAccessor interface {
	SSHAccess(ctx context.Context, id string) (SSHAccess, error)
}

// HostKeyChecker gives providers that SSH into machines themselves (to
// reboot them) the BMDB's record of their SSH host keys, which the
// initializer keeps.
type HostKeyChecker interface {
	// KnownHostKey returns the host key recorded for the provider's machine
	// providerID, or nil if none is recorded yet.
	KnownHostKey(ctx context.Context, providerID string) (ssh.PublicKey, error)
	// HostKeyMismatch turns err, a failed login against the recorded key
	// that wraps an sshx host key mismatch, into the error to report: it
	// keeps the key presented so that an operator can accept it, and names
	// how. Other errors are returned as they are.
	HostKeyMismatch(ctx context.Context, providerID string, err error) error
}

// Reloader is implemented by providers whose configuration lives in files
// an operator edits (a static inventory and the secret files it names).
// The process calls Reload when it gets SIGHUP, after rotating a secret,
// say. A failed reload keeps the configuration in force and returns (and
// logs) what is wrong with the files.
type Reloader interface {
	Reload() error
}

// Errors providers wrap so that callers can test them with errors.Is.
var (
	ErrNotFound    = errors.New("provider: machine not found")
	ErrUnsupported = errors.New("provider: operation not supported")
	// ErrNotReached means a request on a machine certainly never reached
	// it (or the provider's API): the machine is not in the inventory any
	// more, a connection could not be made, the request was refused before
	// it was carried out. Nothing was done to the machine.
	ErrNotReached = errors.New("provider: the request did not reach the machine")
	// ErrRaceLost means someone else took the capacity a create asked for.
	ErrRaceLost = errors.New("provider: capacity taken by someone else")
	// ErrNoBMC means the machine has no BMC configured.
	ErrNoBMC = errors.New("provider: machine has no BMC")
)

// RequestBudget is the request budget of a provider API account shared by
// every process that uses the account (the BMDB's, bmdb.RequestBudget):
// Wait returns when a request may be sent, or an error if ctx ends first
// or its deadline would pass while waiting; Pause holds every request of
// the account until d from now (the API answered 429).
type RequestBudget interface {
	Wait(ctx context.Context) error
	Pause(ctx context.Context, d time.Duration) error
}

// Env is what a provider factory gets from the process that runs it.
type Env struct {
	Logger     *slog.Logger
	Registerer prometheus.Registerer
	HostKeys   HostKeyChecker
	// SSHSigner is Shepherd's SSH client key, for providers that SSH into
	// machines themselves.
	SSHSigner ssh.Signer
	// SSHUser is the default SSH user.
	SSHUser string
	// RequestBudget, if set, returns the budget that every process shares
	// for an API account (named so as not to reveal its credentials), at
	// rate requests a second and burst at once. Providers of metered APIs
	// take their requests from it; nil means the process is alone with the
	// account and keeps its budget in memory.
	RequestBudget func(account string, rate float64, burst int) (RequestBudget, error)
}

// Factory creates a provider from its configuration: a YAML document whose
// schema the provider defines (empty for defaults).
type Factory func(ctx context.Context, env Env, config []byte) (Provider, error)

// Registry maps provider names to factories. Build one in main: adding a
// provider is one Add line there and a package of its own.
type Registry struct {
	factories map[string]Factory
}

// NewRegistry returns an empty registry.
func NewRegistry() *Registry { return &Registry{factories: map[string]Factory{}} }

// Add registers a factory under name. Adding a name twice is a programming
// error and panics.
func (r *Registry) Add(name string, f Factory) {
	if _, dup := r.factories[name]; dup {
		panic("provider: " + name + " registered twice")
	}
	r.factories[name] = f
}

// Names lists the registered providers, sorted.
func (r *Registry) Names() []string {
	names := make([]string, 0, len(r.factories))
	for n := range r.factories {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// New creates the provider registered under name.
func (r *Registry) New(ctx context.Context, name string, env Env, config []byte) (Provider, error) {
	f, ok := r.factories[name]
	if !ok {
		return nil, fmt.Errorf("provider: unknown provider %q (known: %v)", name, r.Names())
	}
	p, err := f(ctx, env, config)
	if err != nil {
		return nil, fmt.Errorf("provider %s: %w", name, err)
	}
	return p, nil
}

// ValidID reports whether id is a usable provider id: 1–128 bytes.
func ValidID(id string) bool { return len(id) >= 1 && len(id) <= 128 }

// Runner is implemented by providers with background work (re-reading an
// inventory, simulating machines). The process runs Run for as long as it
// uses the provider; Run returns nil once ctx ends.
type Runner interface {
	Run(ctx context.Context) error
}
