package metal

import (
	"net/netip"
	"strings"
	"time"
)

// Device states, the values of Device.State.
const (
	DeviceStateQueued         = "queued"
	DeviceStateProvisioning   = "provisioning"
	DeviceStateActive         = "active"
	DeviceStatePoweringOff    = "powering_off"
	DeviceStatePoweringOn     = "powering_on"
	DeviceStateInactive       = "inactive"
	DeviceStateReinstalling   = "reinstalling"
	DeviceStateDeprovisioning = "deprovisioning"
	DeviceStateFailed         = "failed"
)

// Href is a reference to another object.
type Href struct {
	ID   string `json:"id"`
	Href string `json:"href"`
}

// Slug names a plan or an operating system.
type Slug struct {
	Slug string `json:"slug"`
}

// Code names a facility or a metro.
type Code struct {
	Code string `json:"code"`
}

// IPAddress is one address assigned to a device.
type IPAddress struct {
	Address       string `json:"address"`
	Public        bool   `json:"public"`
	AddressFamily int    `json:"address_family"` // 4 or 6
	Management    bool   `json:"management"`
}

// Device is a server of the account.
type Device struct {
	ID                  string      `json:"id"`
	ShortID             string      `json:"short_id"`
	Hostname            string      `json:"hostname"`
	State               string      `json:"state"` // one of the DeviceState constants
	Tags                []string    `json:"tags"`
	CreatedAt           time.Time   `json:"created_at"`
	UpdatedAt           time.Time   `json:"updated_at"`
	Plan                Slug        `json:"plan"`
	OperatingSystem     Slug        `json:"operating_system"`
	Facility            Code        `json:"facility"`
	Metro               Code        `json:"metro"`
	IPAddresses         []IPAddress `json:"ip_addresses"` // empty until provisioned
	HardwareReservation *Href       `json:"hardware_reservation"`
	Project             *Href       `json:"project"`
	Href                string      `json:"href"`
}

// PublicIPv4 returns the device's first public IPv4 address, preferring a
// management address, and false if it has none (yet).
func (d Device) PublicIPv4() (netip.Addr, bool) {
	var first netip.Addr
	for _, ip := range d.IPAddresses {
		if !ip.Public {
			continue
		}
		a, ok := parseAddr(ip.Address)
		if !ok || !a.Is4() {
			continue
		}
		if ip.Management {
			return a, true
		}
		if !first.IsValid() {
			first = a
		}
	}
	return first, first.IsValid()
}

// parseAddr accepts "147.28.1.2" and, in case the API adds the prefix
// length, "147.28.1.2/31".
func parseAddr(s string) (netip.Addr, bool) {
	if a, err := netip.ParseAddr(s); err == nil {
		return a.Unmap(), true
	}
	if p, err := netip.ParsePrefix(s); err == nil {
		return p.Addr().Unmap(), true
	}
	return netip.Addr{}, false
}

// Witness returns the witness of the device's witness tag (see
// WitnessTag), and false if it has none.
func (d Device) Witness() (string, bool) {
	for _, t := range d.Tags {
		if w, ok := strings.CutPrefix(t, WitnessTagPrefix); ok {
			return w, true
		}
	}
	return "", false
}

// HardwareReservation is a server reserved for the account. One without a
// Device is free capacity.
type HardwareReservation struct {
	ID            string    `json:"id"`
	ShortID       string    `json:"short_id"`
	Provisionable bool      `json:"provisionable"`
	Spare         bool      `json:"spare"`
	Device        *Href     `json:"device"` // nil when no device runs on it
	Plan          Slug      `json:"plan"`
	Facility      Code      `json:"facility"`
	Metro         Code      `json:"metro"`
	Project       *Href     `json:"project"`
	CreatedAt     time.Time `json:"created_at"`
	Href          string    `json:"href"`
}

// SSHKey is a project SSH key, installed on the project's new devices.
type SSHKey struct {
	ID          string    `json:"id"`
	Label       string    `json:"label"`
	Key         string    `json:"key"` // authorized_keys format, e.g. "ssh-ed25519 AAAA..."
	Fingerprint string    `json:"fingerprint"`
	CreatedAt   time.Time `json:"created_at"`
	Href        string    `json:"href"`
}

// CreateDeviceRequest is the body of a device creation. CreateDevice adds
// the witness tag to Tags.
type CreateDeviceRequest struct {
	Hostname              string   `json:"hostname"`
	Plan                  string   `json:"plan"`                              // plan slug
	Metro                 string   `json:"metro,omitempty"`                   // metro code
	Facility              []string `json:"facility,omitempty"`                // facility codes
	OperatingSystem       string   `json:"operating_system"`                  // OS slug
	HardwareReservationID string   `json:"hardware_reservation_id,omitempty"` // required by CreateDevice
	ProjectSSHKeys        []string `json:"project_ssh_keys,omitempty"`        // SSH key ids
	Tags                  []string `json:"tags,omitempty"`
	UserData              string   `json:"userdata,omitempty"`
}

// ReinstallRequest asks for a device to be reinstalled.
type ReinstallRequest struct {
	OperatingSystem string `json:"operating_system,omitempty"` // OS slug; empty keeps the current one
	DeprovisionFast bool   `json:"deprovision_fast"`
	PreserveData    bool   `json:"preserve_data"`
}
