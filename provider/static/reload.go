package static

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the provider's series. A machine id is never a label.
type metrics struct {
	machines     prometheus.Gauge
	valid        prometheus.Gauge
	reloadErrors prometheus.Counter
}

// newMetrics registers the series on reg, or on a private registry if reg
// is nil. Two providers with different names can share a registerer; two
// with the same name cannot, and that is an error rather than a panic.
func newMetrics(reg prometheus.Registerer, name string) (*metrics, error) {
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	labels := prometheus.Labels{"provider": name}
	m := &metrics{
		machines: prometheus.NewGauge(prometheus.GaugeOpts{
			Name:        "shepherd_static_inventory_machines",
			Help:        "Machines in the static inventory in force.",
			ConstLabels: labels,
		}),
		valid: prometheus.NewGauge(prometheus.GaugeOpts{
			Name:        "shepherd_static_inventory_valid",
			Help:        "1 if the last read of the static inventory file was good; 0 if the last good inventory is in force in spite of a broken file.",
			ConstLabels: labels,
		}),
		reloadErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name:        "shepherd_static_inventory_reload_errors_total",
			Help:        "Reads of the static inventory file that failed (unreadable or invalid); the last good inventory stayed in force.",
			ConstLabels: labels,
		}),
	}
	var registered []prometheus.Collector
	for _, c := range []prometheus.Collector{m.machines, m.valid, m.reloadErrors} {
		if err := reg.Register(c); err != nil {
			for _, r := range registered {
				reg.Unregister(r)
			}
			return nil, fmt.Errorf("static %s: registering metrics: %w", name, err)
		}
		registered = append(registered, c)
	}
	return m, nil
}

// fileState is what the provider last saw of the inventory file and the
// secret files it names, so that a poll can tell whether there is anything
// new to parse.
type fileState struct {
	readErr string // the error reading it, if it could not be read
	modTime time.Time
	size    int64
	sum     [sha256.Size]byte
	// secrets are the secret files the inventory named when it was last
	// parsed, as they were read then.
	secrets map[string]fileID
}

// fileID is which version of a file was read: a rotated secret is usually
// written to a new file and renamed over the old one (a new inode, perhaps
// with the old size and even the old modification time), or rewritten in
// place (a new modification time or size). err is set for a file that
// could not be opened, so that its appearing counts as a change.
type fileID struct {
	err      string
	modTime  time.Time
	size     int64
	dev, ino uint64
}

// idOf returns the identity of the file fi describes.
func idOf(fi os.FileInfo) fileID {
	id := fileID{modTime: fi.ModTime(), size: fi.Size()}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		id.dev, id.ino = uint64(st.Dev), uint64(st.Ino)
	}
	return id
}

// same reports whether id and o are the same version of a file.
func (id fileID) same(o fileID) bool {
	return id.err == o.err && id.modTime.Equal(o.modTime) && id.size == o.size && id.dev == o.dev && id.ino == o.ino
}

// changedSecret returns the first secret file of s that is not the version
// read any more, or "".
func (s fileState) changedSecret() string {
	for path, was := range s.secrets {
		fi, err := os.Stat(path)
		switch {
		case err != nil && was.err == "", err == nil && was.err != "":
			return path
		case err == nil && !idOf(fi).same(was):
			return path
		}
	}
	return ""
}

// Run polls the files every ReloadInterval until ctx ends, and then
// returns nil. A changed inventory, or a changed secret file it names,
// makes it read the inventory again, which replaces the inventory in force
// if it is good; a broken one is logged and counted once, and the last good
// inventory stays.
func (p *Provider) Run(ctx context.Context) error {
	t := time.NewTicker(p.cfg.ReloadInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			p.poll()
		}
	}
}

// Reload re-reads the inventory and its secrets now, changed or not; on
// error it keeps the last good inventory and returns the error (which it
// has also logged and counted). The process calls it on SIGHUP
// (provider.Reloader).
func (p *Provider) Reload() error {
	p.reloadMu.Lock()
	defer p.reloadMu.Unlock()
	inv, err := p.load()
	if err != nil {
		p.failed(err)
		return err
	}
	p.use(inv)
	return nil
}

