package deploy

import (
	"bufio"
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"
	"golang.org/x/crypto/ssh"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/localport"
	"github.com/shepherd/shepherd/internal/metricstest"
	"github.com/shepherd/shepherd/provider/equinix/fakemetal"
)

// shepherdBin is the shepherd binary built for the tests by TestMain.
var shepherdBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "shepherd-deploy-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	shepherdBin = filepath.Join(dir, "shepherd")
	build := exec.Command("go", "build", "-o", shepherdBin, "./cmd/shepherd")
	build.Dir = ".."
	if out, err := build.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "building shepherd: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	bmdbtest.Main(m, func() { os.RemoveAll(dir) })
}

// lookPath finds tool or fails the test saying how to install it: these
// tests never skip.
func lookPath(t *testing.T, tool, install string) string {
	t.Helper()
	p, err := exec.LookPath(tool)
	if err != nil {
		t.Fatalf("%s is not installed; install it with %s: %v", tool, install, err)
	}
	return p
}

// units are the systemd units, each with the instance it is verified as.
var units = map[string]string{
	"shepherd.service":  "shepherd.service",
	"shepherd@.service": "shepherd@loops.service",
}

// TestSystemdUnits runs `systemd-analyze verify` on each unit, with
// ExecStart pointing at a real shepherd binary (verify checks that it is
// executable), and wants it silent: systemd only warns about unknown or
// misspelt directives.
func TestSystemdUnits(t *testing.T) {
	analyze := lookPath(t, "systemd-analyze", "scripts/require-systemd-analyze (Debian package systemd)")
	dir := t.TempDir()
	for name, instance := range units {
		data, err := os.ReadFile(filepath.Join("systemd", name))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Contains(data, []byte("ExecStart=/usr/local/bin/shepherd run ")) {
			t.Fatalf("%s: no ExecStart=/usr/local/bin/shepherd run", name)
		}
		unit := bytes.ReplaceAll(data, []byte("/usr/local/bin/shepherd "), []byte(shepherdBin+" "))
		path := filepath.Join(dir, instance)
		if err := os.WriteFile(path, unit, 0o644); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command(analyze, "verify", path).CombinedOutput()
		if err != nil || len(bytes.TrimSpace(out)) > 0 {
			t.Errorf("systemd-analyze verify %s: %v\n%s", name, err, out)
		}
		// systemd's own rating of the sandbox: an exposure of at most 1.5
		// of 10 (it rates an unhardened service 9.6).
		out, err = exec.Command(analyze, "security", "--offline=true", "--threshold=15", path).CombinedOutput()
		if err != nil {
			t.Errorf("systemd-analyze security %s: %v\n%s", name, err, out)
		}
		// The hardening the unit promises, and room for 100,000 agents'
		// connections.
		for _, want := range []string{
			"NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes", "PrivateDevices=yes", "PrivateUsers=yes",
			"CapabilityBoundingSet=\n", "RestrictAddressFamilies=", "SystemCallFilter=@system-service",
			"LimitNOFILE=200000", "User=shepherd", "StateDirectory=shepherd", "ReadWritePaths=/var/lib/shepherd",
		} {
			if !bytes.Contains(data, []byte(want)) {
				t.Errorf("%s lacks %q", name, strings.TrimSpace(want))
			}
		}
	}
}

