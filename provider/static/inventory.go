package static

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/internal/secret"
	"github.com/shepherd/shepherd/internal/sshx"
	"github.com/shepherd/shepherd/ladder"
	"github.com/shepherd/shepherd/power"
	"github.com/shepherd/shepherd/provider"
)

// maxProblems bounds how many problems one error reports: enough to fix a
// file in one go, few enough to read.
const maxProblems = 20

// maxSecretSize bounds a secret file, so that a path like /dev/zero given by
// mistake cannot exhaust memory.
const maxSecretSize = 1 << 20

// inventory is one good version of the file. It is never changed once
// parsed, so readers share it without locks.
type inventory struct {
	list []*machine // sorted by id
	byID map[string]*entry
}

// entry is everything the inventory says about one machine.
type entry struct {
	m             *machine
	user          string        // the machine's or the defaults' ssh_user; "" means the caller's default
	password      secret.String // empty if none
	signer        ssh.Signer    // the machine's own key; nil if none
	hostKey       ssh.PublicKey
	rebootCommand string
	// bmc is the machine's BMC; nil if it has none.
	bmc *power.Spec
	// rungs is the machine's recovery ladder (its own recovery_rungs, the
	// defaults' or the provider's); nil for the recoverer's default.
	rungs []ladder.Rung
	// trustOnFirstUse lets password and signer go to a host whose key is
	// neither pinned nor recorded yet.
	trustOnFirstUse bool
}

// parser turns the file into an inventory, collecting every problem with
// its line.
type parser struct {
	file      string // as given in Config.Inventory, for messages
	lookupEnv func(string) (string, bool)
	readFile  func(string) ([]byte, fileID, error) // reads a secret file
	// providerRungs is Config.RecoveryRungs: the ladder of machines for
	// which neither they nor the defaults give one.
	providerRungs []ladder.Rung
	problems      []string
	// secrets are the secret files the inventory names, as they were read.
	secrets map[string]fileID
}

// parse parses and validates data, the contents of file, and reads the
// secrets it names. It also returns the secret files it named, as they
// were when read (also when it fails, so that fixing a secret file makes
// the provider read the inventory again). The error lists the problems
// found, each as "FILE:LINE: what", and never contains a secret.
func parse(file string, data []byte, lookupEnv func(string) (string, bool)) (*inventory, map[string]fileID, error) {
	return parseWith(file, data, lookupEnv, readSecretFile, nil)
}

// parseWith is parse with secret files read by readFile, so that the fuzz
// test need not open the paths it makes up, and with providerRungs
// (Config.RecoveryRungs) as the ladder of machines the file gives none.
func parseWith(file string, data []byte, lookupEnv func(string) (string, bool), readFile func(string) ([]byte, fileID, error), providerRungs []ladder.Rung) (*inventory, map[string]fileID, error) {
	p := &parser{file: file, lookupEnv: lookupEnv, readFile: readFile, providerRungs: providerRungs, secrets: map[string]fileID{}}
	inv := p.parse(data)
	if len(p.problems) > 0 {
		return nil, p.secrets, p.err()
	}
	return inv, p.secrets, nil
}

func (p *parser) errorf(line int, format string, args ...any) {
	p.problems = append(p.problems, fmt.Sprintf("%s:%d: ", p.file, line)+fmt.Sprintf(format, args...))
}

func (p *parser) err() error {
	probs := p.problems
	if n := len(probs); n > maxProblems {
		probs = append(probs[:maxProblems:maxProblems], fmt.Sprintf("%s: %d more problems", p.file, n-maxProblems))
	}
	return errors.New(strings.Join(probs, "\n"))
}

