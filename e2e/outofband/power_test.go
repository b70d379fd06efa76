package outofband_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/internal/eventually"
	"github.com/shepherd/shepherd/internal/sshtest"
	"github.com/shepherd/shepherd/internal/sshx"
	"github.com/shepherd/shepherd/power"
	"github.com/shepherd/shepherd/power/ipmi/ipmisim"
	"github.com/shepherd/shepherd/power/redfish/fakeredfish"
	"github.com/shepherd/shepherd/provider"
	"github.com/shepherd/shepherd/provider/static"
)

// powerConfig paces the BMC calls fast enough for a test: Cycle polls the
// state every MinInterval and sends a command again after Settle.
var powerConfig = power.Config{MinInterval: 200 * time.Millisecond, Settle: 5 * time.Second, CallTimeout: 20 * time.Second}

// sshTimeout bounds one SSH login and command.
const sshTimeout = 10 * time.Second

// bootTimeout is how long a machine may take to answer SSH after its BMC
// reported it on; the hooks start sshd before the BMC answers, so this is
// only slack for a loaded test machine.
const bootTimeout = 30 * time.Second

// writeFile writes a test's file, failing the test on error.
func writeFile(t *testing.T, path, data string, perm os.FileMode) string {
	t.Helper()
	if err := os.WriteFile(path, []byte(data), perm); err != nil {
		t.Fatal(err)
	}
	return path
}

// machineYAML is one machine of the inventory: its SSH server, with its
// host key pinned, and its bmc block.
func machineYAML(id string, m *sshtest.Machine, bmc string) string {
	hostKey := strings.TrimSpace(string(ssh.MarshalAuthorizedKey(m.HostKey)))
	return fmt.Sprintf(`  - id: %s
    address: %s
    port: %d
    ssh_user: %s
    host_key: %q
    bmc:
%s`, id, m.Addr.Addr(), m.Addr.Port(), m.User, hostKey, bmc)
}

// ipmiBlock is the bmc block of an ipmi_sim BMC, with the password in pwFile.
func ipmiBlock(b *ipmisim.BMC, pwFile string) string {
	return fmt.Sprintf(`      driver: ipmi
      address: %s
      port: %d
      username: %s
      password_file: %s
`, b.Addr.Addr(), b.Addr.Port(), b.Username, pwFile)
}

// newProvider writes the inventory and builds the static provider on it.
func newProvider(t *testing.T, dir string, machines ...string) *static.Provider {
	t.Helper()
	inv := writeFile(t, filepath.Join(dir, "inventory.yaml"), "machines:\n"+strings.Join(machines, ""), 0o600)
	p, err := static.New(static.Config{Inventory: inv, Power: powerConfig})
	if err != nil {
		t.Fatalf("static.New: %v", err)
	}
	return p
}

// node is a machine of the inventory, as the test reaches it: through the
// provider's BMC and over SSH the way Shepherd does, with the host key the
// inventory pins.
type node struct {
	id     string
	m      *sshtest.Machine
	bmc    provider.BMC
	target sshx.Target
	// calls describes what the BMC was asked so far, for failure messages.
	calls func() string
}

