// Package install carries out OS installation requests on the machine the
// agent runs on.
//
// An installation (SPEC §4.3) checks the target, downloads a raw disk image
// over http or https, verifies its SHA-256, writes it to the target device,
// fsyncs the device, reads the written bytes back to verify them again, and
// reports success or the error to the server. The image is staged in a
// temporary file while it downloads so that the target device is only ever
// written once the whole image is known to be the one the server asked for:
// a failed or corrupted download leaves the machine's disk untouched.
//
// # Targets
//
// The target is checked before anything is downloaded, and an installation
// to a target that fails the check reports an error naming the target and
// the reason, having downloaded, created and written nothing. A mistyped
// device name (/dev/sdbb) must not become a regular file in /dev that is
// reported installed, and an operator of many machines wants the typo back
// in seconds, not after a multi-gigabyte download. The target, with
// symlinks such as /dev/disk/by-id/... resolved, must be:
//
//   - an existing block device. The agent never creates a target. The
//     device must not be mounted, nor any of its partitions (read from
//     /proc/self/mountinfo, so the error can say where: typically the
//     running system's root file system). It is then opened exclusively
//     (O_EXCL), which the kernel refuses while it has the device in use in
//     any way the mount table does not show (swap, LVM, RAID, device
//     mapper, btrfs, another program's exclusive open), and held so until
//     the installation ends. An installation therefore cannot overwrite
//     the disk the agent's own system runs from: writing a live file
//     system's disk yields an image the running kernel keeps writing into
//     (journal, logs), a machine that may boot a silently corrupted system.
//     Install from a system that runs from memory (a rescue or netboot
//     image) instead. An image larger than the device is refused before
//     anything is written, rather than leaving the disk half overwritten.
//   - or a regular file under one of Config.FileTargetDirs (the agent's
//     --allow-file-target-dir), created there if missing; for tests. There
//     is no such directory by default, so a production agent writes block
//     devices only.
//
// Anything else (a missing path, a directory, a character device such as
// /dev/null, a dangling symlink) is refused. CheckRequest applies the part
// of these rules that needs no access to the machine on the operator's
// side: a target must be a path under /dev unless file targets were asked
// for explicitly.
//
// Rebooting after a successful installation (OSInstallationRequest.reboot_after)
// is not done here: the agent reboots only once the success report was
// delivered to the server.
package install

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"

	"github.com/shepherd/shepherd/internal/safetext"
)

// Defaults for the zero values of Config's fields.
const (
	// DefaultMaxImageBytes is the largest image accepted when
	// Config.MaxImageBytes is 0: 64 GiB.
	DefaultMaxImageBytes int64 = 64 << 30
	// DefaultStallTimeout is how long a download may make no progress when
	// Config.StallTimeout is 0.
	DefaultStallTimeout = 2 * time.Minute
	// defaultConnectTimeout bounds establishing the TCP connection of the
	// default HTTP client (and its TLS handshake).
	defaultConnectTimeout = 10 * time.Second
)

// copyBufferSize is the size of the buffers used to stream the image.
const copyBufferSize = 1 << 20

// errStalled is the cancellation cause of a download that made no progress
// for Config.StallTimeout.
var errStalled = errors.New("download stalled")

// Config says how installations run. Zero values mean defaults.
type Config struct {
	// HTTPClient downloads images. nil means a client with a 10s connect
	// timeout and no overall timeout (images are large; StallTimeout catches
	// dead downloads instead), honouring proxies from the environment
	// (HTTP_PROXY, HTTPS_PROXY, NO_PROXY).
	HTTPClient *http.Client
	// WorkDir is where the image is staged while it downloads; it must have
	// room for the whole image. "" means os.TempDir().
	WorkDir string
	// MaxImageBytes makes Install refuse images larger than this many bytes.
	// 0 means DefaultMaxImageBytes.
	MaxImageBytes int64
	// StallTimeout makes a download fail when it makes no progress for this
	// long (waiting for the response headers or for any read of the body).
	// 0 means DefaultStallTimeout.
	StallTimeout time.Duration
	// FileTargetDirs are the directories under which a target may be a
	// regular file (created if missing) rather than a block device: for
	// tests, never needed in production. Each must be an absolute path to
	// an existing directory other than / and outside /dev, where a file
	// would be a mistyped device. Empty (the default) means block devices
	// only.
	FileTargetDirs []string
	// Logger receives progress and errors. nil discards them.
	Logger *slog.Logger
}

