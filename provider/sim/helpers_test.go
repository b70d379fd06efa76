package sim_test

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/pkg/sftp"
	"golang.org/x/crypto/ssh"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/internal/sshx"
	"github.com/shepherd/shepherd/provider"
	"github.com/shepherd/shepherd/provider/sim"
	"github.com/shepherd/shepherd/server"
	"github.com/shepherd/shepherd/server/servertest"
)

func TestMain(m *testing.M) { bmdbtest.Main(m) }

// newFleet creates a fleet for the test without running it.
func newFleet(t *testing.T, cfg sim.Config) *sim.Fleet {
	t.Helper()
	f, err := sim.New(cfg)
	if err != nil {
		t.Fatalf("sim.New: %v", err)
	}
	return f
}

// run runs f until the test ends, or until the returned func is called,
// which returns once Run did; either checks that Run returned nil.
func run(t *testing.T, f *sim.Fleet) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.Run(ctx) }()
	stop = sync.OnceFunc(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Fleet.Run: %v", err)
		}
	})
	t.Cleanup(stop)
	return stop
}

// startFleet is newFleet and run.
func startFleet(t *testing.T, cfg sim.Config) *sim.Fleet {
	t.Helper()
	f := newFleet(t, cfg)
	run(t, f)
	return f
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// create turns slot id into a machine of ours.
func create(t *testing.T, f *sim.Fleet, id string) {
	t.Helper()
	m, err := f.GetMachine(testCtx(t), id)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.CreateMachine(testCtx(t), provider.CreateRequest{From: m, Session: uuid.New()}); err != nil {
		t.Fatalf("CreateMachine(%s): %v", id, err)
	}
}

// slotID is the id of the n-th slot, counting from 1.
func slotID(n int) string { return "sim-" + pad6(n) }

func pad6(n int) string {
	b := []byte("000000")
	for i := 5; i >= 0 && n > 0; i-- {
		b[i] = byte('0' + n%10)
		n /= 10
	}
	return string(b)
}

var clientKey = sync.OnceValue(func() ssh.Signer {
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		panic(err)
	}
	s, err := ssh.NewSignerFromKey(priv)
	if err != nil {
		panic(err)
	}
	return s
})

// dial connects to machine id as the initializer would: through
// SSHAccess, with its own key, trusting the first host key, which it
// returns.
func dial(t *testing.T, f *sim.Fleet, id string) (*ssh.Client, ssh.PublicKey, error) {
	t.Helper()
	access, err := f.SSHAccess(testCtx(t), id)
	if err != nil {
		t.Fatalf("SSHAccess(%s): %v", id, err)
	}
	if access.HostKey != nil || access.Auth != nil || access.User != "" || access.Dial == nil {
		t.Fatalf("SSHAccess(%s) = %+v, want only Dial", id, access)
	}
	var seen ssh.PublicKey
	c, err := sshx.Dial(testCtx(t), sshx.Target{
		Addr: id + ":22",
		Dial: access.Dial,
		User: "root",
		Keys: []ssh.Signer{clientKey()},
		FirstUse: func(key ssh.PublicKey) error {
			seen = key // trust on first use
			return nil
		},
	})
	if err != nil {
		return nil, nil, err
	}
	t.Cleanup(func() { c.Close() })
	return c, seen, nil
}

// mustDial is dial that fails the test on error.
func mustDial(t *testing.T, f *sim.Fleet, id string) (*ssh.Client, ssh.PublicKey) {
	t.Helper()
	c, key, err := dial(t, f, id)
	if err != nil {
		t.Fatalf("dialing %s: %v", id, err)
	}
	return c, key
}

const agentPath = "/usr/local/bin/shepherd-agent"

// upload copies size bytes to agentPath as the initializer does: write a
// temporary file, make it executable, rename it over the target.
func upload(t *testing.T, c *ssh.Client, size int) {
	t.Helper()
	sc, err := sftp.NewClient(c)
	if err != nil {
		t.Fatalf("starting SFTP: %v", err)
	}
	defer sc.Close()
	tmp := agentPath + ".tmp"
	if err := sc.MkdirAll("/usr/local/bin"); err != nil {
		t.Fatalf("MkdirAll: %v", err)
	}
	w, err := sc.Create(tmp)
	if err != nil {
		t.Fatalf("creating %s: %v", tmp, err)
	}
	chunk := make([]byte, 64<<10)
	for written := 0; written < size; written += len(chunk) {
		if _, err := w.Write(chunk[:min(len(chunk), size-written)]); err != nil {
			t.Fatalf("writing %s: %v", tmp, err)
		}
	}
	if err := w.Chmod(0o755); err != nil {
		t.Fatalf("chmod %s: %v", tmp, err)
	}
	if err := w.Close(); err != nil {
		t.Fatalf("closing %s: %v", tmp, err)
	}
	if err := sc.PosixRename(tmp, agentPath); err != nil {
		t.Fatalf("renaming %s: %v", tmp, err)
	}
	fi, err := sc.Stat(agentPath)
	if err != nil {
		t.Fatalf("stat %s: %v", agentPath, err)
	}
	if fi.Size() != int64(size) || fi.Mode().Perm() != 0o755 || !fi.Mode().IsRegular() {
		t.Errorf("%s after the upload: size %d mode %v, want %d and 0755", agentPath, fi.Size(), fi.Mode(), size)
	}
	if _, err := sc.Stat(tmp); err == nil {
		t.Errorf("%s still exists after the rename", tmp)
	}
}

