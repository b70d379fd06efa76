package ipmisim_test

import (
	"fmt"
	"runtime"
	"strings"
	"testing"

	"github.com/shepherd/shepherd/power/ipmi/ipmisim"
)

// fatalTB records Fatalf instead of failing the test.
type fatalTB struct {
	testing.TB
	msg string
}

func (f *fatalTB) Helper() {}

func (f *fatalTB) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// TestMissingIPMISim: without ipmi_sim, Start fails the test (it does not
// skip it) and says how to install it.
func TestMissingIPMISim(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	f := &fatalTB{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		ipmisim.Start(f, ipmisim.Config{})
		f.msg = "Start returned"
	}()
	<-done
	if !strings.Contains(f.msg, ipmisim.RequireScript) || !strings.Contains(f.msg, "not installed") {
		t.Fatalf("Start without ipmi_sim: %q, want a failure naming %s", f.msg, ipmisim.RequireScript)
	}
}