// Validate reports whether c is usable: no field may be negative, WorkDir,
// when set, must be an existing directory, and FileTargetDirs must be as
// their comment says.
func (c Config) Validate() error {
	var errs []error
	if c.MaxImageBytes < 0 {
		errs = append(errs, fmt.Errorf("MaxImageBytes must not be negative, got %d", c.MaxImageBytes))
	}
	if c.StallTimeout < 0 {
		errs = append(errs, fmt.Errorf("StallTimeout must not be negative, got %s", c.StallTimeout))
	}
	if c.WorkDir != "" {
		fi, err := os.Stat(c.WorkDir)
		switch {
		case err != nil:
			errs = append(errs, fmt.Errorf("WorkDir: %w", err))
		case !fi.IsDir():
			errs = append(errs, fmt.Errorf("WorkDir %s is not a directory", c.WorkDir))
		}
	}
	for _, dir := range c.FileTargetDirs {
		if err := checkFileTargetDir(dir); err != nil {
			errs = append(errs, fmt.Errorf("FileTargetDirs: %w", err))
		}
	}
	return errors.Join(errs...)
}

// checkFileTargetDir checks one entry of Config.FileTargetDirs.
func checkFileTargetDir(dir string) error {
	if !filepath.IsAbs(dir) {
		return fmt.Errorf("%q is not an absolute path", dir)
	}
	resolved, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return fmt.Errorf("%s: %w", dir, err)
	}
	if fi, err := os.Stat(resolved); err != nil {
		return fmt.Errorf("%s: %w", dir, err)
	} else if !fi.IsDir() {
		return fmt.Errorf("%s is not a directory", dir)
	}
	switch {
	case resolved == "/":
		return fmt.Errorf("%s is the root directory: every file of the machine would be a valid target", dir)
	case resolved == "/dev" || strings.HasPrefix(resolved, "/dev/"):
		return fmt.Errorf("%s is in /dev, where a file target is a mistyped device name", describeTarget(dir, resolved))
	}
	return nil
}

// withDefaults returns c with its zero values replaced by the defaults,
// except HTTPClient, which Install builds per call (see newDefaultClient),
// and Logger, which Install resolves itself before anything can fail.
func (c Config) withDefaults() Config {
	if c.WorkDir == "" {
		c.WorkDir = os.TempDir()
	}
	if c.MaxImageBytes == 0 {
		c.MaxImageBytes = DefaultMaxImageBytes
	}
	if c.StallTimeout == 0 {
		c.StallTimeout = DefaultStallTimeout
	}
	return c
}

// newDefaultClient returns the client used when Config.HTTPClient is nil,
// and a function that releases its connections. Each Install gets its own
// client so that no connection (or the goroutines serving it) outlives it.
func newDefaultClient() (*http.Client, func()) {
	dialer := &net.Dialer{Timeout: defaultConnectTimeout, KeepAlive: 30 * time.Second}
	tr := &http.Transport{
		Proxy:               http.ProxyFromEnvironment,
		DialContext:         dialer.DialContext,
		TLSHandshakeTimeout: defaultConnectTimeout,
		ForceAttemptHTTP2:   true,
		// An installation is a single download; keeping the connection
		// open afterwards is of no use.
		DisableKeepAlives: true,
	}
	return &http.Client{Transport: tr}, tr.CloseIdleConnections
}

// Install carries out req and returns the report to send to the server. It
// never panics and always returns a report for req.Generation: every failure
// becomes an error report whose message says what failed (validating the
// request, checking the target, downloading, checksum, writing, syncing,
// verifying). ctx cancels it; cancelling while the image is being written
// leaves the target partially written (and reports an error).
//
// The target is checked (see the package documentation) before the
// download starts, and written only after the downloaded image's SHA-256
// matched req.ImageSha256. Install is safe for concurrent use; two
// installations to the same block device at once cannot both claim it, so
// the second fails.
func Install(ctx context.Context, cfg Config, req *agentv1.OSInstallationRequest) (report *agentv1.OSInstallationReport) {
	generation := req.GetGeneration()
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	logger = logger.With("generation", generation)
	defer func() {
		if r := recover(); r != nil {
			logger.Error("installation panicked", "panic", r)
			report = errorReport(generation, fmt.Errorf("internal error: %v", r))
		}
	}()

	start := time.Now()
	if err := install(ctx, cfg, req, logger); err != nil {
		logger.Warn("installation failed", "error", err, "elapsed", time.Since(start))
		return errorReport(generation, err)
	}
	logger.Info("installation succeeded", "target", req.GetTargetDevice(), "elapsed", time.Since(start))
	return &agentv1.OSInstallationReport{
		Generation: generation,
		Result:     &agentv1.OSInstallationReport_Success{Success: &agentv1.InstallationSuccess{}},
	}
}

