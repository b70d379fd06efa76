package poweraction_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/shepherd/shepherd/bmdb"
	"github.com/shepherd/shepherd/power"
	"github.com/shepherd/shepherd/poweraction"
)

// Begin and Run are tested where they are used, against a real BMDB and a
// real BMC (ipmi_sim): `shepherd machine power` in cmd/shepherd, the power
// actions in web.

func TestParse(t *testing.T) {
	t.Parallel()
	for _, a := range poweraction.Actions {
		if got, err := poweraction.Parse(string(a)); err != nil || got != a {
			t.Errorf("Parse(%q) = %q, %v", a, got, err)
		}
	}
	for _, s := range []string{"", "reboot", "ON", " on"} {
		if _, err := poweraction.Parse(s); err == nil || !strings.Contains(err.Error(), "is not a power action: use status, on, off, cycle") {
			t.Errorf("Parse(%q): %v, want an error listing the actions", s, err)
		}
	}
}

func TestActionProperties(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		a     poweraction.Action
		holds bool
		stops bool
	}{
		{poweraction.Status, false, false},
		{poweraction.On, true, false},
		{poweraction.Off, true, true},
		{poweraction.Cycle, true, true},
	} {
		if got := tt.a.Holds(); got != tt.holds {
			t.Errorf("%s.Holds() = %v, want %v", tt.a, got, tt.holds)
		}
		if got := tt.a.Consequence() != ""; got != tt.stops {
			t.Errorf("%s.Consequence() = %q: says it stops the machine %v, want %v", tt.a, tt.a.Consequence(), got, tt.stops)
		}
	}
}

func TestRequestValidate(t *testing.T) {
	t.Parallel()
	good := poweraction.Request{Action: poweraction.Cycle, By: "alice", Component: "cli", Timeout: time.Minute}
	if err := good.Validate(); err != nil {
		t.Fatalf("Validate() of %+v: %v", good, err)
	}
	status := good
	status.Action, status.Component = poweraction.Status, ""
	if err := status.Validate(); err != nil {
		t.Errorf("a status request needs no session component: %v", err)
	}
	for name, tt := range map[string]struct {
		change func(*poweraction.Request)
		want   string
	}{
		"unknown action":   {func(r *poweraction.Request) { r.Action = "reboot" }, "not a power action"},
		"nobody asked":     {func(r *poweraction.Request) { r.By = "" }, "Request.By is required"},
		"no component":     {func(r *poweraction.Request) { r.Component = "" }, "Request.Component is required for power cycle"},
		"no timeout":       {func(r *poweraction.Request) { r.Timeout = 0 }, "Request.Timeout must be positive"},
		"negative timeout": {func(r *poweraction.Request) { r.Timeout = -time.Second }, "Request.Timeout must be positive"},
	} {
		r := good
		tt.change(&r)
		if err := r.Validate(); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: Validate() = %v, want an error saying %q", name, err, tt.want)
		}
	}
}

func TestReading(t *testing.T) {
	if r := poweraction.Reading("ipmi://u@bmc:623", power.Off, nil); r != (bmdb.PowerReading{BMC: "ipmi://u@bmc:623", State: "off"}) {
		t.Errorf("Reading of a state = %+v", r)
	}
	err := fmt.Errorf("reading power state: %w", power.ErrAuth)
	if r := poweraction.Reading("b", power.On, err); r != (bmdb.PowerReading{BMC: "b", ErrorClass: "auth", Error: err.Error()}) {
		t.Errorf("Reading of an error = %+v, want the class and no state", r)
	}
}