// newNode looks machine id up in p.
func newNode(t *testing.T, p *static.Provider, id string, m *sshtest.Machine, key ssh.Signer, calls func() string) *node {
	t.Helper()
	ctx := t.Context()
	b, err := p.BMC(ctx, id)
	if err != nil {
		t.Fatalf("BMC(%s): %v", id, err)
	}
	pm, err := p.GetMachine(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	access, err := p.SSHAccess(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if access.HostKey == nil {
		t.Fatalf("machine %s: the inventory pins no host key", id)
	}
	return &node{id: id, m: m, bmc: b, calls: calls, target: sshx.Target{
		Addr: pm.Addr().String(), User: access.User, Keys: []ssh.Signer{key}, HostKey: access.HostKey,
	}}
}

// login logs in to the node and closes the client at the end of the test.
func (n *node) login(ctx context.Context, t *testing.T) (*ssh.Client, error) {
	ctx, cancel := context.WithTimeout(ctx, sshTimeout)
	defer cancel()
	c, err := sshx.Dial(ctx, n.target)
	if err == nil {
		t.Cleanup(func() { c.Close() })
	}
	return c, err
}

// run runs cmd on c within sshTimeout and returns its stdout.
func run(ctx context.Context, c *ssh.Client, cmd string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, sshTimeout)
	defer cancel()
	out, err := sshx.Run(ctx, c, cmd, nil, 4096)
	return string(out.Stdout), err
}

// sshWorks logs in to the node and runs a command, within sshTimeout.
func (n *node) sshWorks(ctx context.Context, t *testing.T) error {
	c, err := n.login(ctx, t)
	if err != nil {
		return err
	}
	defer c.Close()
	out, err := run(ctx, c, "echo up")
	if err == nil && strings.TrimSpace(out) != "up" {
		err = fmt.Errorf("echo up printed %q", out)
	}
	return err
}

// waitSSH waits until SSH to the node works, as it must after power on.
func (n *node) waitSSH(t *testing.T, when string) {
	t.Helper()
	eventually.Holds(t, bootTimeout, n.id+": SSH with the pinned host key "+when, func(ctx context.Context) (bool, error) {
		err := n.sshWorks(ctx, t)
		if errors.Is(err, sshx.ErrHostKeyMismatch) {
			t.Fatalf("%s: SSH %s: %v", n.id, when, err) // a machine that came back as another will not turn into itself
		}
		return err == nil, err
	})
}

// startAgent starts a stand-in for the machine's agent over c: a daemon
// detached as the real agent detaches (setsid, in the background, so it
// outlives its session), and returns its pid.
func (n *node) startAgent(t *testing.T, c *ssh.Client) int {
	t.Helper()
	out, err := run(t.Context(), c, "setsid sleep 3600 >/dev/null 2>&1 </dev/null & echo $!")
	if err != nil {
		t.Fatalf("%s: starting the stand-in agent: %v", n.id, err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(out))
	if err != nil {
		t.Fatalf("%s: starting the stand-in agent printed %q, want its pid", n.id, out)
	}
	// Polled: the daemon may still be starting (see sshtest's Processes).
	eventually.Holds(t, sshTimeout, fmt.Sprintf("%s: the stand-in agent %d among the machine's processes", n.id, pid), func(context.Context) (bool, error) {
		return n.m.Runs(pid), nil
	})
	return pid
}

// wantState reads the power state through the BMC.
func (n *node) wantState(t *testing.T, want power.State) {
	t.Helper()
	got, err := n.bmc.State(t.Context())
	if err != nil {
		t.Fatalf("%s: State: %v", n.id, err)
	}
	if got != want {
		t.Fatalf("%s: State = %s, want %s (BMC calls: %s)", n.id, got, want, n.calls())
	}
}

// waitClosed waits until c's connection ends: the machine lost power under
// it.
func waitClosed(t *testing.T, what string, c *ssh.Client) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- c.Wait() }()
	timer := time.NewTimer(sshTimeout)
	defer timer.Stop()
	select {
	case <-done:
	case <-timer.C:
		c.Close()
		<-done
		t.Errorf("%s: an SSH connection made before was still open %s later", what, sshTimeout)
	}
}

// checkPowerPath drives one machine through its BMC: on, off, on, and a
// power cycle, checking each time what the machine itself does.
func checkPowerPath(t *testing.T, n *node) {
	ctx := t.Context()
	n.wantState(t, power.On)
	c, err := n.login(ctx, t)
	if err != nil {
		t.Fatalf("%s: SSH to the machine, which its BMC reports on: %v", n.id, err)
	}
	agent := n.startAgent(t, c)

	if err := n.bmc.Off(ctx); err != nil {
		t.Fatalf("%s: Off: %v", n.id, err)
	}
	n.wantState(t, power.Off)
	err = n.sshWorks(ctx, t)
	if err == nil {
		t.Fatalf("%s: SSH works after Off (BMC calls: %s)", n.id, n.calls())
	}
	if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("%s: SSH after Off: %v, want connection refused", n.id, err)
	}
	waitClosed(t, n.id+" after Off", c)
	if n.m.Runs(agent) {
		t.Errorf("%s: the agent (pid %d) still runs after Off", n.id, agent)
	}

	if err := n.bmc.On(ctx); err != nil {
		t.Fatalf("%s: On: %v", n.id, err)
	}
	n.wantState(t, power.On)
	// sshx.Dial verifies the host key the inventory pinned: the machine
	// came back as itself.
	n.waitSSH(t, "after On")
	if n.m.Runs(agent) {
		t.Errorf("%s: the agent (pid %d) came back with On", n.id, agent)
	}

	c, err = n.login(ctx, t)
	if err != nil {
		t.Fatalf("%s: SSH before Cycle: %v", n.id, err)
	}
	agent = n.startAgent(t, c)
	found, err := n.bmc.Cycle(ctx)
	if err != nil {
		t.Fatalf("%s: Cycle: %v", n.id, err)
	}
	if found != power.On {
		t.Errorf("%s: Cycle found the machine %s, want on", n.id, found)
	}
	n.wantState(t, power.On)
	// The agent being gone and the connection cut show the machine really
	// lost power in between; SSH working shows it came back.
	waitClosed(t, n.id+" after Cycle", c)
	if n.m.Runs(agent) {
		t.Errorf("%s: the agent (pid %d) still runs after Cycle: the machine was not reset (BMC calls: %s)", n.id, agent, n.calls())
	}
	n.waitSSH(t, "after Cycle")
}