// TestSystemdUnitsBrokenAreCaught checks that the verification above can
// fail: a misspelt directive and a missing binary are reported.
func TestSystemdUnitsBrokenAreCaught(t *testing.T) {
	analyze := lookPath(t, "systemd-analyze", "scripts/require-systemd-analyze (Debian package systemd)")
	data, err := os.ReadFile(filepath.Join("systemd", "shepherd.service"))
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for what, unit := range map[string][]byte{
		"misspelt directive": bytes.ReplaceAll(bytes.ReplaceAll(data, []byte("/usr/local/bin/shepherd "), []byte(shepherdBin+" ")),
			[]byte("ProtectHome=yes"), []byte("ProtectHomes=yes")),
		"missing binary": bytes.ReplaceAll(data, []byte("/usr/local/bin/shepherd "), []byte(filepath.Join(dir, "missing")+" ")),
	} {
		path := filepath.Join(dir, "shepherd.service")
		if err := os.WriteFile(path, unit, 0o644); err != nil {
			t.Fatal(err)
		}
		out, err := exec.Command(analyze, "verify", path).CombinedOutput()
		if err == nil && len(bytes.TrimSpace(out)) == 0 {
			t.Errorf("%s: systemd-analyze verify is silent", what)
		}
	}
	// A unit without the sandbox fails the security threshold.
	plain := filepath.Join(dir, "plain.service")
	if err := os.WriteFile(plain, []byte("[Service]\nExecStart="+shepherdBin+" run\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(analyze, "security", "--offline=true", "--threshold=15", plain).CombinedOutput(); err == nil {
		t.Errorf("systemd-analyze security passes a unit without hardening:\n%s", out)
	}
}

// readEnvFile reads a systemd EnvironmentFile: NAME=value lines, comments
// and blank lines.
func readEnvFile(t *testing.T, path string) map[string]string {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	env := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok {
			t.Fatalf("%s: not NAME=value: %q", path, line)
		}
		env[k] = v
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return env
}

// execStart returns the unit's ExecStart command line as systemd runs it
// with env: continuation lines joined, ${NAME} replaced by the value,
// $NAME by the value's words, %S and %i by the state directory root and
// instance.
func execStart(t *testing.T, unit []byte, env map[string]string, instance string) []string {
	t.Helper()
	text := strings.ReplaceAll(string(unit), "\\\n", " ")
	var line string
	for l := range strings.SplitSeq(text, "\n") {
		if v, ok := strings.CutPrefix(l, "ExecStart="); ok {
			line = v
		}
	}
	if line == "" {
		t.Fatal("no ExecStart")
	}
	var args []string
	for _, w := range strings.Fields(line) {
		w = strings.NewReplacer("%S", "/var/lib", "%i", instance).Replace(w)
		if name, ok := strings.CutPrefix(w, "$"); ok && !strings.HasPrefix(name, "{") {
			v, set := env[name]
			if !set {
				t.Errorf("ExecStart uses $%s, which the environment file does not set", name)
			}
			args = append(args, strings.Fields(v)...)
			continue
		}
		w = regexp.MustCompile(`\$\{([A-Za-z_][A-Za-z0-9_]*)\}`).ReplaceAllStringFunc(w, func(m string) string {
			name := m[2 : len(m)-1]
			v, set := env[name]
			if !set {
				t.Errorf("ExecStart uses ${%s}, which the environment file does not set", name)
			}
			return v
		})
		args = append(args, w)
	}
	return args
}

// TestUnitCommandLine expands each unit's ExecStart with the example
// environment file and has the real binary parse it: `--help` after the
// flags makes shepherd check every flag and value and exit without
// running.
func TestUnitCommandLine(t *testing.T) {
	env := readEnvFile(t, filepath.Join("examples", "shepherd.env"))
	if !strings.HasPrefix(env["SHEPHERD_DATABASE_URL"], "postgres://") {
		t.Errorf("the example environment sets no SHEPHERD_DATABASE_URL")
	}
	if cfg := env["SHEPHERD_PROVIDER_CONFIG"]; filepath.Base(cfg) != env["SHEPHERD_PROVIDER"]+".yaml" {
		t.Errorf("SHEPHERD_PROVIDER_CONFIG %s is not the example config of provider %s", cfg, env["SHEPHERD_PROVIDER"])
	}
	for name, instance := range units {
		data, err := os.ReadFile(filepath.Join("systemd", name))
		if err != nil {
			t.Fatal(err)
		}
		args := execStart(t, data, env, strings.TrimSuffix(strings.TrimPrefix(instance, "shepherd@"), ".service"))
		if args[0] != "/usr/local/bin/shepherd" || args[1] != "run" {
			t.Fatalf("%s: ExecStart is %q, want /usr/local/bin/shepherd run ...", name, args)
		}
		cmd := exec.Command(shepherdBin, append(args[1:], "--help")...)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("%s: shepherd %s: %v\n%s", name, strings.Join(args[1:], " "), err, out)
		}
	}
}

