package pgserver

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// DefaultStandbyName is the cluster_name a standby started by StartStandby
// reports to its primary (its application_name in pg_stat_replication)
// unless Config.Settings names another, and so the name the primary lists
// in synchronous_standby_names.
const DefaultStandbyName = "standby"

// syncTimeout bounds how long SetSynchronousStandby and WaitSynchronous
// wait for the server (ctx may end the wait earlier).
const syncTimeout = 60 * time.Second

// StartSyncPair starts a primary and a streaming standby of it whose
// replication is synchronous: the primary runs with synchronous_commit=on
// and, set with SetSynchronousStandby, synchronous_standby_names naming the
// standby (DefaultStandbyName), so a commit returns only once the standby
// has the commit record. It returns once pg_stat_replication on the primary
// shows the standby with sync_state 'sync', so every commit from then on
// survives the loss of the primary (StopImmediate) and the promotion of the
// standby (Promote).
//
// The servers live in parentDir/primary and parentDir/standby (parentDir
// "" means a temporary directory each, removed by Close); when running as
// root, parentDir must be traversable by the postgres OS user. Both listen
// on 127.0.0.1 as well as on their unix sockets (TCPURL, MultiHostURL), so
// that clients and proxies can reach them over TCP. They are not durable
// (see Config.Durable): a server that is killed loses nothing the kernel
// has, which is what failover tests need.
//
// After a failover, StartStandby of the promoted server, SetSynchronousStandby
// and WaitSynchronous make replication synchronous again. The caller must
// Close both servers; on error nothing is left running.
func StartSyncPair(ctx context.Context, parentDir string) (primary, standby *Server, err error) {
	dir := func(name string) string {
		if parentDir == "" {
			return ""
		}
		return filepath.Join(parentDir, name)
	}
	settings := map[string]string{"synchronous_commit": "on"}
	primary, err = Start(ctx, Config{Dir: dir("primary"), TCP: true, Settings: settings})
	if err != nil {
		return nil, nil, fmt.Errorf("starting the primary of a synchronous pair: %w", err)
	}
	standby, err = StartStandby(ctx, primary, Config{Dir: dir("standby"), TCP: true, Settings: settings})
	if err != nil {
		return nil, nil, errors.Join(fmt.Errorf("starting the standby of a synchronous pair: %w", err), primary.Close())
	}
	if err := primary.SetSynchronousStandby(ctx, DefaultStandbyName); err != nil {
		return nil, nil, errors.Join(err, standby.Close(), primary.Close())
	}
	if err := primary.WaitSynchronous(ctx, DefaultStandbyName); err != nil {
		return nil, nil, errors.Join(err, standby.Close(), primary.Close())
	}
	return primary, standby, nil
}

// SetSynchronousStandby sets the server's synchronous_standby_names to
// names (PostgreSQL's syntax: a standby's name, "FIRST 1 (a, b)", ...) with
// ALTER SYSTEM, reloads the configuration and waits until new connections
// see the new value. "" turns synchronous replication off, which also
// releases commits waiting for a standby. It fails when the server was
// started with synchronous_standby_names in Config.Settings, since a
// command-line setting overrides ALTER SYSTEM.
//
// It does not wait for a standby to become synchronous: WaitSynchronous
// does. ALTER SYSTEM writes postgresql.auto.conf, which pg_basebackup
// copies, but StartStandby drops this setting from its copy.
func (s *Server) SetSynchronousStandby(ctx context.Context, names string) error {
	for name := range s.settings {
		if strings.EqualFold(name, "synchronous_standby_names") {
			return fmt.Errorf("setting synchronous_standby_names of postgres in %s: it was given in Config.Settings, which overrides ALTER SYSTEM", s.dir)
		}
	}
	if strings.ContainsAny(names, "\x00\n\r") {
		return fmt.Errorf("setting synchronous_standby_names of postgres in %s: %q contains a NUL or newline", s.dir, names)
	}
	ctx, cancel := context.WithTimeout(ctx, syncTimeout)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.URL(""))
	if err != nil {
		return fmt.Errorf("setting synchronous_standby_names of postgres in %s: %w", s.dir, err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	// ALTER SYSTEM takes no parameters: quote the literal.
	literal := "'" + strings.ReplaceAll(names, "'", "''") + "'"
	for _, sql := range []string{
		"ALTER SYSTEM SET synchronous_standby_names = " + literal,
		"SELECT pg_reload_conf()",
	} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			return fmt.Errorf("setting synchronous_standby_names of postgres in %s: %s: %w", s.dir, sql, err)
		}
	}
	// The postmaster rereads the configuration asynchronously; a backend
	// started after it did sees the new value.
	err = s.poll(ctx, func(ctx context.Context, conn *pgx.Conn) (bool, error) {
		var got string
		err := conn.QueryRow(ctx, "SELECT current_setting('synchronous_standby_names')").Scan(&got)
		return got == names, err
	})
	if err != nil {
		return fmt.Errorf("waiting for synchronous_standby_names = %s on postgres in %s: %w", literal, s.dir, err)
	}
	s.log.Info("synchronous_standby_names set", "dir", s.dir, "names", names)
	return nil
}

