package install

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"go.uber.org/goleak"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// imageSize is the size of the test image: a few MiB, and not a multiple
// of the copy buffer.
const imageSize = 3<<20 + 12345

// testImage returns a random image and its lowercase hex SHA-256.
func testImage(t *testing.T) ([]byte, string) {
	t.Helper()
	var seed [32]byte
	binary.LittleEndian.PutUint64(seed[:], rand.Uint64())
	img := make([]byte, imageSize)
	_, _ = rand.NewChaCha8(seed).Read(img) // never fails
	sum := sha256.Sum256(img)
	return img, hex.EncodeToString(sum[:])
}

// server is an HTTP server for a test, counting the requests it receives.
type server struct {
	*httptest.Server
	requests atomic.Int64
}

// newServer starts a server running handler, closed when the test ends.
func newServer(t *testing.T, handler http.HandlerFunc) *server {
	t.Helper()
	s := &server{}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.requests.Add(1)
		handler(w, r)
	}))
	t.Cleanup(s.Close)
	return s
}

// serveImage returns a handler serving img with a Content-Length.
func serveImage(img []byte) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		http.ServeContent(w, r, "image.raw", time.Time{}, bytes.NewReader(img))
	}
}

// serveChunked returns a handler serving img in chunks of chunk bytes
// without a Content-Length, pausing for pause after each chunk.
func serveChunked(img []byte, chunk int, pause time.Duration) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		for len(img) > 0 {
			n := min(chunk, len(img))
			if _, err := w.Write(img[:n]); err != nil {
				return
			}
			w.(http.Flusher).Flush()
			img = img[n:]
			if pause > 0 && len(img) > 0 {
				time.Sleep(pause)
			}
		}
	}
}

// serveStalling returns a handler that sends the first part bytes of img
// (announcing all of it), signals on sent, and then blocks until the client
// goes away or the test ends.
func serveStalling(t *testing.T, img []byte, part int, sent chan<- struct{}) http.HandlerFunc {
	testDone := make(chan struct{})
	t.Cleanup(func() { close(testDone) }) // runs before the server's Close
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(img)))
		if _, err := w.Write(img[:part]); err != nil {
			return
		}
		w.(http.Flusher).Flush()
		if sent != nil {
			close(sent)
		}
		select {
		case <-r.Context().Done():
		case <-testDone:
		}
	}
}

// newConfig returns a Config staging images in a fresh directory, and
// checks, when the test ends, that no staging file was left behind. The
// config allows regular file targets under fileDirs, and nowhere else.
func newConfig(t *testing.T, fileDirs ...string) Config {
	t.Helper()
	dir := t.TempDir()
	// Registered after TempDir's cleanup, so it runs before the removal.
	t.Cleanup(func() { assertEmptyDir(t, dir) })
	return Config{WorkDir: dir, FileTargetDirs: fileDirs, Logger: testLogger(t)}
}

// allowing returns newConfig(t) allowing the directory of the file
// target: what the tests that install to files use.
func allowing(t *testing.T, target string) Config {
	t.Helper()
	return newConfig(t, filepath.Dir(target))
}

func assertEmptyDir(t *testing.T, dir string) {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		t.Errorf("staging directory %s not empty: %s left behind", dir, e.Name())
	}
}

// testLogger logs to the test's output.
func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
}

func request(url, sum, target string) *agentv1.OSInstallationRequest {
	return &agentv1.OSInstallationRequest{
		Generation:   7,
		ImageUrl:     url,
		ImageSha256:  sum,
		TargetDevice: target,
	}
}

// snapshot is a target file's content and modification time.
type snapshot struct {
	exists  bool
	content []byte
	mtime   time.Time
}

// existingTarget creates a target file holding content, with an old
// modification time so that any write would change it.
func existingTarget(t *testing.T, content []byte) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "disk")
	if err := os.WriteFile(path, content, 0o600); err != nil {
		t.Fatal(err)
	}
	old := time.Date(2001, 2, 3, 4, 5, 6, 0, time.UTC)
	if err := os.Chtimes(path, old, old); err != nil {
		t.Fatal(err)
	}
	return path
}

func takeSnapshot(t *testing.T, path string) snapshot {
	t.Helper()
	fi, err := os.Stat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return snapshot{}
	}
	if err != nil {
		t.Fatal(err)
	}
	content, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return snapshot{exists: true, content: content, mtime: fi.ModTime()}
}

