package sshtest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	gssh "github.com/gliderlabs/ssh"
	"github.com/pkg/sftp"
	"golang.org/x/crypto/ssh"
)

// glServer is the in-process stand-in for sshd: a gliderlabs/ssh server
// that runs session commands with /bin/sh and serves SFTP from the real
// filesystem.
//
// It runs its own accept loop around gliderlabs' HandleConn, instead of
// Server.Serve, so that it can track every connection and handler goroutine
// and wait for them when it stops: tests check for leaked goroutines.
type glServer struct {
	h       *Host
	logPath string

	mu         sync.Mutex
	logf       *os.File      // open while started at least once and not stopped
	log        *log.Logger   // writes to logf
	ln         net.Listener  // current listener; nil when not listening
	acceptDone chan struct{} // closed when the accept loop on ln returns
	acceptErr  error         // why an accept loop ended, if not because ln was closed
	conns      map[net.Conn]struct{}
	closed     bool           // stop has begun: no new connections or handlers
	wg         sync.WaitGroup // connection goroutines and session handlers
}

func newGLServer(h *Host) *glServer {
	return &glServer{
		h:       h,
		logPath: filepath.Join(h.Dir, "gliderlabs.log"),
		conns:   make(map[net.Conn]struct{}),
	}
}

// start listens on the Host's address (a free port if it has none yet)
// with the Host's current key and waits until the server completes an SSH
// handshake. Connections accepted before keep their server and key.
func (g *glServer) start(ctx context.Context) error {
	done, err := g.listen()
	if err != nil {
		return err
	}
	if err := waitReady(ctx, g.h.Addr, g.h.HostKey, done); err != nil {
		return fmt.Errorf("%w\n%s", err, logTail(g.logPath))
	}
	return nil
}

// listen starts serving on a new listener and returns the channel closed
// when its accept loop ends.
func (g *glServer) listen() (<-chan struct{}, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return nil, errors.New("server was stopped")
	}
	if g.ln != nil {
		return nil, errors.New("server is already listening")
	}
	if g.logf == nil {
		f, err := os.OpenFile(g.logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
		if err != nil {
			return nil, fmt.Errorf("opening server log: %w", err)
		}
		g.logf, g.log = f, log.New(f, "", log.LstdFlags|log.Lmicroseconds)
	}
	signers, err := g.h.signers()
	if err != nil {
		return nil, err
	}
	// Not port 0 when choosing: restarts reuse the port, which must not be
	// one an outgoing connection can take meanwhile (see freePort).
	var ln net.Listener
	addr, err := onFreePort(g.h.Addr, func(addr netip.AddrPort) error {
		var err error
		ln, err = net.Listen("tcp", addr.String())
		if errors.Is(err, syscall.EADDRINUSE) {
			err = fmt.Errorf("%w: %w", errAddrInUse, err)
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("listening on %s: %w", addr, err)
	}
	g.h.Addr = ln.Addr().(*net.TCPAddr).AddrPort()
	hostSigners := make([]gssh.Signer, len(signers))
	for i, s := range signers {
		g.log.Printf("listening on %s with host key %s %s", g.h.Addr, s.PublicKey().Type(), ssh.FingerprintSHA256(s.PublicKey()))
		hostSigners[i] = s
	}

	srv := &gssh.Server{
		HostSigners: hostSigners,
		Handler:     g.handleExec,
		// No pty: the initializer runs commands, not terminals.
		PtyCallback: func(gssh.Context, gssh.Pty) bool { return false },
		// HandleConn (unlike Serve) does not fill in defaults.
		ChannelHandlers:   map[string]gssh.ChannelHandler{"session": gssh.DefaultSessionHandler},
		RequestHandlers:   map[string]gssh.RequestHandler{},
		SubsystemHandlers: map[string]gssh.SubsystemHandler{"sftp": g.handleSFTP},
		ConnectionFailedCallback: func(conn net.Conn, err error) {
			g.log.Printf("connection from %s failed: %v", conn.RemoteAddr(), err)
		},
	}
	if g.h.password != "" {
		srv.PasswordHandler = g.checkPassword
	} else {
		srv.PublicKeyHandler = g.authorize
	}
	done := make(chan struct{})
	g.ln, g.acceptDone = ln, done
	go g.accept(ln, srv, done)
	return done, nil
}

// accept serves connections from ln until it is closed.
func (g *glServer) accept(ln net.Listener, srv *gssh.Server, done chan<- struct{}) {
	defer close(done)
	for {
		c, err := ln.Accept()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				g.mu.Lock()
				g.acceptErr = fmt.Errorf("accepting connections on %s: %w", ln.Addr(), err)
				g.mu.Unlock()
			}
			return
		}
		if !g.track(c) {
			_ = c.Close()
			continue
		}
		go func() {
			defer g.untrack(c)
			srv.HandleConn(c) // closes c when the connection ends
		}()
	}
}