// WaitSynchronous waits until the server's pg_stat_replication shows the
// standby whose application_name is name streaming with sync_state 'sync'
// (at most 60 s, or until ctx ends).
func (s *Server) WaitSynchronous(ctx context.Context, name string) error {
	ctx, cancel := context.WithTimeout(ctx, syncTimeout)
	defer cancel()
	err := s.poll(ctx, func(ctx context.Context, conn *pgx.Conn) (bool, error) {
		var n int
		err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_stat_replication WHERE application_name = $1 AND sync_state = 'sync'", name).Scan(&n)
		return n > 0, err
	})
	if err != nil {
		return fmt.Errorf("waiting for standby %q to replicate synchronously from postgres in %s: %w", name, s.dir, err)
	}
	return nil
}

// poll runs cond on a fresh connection every pollInterval until it reports
// true or ctx ends; the error then includes cond's last error.
func (s *Server) poll(ctx context.Context, cond func(ctx context.Context, conn *pgx.Conn) (bool, error)) error {
	tick := time.NewTicker(pollInterval)
	defer tick.Stop()
	for {
		var ok bool
		conn, err := pgx.Connect(ctx, s.URL(""))
		if err == nil {
			ok, err = cond(ctx, conn)
			conn.Close(context.WithoutCancel(ctx))
		}
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (last error: %v)", ctx.Err(), err)
		case <-tick.C:
		}
	}
}

// dropSyncStandbyNames removes synchronous_standby_names from the
// postgresql.auto.conf at path, if there is one.
func dropSyncStandbyNames(path string) error {
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("reading the standby's %s: %w", filepath.Base(path), err)
	}
	var out bytes.Buffer
	dropped := false
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		line := sc.Text()
		name, _, _ := strings.Cut(strings.TrimSpace(line), "=")
		if strings.EqualFold(strings.TrimSpace(name), "synchronous_standby_names") {
			dropped = true
			continue
		}
		out.WriteString(line)
		out.WriteByte('\n')
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("reading the standby's %s: %w", filepath.Base(path), err)
	}
	if !dropped {
		return nil
	}
	// Writing in place keeps the file's owner (the postgres OS user).
	if err := os.WriteFile(path, out.Bytes(), 0o600); err != nil {
		return fmt.Errorf("dropping synchronous_standby_names from the standby's %s: %w", filepath.Base(path), err)
	}
	return nil
}

// MultiHostURL returns a postgres:// URL for database that lists every
// server's 127.0.0.1:port in order (host1:port1,host2:port2) with
// target_session_attrs=read-write, the URL form of MultiHostDSN for clients
// that reach the servers over TCP: a client tries them in turn and keeps
// the first that accepts writes. It returns "" unless every server listens
// on TCP (Config.TCP). An empty database means "postgres".
func MultiHostURL(database string, servers ...*Server) string {
	if len(servers) == 0 {
		return ""
	}
	hosts := make([]string, len(servers))
	for i, s := range servers {
		if !s.tcp {
			return ""
		}
		hosts[i] = "127.0.0.1:" + strconv.Itoa(s.port)
	}
	return fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable&target_session_attrs=read-write",
		servers[0].user, strings.Join(hosts, ","), url.PathEscape(dbName(database)))
}
