package sim_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/bmdb/bmdbtest"
	"github.com/shepherd/shepherd/provider/sim"
)

// imageServer serves image at /os.img and 404 for anything else.
func imageServer(t *testing.T, image []byte) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/os.img" {
			http.NotFound(w, r)
			return
		}
		http.ServeContent(w, r, "os.img", time.Time{}, bytes.NewReader(image))
	}))
	t.Cleanup(srv.Close)
	return srv
}

// heldImages is an image server that holds every request until release
// is called (or the client gives up), then serves the image.
type heldImages struct {
	url       string        // of the image
	requested chan struct{} // receives when a request arrives, if none is pending
	release   func()

	mu         sync.Mutex
	held, most int // requests held now, and at most
}

func newHeldImages(t *testing.T, image []byte) *heldImages {
	t.Helper()
	h := &heldImages{requested: make(chan struct{}, 1)}
	released := make(chan struct{})
	h.release = sync.OnceFunc(func() { close(released) })
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.count(1)
		defer h.count(-1)
		select {
		case h.requested <- struct{}{}:
		default:
		}
		select {
		case <-released:
		case <-r.Context().Done():
			return
		}
		http.ServeContent(w, r, "os.img", time.Time{}, bytes.NewReader(image))
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(h.release) // before srv.Close, which waits for the handlers
	h.url = srv.URL + "/os.img"
	return h
}

// count adds d to the requests held and returns how many are held now and
// at most.
func (h *heldImages) count(d int) (now, most int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.held += d
	h.most = max(h.most, h.held)
	return h.held, h.most
}

// waitRequest waits for a request to arrive.
func (h *heldImages) waitRequest(t *testing.T) {
	t.Helper()
	select {
	case <-h.requested:
	case <-time.After(30 * time.Second):
		t.Fatal("no agent started downloading the image within 30s")
	}
}

// testImage is a small image whose bytes differ at every offset that
// matters: a copy cut short or shifted would not match.
func testImage() []byte {
	img := make([]byte, 3<<20+123) // more than one 1 MiB copy buffer
	for i := range img {
		img[i] = byte(i*7 + i>>11)
	}
	return img
}

// requestInstall records an installation request for machine and
// returns its generation.
func (e *env) requestInstall(t *testing.T, machine uuid.UUID, req *agentv1.OSInstallationRequest) int64 {
	t.Helper()
	raw, err := proto.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	gen, err := e.db.RequestInstallation(t.Context(), machine, "tester", raw)
	if err != nil {
		t.Fatal(err)
	}
	return gen
}

// waitReport polls until machine has a report of generation gen and
// returns it.
func (e *env) waitReport(t *testing.T, machine uuid.UUID, gen int64, what string) bmdb.Installation {
	t.Helper()
	var in bmdb.Installation
	bmdbtest.WaitFor(t, 60*time.Second, what, func(ctx context.Context) (bool, error) {
		var err error
		in, err = e.db.GetInstallation(ctx, machine)
		return err == nil && in.Report != nil && in.Report.Generation == gen, err
	})
	return in
}

// TestInstallRealCode checks that simulated agents carry out installations
// with the real installation code against simulated disks: a good image
// ends installed, with the disk file holding exactly the image; a wrong
// SHA-256, a URL that answers 404 and a target the machine does not have
// end failed with the real cause and write no disk. When Run returns, the
// disks are gone.
func TestInstallRealCode(t *testing.T) {
	t.Parallel()
	image := testImage()
	sum := sha256.Sum256(image)
	good := hex.EncodeToString(sum[:])
	srv := imageServer(t, image)
	diskDir := t.TempDir()

	e := newEnv(t, 100*time.Millisecond)
	f := newFleet(t, sim.Config{Machines: 4, DiskDir: diskDir, RebootLatency: time.Hour})
	stop := run(t, f)

	bad := strings.Repeat("ab", 32)
	cases := []struct {
		name    string
		req     *agentv1.OSInstallationRequest
		wantErr string // "" for success
	}{
		{"good image", &agentv1.OSInstallationRequest{ImageUrl: srv.URL + "/os.img", ImageSha256: good, TargetDevice: "/dev/nvme0n1"}, ""},
		{"wrong sha256", &agentv1.OSInstallationRequest{ImageUrl: srv.URL + "/os.img", ImageSha256: bad, TargetDevice: "/dev/nvme0n1"},
			"checksum mismatch: got " + good + ", want " + bad},
		{"404", &agentv1.OSInstallationRequest{ImageUrl: srv.URL + "/missing.img", ImageSha256: good, TargetDevice: "/dev/nvme0n1"},
			"downloading " + srv.URL + "/missing.img: server responded 404 Not Found"},
		{"unknown target", &agentv1.OSInstallationRequest{ImageUrl: srv.URL + "/os.img", ImageSha256: good, TargetDevice: "/dev/sda"},
			"checking target /dev/sda: it does not exist"},
	}
	machines := make([]uuid.UUID, len(cases))
	gens := make([]int64, len(cases))
	for n, c := range cases {
		id := slotID(n + 1)
		create(t, f, id)
		machines[n] = e.addMachine(t, f, id)
		e.takeover(t, f, id, machines[n])
		gens[n] = e.requestInstall(t, machines[n], c.req)
	}
	for n, c := range cases {
		id := slotID(n + 1)
		in := e.waitReport(t, machines[n], gens[n], c.name+": the installation is reported")
		disk, written := f.DiskPath(id, "nvme0n1")
		if c.wantErr == "" {
			if !in.Installed() {
				t.Errorf("%s: installation %+v, want installed", c.name, in.Report)
			}
			if !written {
				t.Fatalf("%s: no simulated disk was written", c.name)
			}
			got, err := os.ReadFile(disk)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, image) {
				t.Errorf("%s: the simulated disk holds %d bytes that are not the %d-byte image", c.name, len(got), len(image))
			}
			continue
		}
		if in.Installed() || in.Report.Success || !strings.Contains(in.Report.Error, c.wantErr) {
			t.Errorf("%s: report success=%v error %q, want a failure saying %q", c.name, in.Report.Success, in.Report.Error, c.wantErr)
		}
		if written {
			t.Errorf("%s: the failed installation wrote the simulated disk %s", c.name, disk)
		}
	}
	if err := f.ReleaseMachine(t.Context(), slotID(1)); err != nil {
		t.Fatal(err)
	}
	if disk, ok := f.DiskPath(slotID(1), "nvme0n1"); ok {
		t.Errorf("the disk %s of a released machine was not wiped", disk)
	}
	if st := f.Stats(); st.Installations != 1 || st.InstallationsFailed != 3 {
		t.Errorf("Stats: %d installations, %d failed; want 1 and 3", st.Installations, st.InstallationsFailed)
	}

	stop()
	left, err := os.ReadDir(diskDir)
	if err != nil {
		t.Fatal(err)
	}
	if len(left) != 0 {
		t.Errorf("after Run returned, %s still holds %v", diskDir, left)
	}
}