func assertUntouched(t *testing.T, path string, before snapshot) {
	t.Helper()
	after := takeSnapshot(t, path)
	if after.exists != before.exists {
		t.Fatalf("target %s: exists changed from %v to %v", path, before.exists, after.exists)
	}
	if !bytes.Equal(after.content, before.content) {
		t.Errorf("target %s content changed (%d bytes before, %d after)", path, len(before.content), len(after.content))
	}
	if !after.mtime.Equal(before.mtime) {
		t.Errorf("target %s mtime changed from %s to %s", path, before.mtime, after.mtime)
	}
}

func assertSuccess(t *testing.T, report *agentv1.OSInstallationReport, generation int64) {
	t.Helper()
	if report.GetGeneration() != generation {
		t.Errorf("report generation = %d, want %d", report.GetGeneration(), generation)
	}
	if report.GetSuccess() == nil {
		t.Fatalf("report is not a success: %v", report)
	}
}

// assertError checks that report is an error report for generation whose
// message contains each of wants, and returns the message.
func assertError(t *testing.T, report *agentv1.OSInstallationReport, generation int64, wants ...string) string {
	t.Helper()
	if report.GetGeneration() != generation {
		t.Errorf("report generation = %d, want %d", report.GetGeneration(), generation)
	}
	if report.GetError() == nil {
		t.Fatalf("report is not an error: %v", report)
	}
	msg := report.GetError().GetMessage()
	for _, want := range wants {
		if !strings.Contains(msg, want) {
			t.Errorf("error message %q does not mention %q", msg, want)
		}
	}
	return msg
}

func assertContent(t *testing.T, path string, want []byte) {
	t.Helper()
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("target %s holds %d bytes that differ from the %d-byte image", path, len(got), len(want))
	}
}

func TestInstallWritesImageToNewTarget(t *testing.T) {
	img, sum := testImage(t)
	srv := newServer(t, serveImage(img))
	target := filepath.Join(t.TempDir(), "disk")

	report := Install(t.Context(), allowing(t, target), request(srv.URL+"/image.raw", sum, target))
	assertSuccess(t, report, 7)
	assertContent(t, target, img)
	if got := srv.requests.Load(); got != 1 {
		t.Errorf("server got %d requests, want 1", got)
	}
}

func TestInstallTruncatesLargerTargetFile(t *testing.T) {
	img, sum := testImage(t)
	srv := newServer(t, serveImage(img))
	target := existingTarget(t, bytes.Repeat([]byte{0xff}, len(img)+1<<20))

	report := Install(t.Context(), allowing(t, target), request(srv.URL, sum, target))
	assertSuccess(t, report, 7)
	assertContent(t, target, img)
}

func TestInstallAcceptsUpperCaseDigest(t *testing.T) {
	img, sum := testImage(t)
	srv := newServer(t, serveImage(img))
	target := existingTarget(t, []byte("old"))

	report := Install(t.Context(), allowing(t, target), request(srv.URL, strings.ToUpper(sum), target))
	assertSuccess(t, report, 7)
	assertContent(t, target, img)
}

func TestInstallWithoutContentLength(t *testing.T) {
	img, sum := testImage(t)
	srv := newServer(t, serveChunked(img, 100_000, 0))
	target := existingTarget(t, nil)

	report := Install(t.Context(), allowing(t, target), request(srv.URL, sum, target))
	assertSuccess(t, report, 7)
	assertContent(t, target, img)
}

func TestInstallUsesConfiguredHTTPClient(t *testing.T) {
	img, sum := testImage(t)
	srv := httptest.NewTLSServer(serveImage(img))
	t.Cleanup(srv.Close)
	target := existingTarget(t, nil)

	cfg := allowing(t, target)
	cfg.HTTPClient = srv.Client() // trusts the server's certificate
	report := Install(t.Context(), cfg, request(srv.URL, sum, target))
	assertSuccess(t, report, 7)
	assertContent(t, target, img)
}