func (p *parser) parse(data []byte) *inventory {
	var doc yaml.Node
	dec := yaml.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&doc); errors.Is(err, io.EOF) || err == nil && len(doc.Content) == 0 {
		p.errorf(1, `the inventory is empty (write "machines: []" for an inventory without machines)`)
		return nil
	} else if err != nil {
		p.syntaxError(data, err)
		return nil
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); err == nil {
		p.errorf(extra.Line, "a second YAML document: the inventory is a single document")
		return nil
	} else if !errors.Is(err, io.EOF) {
		p.syntaxError(data, err)
		return nil
	}

	root := resolve(doc.Content[0])
	if root.Kind != yaml.MappingNode {
		p.errorf(root.Line, `the inventory must be a mapping with a "machines" list, not %s`, kindName(root))
		return nil
	}
	var defaults, machines *yaml.Node
	for _, f := range p.fields(root, "") {
		switch f.key {
		case "defaults":
			defaults = f.val
		case "machines":
			machines = f.val
		default:
			p.unknownField("", f)
		}
	}
	d := p.defaults(defaults)
	if machines == nil {
		p.errorf(root.Line, `"machines" is required (write "machines: []" for an inventory without machines)`)
		return nil
	}
	if isNull(machines) {
		machines = &yaml.Node{Kind: yaml.SequenceNode}
	}
	if machines.Kind != yaml.SequenceNode {
		p.errorf(machines.Line, `"machines" must be a list, not %s`, kindName(machines))
		return nil
	}

	inv := &inventory{byID: map[string]*entry{}}
	firstLine := map[string]int{}
	for i, n := range machines.Content {
		e, id := p.machine(resolve(n), i+1, d)
		if !id.set || !provider.ValidID(id.v) {
			continue // reported
		}
		if first, dup := firstLine[id.v]; dup {
			p.errorf(id.line, "duplicate machine id %q (first at line %d)", id.v, first)
			continue
		}
		firstLine[id.v] = id.line
		if e == nil {
			continue // reported
		}
		inv.byID[e.m.id] = e
		inv.list = append(inv.list, e.m)
	}
	slices.SortFunc(inv.list, func(a, b *machine) int { return strings.Compare(a.id, b.id) })
	return inv
}

// yamlLine finds the line in the yaml package's messages ("yaml: line 3: …").
var yamlLine = regexp.MustCompile(`^(?:yaml: )?line (\d+): `)

// yamlErrorText returns err's message without the yaml package's prefix.
func yamlErrorText(err error) string {
	return strings.TrimPrefix(err.Error(), "yaml: ")
}

// parserProblems are the messages of the yaml package's parser (as opposed
// to its scanner). It reports their lines counting from 0, its scanner's
// from 1; the messages are all that tells them apart.
var parserProblems = map[string]bool{
	"did not find expected <stream-start>":   true,
	"did not find expected <document start>": true,
	"did not find expected node content":     true,
	"did not find expected '-' indicator":    true,
	"did not find expected key":              true,
	"did not find expected ',' or ']'":       true,
	"did not find expected ',' or '}'":       true,
	"found duplicate %YAML directive":        true,
	"found incompatible YAML document":       true,
	"found undefined tag handle":             true,
	"found duplicate %TAG directive":         true,
}

// syntaxError reports a YAML syntax error in data as FILE:LINE. The yaml
// package leaves out the line when it is the first, and for problems with
// anchors and aliases, which have no single line; those are reported at
// line 1. A problem at the end of the file is reported at its last line.
func (p *parser) syntaxError(data []byte, err error) {
	msg, line := yamlErrorText(err), 1
	if m := yamlLine.FindStringSubmatch(err.Error()); m != nil {
		msg = err.Error()[len(m[0]):]
		line, _ = strconv.Atoi(m[1])
		if parserProblems[msg] {
			line++
		}
	}
	last := bytes.Count(data, []byte("\n"))
	if !bytes.HasSuffix(data, []byte("\n")) { // a last line without its newline
		last++
	}
	p.errorf(max(min(line, last), 1), "%s", msg)
}

// field is one key and value of a mapping.
type field struct {
	key  string
	line int // of the key
	val  *yaml.Node
}

// fields returns the entries of mapping n, reporting keys given twice
// (where reports the mapping, for messages: "" or `machine "x": `).
func (p *parser) fields(n *yaml.Node, where string) []field {
	var out []field
	first := map[string]int{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], resolve(n.Content[i+1])
		if k.Kind != yaml.ScalarNode {
			p.errorf(k.Line, "%sa key must be a plain name, not %s", where, kindName(k))
			continue
		}
		if l, dup := first[k.Value]; dup {
			p.errorf(k.Line, "%sfield %q given twice (first at line %d)", where, k.Value, l)
			continue
		}
		first[k.Value] = k.Line
		out = append(out, field{key: k.Value, line: k.Line, val: v})
	}
	return out
}

