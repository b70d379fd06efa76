package redfish

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"

	"github.com/stmcginnis/gofish/schemas"

	"github.com/shepherd/shepherd/power"
)

// httpError is a BMC's answer with an error status, as gofish's
// schemas.Error or as our own requests (login, logout) read it.
func httpError(status int, body []byte) error {
	return schemas.ConstructError(status, body)
}

// maxWords bounds how much of what a BMC said goes into a message: an HTML
// error page is no use in a log line. It is applied after scrub, so that a
// secret cut in two cannot slip through half.
const maxWords = 400

// bmcWords returns what a BMC said in a Redfish error: its code and message
// and, because iDRAC and others put the real reason only there, each other
// message of @Message.ExtendedInfo with its id. A body that is not a
// Redfish error is its Message.
func bmcWords(e *schemas.Error) string {
	var parts []string
	if e.Message != "" {
		if e.Code != "" {
			parts = append(parts, e.Code+": "+e.Message)
		} else {
			parts = append(parts, e.Message)
		}
	}
	for _, m := range e.ExtendedInfos {
		if m.Message == "" || m.Message == e.Message {
			continue
		}
		if m.MessageID != "" {
			parts = append(parts, m.MessageID+": "+m.Message)
		} else {
			parts = append(parts, m.Message)
		}
	}
	if len(parts) == 0 {
		return http.StatusText(e.HTTPReturnedStatusCode)
	}
	return strings.Join(parts, "; ")
}

// truncate cuts s to at most n bytes, marking the cut.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return strings.ToValidUTF8(s[:n], "") + "…"
}

// classify turns an error met while doing what into one that names the BMC
// and what was done, wraps the power error class it belongs to, keeps the
// BMC's own words, and contains neither the password nor a session token
// (scrub). It does not wrap err itself: gofish's errors print the raw
// response body, and a transport error's chain is of no use to callers,
// who act on the class.
func (c *call) classify(what string, err error) error {
	if err == nil {
		return nil
	}
	prefix := fmt.Sprintf("redfish %s: %s", c.d.spec.Endpoint(), what)
	// The call's context first: a cancelled request surfaces as whatever the
	// transport was doing at the time.
	switch ctxErr := c.ctx.Err(); {
	case errors.Is(ctxErr, context.Canceled):
		return fmt.Errorf("%s: %s: %w", prefix, c.scrub(err.Error()), context.Canceled)
	case errors.Is(ctxErr, context.DeadlineExceeded):
		// No answer within the call's time: the BMC is, for this call,
		// unreachable; DeadlineExceeded stays visible to errors.Is.
		return fmt.Errorf("%s: no answer before the deadline: %w (%w)", prefix, power.ErrUnreachable, context.DeadlineExceeded)
	}
	var rfErr *schemas.Error
	if errors.As(err, &rfErr) && rfErr.HTTPReturnedStatusCode != 0 {
		status := rfErr.HTTPReturnedStatusCode
		msg := fmt.Sprintf("%s: HTTP %d: %s", prefix, status, truncate(c.scrub(bmcWords(rfErr)), maxWords))
		switch status {
		case http.StatusUnauthorized, http.StatusForbidden:
			return fmt.Errorf("%s: %w", msg, power.ErrAuth)
		case http.StatusServiceUnavailable, http.StatusTooManyRequests:
			return fmt.Errorf("%s: %w", msg, power.ErrBusy)
		}
		return errors.New(msg)
	}
	if isCertificateError(err) {
		return fmt.Errorf("%s: %s: %w", prefix, c.scrub(err.Error()), power.ErrCertificate)
	}
	var urlErr *url.Error
	if errors.As(err, &urlErr) {
		// Refused, reset, timed out, TLS failure other than the certificate,
		// the connection closed before an answer.
		return fmt.Errorf("%s: %s: %w", prefix, c.scrub(urlErr.Err.Error()), power.ErrUnreachable)
	}
	return fmt.Errorf("%s: %s", prefix, c.scrub(err.Error()))
}

// isCertificateError reports whether err is a failure to verify the BMC's
// certificate, which needs an operator, as opposed to a TLS failure (a
// dropped handshake, no common version) that may pass.
func isCertificateError(err error) bool {
	var (
		verify    *tls.CertificateVerificationError
		authority x509.UnknownAuthorityError
		invalid   x509.CertificateInvalidError
		hostname  x509.HostnameError
	)
	return errors.As(err, &verify) || errors.As(err, &authority) ||
		errors.As(err, &invalid) || errors.As(err, &hostname)
}

// scrub removes the password, the basic authentication header's encoding
// of it, and the session token from s, in case a BMC echoes them (some put
// the request, headers and body, in their error messages).
func (c *call) scrub(s string) string {
	basic := base64.StdEncoding.EncodeToString([]byte(c.d.spec.Username + ":" + c.d.spec.Password.Reveal()))
	for _, secret := range []string{c.d.spec.Password.Reveal(), basic, c.token} {
		if secret != "" {
			s = strings.ReplaceAll(s, secret, "REDACTED")
		}
	}
	return s
}

// statusOf returns the HTTP status of an error answer, or 0.
func statusOf(err error) int {
	var rfErr *schemas.Error
	if errors.As(err, &rfErr) {
		return rfErr.HTTPReturnedStatusCode
	}
	return 0
}