// execTakeover runs the agent with stdin and parses its answer.
func execTakeover(t *testing.T, c *ssh.Client, stdin []byte) *agentv1.TakeoverResponse {
	t.Helper()
	out, err := sshx.Run(testCtx(t), c, agentPath+" takeover", stdin, 1<<20)
	if err != nil {
		t.Fatalf("running the takeover: %v (stderr %q)", err, out.Stderr)
	}
	var resp agentv1.TakeoverResponse
	if err := proto.Unmarshal(out.Stdout, &resp); err != nil {
		t.Fatalf("parsing the TakeoverResponse %q: %v", out.Stdout, err)
	}
	return &resp
}

// env is a BMDB with a running callback server.
type env struct {
	db       *bmdbtest.DB
	sess     *bmdb.Session
	endpoint string
	ca       []byte
}

func newEnv(t *testing.T, interval time.Duration) *env {
	t.Helper()
	db := bmdbtest.New(t)
	srv, endpoint := servertest.Start(t, db.DB, server.Config{HeartbeatInterval: interval})
	return &env{db: db, sess: bmdbtest.Session(t, db, "sim-test", 0), endpoint: endpoint, ca: srv.CA()}
}

// addMachine records slot id of f in the BMDB.
func (e *env) addMachine(t *testing.T, f *sim.Fleet, id string) uuid.UUID {
	t.Helper()
	var mid uuid.UUID
	err := e.sess.Transact(testCtx(t), func(ctx context.Context, tx *bmdb.Tx) error {
		var err error
		mid, err = tx.AddMachine(ctx, bmdb.Provided{Provider: f.Name(), ProviderID: id, Status: bmdb.ProviderStatusRunning})
		return err
	})
	if err != nil {
		t.Fatalf("adding machine %s: %v", id, err)
	}
	return mid
}

func (e *env) setAgentStarted(t *testing.T, machine uuid.UUID, key ed25519.PublicKey) {
	t.Helper()
	err := e.sess.Transact(testCtx(t), func(ctx context.Context, tx *bmdb.Tx) error {
		return tx.SetAgentStarted(ctx, machine, key)
	})
	if err != nil {
		t.Fatalf("setting AgentStarted: %v", err)
	}
}

func (e *env) init(machine uuid.UUID) *agentv1.TakeoverInit {
	return &agentv1.TakeoverInit{MachineId: machine.String(), ServerEndpoint: e.endpoint, CaCertificate: e.ca}
}

// takeover takes machine (slot id) over as the initializer does and
// records AgentStarted; it returns the agent's key.
func (e *env) takeover(t *testing.T, f *sim.Fleet, id string, machine uuid.UUID) ed25519.PublicKey {
	t.Helper()
	c, _ := mustDial(t, f, id)
	upload(t, c, 4096)
	init := e.init(machine)
	raw, err := proto.Marshal(init)
	if err != nil {
		t.Fatal(err)
	}
	resp := execTakeover(t, c, raw)
	c.Close()
	ok := resp.GetSuccess()
	if ok == nil {
		t.Fatalf("takeover of %s: %v", id, resp)
	}
	if !proto.Equal(ok.GetInitMessage(), init) {
		t.Errorf("takeover of %s echoed %v, want %v", id, ok.GetInitMessage(), init)
	}
	if len(ok.GetPublicKey()) != ed25519.PublicKeySize {
		t.Fatalf("takeover of %s answered a %d-byte key", id, len(ok.GetPublicKey()))
	}
	e.setAgentStarted(t, machine, ok.GetPublicKey())
	return ok.GetPublicKey()
}

// waitHeartbeat polls until the fleet saw a successful heartbeat of slot
// id after after.
func waitHeartbeat(t *testing.T, f *sim.Fleet, id string, after time.Time, what string) time.Time {
	t.Helper()
	var last time.Time
	bmdbtest.WaitFor(t, 30*time.Second, what, func(context.Context) (bool, error) {
		last = f.LastHeartbeat(id)
		return last.After(after), nil
	})
	return last
}
