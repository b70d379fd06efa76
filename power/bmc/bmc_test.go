package bmc_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/shepherd/shepherd/internal/secret"
	"github.com/shepherd/shepherd/power"
	"github.com/shepherd/shepherd/power/bmc"
	"github.com/shepherd/shepherd/power/ipmi"
	"github.com/shepherd/shepherd/power/redfish"
)

// TestOpen: each driver name opens its driver; a bad spec is refused with
// the field named and no password.
func TestOpen(t *testing.T) {
	s := power.Spec{Driver: power.DriverIPMI, Address: "127.0.0.1", Username: "u", Password: secret.New("hunter2")}
	d, err := bmc.Open(s)
	if err != nil {
		t.Fatalf("Open(ipmi) = %v", err)
	}
	if _, ok := d.(*ipmi.Driver); !ok {
		t.Errorf("Open(ipmi) = %T, want *ipmi.Driver", d)
	}
	r := s
	r.Driver, r.Port = power.DriverRedfish, 8443
	if d, err := bmc.Open(r); err != nil {
		t.Errorf("Open(redfish) = %v", err)
	} else if _, ok := d.(*redfish.Driver); !ok {
		t.Errorf("Open(redfish) = %T, want *redfish.Driver", d)
	}
	s.Address = ""
	if _, err := bmc.Open(s); err == nil || !strings.Contains(err.Error(), "address missing") || strings.Contains(err.Error(), "hunter2") {
		t.Errorf("Open(no address) = %v", err)
	}
	s.Address, s.Driver = "127.0.0.1", "amt"
	if _, err := bmc.Open(s); err == nil || errors.Is(err, power.ErrAuth) {
		t.Errorf("Open(amt) = %v, want an error", err)
	}
}