// errorReport returns the report of a failed installation.
func errorReport(generation int64, err error) *agentv1.OSInstallationReport {
	return ErrorReport(generation, err.Error())
}

// MaxErrorBytes bounds the message of an error report, which is what the
// server stores of it.
const MaxErrorBytes = 4096

// ErrorReport returns the report of a failed installation of generation
// with message msg made sendable: valid UTF-8 (protobuf refuses to encode a
// string that is not, so the report could never be sent), without NUL bytes
// (PostgreSQL refuses them) and at most MaxErrorBytes long, cut on a
// character boundary with "..." marking the cut. Error texts quote what
// others wrote (an HTTP status line, a file name), so any of these can occur.
func ErrorReport(generation int64, msg string) *agentv1.OSInstallationReport {
	return &agentv1.OSInstallationReport{
		Generation: generation,
		Result: &agentv1.OSInstallationReport_Error{
			Error: &agentv1.InstallationError{Message: safetext.Cut(msg, MaxErrorBytes)},
		},
	}
}

// InterruptedReport returns the report of installation generation that
// never finished because the agent running it stopped (it was killed, or
// the machine restarted), which the machine's next agent sends.
func InterruptedReport(generation int64) *agentv1.OSInstallationReport {
	return ErrorReport(generation, fmt.Sprintf("installation %d was interrupted: the agent stopped before it finished "+
		"(killed, or the machine restarted); the target may be partly written", generation))
}

// install does Install's work and returns its first error.
func install(ctx context.Context, cfg Config, req *agentv1.OSInstallationRequest, logger *slog.Logger) error {
	if err := cfg.Validate(); err != nil {
		return fmt.Errorf("invalid agent configuration: %w", err)
	}
	cfg = cfg.withDefaults()
	imageURL, err := validateRequest(req)
	if err != nil {
		return fmt.Errorf("invalid installation request: %w", err)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("installation cancelled before it started: %w", context.Cause(ctx))
	}
	want := strings.ToLower(req.GetImageSha256())
	target, err := checkTarget(req.GetTargetDevice(), cfg.FileTargetDirs)
	if err != nil {
		return err
	}
	defer target.close() // after a failure; success closes it and checks the error
	logger.Info("installing image", "url", imageURL.Redacted(), "target", target.String())

	staged, err := os.CreateTemp(cfg.WorkDir, "shepherd-image-*")
	if err != nil {
		return fmt.Errorf("creating staging file for the image: %w", err)
	}
	defer func() {
		// A close error cannot matter any more: the content was checked
		// by checkStaged, and the file is removed right away.
		_ = staged.Close()
		if err := os.Remove(staged.Name()); err != nil && !errors.Is(err, fs.ErrNotExist) {
			logger.Warn("removing staging file", "path", staged.Name(), "error", err)
		}
	}()

	size, got, err := download(ctx, cfg, imageURL, staged, logger)
	if err != nil {
		return err
	}
	if got != want {
		return fmt.Errorf("checksum mismatch: got %s, want %s", got, want)
	}
	logger.Info("image downloaded and verified", "bytes", size)
	if target.size != -1 && size > target.size { // -1: a file, which grows to the image's size
		return fmt.Errorf("image is %d bytes, larger than target %s (%d bytes): nothing was written", size, target, target.size)
	}

	// The digest above is of the bytes received, not of the bytes the
	// staging file gives back. Check those too before the target is
	// touched, so that a failing WorkDir (or a write error only reported
	// lazily, as on network file systems) cannot get a corrupted image
	// written over the machine's disk.
	if err := checkStaged(ctx, staged, size, want); err != nil {
		return err
	}
	if _, err := staged.Seek(0, io.SeekStart); err != nil {
		return fmt.Errorf("rewinding staging file %s: %w", staged.Name(), err)
	}
	if err := writeTarget(ctx, staged, size, target); err != nil {
		return err
	}
	if err := verifyTarget(ctx, target.f, target.String(), size, want); err != nil {
		return err
	}
	if err := target.close(); err != nil {
		return fmt.Errorf("closing %s after writing: %w", target, err)
	}
	return nil
}

// RequestOptions relax what CheckRequest accepts.
type RequestOptions struct {
	// FileTarget accepts a target outside /dev: a regular file, which an
	// agent writes only under one of its Config.FileTargetDirs. For tests;
	// off by default, so that a target typed without its /dev/ is refused
	// at once.
	FileTarget bool
}

