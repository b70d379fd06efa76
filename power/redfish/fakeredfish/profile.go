package fakeredfish

import (
	"crypto/tls"
	"slices"
)

// Profile is the behaviour of one kind of BMC: what its service root
// offers, which TLS versions it speaks, which reset types it advertises and
// how it answers a reset that asks for the state the system is already in.
// The predefined profiles copy what the firmware they are named after does;
// a test may change a copy.
type Profile struct {
	// Name names the profile in test names and logs.
	Name string
	// Vendor and Product are the service root's Vendor and Product.
	Vendor, Product string
	// SystemID is the ComputerSystem's Id (the last segment of its URI):
	// OpenBMC uses "system", iDRAC "System.Embedded.1", others "1".
	SystemID string
	// SessionService makes the service root link a SessionService and
	// Links.Sessions, and the service accept session logins. Without it the
	// BMC knows only basic authentication, like many older BMCs in service.
	SessionService bool
	// MaxSessions is how many sessions may be open at once; a login beyond
	// it is refused with 503 SessionLimitExceeded, as real BMCs (which have
	// a handful of session slots) do. 0 means no limit.
	MaxSessions int
	// TLSMaxVersion is the newest TLS version spoken: tls.VersionTLS12 for a
	// BMC that speaks only TLS 1.2; 0 means TLS 1.3. The oldest is always
	// TLS 1.2.
	TLSMaxVersion uint16
	// ResetTypes is the system's ResetType@Redfish.AllowableValues; a reset
	// of another type is refused with 400. Nil leaves the annotation out
	// (and then every type is accepted), as some BMCs do.
	ResetTypes []string
	// RefuseRedundantReset refuses, with 409 Conflict and iDRAC's message,
	// a reset that asks for the power state the system is already in or
	// heading to ("Server is already powered ON."). Otherwise such a reset
	// succeeds and changes nothing, as on OpenBMC.
	RefuseRedundantReset bool
	// RedundantResetBadRequest, with RefuseRedundantReset, refuses with 400
	// Bad Request and HPE iLO's InvalidOperationForSystemState instead of
	// iDRAC's 409.
	RedundantResetBadRequest bool
	// GeneralErrorCode answers errors as iDRAC does: the error's code and
	// message are Base's GeneralError ("See ExtendedInfo for more
	// information") and the specific message is only in
	// @Message.ExtendedInfo. Otherwise, as bmcweb does, they are those of
	// the one message.
	GeneralErrorCode bool
	// RequireJSONContentType refuses a request with a body (POST, PATCH)
	// whose Content-Type is not application/json with 400
	// UnrecognizedRequestBody, as bmcweb does, login included.
	RequireJSONContentType bool
	// SessionLocation is how a login names the new session: "" (the
	// default) in a Location header with the URI's path and in the body's
	// @odata.id; LocationAbsolute with an absolute URL in Location
	// (https://host:port/redfish/v1/...), as HPE iLO does; LocationNone in
	// the body only, with no Location header, as some firmware does.
	SessionLocation string
	// NoSessionsLink leaves Links.Sessions out of the service root, which
	// still links the SessionService, as some older firmware does: a client
	// must find the sessions collection at its standard path.
	NoSessionsLink bool
}

// Values of Profile.SessionLocation.
const (
	LocationAbsolute = "absolute"
	LocationNone     = "none"
)

// OpenBMC is an OpenBMC (bmcweb) BMC: sessions, TLS 1.2 and 1.3, the full
// set of reset types, a redundant reset is a successful no-op, and a body
// must be sent as application/json.
func OpenBMC() Profile {
	return Profile{
		Name: "openbmc", Vendor: "OpenBMC", Product: "bmcweb", SystemID: "system",
		SessionService: true, RequireJSONContentType: true,
		ResetTypes: []string{"On", "ForceOff", "ForceOn", "ForceRestart", "GracefulRestart",
			"GracefulShutdown", "PowerCycle", "Nmi"},
	}
}

// IDRAC is a Dell iDRAC: sessions, TLS 1.2 only, its reset types (no
// PowerCycle), and a redundant reset refused with 409 and a Dell message.
func IDRAC() Profile {
	return Profile{
		Name: "idrac", Vendor: "Dell", Product: "Integrated Dell Remote Access Controller",
		SystemID: "System.Embedded.1", SessionService: true, TLSMaxVersion: tls.VersionTLS12,
		ResetTypes:           []string{"On", "ForceOff", "ForceRestart", "GracefulRestart", "GracefulShutdown", "PushPowerButton", "Nmi", "PowerCycle"},
		RefuseRedundantReset: true,
		GeneralErrorCode:     true,
	}
}

// BasicOnly is an older BMC with no SessionService: basic authentication
// only, and TLS 1.2 only.
func BasicOnly() Profile {
	return Profile{
		Name: "basic-only", Vendor: "Generic", Product: "Legacy BMC", SystemID: "1",
		TLSMaxVersion: tls.VersionTLS12,
		ResetTypes:    []string{"On", "ForceOff", "ForceRestart", "GracefulShutdown"},
	}
}

// NoForceOff is a BMC whose reset types lack ForceOff and Off: only On,
// GracefulShutdown and PushPowerButton (seen on some Supermicro and HPE
// firmware), so an immediate power-off must press the power button.
func NoForceOff() Profile {
	return Profile{
		Name: "no-forceoff", Vendor: "Generic", Product: "Button BMC", SystemID: "1",
		SessionService: true,
		ResetTypes:     []string{"On", "GracefulShutdown", "PushPowerButton"},
	}
}

// NoAllowableValues is a BMC that does not annotate its Reset action with
// ResetType@Redfish.AllowableValues at all.
func NoAllowableValues() Profile {
	return Profile{
		Name: "no-allowable-values", Vendor: "Generic", Product: "Quiet BMC", SystemID: "1",
		SessionService: true,
	}
}

// Profiles returns every predefined profile, for tests that run once per
// profile.
func Profiles() []Profile {
	return []Profile{OpenBMC(), IDRAC(), BasicOnly(), NoForceOff(), NoAllowableValues()}
}

// allows reports whether the profile accepts reset type t.
func (p Profile) allows(t string) bool {
	return p.ResetTypes == nil || slices.Contains(p.ResetTypes, t)
}