// unknownField reports a field the format does not know. It never prints
// the value, which might be a secret written inline by mistake.
func (p *parser) unknownField(where string, f field) {
	name := f.key
	switch {
	case name == "password" || strings.HasSuffix(name, "_password") || strings.HasSuffix(name, "passwd"):
		p.errorf(f.line, "%sfield %q is not allowed: secrets must come from a file (ssh_password_file) or an environment variable (ssh_password_env), not inline", where, name)
	case name == "key" || strings.HasSuffix(name, "_key") && name != "host_key" || strings.Contains(name, "private_key"):
		p.errorf(f.line, "%sfield %q is not allowed: secrets must come from a file (ssh_key_file) or an environment variable (ssh_key_env), not inline", where, name)
	default:
		p.errorf(f.line, "%sunknown field %q", where, name)
	}
}

// scalar is a string value and its line; set is false if it was left out
// or null.
type scalar struct {
	v    string
	line int
	set  bool
}

// scalar returns f's value as a string, reporting lists and mappings.
func (p *parser) scalar(where string, f field) scalar {
	if isNull(f.val) {
		return scalar{line: f.line}
	}
	if f.val.Kind != yaml.ScalarNode {
		p.errorf(f.val.Line, "%s%s must be a single value, not %s", where, f.key, kindName(f.val))
		return scalar{line: f.line}
	}
	return scalar{v: f.val.Value, line: f.val.Line, set: true}
}

// port parses a port, reporting values outside 1-65535.
func (p *parser) port(where string, s scalar) (uint16, bool) {
	n, err := strconv.Atoi(s.v)
	if err != nil || n < 1 || n > 65535 {
		p.errorf(s.line, "%sport must be a number from 1 to 65535, got %q", where, s.v)
		return 0, false
	}
	return uint16(n), true
}

// nonEmpty reports a field given as an empty string.
func (p *parser) nonEmpty(where, name string, s scalar) bool {
	if s.set && strings.TrimSpace(s.v) == "" {
		p.errorf(s.line, "%s%s is empty (leave it out for the default)", where, name)
		return false
	}
	return true
}

// defaultsSection is the inventory's defaults, already validated.
type defaultsSection struct {
	port            uint16
	user            string
	rebootCommand   string
	trustOnFirstUse bool
	bmc             *bmcBlock // shared fields of the machines' bmc blocks
	rungs           rungList  // the ladder of machines without recovery_rungs of their own
}

func (p *parser) defaults(n *yaml.Node) defaultsSection {
	d := defaultsSection{port: defaultPort, rebootCommand: defaultRebootCommand}
	if n == nil || isNull(n) {
		return d
	}
	const where = "defaults: "
	if n.Kind != yaml.MappingNode {
		p.errorf(n.Line, "defaults must be a mapping, not %s", kindName(n))
		return d
	}
	for _, f := range p.fields(n, where) {
		switch f.key {
		case "port":
			if s := p.scalar(where, f); s.set {
				if port, ok := p.port(where, s); ok {
					d.port = port
				}
			}
		case "ssh_user":
			if s := p.scalar(where, f); s.set && p.nonEmpty(where, f.key, s) {
				d.user = s.v
			}
		case "reboot_command":
			if s := p.scalar(where, f); s.set && p.nonEmpty(where, f.key, s) {
				d.rebootCommand = s.v
			}
		case "trust_on_first_use":
			if s := p.scalar(where, f); s.set {
				d.trustOnFirstUse, _ = p.boolean(where, f.key, s)
			}
		case "bmc":
			d.bmc = p.bmcBlock(where, f)
		case "recovery_rungs":
			d.rungs = p.rungList(where, f)
		default:
			p.unknownField(where, f)
		}
	}
	return d
}

// boolean parses a YAML boolean (true or false), reporting anything else.
func (p *parser) boolean(where, name string, s scalar) (bool, bool) {
	switch s.v {
	case "true":
		return true, true
	case "false":
		return false, true
	}
	p.errorf(s.line, "%s%s must be true or false, got %q", where, name, s.v)
	return false, false
}