// TestInstallSlowDownload checks that a download trickling in small chunks
// succeeds as long as each chunk arrives within the stall timeout, however
// long the whole download takes.
func TestInstallSlowDownload(t *testing.T) {
	img, sum := testImage(t)
	srv := newServer(t, serveChunked(img, 128<<10, 10*time.Millisecond))
	target := existingTarget(t, []byte("old"))

	cfg := allowing(t, target)
	cfg.StallTimeout = 2 * time.Second
	report := Install(t.Context(), cfg, request(srv.URL, sum, target))
	assertSuccess(t, report, 7)
	assertContent(t, target, img)
}

func TestInstallChecksumMismatchLeavesTargetUntouched(t *testing.T) {
	img, _ := testImage(t)
	srv := newServer(t, serveImage(img))
	target := existingTarget(t, []byte("the old operating system"))
	before := takeSnapshot(t, target)
	wrong := strings.Repeat("ab", 32)

	report := Install(t.Context(), allowing(t, target), request(srv.URL, wrong, target))
	msg := assertError(t, report, 7, "checksum mismatch", "want "+wrong)
	sum := sha256.Sum256(img)
	if !strings.Contains(msg, "got "+hex.EncodeToString(sum[:])) {
		t.Errorf("error message %q does not name the image's actual digest", msg)
	}
	assertUntouched(t, target, before)
}

func TestInstallChecksumMismatchDoesNotCreateTarget(t *testing.T) {
	img, _ := testImage(t)
	srv := newServer(t, serveImage(img))
	target := filepath.Join(t.TempDir(), "disk")

	report := Install(t.Context(), allowing(t, target), request(srv.URL, strings.Repeat("0", 64), target))
	assertError(t, report, 7, "checksum")
	assertUntouched(t, target, snapshot{})
}

func TestInstallHTTPErrorStatus(t *testing.T) {
	_, sum := testImage(t)
	srv := newServer(t, http.NotFound)
	target := existingTarget(t, []byte("old"))
	before := takeSnapshot(t, target)

	report := Install(t.Context(), allowing(t, target), request(srv.URL+"/missing.raw", sum, target))
	assertError(t, report, 7, "404", "downloading")
	assertUntouched(t, target, before)
}

func TestInstallRejectsMalformedRequests(t *testing.T) {
	img, sum := testImage(t)
	srv := newServer(t, serveImage(img))
	target := existingTarget(t, []byte("old"))
	before := takeSnapshot(t, target)

	tests := []struct {
		name   string
		modify func(*agentv1.OSInstallationRequest)
		want   string
	}{
		{"ftp URL", func(r *agentv1.OSInstallationRequest) {
			r.ImageUrl = "ftp" + strings.TrimPrefix(srv.URL, "http")
		}, "http or https"},
		{"URL without scheme", func(r *agentv1.OSInstallationRequest) {
			r.ImageUrl = strings.TrimPrefix(srv.URL, "http://")
		}, "image_url"},
		{"URL without host", func(r *agentv1.OSInstallationRequest) { r.ImageUrl = "http:///image.raw" }, "no host"},
		{"unparsable URL", func(r *agentv1.OSInstallationRequest) { r.ImageUrl = "http://a b/%zz" }, "image_url"},
		{"empty URL", func(r *agentv1.OSInstallationRequest) { r.ImageUrl = "" }, "image_url"},
		{"short digest", func(r *agentv1.OSInstallationRequest) { r.ImageSha256 = sum[:63] }, "image_sha256 must be 64 hexadecimal characters, got 63 characters"},
		{"long digest", func(r *agentv1.OSInstallationRequest) { r.ImageSha256 = sum + "0" }, "image_sha256 must be 64 hexadecimal characters, got 65 characters"},
		{"non-hex digest", func(r *agentv1.OSInstallationRequest) { r.ImageSha256 = "zz" + sum[2:] }, "image_sha256"},
		{"empty digest", func(r *agentv1.OSInstallationRequest) { r.ImageSha256 = "" }, "image_sha256"},
		{"relative target", func(r *agentv1.OSInstallationRequest) { r.TargetDevice = "dev/sda" }, "target_device"},
		{"empty target", func(r *agentv1.OSInstallationRequest) { r.TargetDevice = "" }, "target_device"},
		{"generation 0", func(r *agentv1.OSInstallationRequest) { r.Generation = 0 }, "generation"},
		{"negative generation", func(r *agentv1.OSInstallationRequest) { r.Generation = -3 }, "generation"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req := request(srv.URL, sum, target)
			tt.modify(req)
			report := Install(t.Context(), allowing(t, target), req)
			assertError(t, report, req.Generation, "invalid installation request", tt.want)
			if got := srv.requests.Load(); got != 0 {
				t.Fatalf("server got %d requests, want none", got)
			}
			assertUntouched(t, target, before)
		})
	}
}

