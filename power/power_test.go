package power_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/shepherd/shepherd/internal/secret"
	"github.com/shepherd/shepherd/power"
)

func TestSpecValidate(t *testing.T) {
	good := power.Spec{Driver: power.DriverIPMI, Address: "10.0.0.5", Username: "admin", Password: secret.New("pw")}
	if err := good.Validate(); err != nil {
		t.Fatalf("valid ipmi spec: %v", err)
	}
	rf := power.Spec{Driver: power.DriverRedfish, Address: "bmc1", Port: 8443, Username: "root", Password: secret.New("pw"), Auth: power.AuthSession, CAFile: "/ca.pem"}
	if err := rf.Validate(); err != nil {
		t.Fatalf("valid redfish spec: %v", err)
	}
	for _, tt := range []struct {
		name string
		edit func(*power.Spec)
		want string
	}{
		{"no driver", func(s *power.Spec) { s.Driver = "" }, "driver missing"},
		{"unknown driver", func(s *power.Spec) { s.Driver = "amt" }, `driver "amt"`},
		{"cipher suite", func(s *power.Spec) { s.CipherSuite = 2 }, "cipher_suite 2"},
		{"suite 17", func(s *power.Spec) { s.CipherSuite = 17 }, ""},
		{"suite 3", func(s *power.Spec) { s.CipherSuite = 3 }, ""},
		{"ca for ipmi", func(s *power.Spec) { s.CAFile = "x" }, "for redfish"},
		{"insecure for ipmi", func(s *power.Spec) { s.InsecureSkipVerify = true }, "for redfish"},
		{"auth for ipmi", func(s *power.Spec) { s.Auth = power.AuthBasic }, "for redfish"},
		{"no address", func(s *power.Spec) { s.Address = "" }, "address missing"},
		{"port low", func(s *power.Spec) { s.Port = -1 }, "port -1"},
		{"port high", func(s *power.Spec) { s.Port = 65536 }, "port 65536"},
		{"port max", func(s *power.Spec) { s.Port = 65535 }, ""},
		{"no user", func(s *power.Spec) { s.Username = "" }, "username missing"},
		{"no password", func(s *power.Spec) { s.Password = secret.String{} }, "password missing"},
	} {
		s := good
		tt.edit(&s)
		err := s.Validate()
		if tt.want == "" {
			if err != nil {
				t.Errorf("%s: %v", tt.name, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: Validate() = %v, want an error with %q", tt.name, err, tt.want)
		}
	}
	for _, tt := range []struct {
		name string
		edit func(*power.Spec)
		want string
	}{
		{"suite", func(s *power.Spec) { s.CipherSuite = 3 }, "for ipmi"},
		{"auth", func(s *power.Spec) { s.Auth = "digest" }, `auth "digest"`},
		{"basic", func(s *power.Spec) { s.Auth = power.AuthBasic }, ""},
		{"auto", func(s *power.Spec) { s.Auth = power.AuthAuto }, ""},
		{"both", func(s *power.Spec) { s.InsecureSkipVerify = true }, "exclude each other"},
		{"insecure alone", func(s *power.Spec) { s.InsecureSkipVerify, s.CAFile = true, "" }, ""},
	} {
		s := rf
		tt.edit(&s)
		err := s.Validate()
		if tt.want == "" {
			if err != nil {
				t.Errorf("redfish %s: %v", tt.name, err)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("redfish %s: Validate() = %v, want an error with %q", tt.name, err, tt.want)
		}
	}
}

func TestSpecEndpointAndString(t *testing.T) {
	s := power.Spec{Driver: power.DriverIPMI, Address: "10.0.0.5", Username: "admin", Password: secret.New("hunter2")}
	if got := s.Endpoint(); got != "10.0.0.5:623" {
		t.Errorf("ipmi Endpoint() = %q", got)
	}
	s.Driver = power.DriverRedfish
	if got := s.Endpoint(); got != "10.0.0.5:443" {
		t.Errorf("redfish Endpoint() = %q", got)
	}
	s.Address, s.Port = "fe80::1", 8443
	if got := s.Endpoint(); got != "[fe80::1]:8443" {
		t.Errorf("Endpoint() = %q", got)
	}
	for _, out := range []string{s.String(), fmt.Sprintf("%v %+v %#v", s, s, s)} {
		if strings.Contains(out, "hunter2") {
			t.Errorf("password printed: %s", out)
		}
	}
	if got := s.String(); got != "redfish://admin@[fe80::1]:8443" {
		t.Errorf("String() = %q", got)
	}
}

func TestClass(t *testing.T) {
	for _, tt := range []struct {
		err  error
		want string
	}{
		{nil, ""},
		{fmt.Errorf("x: %w", power.ErrAuth), "auth"},
		{fmt.Errorf("x: %w", power.ErrCertificate), "certificate"},
		{fmt.Errorf("x: %w", power.ErrBusy), "busy"},
		{fmt.Errorf("x: %w", power.ErrWrongState), "wrong_state"},
		{fmt.Errorf("x: %w", power.ErrUnsupported), "unsupported"},
		{fmt.Errorf("x: %w", power.ErrNotReached), "not_reached"},
		{fmt.Errorf("x: %w", power.ErrUnreachable), "unreachable"},
		{fmt.Errorf("x: %w", context.Canceled), "canceled"},
		{errors.New("x"), "other"},
		// Auth wins over a transport class wrapped alongside it: it must
		// never be retried.
		{errors.Join(power.ErrUnreachable, power.ErrAuth), "auth"},
	} {
		if got := power.Class(tt.err); got != tt.want {
			t.Errorf("Class(%v) = %q, want %q", tt.err, got, tt.want)
		}
	}
}
