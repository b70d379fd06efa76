package agent

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/shepherd/shepherd/internal/atomicfile"

	"google.golang.org/protobuf/proto"

	agentv1 "github.com/shepherd/shepherd/api/agent/v1"
)

// What the daemon keeps about installations in its state directory, so that
// neither a restart nor a crash installs a generation twice or loses its
// report (SPEC §4.3):
//
//   - generationFile holds the highest generation the daemon started, as
//     "G started" from before the installation begins until the server
//     acknowledged its report, then as "G". (An agent before this one wrote
//     only "G", which therefore means the report was delivered.)
//   - reportFile holds the finished installation's report until the server
//     acknowledged it.
//
// On start, a report of generation G is sent again; a generation "started"
// without a report was interrupted (the daemon was killed, the machine lost
// power), and an error report saying so is sent instead of nothing. Every
// write is durable before the daemon acts on it: temporary file, fsync,
// rename, fsync of the directory.

// generationState is the content of the generation file.
type generationState struct {
	gen     int64
	started bool // the report of gen was not yet acknowledged
}

func readGeneration(dir string) (generationState, error) {
	data, err := os.ReadFile(filepath.Join(dir, generationFile))
	if errors.Is(err, fs.ErrNotExist) {
		return generationState{}, nil
	}
	if err != nil {
		return generationState{}, fmt.Errorf("reading installation generation: %w", err)
	}
	num, state, _ := strings.Cut(strings.TrimSpace(string(data)), " ")
	g, err := strconv.ParseInt(num, 10, 64)
	if err != nil || g < 0 || (state != "" && state != "started") {
		return generationState{}, fmt.Errorf("%s holds %q, not a generation", filepath.Join(dir, generationFile), data)
	}
	return generationState{gen: g, started: state == "started"}, nil
}

func writeGeneration(dir string, st generationState) error {
	text := strconv.FormatInt(st.gen, 10)
	if st.started {
		text += " started"
	}
	if err := atomicfile.Write(filepath.Join(dir, generationFile), []byte(text+"\n"), 0o600); err != nil {
		return fmt.Errorf("recording installation generation %d: %w", st.gen, err)
	}
	return nil
}

// storedReport is the content of the report file.
type storedReport struct {
	Report []byte `json:"report"` // OSInstallationReport, serialized
	Reboot bool   `json:"reboot"` // reboot once it is acknowledged (if a success)
}

func writeReport(dir string, r *agentv1.OSInstallationReport, reboot bool) error {
	raw, err := proto.Marshal(r)
	if err != nil {
		return fmt.Errorf("encoding the report of installation %d: %w", r.GetGeneration(), err)
	}
	data, err := json.Marshal(storedReport{Report: raw, Reboot: reboot})
	if err != nil {
		return fmt.Errorf("encoding the report of installation %d: %w", r.GetGeneration(), err)
	}
	if err := atomicfile.Write(filepath.Join(dir, reportFile), data, 0o600); err != nil {
		return fmt.Errorf("keeping the report of installation %d: %w", r.GetGeneration(), err)
	}
	return nil
}

// readReport returns the stored report, or nil if there is none.
func readReport(dir string) (*agentv1.OSInstallationReport, bool, error) {
	path := filepath.Join(dir, reportFile)
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, fmt.Errorf("reading the kept installation report: %w", err)
	}
	var sr storedReport
	if err := json.Unmarshal(data, &sr); err != nil {
		return nil, false, fmt.Errorf("%s: %w", path, err)
	}
	var r agentv1.OSInstallationReport
	if err := proto.Unmarshal(sr.Report, &r); err != nil {
		return nil, false, fmt.Errorf("%s: %w", path, err)
	}
	return &r, sr.Reboot, nil
}

func removeReport(dir string) error {
	err := os.Remove(filepath.Join(dir, reportFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("removing the acknowledged installation report: %w", err)
	}
	return atomicfile.SyncDir(dir)
}