func TestInstallNilRequest(t *testing.T) {
	report := Install(t.Context(), newConfig(t), nil)
	assertError(t, report, 0, "no request")
}

func TestInstallRejectsInvalidConfig(t *testing.T) {
	img, sum := testImage(t)
	srv := newServer(t, serveImage(img))
	target := existingTarget(t, []byte("old"))
	before := takeSnapshot(t, target)

	tests := []struct {
		name string
		cfg  Config
	}{
		{"negative MaxImageBytes", Config{MaxImageBytes: -1}},
		{"negative StallTimeout", Config{StallTimeout: -time.Second}},
		{"missing WorkDir", Config{WorkDir: filepath.Join(t.TempDir(), "missing")}},
		{"WorkDir is a file", Config{WorkDir: target}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := tt.cfg.Validate(); err == nil {
				t.Fatal("Validate() = nil, want an error")
			}
			report := Install(t.Context(), tt.cfg, request(srv.URL, sum, target))
			assertError(t, report, 7, "configuration")
			if got := srv.requests.Load(); got != 0 {
				t.Fatalf("server got %d requests, want none", got)
			}
			assertUntouched(t, target, before)
		})
	}
}

func TestConfigValidateAcceptsZeroValue(t *testing.T) {
	if err := (Config{}).Validate(); err != nil {
		t.Fatalf("Config{}.Validate() = %v", err)
	}
}

func TestInstallImageTooLarge(t *testing.T) {
	img, sum := testImage(t)
	for _, tt := range []struct {
		name    string
		handler http.HandlerFunc
	}{
		{"with Content-Length", serveImage(img)},
		{"without Content-Length", serveChunked(img, 64<<10, 0)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			srv := newServer(t, tt.handler)
			target := existingTarget(t, []byte("old"))
			before := takeSnapshot(t, target)

			cfg := allowing(t, target)
			cfg.MaxImageBytes = int64(len(img)) - 1
			report := Install(t.Context(), cfg, request(srv.URL, sum, target))
			assertError(t, report, 7, "larger than the limit of "+strconv.Itoa(len(img)-1))
			assertUntouched(t, target, before)
		})
	}
}

func TestInstallImageExactlyAtLimit(t *testing.T) {
	img, sum := testImage(t)
	for _, tt := range []struct {
		name    string
		handler http.HandlerFunc
	}{
		{"with Content-Length", serveImage(img)},
		{"without Content-Length", serveChunked(img, 64<<10, 0)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			srv := newServer(t, tt.handler)
			target := existingTarget(t, nil)

			cfg := allowing(t, target)
			cfg.MaxImageBytes = int64(len(img))
			assertSuccess(t, Install(t.Context(), cfg, request(srv.URL, sum, target)), 7)
			assertContent(t, target, img)
		})
	}
}

// TestInstallHTTPStatusRange: every 2xx status is a success (a proxy may
// answer 203), and anything else fails naming the status.
func TestInstallHTTPStatusRange(t *testing.T) {
	img, sum := testImage(t)
	for _, tt := range []struct {
		status int
		want   string // "" means success
	}{
		{200, ""}, // a final 1xx status cannot be sent: net/http takes it for an informational one
		{203, ""},
		{299, ""},
		{300, "server responded 300"},
	} {
		t.Run(strconv.Itoa(tt.status), func(t *testing.T) {
			srv := newServer(t, func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Length", strconv.Itoa(len(img)))
				w.WriteHeader(tt.status)
				_, _ = w.Write(img)
			})
			target := existingTarget(t, []byte("old"))
			before := takeSnapshot(t, target)

			report := Install(t.Context(), allowing(t, target), request(srv.URL, sum, target))
			if tt.want == "" {
				assertSuccess(t, report, 7)
				assertContent(t, target, img)
				return
			}
			assertError(t, report, 7, "downloading", tt.want)
			assertUntouched(t, target, before)
		})
	}
}