// TestAlertRules runs promtool on the alerting rules: the syntax check and
// their unit tests.
func TestAlertRules(t *testing.T) {
	promtool := lookPath(t, "promtool", "scripts/require-promtool (Debian package prometheus)")
	for _, args := range [][]string{{"check", "rules", "alerts.yml"}, {"test", "rules", "alerts_test.yml"}} {
		cmd := exec.Command(promtool, args...)
		cmd.Dir = "prometheus"
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// alertNames are the alerts operators act on (the list); each must
// be in alerts.yml and covered by alerts_test.yml.
var alertNames = []string{
	"ShepherdRecoveryBreakerPaused", "ShepherdQuarantinesRising", "ShepherdHeartbeatsRejected",
	"ShepherdProviderRateLimited", "ShepherdSessionsExpiring", "ShepherdNoRecoverer",
}

// readYAML reads the YAML file at path into v.
func readYAML(t *testing.T, path string, v any) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(data, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

// rules reads the alerting rules: alert name → expression.
func rules(t *testing.T) map[string]string {
	t.Helper()
	var f struct {
		Groups []struct {
			Rules []struct {
				Alert string `yaml:"alert"`
				Expr  string `yaml:"expr"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	readYAML(t, filepath.Join("prometheus", "alerts.yml"), &f)
	r := map[string]string{}
	for _, g := range f.Groups {
		for _, rule := range g.Rules {
			r[rule.Alert] = rule.Expr
		}
	}
	return r
}

// TestAlertsCovered checks that every alert the operator needs is there,
// and that the unit tests expect every alert to fire at least once.
func TestAlertsCovered(t *testing.T) {
	r := rules(t)
	var tests struct {
		Tests []struct {
			AlertRuleTest []struct {
				Alertname string           `yaml:"alertname"`
				ExpAlerts []map[string]any `yaml:"exp_alerts"`
			} `yaml:"alert_rule_test"`
		} `yaml:"tests"`
	}
	readYAML(t, filepath.Join("prometheus", "alerts_test.yml"), &tests)
	fires, quiet := map[string]bool{}, map[string]bool{}
	for _, tc := range tests.Tests {
		for _, a := range tc.AlertRuleTest {
			if len(a.ExpAlerts) > 0 {
				fires[a.Alertname] = true
			} else {
				quiet[a.Alertname] = true
			}
		}
	}
	for _, name := range alertNames {
		if _, ok := r[name]; !ok {
			t.Errorf("alerts.yml has no alert %s", name)
		}
	}
	for name := range r {
		if !fires[name] || !quiet[name] {
			t.Errorf("alerts_test.yml does not test %s both firing (%t) and quiet (%t)", name, fires[name], quiet[name])
		}
	}
}

// panel is a panel of the dashboard.
type panel struct {
	Type    string `json:"type"`
	Title   string `json:"title"`
	Targets []struct {
		Expr string `json:"expr"`
	} `json:"targets"`
	Panels []panel `json:"panels"` // of a collapsed row
}

// dashboardQueries reads the dashboard and returns its PromQL queries, those
// of the panels in collapsed rows included.
func dashboardQueries(t *testing.T) []string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("grafana", "shepherd-fleet.json"))
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Title      string `json:"title"`
		UID        string `json:"uid"`
		Templating struct {
			List []struct {
				Definition string `json:"definition"`
			} `json:"list"`
		} `json:"templating"`
		Panels []panel `json:"panels"`
	}
	if err := json.Unmarshal(data, &d); err != nil {
		t.Fatalf("the dashboard is not valid JSON: %v", err)
	}
	if d.Title == "" || d.UID == "" {
		t.Error("the dashboard has no title or uid")
	}
	var qs []string
	for i := 0; i < len(d.Panels); i++ {
		p := d.Panels[i]
		if p.Type == "row" {
			// A collapsed row holds its panels.
			d.Panels = append(d.Panels, p.Panels...)
			continue
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			qs = append(qs, tg.Expr)
		}
	}
	for _, v := range d.Templating.List {
		if v.Definition != "" {
			qs = append(qs, v.Definition)
		}
	}
	return qs
}

// served is what a running shepherd's /metrics serves: series names
// (histograms' _bucket, _sum and _count included) and their label names.
type served map[string]map[string]bool

// add parses the text exposition format into s.
func (s served) add(body []byte) {
	series := regexp.MustCompile(`^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? `)
	label := regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)="(?:[^"\\]|\\.)*"`)
	for line := range strings.SplitSeq(string(body), "\n") {
		m := series.FindStringSubmatch(line)
		if m == nil {
			continue
		}
		if s[m[1]] == nil {
			s[m[1]] = map[string]bool{}
		}
		for _, l := range label.FindAllStringSubmatch(m[3], -1) {
			s[m[1]][l[1]] = true
		}
	}
}

// targetLabels are added by Prometheus to every scraped series.
var targetLabels = []string{"instance", "job"}

var (
	selectorRE = regexp.MustCompile(`\b(shepherd_[a-zA-Z0-9_]+)(\{([^}]*)\})?`)
	matcherRE  = regexp.MustCompile(`([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*"`)
	groupingRE = regexp.MustCompile(`\b(?:by|without)\s*\(([^)]*)\)`)
	labelArgRE = regexp.MustCompile(`label_values\(\s*(shepherd_[a-zA-Z0-9_]+)\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)`)
)

// problems lists what query asks of s that s does not serve: metrics,
// label names in selectors, and label names it groups by (which some
// metric of the query must have).
func (s served) problems(query string) []string {
	var probs []string
	var names []string
	for _, m := range selectorRE.FindAllStringSubmatch(query, -1) {
		name := m[1]
		names = append(names, name)
		labels, ok := s[name]
		if !ok {
			probs = append(probs, "no metric "+name)
			continue
		}
		for _, lm := range matcherRE.FindAllStringSubmatch(m[3], -1) {
			if !labels[lm[1]] && !slices.Contains(targetLabels, lm[1]) {
				probs = append(probs, fmt.Sprintf("%s has no label %s", name, lm[1]))
			}
		}
	}
	if len(names) == 0 {
		probs = append(probs, "names no shepherd_ metric")
	}
	hasLabel := func(l string) bool {
		if slices.Contains(targetLabels, l) {
			return true
		}
		for _, n := range names {
			if s[n][l] {
				return true
			}
		}
		return false
	}
	for _, g := range groupingRE.FindAllStringSubmatch(query, -1) {
		for l := range strings.SplitSeq(g[1], ",") {
			if l = strings.TrimSpace(l); l != "" && !hasLabel(l) {
				probs = append(probs, fmt.Sprintf("groups by %s, which none of %s has", l, strings.Join(names, ", ")))
			}
		}
	}
	for _, m := range labelArgRE.FindAllStringSubmatch(query, -1) {
		if !hasLabel(m[2]) {
			probs = append(probs, fmt.Sprintf("label_values of %s by %s, which it does not have", m[1], m[2]))
		}
	}
	return probs
}

// TestQueriesCheckNames checks the checker: it must catch a misspelt
// metric, a label a metric lacks and a grouping by a missing label.
func TestQueriesCheckNames(t *testing.T) {
	s := served{}
	s.add([]byte("# TYPE shepherd_x_total counter\nshepherd_x_total{process=\"AgentStart\"} 1\nshepherd_y 2\n"))
	for q, want := range map[string]string{
		`sum by (process) (rate(shepherd_x_total[5m]))`:                "",
		`sum by (job) (shepherd_y{instance="a"})`:                      "",
		`rate(shepherd_x_totl[5m])`:                                    "no metric shepherd_x_totl",
		`shepherd_y{process="AgentStart"}`:                             "shepherd_y has no label process",
		`max by (provider) (shepherd_x_total)`:                         "groups by provider",
		`label_values(shepherd_y, process)`:                            "label_values of shepherd_y by process",
		`time() - max(shepherd_x_total{process=~"Agent.*"}) > 600`:     "",
		`sum without (reason) (shepherd_x_total)`:                      "groups by reason",
		`(sum(shepherd_x_total{process="Recovery"}) or vector(0)) < 1`: "",
	} {
		probs := strings.Join(s.problems(q), "; ")
		if (want == "") != (probs == "") || !strings.Contains(probs, want) {
			t.Errorf("problems(%s) = %q, want %q", q, probs, want)
		}
	}
}

// TestQueriesNameServedMetrics runs shepherd as the examples configure it
// (all components with the static provider and the example inventory, and
// the provisioner with the Equinix Metal provider and the example config
// against a fake Metal API) and checks that every metric and label the
// alerts and the dashboard name is served on their /metrics.
func TestQueriesNameServedMetrics(t *testing.T) {
	db := bmdbtest.New(t)
	// Machines of another provider for the fleet gauges that need them:
	// hardware reports and a decommissioned machine.
	bmdbtest.AddFleet(t, db, bmdbtest.Fleet{Provider: "lab", Healthy: 2, Stale: 1})
	db.Exec(t, `INSERT INTO machine_hardware_report (machine_id, hardware_report_raw, cpu_threads, memory_bytes)
		SELECT machine_id, '\x00', 16, 64::bigint << 30 FROM machine_agent_heartbeat`)
	s := bmdbtest.Session(t, db, "setup", time.Minute)
	gone := bmdbtest.AddMachine(t, db, s, "lab")
	if err := s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error {
		_, err := tx.Decommission(ctx, gone, true)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	etc := t.TempDir()
	secrets := filepath.Join(etc, "secrets")
	if err := os.Mkdir(secrets, 0o700); err != nil {
		t.Fatal(err)
	}
	_, key, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	block, err := ssh.MarshalPrivateKey(key, "")
	if err != nil {
		t.Fatal(err)
	}
	const metalToken = "deploy-test-metal-token"
	for name, data := range map[string][]byte{
		"bmc.pw": []byte("bmc-password\n"), "rack2.key": pem.EncodeToMemory(block), "metal-token": []byte(metalToken + "\n"),
	} {
		if err := os.WriteFile(filepath.Join(secrets, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// The fake Metal API, with the example's project.
	api, err := fakemetal.New(fakemetal.Config{Token: metalToken})
	if err != nil {
		t.Fatal(err)
	}
	var eq struct {
		Project string `yaml:"project"`
		APIURL  string `yaml:"api_url"`
	}
	readYAML(t, filepath.Join("examples", "equinix.yaml"), &eq)
	api.AddReservations(eq.Project, "m3.small.x86", "fr2", "fr", 2)
	apiSrv := httptest.NewServer(api)
	t.Cleanup(apiSrv.Close)

	// The examples, with /etc/shepherd/ in a temporary directory and the
	// API URL the fake's.
	for _, name := range []string{"static.yaml", "inventory.yaml", "equinix.yaml"} {
		data, err := os.ReadFile(filepath.Join("examples", name))
		if err != nil {
			t.Fatal(err)
		}
		data = bytes.ReplaceAll(data, []byte("/etc/shepherd/"), []byte(etc+"/"))
		data = bytes.ReplaceAll(data, []byte(eq.APIURL), []byte(apiSrv.URL+"/metal/v1"))
		if err := os.WriteFile(filepath.Join(etc, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	agent := filepath.Join(etc, "shepherd-agent")
	if err := os.WriteFile(agent, []byte("stand-in: nothing runs it"), 0o755); err != nil {
		t.Fatal(err)
	}
	common := []string{"run", "--database-url", db.URL, "--log-level", "error", "--agent", agent,
		"--server-listen", "127.0.0.1:0", "--web-listen", "127.0.0.1:0", "--janitor-period", "100ms",
		"--provisioner-period", "100ms"}
	staticMetrics, equinixMetrics := freeAddr(t), freeAddr(t)
	start(t, append(common, "--components=all", "--provider=static", "--provider-config", filepath.Join(etc, "static.yaml"),
		"--data-dir", filepath.Join(etc, "static-data"), "--metrics-listen", staticMetrics)...)
	start(t, append(common, "--components=provisioner", "--provider=equinix", "--provider-config", filepath.Join(etc, "equinix.yaml"),
		"--data-dir", filepath.Join(etc, "equinix-data"), "--metrics-listen", equinixMetrics)...)

	queries := map[string]string{}
	for name, expr := range rules(t) {
		queries["alert "+name] = expr
	}
	for i, q := range dashboardQueries(t) {
		queries[fmt.Sprintf("dashboard query %d", i+1)] = q
	}
	var report []string
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("what the alerts and the dashboard ask for and shepherd did not serve:\n%s", strings.Join(report, "\n"))
		}
	})
	bmdbtest.WaitFor(t, 60*time.Second, "every metric the alerts and the dashboard name served", func(ctx context.Context) (bool, error) {
		s := served{}
		for _, addr := range []string{staticMetrics, equinixMetrics} {
			rctx, cancel := context.WithTimeout(ctx, 5*time.Second) // a stuck answer is asked again
			body, err := metricstest.Get(rctx, addr)
			cancel()
			if err != nil {
				return false, err
			}
			s.add(body)
		}
		var r []string
		for what, q := range queries {
			for _, p := range s.problems(q) {
				r = append(r, what+": "+p)
			}
		}
		sort.Strings(r)
		report = r
		return len(r) == 0, nil
	})
}

// freeAddr returns a loopback address whose port was free a moment ago,
// below the ephemeral range (see package localport), so that no outgoing
// connection of the tests or of shepherd takes it before shepherd binds it.
func freeAddr(t *testing.T) string {
	t.Helper()
	port, err := localport.Free(localport.Low, localport.High)
	if err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("127.0.0.1:%d", port)
}

// start runs shepherd with args until the test ends; if it exits before,
// the test fails with its output.
func start(t *testing.T, args ...string) {
	t.Helper()
	var out bytes.Buffer
	cmd := exec.Command(shepherdBin, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	t.Cleanup(func() {
		select {
		case err := <-done:
			t.Errorf("shepherd %s exited early: %v\n%s", strings.Join(args, " "), err, &out)
			return
		default:
		}
		_ = cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			<-done
			t.Errorf("shepherd %s did not stop on SIGTERM", strings.Join(args, " "))
		}
	})
}
