package redfish

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"

	"github.com/stmcginnis/gofish"
	"github.com/stmcginnis/gofish/schemas"

	"github.com/shepherd/shepherd/power"
)

// call is one Driver call's connection to the BMC: its HTTP client, its
// gofish client, and its session if it logged in.
type call struct {
	d         *Driver
	ctx       context.Context
	transport *http.Transport
	http      *http.Client
	root      serviceRoot
	client    *gofish.APIClient
	session   string // URI of our session, to log out; "" with basic auth
	token     string // the session's X-Auth-Token
}

// serviceRoot is what the driver reads from /redfish/v1 itself, before
// authenticating: gofish keeps the session links private, and the choice
// between session and basic authentication depends on them.
type serviceRoot struct {
	Systems        schemas.Link
	SessionService schemas.Link
	Links          struct{ Sessions schemas.Link }
}

// defaultSessionsPath is where the Redfish specification puts the sessions
// collection, for a root that links a SessionService but not
// Links.Sessions (some older firmware).
const defaultSessionsPath = "/redfish/v1/SessionService/Sessions"

// connect reads the service root, authenticates as spec.Auth says, and
// returns the call ready for gofish. On error nothing is left open. The
// caller must call close.
func (d *Driver) connect(ctx context.Context) (*call, error) {
	tr := &http.Transport{
		// No proxy: BMCs sit on a management network that a proxy from the
		// environment cannot reach.
		Proxy:               nil,
		DialContext:         d.dialer.DialContext,
		TLSClientConfig:     d.tls.Clone(),
		MaxIdleConnsPerHost: 1,
		// HTTP/1.1 only: BMC web servers speak it, and some announce h2
		// and then fail at it.
		ForceAttemptHTTP2: false,
	}
	c := &call{d: d, ctx: ctx, transport: tr, http: &http.Client{Transport: tr}}
	if err := c.readRoot(); err != nil {
		c.close()
		return nil, err
	}
	mode := d.spec.Auth
	if mode == power.AuthAuto {
		mode = power.AuthBasic
		if c.root.Links.Sessions.String() != "" || c.root.SessionService.String() != "" {
			mode = power.AuthSession
		}
	}
	cfg := gofish.ClientConfig{
		Endpoint:          d.endpoint,
		HTTPClient:        c.http,
		NoModifyTransport: true, // keep our TLS settings
		ReuseConnections:  true, // one TLS handshake per call, not per request
	}
	if mode == power.AuthSession {
		if err := c.login(); err != nil {
			c.close()
			return nil, err
		}
		cfg.Session = &gofish.Session{ID: c.session, Token: c.token}
	} else {
		cfg.Username, cfg.Password, cfg.BasicAuth = d.spec.Username, d.spec.Password.Reveal(), true
	}
	client, err := gofish.ConnectContext(ctx, cfg)
	if err != nil {
		c.close()
		return nil, c.classify("reading the service root", err)
	}
	c.client = client
	return c, nil
}

// readRoot reads the service root, which Redfish serves without
// authentication.
func (c *call) readRoot() error {
	body, err := c.request(http.MethodGet, schemas.DefaultServiceRoot, nil, nil)
	if err != nil {
		return c.classify("reading the service root", err)
	}
	if err := json.Unmarshal(body, &c.root); err != nil {
		return c.classify("reading the service root", fmt.Errorf("decoding it: %w", err))
	}
	return nil
}

// login creates a session, keeping its URI and token for close.
func (c *call) login() error {
	uri := c.root.Links.Sessions.String()
	if uri == "" && c.root.SessionService.String() != "" {
		uri = defaultSessionsPath
	}
	if uri == "" {
		return fmt.Errorf("redfish %s: logging in: the service root links no SessionService (use auth: basic): %w",
			c.d.spec.Endpoint(), power.ErrUnsupported)
	}
	payload, err := json.Marshal(struct{ UserName, Password string }{c.d.spec.Username, c.d.spec.Password.Reveal()})
	if err != nil {
		return c.classify("logging in", err)
	}
	var hdr http.Header
	body, err := c.request(http.MethodPost, uri, payload, func(h http.Header) { hdr = h })
	if err != nil {
		return c.classify("logging in", err)
	}
	c.token = hdr.Get("X-Auth-Token")
	c.session = sessionPath(hdr.Get("Location"))
	if c.session == "" { // some BMCs only name the session in the body
		var s struct {
			ID string `json:"@odata.id"`
		}
		_ = json.Unmarshal(body, &s)
		c.session = s.ID
	}
	if c.token == "" {
		err := errors.New("the BMC created a session but sent no X-Auth-Token")
		if c.session != "" { // cannot log out without the token: try basic auth
			c.logout(func(r *http.Request) { r.SetBasicAuth(c.d.spec.Username, c.d.spec.Password.Reveal()) })
		}
		return c.classify("logging in", err)
	}
	return nil
}