// track records a new connection; it returns false once stop has begun.
func (g *glServer) track(c net.Conn) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return false
	}
	g.conns[c] = struct{}{}
	g.wg.Add(1)
	return true
}

func (g *glServer) untrack(c net.Conn) {
	g.mu.Lock()
	delete(g.conns, c)
	g.mu.Unlock()
	g.wg.Done()
}

// enter counts a session handler in g.wg; it returns false once stop has
// begun. gliderlabs starts handlers in goroutines of its own, which may run
// after their connection's goroutine has ended.
func (g *glServer) enter() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.closed {
		return false
	}
	g.wg.Add(1)
	return true
}

// closeListener stops accepting connections and waits for the accept loop.
func (g *glServer) closeListener() {
	g.mu.Lock()
	ln, done := g.ln, g.acceptDone
	g.ln, g.acceptDone = nil, nil
	g.mu.Unlock()
	if ln == nil {
		return
	}
	_ = ln.Close()
	<-done
}

// restart replaces the listener, keeping established connections.
func (g *glServer) restart(ctx context.Context) error {
	g.closeListener()
	return g.start(ctx)
}

// stop closes the listener and every connection, which ends their
// commands, and waits for all goroutines of the server.
func (g *glServer) stop() error {
	g.closeListener()
	g.mu.Lock()
	if g.closed {
		g.mu.Unlock()
		return nil
	}
	g.closed = true
	for c := range g.conns {
		_ = c.Close()
	}
	acceptErr := g.acceptErr
	g.mu.Unlock()

	idle := make(chan struct{})
	go func() {
		g.wg.Wait()
		close(idle)
	}()
	var waitErr error
	select {
	case <-idle:
	case <-time.After(stopTimeout):
		waitErr = fmt.Errorf("connection handlers still run %s after their connections were closed", stopTimeout)
	}
	var logErr error
	if g.logf != nil {
		logErr = g.logf.Close()
	}
	return errors.Join(acceptErr, waitErr, logErr)
}

// authorize accepts exactly the configured keys, for the user running the
// test (the only user whose commands this server can run).
func (g *glServer) authorize(ctx gssh.Context, key gssh.PublicKey) bool {
	if ctx.User() != g.h.User {
		g.log.Printf("refused user %q from %s: only %q may log in", ctx.User(), ctx.RemoteAddr(), g.h.User)
		return false
	}
	for _, k := range g.h.authorizedKeys {
		if gssh.KeysEqual(key, k) {
			g.log.Printf("accepted key %s for %s from %s", ssh.FingerprintSHA256(key), ctx.User(), ctx.RemoteAddr())
			return true
		}
	}
	g.log.Printf("refused key %s for %s from %s: not authorized", ssh.FingerprintSHA256(key), ctx.User(), ctx.RemoteAddr())
	return false
}

// checkPassword accepts exactly the configured password for the user
// running the test, and logs every attempt in sshd's words (see
// Host.PasswordAttempts). It never logs the password.
func (g *glServer) checkPassword(ctx gssh.Context, password string) bool {
	ok := ctx.User() == g.h.User && password == g.h.password
	verdict := "Failed"
	if ok {
		verdict = "Accepted"
	}
	g.log.Printf("%s password for %s from %s", verdict, ctx.User(), ctx.RemoteAddr())
	return ok
}