// TestPowerThroughBMC: two machines of a static inventory, one behind an
// IPMI BMC (ipmi_sim) and one behind a Redfish BMC (over TLS, trusting the
// inventory's ca_file), are powered off, on and cycled through the
// provider's BMC controllers; each time the machine itself (its sshd, its
// agent) does what the BMC reports.
func TestPowerThroughBMC(t *testing.T) {
	t.Parallel()
	key := sshtest.NewKey(t)
	dir := t.TempDir()
	cfg := sshtest.Config{AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}}

	ipmiMachine := sshtest.StartMachine(t, cfg)
	on, off := ipmiMachine.PowerCommands()
	ipmiBMC := ipmisim.Start(t, ipmisim.Config{On: true, PowerOn: on, PowerOff: off})
	ipmiPW := writeFile(t, filepath.Join(dir, "ipmi.pw"), ipmiBMC.Password.Reveal()+"\n", 0o600)

	rfMachine := sshtest.StartMachine(t, cfg)
	rfBMC, err := fakeredfish.Start(fakeredfish.Config{PowerState: fakeredfish.On, OnPowerChange: rfMachine.RedfishPowerHook(t)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(rfBMC.Close)
	rfPW := writeFile(t, filepath.Join(dir, "redfish.pw"), rfBMC.Password()+"\n", 0o600)
	ca := filepath.Join(dir, "redfish-ca.pem")
	if err := rfBMC.WriteCAFile(ca); err != nil {
		t.Fatal(err)
	}

	p := newProvider(t, dir,
		machineYAML("ipmi-node", ipmiMachine, ipmiBlock(ipmiBMC, ipmiPW)),
		machineYAML("redfish-node", rfMachine, fmt.Sprintf(`      driver: redfish
      address: %s
      port: %d
      username: %s
      password_file: %s
      ca_file: %s
`, rfBMC.Host(), rfBMC.Port(), rfBMC.Username(), rfPW, ca)))

	nodes := []*node{
		newNode(t, p, "ipmi-node", ipmiMachine, key, func() string {
			calls, err := ipmiBMC.Calls()
			if err != nil {
				return err.Error()
			}
			return strings.Join(calls, ", ")
		}),
		newNode(t, p, "redfish-node", rfMachine, key, func() string {
			return fmt.Sprintf("resets %v, power state %s", rfBMC.Resets(), rfBMC.PowerState())
		}),
	}
	for _, n := range nodes {
		t.Run(n.id, func(t *testing.T) {
			t.Parallel()
			checkPowerPath(t, n)
		})
	}
}

// TestWrongBMCPassword: a BMC that refuses the inventory's password fails
// Off with power.ErrAuth, leaves the machine running, and no error shows
// either password.
func TestWrongBMCPassword(t *testing.T) {
	t.Parallel()
	key := sshtest.NewKey(t)
	dir := t.TempDir()
	m := sshtest.StartMachine(t, sshtest.Config{AuthorizedKeys: []ssh.PublicKey{key.PublicKey()}})
	on, off := m.PowerCommands()
	bmc := ipmisim.Start(t, ipmisim.Config{On: true, PowerOn: on, PowerOff: off})
	const wrong = "Wr0ngBMCPassw0rd"
	if bmc.Password.Reveal() == wrong {
		t.Fatal("the BMC's random password is the wrong one")
	}
	pw := writeFile(t, filepath.Join(dir, "ipmi.pw"), wrong+"\n", 0o600)
	p := newProvider(t, dir, machineYAML("node", m, ipmiBlock(bmc, pw)))
	n := newNode(t, p, "node", m, key, func() string { return "" })

	c, err := n.login(t.Context(), t)
	if err != nil {
		t.Fatal(err)
	}
	agent := n.startAgent(t, c)

	offErr := n.bmc.Off(t.Context())
	if !errors.Is(offErr, power.ErrAuth) {
		t.Fatalf("Off with the wrong password: %v, want power.ErrAuth", offErr)
	}
	_, stateErr := n.bmc.State(t.Context())
	if !errors.Is(stateErr, power.ErrAuth) {
		t.Errorf("State with the wrong password: %v, want power.ErrAuth", stateErr)
	}
	for _, err := range []error{offErr, stateErr} {
		// %#v too: it shows the fields of the wrapped errors.
		text := err.Error() + "\n" + fmt.Sprintf("%+v", err) + "\n" + fmt.Sprintf("%#v", err)
		for name, secret := range map[string]string{"wrong": wrong, "right": bmc.Password.Reveal()} {
			if strings.Contains(text, secret) {
				t.Errorf("an error shows the %s password: %s", name, err)
			}
		}
	}

	if !m.Powered() || !m.Runs(agent) {
		t.Errorf("after a refused Off: powered %v, agent running %v; want the machine up", m.Powered(), m.Runs(agent))
	}
	if _, err := run(t.Context(), c, "true"); err != nil {
		t.Errorf("the SSH connection made before the refused Off: %v", err)
	}
	if err := n.sshWorks(t.Context(), t); err != nil {
		t.Errorf("SSH after the refused Off: %v", err)
	}
	calls, err := bmc.Calls()
	if err != nil {
		t.Fatal(err)
	}
	for _, call := range calls {
		if strings.HasPrefix(call, "set power") {
			t.Errorf("the BMC's chassis was asked to %q with the wrong password", call)
		}
	}
}