// sessionPath reduces a Location, absolute or not, to its path.
func sessionPath(loc string) string {
	if u, err := url.Parse(loc); err == nil && u.Path != "" {
		return u.RequestURI()
	}
	return loc
}

// request does one request with the call's context and returns the body of
// a 2xx answer; other answers become a *schemas.Error. headers, if not nil,
// receives the answer's headers.
func (c *call) request(method, path string, payload []byte, headers func(http.Header)) ([]byte, error) {
	return c.requestCtx(c.ctx, method, path, payload, headers, nil)
}

func (c *call) requestCtx(ctx context.Context, method, path string, payload []byte, headers func(http.Header), auth func(*http.Request)) ([]byte, error) {
	var body io.Reader
	if payload != nil {
		body = bytes.NewReader(payload)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.d.endpoint+path, body)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", "application/json")
	if payload != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if auth != nil {
		auth(req)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if err != nil {
		return nil, err
	}
	if headers != nil {
		headers(resp.Header)
	}
	if !success(resp.StatusCode) {
		return nil, httpError(resp.StatusCode, data)
	}
	return data, nil
}

// success reports whether status is of the 2xx class. Each is a success,
// whichever it is (RFC 9110 §15: a client treats a 2xx it does not know as
// 200): BMCs answer a login with 200 or 201 and a logout with 200, 202 or
// 204.
func success(status int) bool {
	return status >= 200 && status <= 299
}

// close logs out the session if the call opened one and closes the
// connections. Logging out gets a context of its own, with a short timeout,
// because the call's context may be the reason the call ends: a session
// left open holds one of the BMC's few session slots until it times out
// (30 minutes on many BMCs), and a BMC whose slots are full refuses every
// login.
func (c *call) close() {
	if c.session != "" && c.token != "" {
		c.logout(func(r *http.Request) { r.Header.Set("X-Auth-Token", c.token) })
	}
	c.transport.CloseIdleConnections()
}

// logout deletes the session, and logs (never returns) a failure: the
// call's own result matters more to its caller than the leaked session,
// which the BMC expires in the end.
func (c *call) logout(auth func(*http.Request)) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(c.ctx), c.d.cfg.LogoutTimeout)
	defer cancel()
	_, err := c.requestCtx(ctx, http.MethodDelete, c.session, nil, nil, auth)
	if err != nil && statusOf(err) != http.StatusNotFound { // 404: already gone
		c.d.log.WarnContext(c.ctx, "logging out of the BMC failed; its session stays open until it expires",
			slog.String("bmc", c.d.spec.String()), slog.String("session", c.session),
			slog.String("err", c.scrub(err.Error())))
		return
	}
	c.session, c.token = "", ""
}

// system returns the ComputerSystem: the first (normally the only) member
// of the Systems collection.
func (c *call) system() (*schemas.ComputerSystem, error) {
	link := c.root.Systems.String()
	if link == "" {
		return nil, fmt.Errorf("redfish %s: the service root links no Systems collection: %w", c.d.spec.Endpoint(), power.ErrUnsupported)
	}
	coll, err := schemas.GetCollection(c.client, link)
	if err != nil {
		return nil, c.classify("listing the systems", err)
	}
	if len(coll.ItemLinks) == 0 {
		return nil, fmt.Errorf("redfish %s: the Systems collection is empty: %w", c.d.spec.Endpoint(), power.ErrUnsupported)
	}
	sys, err := schemas.GetComputerSystem(c.client, coll.ItemLinks[0])
	if err != nil {
		return nil, c.classify("reading system "+coll.ItemLinks[0], err)
	}
	return sys, nil
}
