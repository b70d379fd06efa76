package fakemetal

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc/test/bufconn"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

const testToken = "s3cret-token-do-not-log"

// fakeClock is a clock that moves only when told to.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newFakeClock() *fakeClock {
	return &fakeClock{t: time.Date(2026, 3, 4, 5, 6, 7, 0, time.UTC)}
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// env is a fake behind a real HTTP server, and a client for it.
type env struct {
	t    *testing.T
	fake *Server
	url  string
	hc   *http.Client
}

// newEnv starts a fake with cfg (Token defaults to testToken) behind an
// httptest.Server, closed when the test ends.
func newEnv(t *testing.T, cfg Config) *env {
	t.Helper()
	fake := newFake(t, cfg)
	ts := httptest.NewServer(fake)
	hc := ts.Client()
	t.Cleanup(ts.Close)
	t.Cleanup(hc.CloseIdleConnections)
	t.Cleanup(fake.Close) // first: releases held requests, so ts.Close need not wait
	return &env{t: t, fake: fake, url: ts.URL, hc: hc}
}

// newPipeEnv is newEnv over in-memory connections (grpc's bufconn, as
// the metal package's tests use), for tests that run in a
// testing/synctest bubble (call it inside the bubble): a socket would keep
// the bubble's clock from ever moving.
func newPipeEnv(t *testing.T, cfg Config) *env {
	t.Helper()
	fake := newFake(t, cfg)
	l := bufconn.Listen(1 << 16)
	srv := &http.Server{Handler: fake}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	hc := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) { return l.DialContext(ctx) },
	}}
	t.Cleanup(func() {
		fake.Close()
		hc.CloseIdleConnections()
		if err := srv.Close(); err != nil {
			t.Errorf("closing the server: %v", err)
		}
		if err := <-served; !errors.Is(err, http.ErrServerClosed) {
			t.Errorf("serving: %v", err)
		}
	})
	return &env{t: t, fake: fake, url: "http://fakemetal.invalid", hc: hc}
}

// newFake is the fake of newEnv and newPipeEnv: New(cfg), with Token
// defaulting to testToken.
func newFake(t *testing.T, cfg Config) *Server {
	t.Helper()
	if cfg.Token == "" {
		cfg.Token = testToken
	}
	fake, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return fake
}

type reply struct {
	status int
	header http.Header
	body   []byte
}

// do sends a request with the right token. path is below PathPrefix unless
// it starts with it. body is sent as is if it is a string, else as JSON.
func (e *env) do(method, path string, body any) reply {
	e.t.Helper()
	r, err := e.send(e.t.Context(), testToken, method, path, body)
	if err != nil {
		e.t.Fatalf("%s %s: %v", method, path, err)
	}
	return r
}

func (e *env) send(ctx context.Context, token, method, path string, body any) (reply, error) {
	e.t.Helper()
	if !strings.HasPrefix(path, PathPrefix) {
		path = PathPrefix + path
	}
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		rd = strings.NewReader(b)
	default:
		j, err := json.Marshal(b)
		if err != nil {
			e.t.Fatalf("encoding request body: %v", err)
		}
		rd = bytes.NewReader(j)
	}
	req, err := http.NewRequestWithContext(ctx, method, e.url+path, rd)
	if err != nil {
		e.t.Fatalf("building request: %v", err)
	}
	if token != "" {
		req.Header.Set("X-Auth-Token", token)
	}
	if rd != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := e.hc.Do(req)
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return reply{}, err
	}
	return reply{resp.StatusCode, resp.Header, b}, nil
}

// want fails the test unless the reply has status.
func (r reply) want(t *testing.T, status int) reply {
	t.Helper()
	if r.status != status {
		t.Fatalf("status %d, want %d; body %s", r.status, status, r.body)
	}
	return r
}

// wantError fails the test unless the reply is an error body with status
// whose message contains substr.
func (r reply) wantError(t *testing.T, status int, substr string) {
	t.Helper()
	r.want(t, status)
	var e errorsJSON
	if err := json.Unmarshal(r.body, &e); err != nil || len(e.Errors) == 0 {
		t.Fatalf("error body %s: not {\"errors\":[...]} (%v)", r.body, err)
	}
	if !strings.Contains(strings.Join(e.Errors, "; "), substr) {
		t.Fatalf("errors %q do not mention %q", e.Errors, substr)
	}
}

func decodeAs[T any](t *testing.T, r reply) T {
	t.Helper()
	var v T
	if err := json.Unmarshal(r.body, &v); err != nil {
		t.Fatalf("decoding %s: %v", r.body, err)
	}
	return v
}

// waitFor polls cond until it is true, and fails the test at the deadline.
func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), timeout)
	defer cancel()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("%s: still false after %s", what, timeout)
		case <-tick.C:
		}
	}
}

// createBody is a valid device creation on reservation res.
func createBody(hostname, res string) createDeviceJSON {
	return createDeviceJSON{
		Hostname: hostname, Plan: "c3.small.x86", OperatingSystem: "ubuntu_22_04",
		HardwareReservationID: res, Tags: []string{"shepherd"},
	}
}