// handleExec runs a session's command and exits with its status.
func (g *glServer) handleExec(s gssh.Session) {
	if !g.enter() {
		return
	}
	defer g.wg.Done()
	code := g.run(s)
	g.log.Printf("command %q from %s exited with status %d", s.RawCommand(), s.RemoteAddr(), code)
	_ = s.Exit(code) // fails only when the connection is gone
}

// run runs the session's raw command with /bin/sh -c in Host.Dir and the
// test process's environment, and returns its exit status.
//
// Like sshd, the session lasts until the command has exited AND its stdout
// and stderr are closed, so a background process that keeps them open
// holds the session, and one that redirected them (a daemon) does not. The
// output pipes are made here, not by os/exec, because exec's Wait would
// also wait for stdin to reach EOF, which sshd does not do. When the
// connection ends, the command is killed and the session stops waiting.
func (g *glServer) run(s gssh.Session) int {
	if s.RawCommand() == "" {
		fmt.Fprintln(s.Stderr(), "sshtest: this server runs commands only; it has no interactive shell")
		return 1
	}
	ctx := s.Context()
	cmd := exec.CommandContext(ctx, "/bin/sh", "-c", s.RawCommand())
	cmd.Dir = g.h.Dir
	stdin, err := cmd.StdinPipe()
	if err != nil {
		fmt.Fprintf(s.Stderr(), "sshtest: making stdin pipe: %v\n", err)
		return 255
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		fmt.Fprintf(s.Stderr(), "sshtest: making stdout pipe: %v\n", err)
		return 255
	}
	defer outR.Close()
	errR, errW, err := os.Pipe()
	if err != nil {
		outW.Close()
		fmt.Fprintf(s.Stderr(), "sshtest: making stderr pipe: %v\n", err)
		return 255
	}
	defer errR.Close()
	cmd.Stdout, cmd.Stderr = outW, errW
	err = cmd.Start()
	outW.Close() // the command has its copies; ours would keep the pipes open
	errW.Close()
	if err != nil {
		fmt.Fprintf(s.Stderr(), "sshtest: starting /bin/sh: %v\n", err)
		return 127
	}

	// Stdin is copied until the client sends EOF or the session ends; the
	// copy does not hold the session open. It is counted in g.wg, which the
	// running handler keeps above zero, so the Add is safe.
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		_, _ = io.Copy(stdin, s)
		_ = stdin.Close()
	}()
	var copies sync.WaitGroup
	copies.Go(func() { _, _ = io.Copy(s, outR) })
	copies.Go(func() { _, _ = io.Copy(s.Stderr(), errR) })
	waitErr := cmd.Wait() // closes stdin, ending a copy blocked writing to it
	copied := make(chan struct{})
	go func() {
		copies.Wait()
		close(copied)
	}()
	select {
	case <-copied:
	case <-ctx.Done():
		// The client is gone: a background process holding stdout must not
		// keep this handler (and the test's leak check) waiting.
		_ = outR.Close()
		_ = errR.Close()
		<-copied
	}
	var ee *exec.ExitError
	switch {
	case waitErr == nil:
		return 0
	case errors.As(waitErr, &ee):
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			return 128 + int(ws.Signal())
		}
		return ee.ExitCode()
	default:
		fmt.Fprintf(s.Stderr(), "sshtest: waiting for /bin/sh: %v\n", waitErr)
		return 255
	}
}

// handleSFTP serves SFTP on the real filesystem, resolving relative paths
// against Host.Dir like commands' working directory.
func (g *glServer) handleSFTP(s gssh.Session) {
	if !g.enter() {
		return
	}
	defer g.wg.Done()
	g.log.Printf("sftp session from %s started", s.RemoteAddr())
	h := sftp.Handlers{FileGet: sftpFS{}, FilePut: sftpFS{}, FileCmd: sftpFS{}, FileList: sftpFS{}}
	srv := sftp.NewRequestServer(s, h, sftp.WithStartDirectory(g.h.Dir))
	if err := srv.Serve(); err != nil && !errors.Is(err, io.EOF) {
		g.log.Printf("sftp session from %s ended: %v", s.RemoteAddr(), err)
		return
	}
	g.log.Printf("sftp session from %s ended", s.RemoteAddr())
}