// poll reloads the inventory if it or a secret file it names changed since
// it was last read. The inventory's size and modification time, and each
// secret file's identity, tell cheaply; the inventory's content hash
// catches a rewrite with the same contents (an editor's save, a config
// management run) so that it is not logged again, and a broken file is
// reported only once.
func (p *Provider) poll() {
	p.reloadMu.Lock()
	defer p.reloadMu.Unlock()
	fi, err := os.Stat(p.cfg.Inventory)
	changed := p.seen.changedSecret()
	if err == nil && p.seen.readErr == "" && fi.ModTime().Equal(p.seen.modTime) && fi.Size() == p.seen.size && changed == "" {
		return
	}
	if err != nil {
		p.readFailed(fmt.Errorf("reading inventory: %w", err))
		return
	}
	data, err := os.ReadFile(p.cfg.Inventory)
	if err != nil {
		p.readFailed(fmt.Errorf("reading inventory: %w", err))
		return
	}
	// Stat before reading: if the file changes in between, the next poll
	// sees a new time or size and reads it again.
	st := fileState{modTime: fi.ModTime(), size: fi.Size(), sum: sha256.Sum256(data), secrets: p.seen.secrets}
	same := p.seen.readErr == "" && st.sum == p.seen.sum && changed == ""
	p.seen = st
	if same {
		return
	}
	if changed != "" {
		p.log.Info("a secret file the inventory names changed, reading the inventory again",
			slog.String("file", p.cfg.Inventory), slog.String("secret_file", changed))
	}
	inv, secrets, err := parseWith(p.cfg.Inventory, data, p.lookupEnv, readSecretFile, p.cfg.RecoveryRungs)
	p.seen.secrets = secrets
	if err != nil {
		p.failed(err)
		return
	}
	p.use(inv)
}

// readFailed reports a file that cannot be read, once until that changes.
// The caller holds reloadMu.
func (p *Provider) readFailed(err error) {
	if p.seen.readErr == err.Error() {
		return
	}
	p.seen = fileState{readErr: err.Error()}
	p.failed(err)
}

// load reads and parses the file, recording what it read. The caller holds
// reloadMu.
func (p *Provider) load() (*inventory, error) {
	fi, err := os.Stat(p.cfg.Inventory)
	if err != nil {
		p.seen = fileState{readErr: err.Error()}
		return nil, fmt.Errorf("reading inventory: %w", err)
	}
	data, err := os.ReadFile(p.cfg.Inventory)
	if err != nil {
		p.seen = fileState{readErr: err.Error()}
		return nil, fmt.Errorf("reading inventory: %w", err)
	}
	inv, secrets, err := parseWith(p.cfg.Inventory, data, p.lookupEnv, readSecretFile, p.cfg.RecoveryRungs)
	p.seen = fileState{modTime: fi.ModTime(), size: fi.Size(), sum: sha256.Sum256(data), secrets: secrets}
	return inv, err
}

// use puts inv in force.
func (p *Provider) use(inv *inventory) {
	old := p.inv.Swap(inv)
	p.metrics.machines.Set(float64(len(inv.list)))
	p.metrics.valid.Set(1)
	if old == nil {
		return
	}
	added, removed := 0, 0
	for id := range inv.byID {
		if _, ok := old.byID[id]; !ok {
			added++
		}
	}
	for id := range old.byID {
		if _, ok := inv.byID[id]; !ok {
			removed++
		}
	}
	p.log.Info("inventory reloaded", slog.String("file", p.cfg.Inventory), slog.Int("machines", len(inv.list)),
		slog.Int("added", added), slog.Int("removed", removed))
}

// failed counts and logs a file that could not be used.
func (p *Provider) failed(err error) {
	p.metrics.reloadErrors.Inc()
	p.metrics.valid.Set(0)
	level := slog.LevelError
	if errors.Is(err, os.ErrNotExist) {
		// Often the moment between an editor's unlink and rename.
		level = slog.LevelWarn
	}
	p.log.Log(context.Background(), level, "inventory is broken, keeping the last good one",
		slog.String("file", p.cfg.Inventory), slog.Int("machines", len(p.inv.Load().list)), slog.Any("err", err))
}