// machine parses entry number num (from 1) of the machines list. It returns
// nil if the entry has problems, which it reports, and the id as given.
func (p *parser) machine(n *yaml.Node, num int, d defaultsSection) (*entry, scalar) {
	where := fmt.Sprintf("machine #%d: ", num)
	if n.Kind != yaml.MappingNode {
		p.errorf(n.Line, "%smust be a mapping, not %s", where, kindName(n))
		return nil, scalar{}
	}
	before := len(p.problems)

	// The id names the machine in every other message, so find it first.
	var id scalar
	for i := 0; i+1 < len(n.Content); i += 2 {
		if k := n.Content[i]; k.Kind == yaml.ScalarNode && k.Value == "id" {
			id = p.scalar(where, field{key: "id", line: k.Line, val: resolve(n.Content[i+1])})
			break
		}
	}
	switch {
	case !id.set:
		p.errorf(n.Line, "%sid is required", where)
	case !provider.ValidID(id.v):
		p.errorf(id.line, "%sid must be 1 to 128 bytes long, got %d bytes", where, len(id.v))
	default:
		where = fmt.Sprintf("machine %q: ", id.v)
	}
	fs := p.fields(n, where)

	var addr, port, user, pwFile, pwEnv, keyFile, keyEnv, hostKey, reboot, tofu scalar
	var bmc *bmcBlock
	var hasBMC bool // a bmc block is given, good or not
	var rungs rungList
	e := &entry{m: &machine{id: id.v}}
	for _, f := range fs {
		switch f.key {
		case "id":
		case "address":
			addr = p.scalar(where, f)
		case "port":
			port = p.scalar(where, f)
		case "location":
			e.m.location = p.scalar(where, f).v
		case "ssh_user":
			user = p.scalar(where, f)
		case "ssh_password_file":
			pwFile = p.scalar(where, f)
		case "ssh_password_env":
			pwEnv = p.scalar(where, f)
		case "ssh_key_file":
			keyFile = p.scalar(where, f)
		case "ssh_key_env":
			keyEnv = p.scalar(where, f)
		case "host_key":
			hostKey = p.scalar(where, f)
		case "reboot_command":
			reboot = p.scalar(where, f)
		case "trust_on_first_use":
			tofu = p.scalar(where, f)
		case "bmc":
			bmc, hasBMC = p.bmcBlock(where, f), !isNull(f.val)
		case "recovery_rungs":
			rungs = p.rungList(where, f)
		default:
			p.unknownField(where, f)
		}
	}

	var ip netip.Addr
	if !addr.set {
		p.errorf(n.Line, "%saddress is required", where)
	} else if a, err := netip.ParseAddr(addr.v); err != nil {
		p.errorf(addr.line, "%saddress %q is not an IPv4 or IPv6 address", where, addr.v)
	} else {
		ip = a
	}
	portNum := d.port
	if port.set {
		portNum, _ = p.port(where, port)
	}
	e.m.addr = netip.AddrPortFrom(ip, portNum)

	e.user = d.user
	if p.nonEmpty(where, "ssh_user", user) && user.set {
		e.user = user.v
	}
	e.rebootCommand = d.rebootCommand
	if p.nonEmpty(where, "reboot_command", reboot) && reboot.set {
		e.rebootCommand = reboot.v
	}
	e.trustOnFirstUse = d.trustOnFirstUse
	if tofu.set {
		e.trustOnFirstUse, _ = p.boolean(where, "trust_on_first_use", tofu)
	}
	if p.nonEmpty(where, "host_key", hostKey) && hostKey.set {
		k, _, _, _, err := ssh.ParseAuthorizedKey([]byte(hostKey.v))
		switch {
		case err != nil:
			p.errorf(hostKey.line, "%shost_key is not a public key in authorized_keys format: %v", where, err)
		case sshx.SupportedHostKey(k) != nil:
			p.errorf(hostKey.line, "%shost_key: %v", where, sshx.SupportedHostKey(k))
		default:
			e.hostKey = k
		}
	}
	if pw, ok := p.secret(where, "ssh_password", pwFile, pwEnv); ok {
		// A file's line ends in a newline that is no part of the password.
		if pwFile.set {
			pw = strings.TrimSuffix(strings.TrimSuffix(pw, "\n"), "\r")
		}
		if pw == "" {
			p.errorf(max(pwFile.line, pwEnv.line), "%sthe password from %s is empty", where, secretSource("ssh_password", pwFile, pwEnv))
		}
		e.password = secret.New(pw)
	}
	if key, ok := p.secret(where, "ssh_key", keyFile, keyEnv); ok {
		e.signer = p.privateKey(where, key, keyFile, keyEnv)
	}
	e.bmc = p.bmcSpec(where, d.bmc, bmc)
	// Whether the machine has a BMC is its bmc block's presence, not
	// whether the block is good: a broken block is reported already, and
	// "power needs a bmc block" on top would mislead.
	e.rungs = p.machineRungs(where, rungs, d.rungs, p.providerRungs, hasBMC)
	if len(p.problems) > before {
		return nil, id
	}
	return e, id
}