func TestInstallEmptyImage(t *testing.T) {
	srv := newServer(t, serveImage(nil))
	target := existingTarget(t, []byte("old"))
	before := takeSnapshot(t, target)
	sum := sha256.Sum256(nil)

	report := Install(t.Context(), allowing(t, target), request(srv.URL, hex.EncodeToString(sum[:]), target))
	assertError(t, report, 7, "empty")
	assertUntouched(t, target, before)
}

func TestInstallStalledDownload(t *testing.T) {
	img, sum := testImage(t)
	srv := newServer(t, serveStalling(t, img, 256<<10, nil))
	target := existingTarget(t, []byte("old"))
	before := takeSnapshot(t, target)

	cfg := allowing(t, target)
	cfg.StallTimeout = 200 * time.Millisecond
	start := time.Now()
	report := Install(t.Context(), cfg, request(srv.URL, sum, target))
	elapsed := time.Since(start)
	assertError(t, report, 7, "stalled", "200ms")
	if elapsed > 3*time.Second {
		t.Errorf("Install took %s to notice a stall of 200ms", elapsed)
	}
	assertUntouched(t, target, before)
}

func TestInstallStalledBeforeHeaders(t *testing.T) {
	_, sum := testImage(t)
	testDone := make(chan struct{})
	srv := newServer(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-testDone:
		}
	})
	t.Cleanup(func() { close(testDone) })
	target := existingTarget(t, []byte("old"))
	before := takeSnapshot(t, target)

	cfg := allowing(t, target)
	cfg.StallTimeout = 200 * time.Millisecond
	report := Install(t.Context(), cfg, request(srv.URL, sum, target))
	assertError(t, report, 7, "stalled", "waiting for the response")
	assertUntouched(t, target, before)
}

func TestInstallCancelledMidDownload(t *testing.T) {
	img, sum := testImage(t)
	sent := make(chan struct{})
	srv := newServer(t, serveStalling(t, img, 256<<10, sent))
	target := existingTarget(t, []byte("old"))
	before := takeSnapshot(t, target)

	cfg := allowing(t, target)
	cfg.StallTimeout = time.Hour // only the cancellation can end it
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	done := make(chan *agentv1.OSInstallationReport, 1)
	go func() { done <- Install(ctx, cfg, request(srv.URL, sum, target)) }()

	select {
	case <-sent:
	case <-time.After(10 * time.Second):
		t.Fatal("server never sent the first part of the image")
	}
	cancel()
	var report *agentv1.OSInstallationReport
	select {
	case report = <-done:
	case <-time.After(3 * time.Second):
		t.Fatal("Install did not return within 3s of the cancellation")
	}
	assertError(t, report, 7, "cancelled", "context canceled")
	assertUntouched(t, target, before)
}

func TestInstallAlreadyCancelled(t *testing.T) {
	img, sum := testImage(t)
	srv := newServer(t, serveImage(img))
	target := existingTarget(t, []byte("old"))
	before := takeSnapshot(t, target)

	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	report := Install(ctx, allowing(t, target), request(srv.URL, sum, target))
	assertError(t, report, 7, "cancelled")
	if got := srv.requests.Load(); got != 0 {
		t.Errorf("server got %d requests, want none", got)
	}
	assertUntouched(t, target, before)
}

func TestInstallRemovesStagingFile(t *testing.T) {
	img, sum := testImage(t)
	srv := newServer(t, serveImage(img))
	target := existingTarget(t, nil)

	for _, tt := range []struct {
		name    string
		sum     string
		success bool
	}{
		{"success", sum, true},
		{"failure", strings.Repeat("0", 64), false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			cfg := Config{WorkDir: dir, FileTargetDirs: []string{filepath.Dir(target)}, Logger: testLogger(t)}
			report := Install(t.Context(), cfg, request(srv.URL, tt.sum, target))
			if got := report.GetSuccess() != nil; got != tt.success {
				t.Fatalf("success = %v, want %v: %v", got, tt.success, report)
			}
			assertEmptyDir(t, dir)
		})
	}
}

