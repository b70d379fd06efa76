package servertest_test

import (
	"context"
	"crypto/ed25519"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/shepherd/shepherd/agent"
	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/devpki"
	"github.com/shepherd/shepherd/server"
	"github.com/shepherd/shepherd/server/servertest"
)

func TestMain(m *testing.M) { bmdbtest.Main(m) }

// Start runs a server on loopback that an agent can reach and trust with
// the server's CA, using the test's data directory if it names one.
func TestStart(t *testing.T) {
	t.Parallel()
	for name, dataDir := range map[string]string{"own data directory": "", "test's data directory": t.TempDir()} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := bmdbtest.New(t)
			srv, endpoint := servertest.Start(t, db.DB, server.Config{DataDir: dataDir})
			if !strings.HasPrefix(endpoint, "127.0.0.1:") || strings.HasSuffix(endpoint, ":0") {
				t.Errorf("endpoint %q, want 127.0.0.1 and the port chosen", endpoint)
			}
			if dataDir != "" {
				if _, err := os.Stat(filepath.Join(dataDir, devpki.CACertFile)); err != nil {
					t.Errorf("the development CA is not in the given data directory: %v", err)
				}
			}

			s := bmdbtest.Session(t, db, "test", time.Minute)
			id := bmdbtest.AddMachine(t, db, s, "p")
			pub, key, err := ed25519.GenerateKey(nil)
			if err != nil {
				t.Fatal(err)
			}
			err = s.Transact(t.Context(), func(ctx context.Context, tx *bmdb.Tx) error { return tx.SetAgentStarted(ctx, id, pub) })
			if err != nil {
				t.Fatal(err)
			}
			tlsCfg, err := agent.ClientTLS(id.String(), endpoint, srv.CA(), key)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			if _, err := agent.NewCallbackClient(endpoint, tlsCfg).Heartbeat(ctx, connect.NewRequest(&agentv1.HeartbeatRequest{MachineId: id.String()})); err != nil {
				t.Errorf("heartbeat: %v", err)
			}
		})
	}
}
