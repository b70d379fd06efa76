// Package bmc opens the power driver a BMC spec names. It is apart from
// package power so that power's shared logic does not import every
// protocol, and every protocol can import power.
package bmc

import (
	"fmt"

	"github.com/shepherd/shepherd/power"
	"github.com/shepherd/shepherd/power/ipmi"
	"github.com/shepherd/shepherd/power/redfish"
)

// Open returns the driver for s, which must be valid.
func Open(s power.Spec) (power.Driver, error) {
	if err := s.Validate(); err != nil {
		return nil, fmt.Errorf("BMC %s: %w", s, err)
	}
	switch s.Driver {
	case power.DriverIPMI:
		return ipmi.New(s)
	case power.DriverRedfish:
		return redfish.New(s)
	}
	return nil, fmt.Errorf("BMC %s: driver %q: %w", s, s.Driver, power.ErrUnsupported)
}