// TestInstallConcurrent runs installations to different targets at once,
// which the agent does not do but which must not interfere (no shared
// state).
func TestInstallConcurrent(t *testing.T) {
	img, sum := testImage(t)
	srv := newServer(t, serveImage(img))
	const n = 4
	targets := make([]string, n)
	for i := range targets {
		targets[i] = filepath.Join(t.TempDir(), "disk")
	}
	cfg := newConfig(t)
	for _, target := range targets {
		cfg.FileTargetDirs = append(cfg.FileTargetDirs, filepath.Dir(target))
	}
	reports := make(chan *agentv1.OSInstallationReport, n)
	for i := range targets {
		go func() { reports <- Install(t.Context(), cfg, request(srv.URL, sum, targets[i])) }()
	}
	for range n {
		assertSuccess(t, <-reports, 7)
	}
	for _, target := range targets {
		assertContent(t, target, img)
	}
}

// TestVerifyTarget checks the read-back verification directly, as a
// regular file cannot be made to lose writes.
func TestVerifyTarget(t *testing.T) {
	img, sum := testImage(t)
	dir := t.TempDir()
	write := func(name string, content []byte) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, content, 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	corrupted := bytes.Clone(img)
	corrupted[len(corrupted)/2] ^= 1

	tests := []struct {
		name   string
		path   string
		errMsg string // "" means success
	}{
		{"exact", write("exact", img), ""},
		{"longer device", write("longer", append(bytes.Clone(img), 1, 2, 3)), ""},
		{"short write", write("short", img[:len(img)-1]), "read back only"},
		{"corrupted", write("corrupted", corrupted), "checksum mismatch"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f, err := os.Open(tt.path)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			err = verifyTarget(t.Context(), f, tt.path, int64(len(img)), sum)
			switch {
			case tt.errMsg == "" && err != nil:
				t.Fatalf("verifyTarget() = %v, want nil", err)
			case tt.errMsg != "" && err == nil:
				t.Fatalf("verifyTarget() = nil, want an error mentioning %q", tt.errMsg)
			case tt.errMsg != "" && !strings.Contains(err.Error(), tt.errMsg):
				t.Fatalf("verifyTarget() = %v, want an error mentioning %q", err, tt.errMsg)
			case err != nil && !strings.HasPrefix(err.Error(), "verifying "+tt.path):
				t.Errorf("verifyTarget() = %v, want it to start with %q", err, "verifying "+tt.path)
			}
		})
	}
}

// TestCheckStaged checks the re-read of the staging file that guards the
// target against a staging directory that does not give back what was
// written to it.
func TestCheckStaged(t *testing.T) {
	img, sum := testImage(t)
	dir := t.TempDir()
	corrupted := bytes.Clone(img)
	corrupted[0] ^= 0x80
	tests := []struct {
		name    string
		content []byte
		errMsg  string // "" means success
	}{
		{"intact", img, ""},
		{"truncated", img[:len(img)/2], "holds only"},
		{"corrupted", corrupted, "does not hold the downloaded image: checksum mismatch"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f, err := os.CreateTemp(dir, "staged-*")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { f.Close() })
			if _, err := f.Write(tt.content); err != nil {
				t.Fatal(err)
			}
			// checkStaged must rewind by itself.
			err = checkStaged(t.Context(), f, int64(len(img)), sum)
			switch {
			case tt.errMsg == "" && err != nil:
				t.Fatalf("checkStaged() = %v, want nil", err)
			case tt.errMsg != "" && (err == nil || !strings.Contains(err.Error(), tt.errMsg)):
				t.Fatalf("checkStaged() = %v, want an error mentioning %q", err, tt.errMsg)
			}
		})
	}
}

// TestInstallErrorIsSendable: an error message quotes what others wrote (here
// an image server's status line: invalid UTF-8, and long). The report must
// still be encodable as protobuf, which refuses invalid UTF-8 in strings (the
// agent could never send it, and would retry it forever), and bounded, cut on
// a character boundary.
func TestInstallErrorIsSendable(t *testing.T) {
	_, sum := testImage(t)
	reason := "bad \xff\xfe gateway " + strings.Repeat("é", 5000) // 10 KB; é is 2 bytes
	srv := newServer(t, func(w http.ResponseWriter, r *http.Request) {
		conn, buf, err := w.(http.Hijacker).Hijack()
		if err != nil {
			t.Error(err)
			return
		}
		defer conn.Close()
		fmt.Fprintf(buf, "HTTP/1.1 502 %s\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", reason)
		buf.Flush()
	})
	target := existingTarget(t, []byte("old"))

	report := Install(t.Context(), allowing(t, target), request(srv.URL+"/image.raw", sum, target))
	msg := report.GetError().GetMessage()
	if !strings.Contains(msg, "502") {
		t.Fatalf("report %v, want an error naming the status 502", report)
	}
	if !utf8.ValidString(msg) {
		t.Errorf("error message is not valid UTF-8: %q", msg[:min(len(msg), 80)])
	}
	if len(msg) > MaxErrorBytes {
		t.Errorf("error message has %d bytes, want at most %d", len(msg), MaxErrorBytes)
	}
	if _, err := proto.Marshal(report); err != nil {
		t.Errorf("the report cannot be encoded: %v", err)
	}
}