// TestInstallInterrupted checks that an installation whose machine
// reboots before it finishes is reported failed by the machine's next
// agent, as the real agent reports it from its state directory.
func TestInstallInterrupted(t *testing.T) {
	t.Parallel()
	image := testImage()
	sum := sha256.Sum256(image)
	images := newHeldImages(t, image)

	e := newEnv(t, 100*time.Millisecond)
	f := startFleet(t, sim.Config{Machines: 1, DiskDir: t.TempDir()})
	id := slotID(1)
	create(t, f, id)
	machine := e.addMachine(t, f, id)
	e.takeover(t, f, id, machine)
	gen := e.requestInstall(t, machine, &agentv1.OSInstallationRequest{
		ImageUrl: images.url, ImageSha256: hex.EncodeToString(sum[:]), TargetDevice: "/dev/nvme1n1"})
	images.waitRequest(t)
	if err := f.RebootMachine(t.Context(), id); err != nil {
		t.Fatal(err)
	}
	e.takeover(t, f, id, machine)
	in := e.waitReport(t, machine, gen, "the next agent reports the interrupted installation")
	if in.Report.Success || !strings.Contains(in.Report.Error, "was interrupted") {
		t.Errorf("report success=%v error %q, want an interrupted installation", in.Report.Success, in.Report.Error)
	}
	if st := f.Stats(); st.Installations != 0 {
		t.Errorf("Stats().Installations = %d, want 0", st.Installations)
	}
}

// TestInstallConcurrency checks that Config.InstallConcurrency bounds the
// installations that run at once: with 1, a second machine's installation
// waits, through several heartbeats of its agent, until the first one is
// done, and then runs.
func TestInstallConcurrency(t *testing.T) {
	t.Parallel()
	image := testImage()
	sum := sha256.Sum256(image)
	images := newHeldImages(t, image)

	e := newEnv(t, 100*time.Millisecond)
	f := startFleet(t, sim.Config{Machines: 2, DiskDir: t.TempDir(), InstallConcurrency: 1, RebootLatency: time.Hour})
	ids := []string{slotID(1), slotID(2)}
	machines := make([]uuid.UUID, len(ids))
	gens := make([]int64, len(ids))
	for n, id := range ids {
		create(t, f, id)
		machines[n] = e.addMachine(t, f, id)
		e.takeover(t, f, id, machines[n])
		gens[n] = e.requestInstall(t, machines[n], &agentv1.OSInstallationRequest{
			ImageUrl: images.url, ImageSha256: hex.EncodeToString(sum[:]), TargetDevice: "/dev/nvme0n1"})
	}
	images.waitRequest(t)
	// The second answer after now carries the request to each agent (the
	// first may have been on its way before the request was stored); the
	// third leaves time for a download it started to reach the server.
	since := time.Now()
	for _, id := range ids {
		last := since
		for range 3 {
			last = waitHeartbeat(t, f, id, last, id+" heartbeats")
		}
	}
	if n, _ := images.count(0); n != 1 {
		t.Errorf("%d downloads at once, want 1 (InstallConcurrency 1)", n)
	}
	images.release()
	for n := range ids {
		if in := e.waitReport(t, machines[n], gens[n], ids[n]+"'s installation is reported"); !in.Installed() {
			t.Errorf("%s: installation %+v, want installed", ids[n], in.Report)
		}
	}
	if _, m := images.count(0); m != 1 {
		t.Errorf("at most %d downloads at once, want 1", m)
	}
}
