package metal

import (
	"encoding/json"
	"net/netip"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
)

// The objects as notes/metal-wire.md writes them.
const (
	wireDevice = `{"id": "5e0c1c2a-8a0f-4f43-9d0b-1c9a2b3c4d5e", "short_id": "5e0c1c2a", "hostname": "shepherd-abc",
	 "state": "active", "tags": ["a", "shepherd-witness:w1"],
	 "created_at": "2026-01-02T03:04:05Z", "updated_at": "2026-01-02T03:14:05Z",
	 "plan": {"slug": "c3.small.x86"}, "operating_system": {"slug": "ubuntu_22_04"},
	 "facility": {"code": "fr2"}, "metro": {"code": "fr"},
	 "ip_addresses": [{"address": "10.1.2.3", "public": false, "address_family": 4, "management": true},
	                  {"address": "147.28.1.2", "public": true, "address_family": 4, "management": true},
	                  {"address": "2604:1380::1", "public": true, "address_family": 6, "management": true}],
	 "hardware_reservation": {"id": "r1", "href": "/metal/v1/hardware-reservations/r1"},
	 "project": {"id": "p1", "href": "/metal/v1/projects/p1"},
	 "href": "/metal/v1/devices/5e0c1c2a-8a0f-4f43-9d0b-1c9a2b3c4d5e"}`
	wireReservation = `{"id": "r1", "short_id": "r1", "provisionable": true, "spare": false,
	 "device": null, "plan": {"slug": "c3.small.x86"}, "facility": {"code": "fr2"}, "metro": {"code": "fr"},
	 "project": {"id": "p1", "href": "/metal/v1/projects/p1"}, "created_at": "2026-01-02T03:04:05Z",
	 "href": "/metal/v1/hardware-reservations/r1"}`
	wireKey = `{"id": "k1", "label": "shepherd", "key": "ssh-ed25519 AAAAC3Nz", "fingerprint": "aa:bb",
	 "created_at": "2026-01-02T03:04:05Z", "href": "/metal/v1/ssh-keys/k1"}`
)

func TestDecodeWireObjects(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	var d Device
	if err := json.Unmarshal([]byte(wireDevice), &d); err != nil {
		t.Fatal(err)
	}
	wantD := Device{
		ID: "5e0c1c2a-8a0f-4f43-9d0b-1c9a2b3c4d5e", ShortID: "5e0c1c2a", Hostname: "shepherd-abc", State: DeviceStateActive,
		Tags: []string{"a", "shepherd-witness:w1"}, CreatedAt: at, UpdatedAt: at.Add(10 * time.Minute),
		Plan: Slug{"c3.small.x86"}, OperatingSystem: Slug{"ubuntu_22_04"}, Facility: Code{"fr2"}, Metro: Code{"fr"},
		IPAddresses: []IPAddress{
			{Address: "10.1.2.3", AddressFamily: 4, Management: true},
			{Address: "147.28.1.2", Public: true, AddressFamily: 4, Management: true},
			{Address: "2604:1380::1", Public: true, AddressFamily: 6, Management: true},
		},
		HardwareReservation: &Href{ID: "r1", Href: "/metal/v1/hardware-reservations/r1"},
		Project:             &Href{ID: "p1", Href: "/metal/v1/projects/p1"},
		Href:                "/metal/v1/devices/5e0c1c2a-8a0f-4f43-9d0b-1c9a2b3c4d5e",
	}
	if diff := cmp.Diff(wantD, d); diff != "" {
		t.Errorf("device (-want +got):\n%s", diff)
	}
	if w, ok := d.Witness(); !ok || w != "w1" {
		t.Errorf("Witness() = %q, %v, want w1, true", w, ok)
	}

	var r HardwareReservation
	if err := json.Unmarshal([]byte(wireReservation), &r); err != nil {
		t.Fatal(err)
	}
	wantR := HardwareReservation{ID: "r1", ShortID: "r1", Provisionable: true, Plan: Slug{"c3.small.x86"},
		Facility: Code{"fr2"}, Metro: Code{"fr"}, Project: &Href{ID: "p1", Href: "/metal/v1/projects/p1"},
		CreatedAt: at, Href: "/metal/v1/hardware-reservations/r1"}
	if diff := cmp.Diff(wantR, r); diff != "" {
		t.Errorf("reservation (-want +got):\n%s", diff)
	}

	var k SSHKey
	if err := json.Unmarshal([]byte(wireKey), &k); err != nil {
		t.Fatal(err)
	}
	wantK := SSHKey{ID: "k1", Label: "shepherd", Key: "ssh-ed25519 AAAAC3Nz", Fingerprint: "aa:bb", CreatedAt: at,
		Href: "/metal/v1/ssh-keys/k1"}
	if diff := cmp.Diff(wantK, k); diff != "" {
		t.Errorf("SSH key (-want +got):\n%s", diff)
	}
}

func TestPublicIPv4(t *testing.T) {
	t.Parallel()
	pub := func(addr string, mgmt bool) IPAddress {
		return IPAddress{Address: addr, Public: true, AddressFamily: 4, Management: mgmt}
	}
	tests := []struct {
		name string
		ips  []IPAddress
		want string // "" means none
	}{
		{"none yet", nil, ""},
		{"private only", []IPAddress{{Address: "10.0.0.1", AddressFamily: 4, Management: true}}, ""},
		{"v6 only", []IPAddress{{Address: "2604:1380::1", Public: true, AddressFamily: 6, Management: true}}, ""},
		{"first public", []IPAddress{pub("147.28.1.2", false), pub("147.28.1.3", false)}, "147.28.1.2"},
		{"management preferred", []IPAddress{pub("147.28.1.2", false), pub("147.28.1.3", true)}, "147.28.1.3"},
		{"with prefix length", []IPAddress{pub("147.28.1.4/31", true)}, "147.28.1.4"},
		{"garbage skipped", []IPAddress{pub("nope", true), pub("147.28.1.5", false)}, "147.28.1.5"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			got, ok := Device{IPAddresses: tt.ips}.PublicIPv4()
			if tt.want == "" {
				if ok {
					t.Fatalf("PublicIPv4() = %v, true; want none", got)
				}
				return
			}
			if want := netip.MustParseAddr(tt.want); !ok || got != want {
				t.Fatalf("PublicIPv4() = %v, %v; want %v, true", got, ok, want)
			}
		})
	}
}