// TestInstallStagesInWorkDir checks that the image is staged in
// Config.WorkDir, which the operator chose for its room, while it
// downloads.
func TestInstallStagesInWorkDir(t *testing.T) {
	img, sum := testImage(t)
	target := existingTarget(t, nil)
	cfg := allowing(t, target)
	var staged atomic.Int64
	srv := newServer(t, func(w http.ResponseWriter, r *http.Request) {
		matches, err := filepath.Glob(filepath.Join(cfg.WorkDir, "shepherd-image-*"))
		if err != nil {
			t.Error(err)
		}
		staged.Store(int64(len(matches)))
		serveImage(img)(w, r)
	})

	assertSuccess(t, Install(t.Context(), cfg, request(srv.URL, sum, target)), 7)
	if got := staged.Load(); got != 1 {
		t.Errorf("during the download WorkDir %s held %d staging files, want 1", cfg.WorkDir, got)
	}
}

// TestInstallLogsNoWarningOnSuccess: a successful installation leaves no
// warning in the agent's log, where an operator would look for trouble.
func TestInstallLogsNoWarningOnSuccess(t *testing.T) {
	img, sum := testImage(t)
	srv := newServer(t, serveImage(img))
	target := existingTarget(t, nil)
	cfg := allowing(t, target)
	var logs bytes.Buffer // written only by Install, which returns before it is read
	cfg.Logger = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))

	assertSuccess(t, Install(t.Context(), cfg, request(srv.URL, sum, target)), 7)
	if strings.Contains(logs.String(), "level=WARN") || strings.Contains(logs.String(), "level=ERROR") {
		t.Errorf("a successful installation logged trouble:\n%s", logs.String())
	}
	if !strings.Contains(logs.String(), "installation succeeded") {
		t.Errorf("the log does not say the installation succeeded:\n%s", logs.String())
	}
}

// TestInstallRefusesTargetChangedDuringDownload: the file written must be
// the one checked. A target replaced while the image downloads (or created
// by someone else, where there was none) is not written, and the error
// says so.
func TestInstallRefusesTargetChangedDuringDownload(t *testing.T) {
	img, sum := testImage(t)
	for _, tt := range []struct {
		name   string
		before []byte // nil: no target before the installation
		want   string
	}{
		{"replaced", []byte("the checked file"), "it changed since it was checked"},
		{"created", nil, "file exists"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			target := filepath.Join(t.TempDir(), "disk")
			if tt.before != nil {
				target = existingTarget(t, tt.before)
			}
			intruder := []byte("another file")
			srv := newServer(t, func(w http.ResponseWriter, r *http.Request) {
				tmp := target + ".new"
				if err := os.WriteFile(tmp, intruder, 0o600); err != nil {
					t.Error(err)
				}
				if err := os.Rename(tmp, target); err != nil {
					t.Error(err)
				}
				serveImage(img)(w, r)
			})

			report := Install(t.Context(), allowing(t, target), request(srv.URL, sum, target))
			assertError(t, report, 7, "writing image to "+target, tt.want)
			assertContent(t, target, intruder)
		})
	}
}

// panicTransport is an http.RoundTripper that panics.
type panicTransport struct{}

func (panicTransport) RoundTrip(*http.Request) (*http.Response, error) { panic("transport broke") }

