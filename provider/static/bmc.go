package static

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/shepherd/shepherd/internal/secret"
	"github.com/shepherd/shepherd/power"
	"github.com/shepherd/shepherd/power/bmc"
	"github.com/shepherd/shepherd/provider"
)

// bmcBlock is a bmc mapping as written, in defaults or in a machine: a
// machine's block is laid over the defaults' block field by field, so the
// defaults hold what a rack shares (driver, user, password) and each machine
// its address. A machine without a bmc block has no BMC.
type bmcBlock struct {
	line                                       int // of the bmc key
	driver, address, port, user, suite, caFile scalar
	insecure, auth, pwFile, pwEnv              scalar
	password                                   secret.String
	passwordSet                                bool
}

// bmcBlock parses the bmc mapping of f (where names its owner for messages).
func (p *parser) bmcBlock(where string, f field) *bmcBlock {
	if isNull(f.val) {
		return nil
	}
	where += "bmc: "
	if f.val.Kind != yaml.MappingNode {
		p.errorf(f.val.Line, "%smust be a mapping, not %s", where, kindName(f.val))
		return nil
	}
	b := &bmcBlock{line: f.line}
	for _, g := range p.fields(f.val, where) {
		switch g.key {
		case "driver":
			b.driver = p.scalar(where, g)
		case "address":
			b.address = p.scalar(where, g)
		case "port":
			b.port = p.scalar(where, g)
		case "username":
			b.user = p.scalar(where, g)
		case "password_file":
			b.pwFile = p.scalar(where, g)
		case "password_env":
			b.pwEnv = p.scalar(where, g)
		case "cipher_suite":
			b.suite = p.scalar(where, g)
		case "ca_file":
			b.caFile = p.scalar(where, g)
		case "insecure_skip_verify":
			b.insecure = p.scalar(where, g)
		case "auth":
			b.auth = p.scalar(where, g)
		case "password", "passwd", "pass":
			p.errorf(g.line, "%sfield %q is not allowed: the BMC password must come from a file (password_file) or an environment variable (password_env), not inline", where, g.key)
		default:
			p.errorf(g.line, "%sunknown field %q", where, g.key)
		}
	}
	if pw, ok := p.secret(where, "password", b.pwFile, b.pwEnv); ok {
		if b.pwFile.set {
			pw = strings.TrimSuffix(strings.TrimSuffix(pw, "\n"), "\r")
		}
		if pw == "" {
			p.errorf(max(b.pwFile.line, b.pwEnv.line), "%sthe password from %s is empty", where, secretSource("password", b.pwFile, b.pwEnv))
		}
		b.password, b.passwordSet = secret.New(pw), true
	}
	return b
}

// bmcSpec lays the machine's block m over the defaults' block d and checks
// the result. It returns nil when the machine has no bmc block, and reports
// problems at the machine's bmc line.
func (p *parser) bmcSpec(where string, d, m *bmcBlock) *power.Spec {
	if m == nil {
		return nil
	}
	if d == nil {
		d = &bmcBlock{}
	}
	where += "bmc: "
	pick := func(mine, dflt scalar) scalar {
		if mine.set {
			return mine
		}
		return dflt
	}
	// The defaults' protocol fields apply only to machines of that
	// protocol, so one defaults block serves a fleet of IPMI and Redfish
	// BMCs.
	driver := pick(m.driver, d.driver).v
	only := func(forDriver string, mine, dflt scalar) scalar {
		if mine.set || driver != forDriver {
			return mine
		}
		return dflt
	}
	s := power.Spec{
		Driver:   driver,
		Address:  pick(m.address, d.address).v,
		Username: pick(m.user, d.user).v,
		CAFile:   only(power.DriverRedfish, m.caFile, d.caFile).v,
		Auth:     only(power.DriverRedfish, m.auth, d.auth).v,
		Password: d.password,
	}
	if m.passwordSet {
		s.Password = m.password
	}
	ok := true
	for _, f := range []struct {
		name string
		v    scalar
	}{{"driver", pick(m.driver, d.driver)}, {"address", pick(m.address, d.address)}, {"username", pick(m.user, d.user)}, {"ca_file", only(power.DriverRedfish, m.caFile, d.caFile)}} {
		ok = p.nonEmpty(where, f.name, f.v) && ok
	}
	if port := pick(m.port, d.port); port.set {
		n, good := p.port(where, port)
		s.Port, ok = int(n), good && ok
	}
	if suite := only(power.DriverIPMI, m.suite, d.suite); suite.set {
		n, err := strconv.Atoi(suite.v)
		if err != nil {
			p.errorf(suite.line, "%scipher_suite must be 3 or 17, got %q", where, suite.v)
			ok = false
		}
		s.CipherSuite = n
	}
	if insecure := only(power.DriverRedfish, m.insecure, d.insecure); insecure.set {
		v, good := p.boolean(where, "insecure_skip_verify", insecure)
		s.InsecureSkipVerify, ok = v, good && ok
	}
	if !ok {
		return nil
	}
	if err := s.Validate(); err != nil {
		for _, line := range strings.Split(err.Error(), "\n") {
			p.errorf(m.line, "%s%s", where, line)
		}
		return nil
	}
	return &s
}

// bmcController is the controller of one BMC and the spec it was opened
// with.
type bmcController struct {
	spec power.Spec
	c    *power.Controller
}

// BMC returns the controller of machine id's BMC, from its inventory entry's
// bmc block. A BMC's controller is kept while its spec stays the same, so
// its pacing holds across calls and machines; a reload that changes the
// spec (a new password) opens a new one.
func (p *Provider) BMC(_ context.Context, id string) (provider.BMC, error) {
	e, err := p.entry(id)
	if err != nil {
		return provider.BMC{}, err
	}
	if e.bmc == nil {
		return provider.BMC{}, fmt.Errorf("static: machine %s: %w", id, provider.ErrNoBMC)
	}
	p.bmcMu.Lock()
	defer p.bmcMu.Unlock()
	key := e.bmc.Endpoint()
	if b, ok := p.bmcs[key]; ok && b.spec == *e.bmc {
		return provider.BMC{Name: e.bmc.String(), Controller: b.c}, nil
	}
	open := p.cfg.OpenBMC
	if open == nil {
		open = bmc.Open
	}
	d, err := open(*e.bmc)
	if err != nil {
		return provider.BMC{}, fmt.Errorf("static: machine %s: BMC %s: %w", id, e.bmc, err)
	}
	c := power.NewController(d, p.cfg.Power)
	p.bmcs[key] = bmcController{spec: *e.bmc, c: c}
	return provider.BMC{Name: e.bmc.String(), Controller: c}, nil
}