// secret reads the secret named by file or env (name is ssh_password or
// ssh_key). ok is false if neither is given or reading failed. Messages
// name the machine and the file or variable, never the value.
func (p *parser) secret(where, name string, file, env scalar) (string, bool) {
	switch {
	case file.set && env.set:
		p.errorf(max(file.line, env.line), "%sgive %s_file or %s_env, not both", where, name, name)
		return "", false
	case file.set:
		if !p.nonEmpty(where, name+"_file", file) {
			return "", false
		}
		b, id, err := p.readFile(file.v)
		p.secrets[file.v] = id
		if err != nil {
			p.errorf(file.line, "%s%s_file: %v", where, name, err)
			return "", false
		}
		return string(b), true
	case env.set:
		if !p.nonEmpty(where, name+"_env", env) {
			return "", false
		}
		v, ok := p.lookupEnv(env.v)
		if !ok {
			p.errorf(env.line, "%s%s_env: environment variable %s is not set", where, name, env.v)
			return "", false
		}
		return v, true
	}
	return "", false
}

// secretSource says where a secret came from, for messages.
func secretSource(name string, file, env scalar) string {
	if file.set {
		return fmt.Sprintf("%s_file %s", name, file.v)
	}
	return fmt.Sprintf("%s_env %s", name, env.v)
}

// readSecretFile reads a secret file and says which file it read: the
// identity of the open file, so that a file replaced or changed after it
// was read is noticed (see fileID).
func readSecretFile(path string) ([]byte, fileID, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fileID{err: err.Error()}, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fileID{err: err.Error()}, fmt.Errorf("reading %s: %w", path, err)
	}
	id := idOf(fi)
	b, err := io.ReadAll(io.LimitReader(f, maxSecretSize+1))
	if err != nil {
		return nil, id, fmt.Errorf("reading %s: %w", path, err)
	}
	if len(b) > maxSecretSize {
		return nil, id, fmt.Errorf("%s is larger than %d bytes", path, maxSecretSize)
	}
	return b, id, nil
}

// privateKey parses a private key without a passphrase. The messages of
// ssh.ParsePrivateKey describe the format, never the key's bytes.
func (p *parser) privateKey(where string, key string, file, env scalar) ssh.Signer {
	line := max(file.line, env.line)
	src := secretSource("ssh_key", file, env)
	signer, err := ssh.ParsePrivateKey([]byte(key))
	var pass *ssh.PassphraseMissingError
	switch {
	case errors.As(err, &pass):
		p.errorf(line, "%sthe key from %s is protected by a passphrase, which is not supported", where, src)
		return nil
	case err != nil:
		p.errorf(line, "%sthe key from %s is not a usable private key: %v", where, src, err)
		return nil
	}
	return signer
}

// resolve follows an alias to the node it names.
func resolve(n *yaml.Node) *yaml.Node {
	for n.Kind == yaml.AliasNode && n.Alias != nil {
		n = n.Alias
	}
	return n
}

func isNull(n *yaml.Node) bool {
	return n.Kind == yaml.ScalarNode && n.Tag == "!!null"
}

// kindName names what a node is, for messages.
func kindName(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	case yaml.ScalarNode:
		return "a single value"
	}
	return "empty"
}