// TestInstallReportsPanic: Install never panics; a panic while installing
// becomes an error report for the request's generation, which the agent
// can send like any other.
func TestInstallReportsPanic(t *testing.T) {
	_, sum := testImage(t)
	target := existingTarget(t, []byte("old"))
	before := takeSnapshot(t, target)
	cfg := allowing(t, target)
	cfg.HTTPClient = &http.Client{Transport: panicTransport{}}

	report := Install(t.Context(), cfg, request("http://images.example/os.img", sum, target))
	assertError(t, report, 7, "internal error: transport broke")
	assertUntouched(t, target, before)
}

// TestInstallDefaultWorkDir: without Config.WorkDir the image is staged in
// the system's temporary directory ($TMPDIR), and removed afterwards.
func TestInstallDefaultWorkDir(t *testing.T) {
	img, sum := testImage(t)
	tmp := t.TempDir()
	t.Setenv("TMPDIR", tmp)
	target := existingTarget(t, nil)
	var staged atomic.Int64
	srv := newServer(t, func(w http.ResponseWriter, r *http.Request) {
		matches, err := filepath.Glob(filepath.Join(tmp, "shepherd-image-*"))
		if err != nil {
			t.Error(err)
		}
		staged.Store(int64(len(matches)))
		serveImage(img)(w, r)
	})

	cfg := Config{FileTargetDirs: []string{filepath.Dir(target)}, Logger: testLogger(t)}
	assertSuccess(t, Install(t.Context(), cfg, request(srv.URL, sum, target)), 7)
	if got := staged.Load(); got != 1 {
		t.Errorf("during the download $TMPDIR held %d staging files, want 1", got)
	}
	assertEmptyDir(t, tmp)
}

// TestInstallStagingCorrupted: a staging directory that does not give back
// what was written to it (a failing disk; here the staged file is changed
// behind the download's back) must not get a corrupted image onto the
// target, though the bytes received had the right digest.
func TestInstallStagingCorrupted(t *testing.T) {
	img, sum := testImage(t)
	target := existingTarget(t, []byte("old"))
	before := takeSnapshot(t, target)
	cfg := allowing(t, target)
	half := len(img) / 2
	srv := newServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(img)))
		if _, err := w.Write(img[:half]); err != nil {
			return
		}
		w.(http.Flusher).Flush()
		// Once the first half is staged, change its first byte.
		ctx, cancel := context.WithTimeout(r.Context(), 30*time.Second)
		defer cancel()
		for {
			matches, _ := filepath.Glob(filepath.Join(cfg.WorkDir, "shepherd-image-*"))
			if len(matches) == 1 {
				if fi, err := os.Stat(matches[0]); err == nil && fi.Size() >= int64(half) {
					f, err := os.OpenFile(matches[0], os.O_WRONLY, 0)
					if err != nil {
						t.Error(err)
						return
					}
					_, err = f.WriteAt([]byte{img[0] ^ 0xff}, 0)
					f.Close()
					if err != nil {
						t.Error(err)
						return
					}
					break
				}
			}
			select {
			case <-ctx.Done():
				t.Error("the first half of the image was never staged")
				return
			case <-time.After(5 * time.Millisecond):
			}
		}
		_, _ = w.Write(img[half:])
	})

	report := Install(t.Context(), cfg, request(srv.URL, sum, target))
	assertError(t, report, 7, "staging file", "does not hold the downloaded image: checksum mismatch")
	assertUntouched(t, target, before)
}

// TestInstallDownloadCutShort: an image server that cuts the download
// short fails the installation with an error naming the URL and how far it
// got, and the target is untouched.
func TestInstallDownloadCutShort(t *testing.T) {
	img, sum := testImage(t)
	cut := newServer(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(img)))
		_, _ = w.Write(img[:1000])
		w.(http.Flusher).Flush()
		conn, _, err := w.(http.Hijacker).Hijack()
		if err != nil {
			t.Error(err)
			return
		}
		conn.Close()
	})
	target := existingTarget(t, []byte("old"))
	before := takeSnapshot(t, target)
	report := Install(t.Context(), allowing(t, target), request(cut.URL, sum, target))
	assertError(t, report, 7, "downloading "+cut.URL+": reading the body after 1000 bytes: unexpected EOF")
	assertUntouched(t, target, before)
}

func TestCheckRequestNil(t *testing.T) {
	if err := CheckRequest(nil, RequestOptions{}); err == nil || err.Error() != "no request" {
		t.Errorf("CheckRequest(nil) = %v, want %q", err, "no request")
	}
}