// CheckRequest checks what an operator fills in when requesting an
// installation (image URL, digest, target), so that a bad request is refused
// before it reaches the BMDB. The target must be a clean absolute path
// under /dev (unless opts.FileTarget): whether it exists, and is a block
// device, only the agent can tell. The generation is the BMDB's to assign
// and is not checked.
func CheckRequest(req *agentv1.OSInstallationRequest, opts RequestOptions) error {
	if req == nil {
		return errors.New("no request")
	}
	r := proto.CloneOf(req)
	r.Generation = 1
	_, err := validateRequest(r)
	if err == nil {
		err = checkTargetForm(r.GetTargetDevice(), opts)
	}
	return err
}

// checkTargetForm checks the form of an absolute target path for
// CheckRequest.
func checkTargetForm(target string, opts RequestOptions) error {
	if clean := filepath.Clean(target); clean != target {
		return fmt.Errorf("target_device %q is not a clean path (did you mean %q?)", target, clean)
	}
	if opts.FileTarget {
		return nil
	}
	if dev, ok := strings.CutPrefix(target, "/dev/"); !ok || dev == "" {
		return fmt.Errorf("target_device %q is not a device under /dev (such as /dev/sda or /dev/disk/by-id/NAME)", target)
	}
	return nil
}

// validateRequest checks req's fields and returns its parsed image URL.
func validateRequest(req *agentv1.OSInstallationRequest) (*url.URL, error) {
	if req == nil {
		return nil, errors.New("no request")
	}
	var errs []error
	if req.GetGeneration() <= 0 {
		errs = append(errs, fmt.Errorf("generation must be positive, got %d", req.GetGeneration()))
	}
	u, err := url.Parse(req.GetImageUrl())
	switch {
	case err != nil:
		// url.Error includes the URL, which may hold credentials.
		var uerr *url.Error
		if errors.As(err, &uerr) {
			err = uerr.Err
		}
		errs = append(errs, fmt.Errorf("image_url: %w", err))
	case u.Scheme != "http" && u.Scheme != "https":
		errs = append(errs, fmt.Errorf("image_url must be an http or https URL, got scheme %q", u.Scheme))
	case u.Hostname() == "":
		errs = append(errs, errors.New("image_url has no host"))
	}
	if sum := req.GetImageSha256(); len(sum) != 2*sha256.Size {
		errs = append(errs, fmt.Errorf("image_sha256 must be %d hexadecimal characters, got %d characters", 2*sha256.Size, len(sum)))
	} else if _, err := hex.DecodeString(sum); err != nil {
		errs = append(errs, fmt.Errorf("image_sha256 is not hexadecimal: %w", err))
	}
	if target := req.GetTargetDevice(); !filepath.IsAbs(target) {
		errs = append(errs, fmt.Errorf("target_device must be an absolute path, got %q", target))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return u, nil
}

// download streams the image at u into staged, enforcing
// cfg.MaxImageBytes and cfg.StallTimeout, and returns its size and
// lowercase hex SHA-256.
func download(ctx context.Context, cfg Config, u *url.URL, staged *os.File, logger *slog.Logger) (int64, string, error) {
	shown := u.Redacted()
	client := cfg.HTTPClient
	if client == nil {
		var release func()
		client, release = newDefaultClient()
		defer release()
	}

	// Every phase of the request (connecting, waiting for the headers, each
	// read of the body) must finish within StallTimeout. The timer cancels
	// the request's context with errStalled when one does not; it is
	// re-armed whenever a read of the body starts and stopped when it ends.
	reqCtx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	timer := time.AfterFunc(cfg.StallTimeout, func() { cancel(errStalled) })
	defer timer.Stop()
	// failed turns err into the error to report, naming the stall or the
	// cancellation rather than the transport's symptom of it.
	failed := func(what string, err error) error {
		if ctx.Err() != nil {
			return fmt.Errorf("downloading %s: cancelled while %s: %w", shown, what, context.Cause(ctx))
		}
		if errors.Is(context.Cause(reqCtx), errStalled) {
			return fmt.Errorf("downloading %s: %w: no progress for %s while %s", shown, errStalled, cfg.StallTimeout, what)
		}
		return fmt.Errorf("downloading %s: %s: %w", shown, what, err)
	}

	req, err := http.NewRequestWithContext(reqCtx, http.MethodGet, u.String(), nil)
	if err != nil {
		return 0, "", fmt.Errorf("downloading %s: %w", shown, err)
	}
	resp, err := client.Do(req)
	if err != nil {
		// url.Error repeats the URL, which the message already names.
		var uerr *url.Error
		if errors.As(err, &uerr) {
			err = uerr.Err
		}
		return 0, "", failed("waiting for the response", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return 0, "", fmt.Errorf("downloading %s: server responded %s", shown, resp.Status)
	}
	if resp.ContentLength > cfg.MaxImageBytes {
		return 0, "", fmt.Errorf("downloading %s: image is %d bytes, larger than the limit of %d bytes", shown, resp.ContentLength, cfg.MaxImageBytes)
	}
	logger.Debug("image download started", "url", shown, "content_length", resp.ContentLength)

	h := sha256.New()
	buf := make([]byte, copyBufferSize)
	var size int64
	for {
		timer.Reset(cfg.StallTimeout)
		n, rerr := resp.Body.Read(buf)
		timer.Stop()
		if n > 0 {
			size += int64(n)
			if size > cfg.MaxImageBytes {
				return 0, "", fmt.Errorf("downloading %s: image is larger than the limit of %d bytes", shown, cfg.MaxImageBytes)
			}
			h.Write(buf[:n]) // never fails
			if _, err := staged.Write(buf[:n]); err != nil {
				return 0, "", fmt.Errorf("downloading %s: staging the image: %w", shown, err)
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return 0, "", failed(fmt.Sprintf("reading the body after %d bytes", size), rerr)
		}
	}
	if size == 0 {
		return 0, "", fmt.Errorf("downloading %s: image is empty", shown)
	}
	return size, hex.EncodeToString(h.Sum(nil)), nil
}

// checkStaged re-reads the staged image and checks that it is size bytes
// with the SHA-256 want.
func checkStaged(ctx context.Context, staged *os.File, size int64, want string) error {
	if _, err := staged.Seek(0, io.SeekStart); err != nil {
		return fmt.Errorf("rewinding staging file %s: %w", staged.Name(), err)
	}
	got, n, err := digest(ctx, staged, size)
	switch {
	case err != nil:
		return fmt.Errorf("re-reading staging file %s after %d bytes: %w", staged.Name(), n, err)
	case n != size:
		return fmt.Errorf("staging file %s holds only %d of the %d bytes downloaded", staged.Name(), n, size)
	case got != want:
		return fmt.Errorf("staging file %s does not hold the downloaded image: checksum mismatch: got %s, want %s", staged.Name(), got, want)
	}
	return nil
}

// digest returns the lowercase hex SHA-256 of the first (up to) size bytes
// of r and how many bytes it read, checking ctx between reads.
func digest(ctx context.Context, r io.Reader, size int64) (string, int64, error) {
	h := sha256.New()
	n, err := io.CopyBuffer(h, ctxReader{ctx, io.LimitReader(r, size)}, make([]byte, copyBufferSize))
	return hex.EncodeToString(h.Sum(nil)), n, err
}

// writeTarget copies size bytes from the staged image to the start of the
// target and fsyncs it, leaving it open for verifyTarget.
func writeTarget(ctx context.Context, staged io.Reader, size int64, t *target) error {
	if err := t.openForWriting(); err != nil {
		return fmt.Errorf("writing image to %s: %w", t, err)
	}
	// Hiding t.f's ReadFrom and the reader's type makes io.CopyBuffer use
	// the large buffer, in chunks that are each checked for cancellation.
	dst := struct{ io.Writer }{t.f}
	n, err := io.CopyBuffer(dst, ctxReader{ctx, io.LimitReader(staged, size)}, make([]byte, copyBufferSize))
	if err != nil {
		return fmt.Errorf("writing image to %s: after %d of %d bytes: %w", t, n, size, err)
	}
	if n != size {
		return fmt.Errorf("writing image to %s: staged image ended after %d of %d bytes", t, n, size)
	}
	if err := t.f.Sync(); err != nil {
		return fmt.Errorf("syncing %s: %w", t, err)
	}
	return nil
}

// verifyTarget re-reads the first size bytes of the written target (named
// name in messages) and checks that their SHA-256 is want, catching short
// writes and bad devices.
func verifyTarget(ctx context.Context, written io.ReaderAt, name string, size int64, want string) error {
	got, n, err := digest(ctx, io.NewSectionReader(written, 0, size), size)
	switch {
	case err != nil:
		return fmt.Errorf("verifying %s after writing: reading back after %d bytes: %w", name, n, err)
	case n != size:
		return fmt.Errorf("verifying %s after writing: read back only %d of %d bytes", name, n, size)
	case got != want:
		return fmt.Errorf("verifying %s after writing: checksum mismatch: got %s, want %s", name, got, want)
	}
	return nil
}

// ctxReader is an io.Reader that fails once ctx is done.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

// Read reads from the underlying reader unless the context is done.
func (r ctxReader) Read(p []byte) (int, error) {
	if err := r.ctx.Err(); err != nil {
		return 0, fmt.Errorf("cancelled: %w", context.Cause(r.ctx))
	}
	return r.r.Read(p)
}
