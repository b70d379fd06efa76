package fakemetal

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// The JSON shapes of notes/metal-wire.md. They are the fake's own, not the
// client's, so that the two are checked against the document and not
// against each other.

type hrefJSON struct {
	ID   string `json:"id"`
	Href string `json:"href"`
}

type slugJSON struct {
	Slug string `json:"slug"`
}

type codeJSON struct {
	Code string `json:"code"`
}

type ipJSON struct {
	Address       string `json:"address"`
	Public        bool   `json:"public"`
	AddressFamily int    `json:"address_family"`
	Management    bool   `json:"management"`
}

type deviceJSON struct {
	ID                  string    `json:"id"`
	ShortID             string    `json:"short_id"`
	Hostname            string    `json:"hostname"`
	State               string    `json:"state"`
	Tags                []string  `json:"tags"`
	CreatedAt           time.Time `json:"created_at"`
	UpdatedAt           time.Time `json:"updated_at"`
	Plan                slugJSON  `json:"plan"`
	OperatingSystem     slugJSON  `json:"operating_system"`
	Facility            codeJSON  `json:"facility"`
	Metro               codeJSON  `json:"metro"`
	IPAddresses         []ipJSON  `json:"ip_addresses"`
	HardwareReservation *hrefJSON `json:"hardware_reservation"`
	Project             hrefJSON  `json:"project"`
	Href                string    `json:"href"`
}

type reservationJSON struct {
	ID            string    `json:"id"`
	ShortID       string    `json:"short_id"`
	Provisionable bool      `json:"provisionable"`
	Spare         bool      `json:"spare"`
	Device        *hrefJSON `json:"device"`
	Plan          slugJSON  `json:"plan"`
	Facility      codeJSON  `json:"facility"`
	Metro         codeJSON  `json:"metro"`
	Project       hrefJSON  `json:"project"`
	CreatedAt     time.Time `json:"created_at"`
	Href          string    `json:"href"`
}

type sshKeyJSON struct {
	ID          string    `json:"id"`
	Label       string    `json:"label"`
	Key         string    `json:"key"`
	Fingerprint string    `json:"fingerprint"`
	CreatedAt   time.Time `json:"created_at"`
	Href        string    `json:"href"`
}

type linkJSON struct {
	Href string `json:"href"`
}

type metaJSON struct {
	First       linkJSON  `json:"first"`
	Previous    *linkJSON `json:"previous"`
	Next        *linkJSON `json:"next"`
	Last        linkJSON  `json:"last"`
	CurrentPage int       `json:"current_page"`
	LastPage    int       `json:"last_page"`
	Total       int       `json:"total"`
}

type devicesJSON struct {
	Devices []deviceJSON `json:"devices"`
	Meta    metaJSON     `json:"meta"`
}

type reservationsJSON struct {
	HardwareReservations []reservationJSON `json:"hardware_reservations"`
	Meta                 metaJSON          `json:"meta"`
}

type sshKeysJSON struct {
	SSHKeys []sshKeyJSON `json:"ssh_keys"`
	Meta    metaJSON     `json:"meta"`
}

type errorsJSON struct {
	Errors []string `json:"errors"`
}

// Request bodies.

type createDeviceJSON struct {
	Hostname              string   `json:"hostname"`
	Plan                  string   `json:"plan"`
	Metro                 string   `json:"metro"`
	Facility              []string `json:"facility"`
	OperatingSystem       string   `json:"operating_system"`
	HardwareReservationID string   `json:"hardware_reservation_id"`
	ProjectSSHKeys        []string `json:"project_ssh_keys"`
	Tags                  []string `json:"tags"`
	Userdata              string   `json:"userdata"`
}

type actionJSON struct {
	Type            string `json:"type"`
	OperatingSystem string `json:"operating_system"`
	DeprovisionFast bool   `json:"deprovision_fast"`
	PreserveData    bool   `json:"preserve_data"`
}

type moveJSON struct {
	ProjectID string `json:"project_id"`
}

type sshKeyBodyJSON struct {
	Label string `json:"label"`
	Key   string `json:"key"`
}

func href(kind, id string) string {
	return PathPrefix + "/" + kind + "/" + url.PathEscape(id)
}

func ref(kind, id string) hrefJSON {
	return hrefJSON{ID: id, Href: href(kind, id)}
}

func (d *device) wire() deviceJSON {
	j := deviceJSON{
		ID: d.id, ShortID: d.id[:8], Hostname: d.hostname, State: d.state,
		Tags: append([]string{}, d.tags...), CreatedAt: d.created.UTC(), UpdatedAt: d.updated.UTC(),
		Plan: slugJSON{d.plan}, OperatingSystem: slugJSON{d.os},
		Facility: codeJSON{d.facility}, Metro: codeJSON{d.metro},
		IPAddresses: []ipJSON{},
		Project:     ref("projects", d.project),
		Href:        href("devices", d.id),
	}
	// Like the real API, addresses appear once the device is provisioned.
	if d.state != StateQueued && d.state != StateProvisioning {
		family := func(a string) int {
			if strings.Contains(a, ":") {
				return 6
			}
			return 4
		}
		pub, v6, priv := d.ip.String(), ipv6Addr(d.n).String(), privateAddr(d.n).String()
		j.IPAddresses = []ipJSON{
			{Address: pub, Public: true, AddressFamily: family(pub), Management: true},
			{Address: v6, Public: true, AddressFamily: 6, Management: true},
			{Address: priv, Public: false, AddressFamily: 4, Management: true},
		}
	}
	if d.reservation != "" {
		r := ref("hardware-reservations", d.reservation)
		j.HardwareReservation = &r
	}
	return j
}

func (r *reservation) wire() reservationJSON {
	j := reservationJSON{
		ID: r.id, ShortID: r.id[:8], Provisionable: r.provisionable, Spare: r.spare,
		Plan: slugJSON{r.plan}, Facility: codeJSON{r.facility}, Metro: codeJSON{r.metro},
		Project: ref("projects", r.project), CreatedAt: r.created.UTC(),
		Href: href("hardware-reservations", r.id),
	}
	if r.device != "" {
		d := ref("devices", r.device)
		j.Device = &d
	}
	return j
}

func (k *sshKey) wire() sshKeyJSON {
	return sshKeyJSON{
		ID: k.id, Label: k.label, Key: k.key, Fingerprint: k.fingerprint,
		CreatedAt: k.created.UTC(), Href: href("ssh-keys", k.id),
	}
}

// response is a handler's answer; a nil body sends none (202, 204).
type response struct {
	status int
	body   any
}

func errorResponse(status int, msg string) response {
	return response{status, errorsJSON{[]string{msg}}}
}

// write sends the response and returns its status.
func (r response) write(w http.ResponseWriter) int {
	if r.body == nil {
		w.WriteHeader(r.status)
		return r.status
	}
	b, err := json.Marshal(r.body)
	if err != nil { // the fake's own types always marshal; this is a bug
		r.status = http.StatusInternalServerError
		b = []byte(`{"errors":["fakemetal: encoding the response: ` + strings.ReplaceAll(err.Error(), `"`, `'`) + `"]}`)
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)+1))
	w.WriteHeader(r.status)
	w.Write(append(b, '\n'))
	return r.status
}

func writeError(w http.ResponseWriter, status int, msg string) int {
	return errorResponse(status, msg).write(w)
}

// decode reads a JSON request body into v. Malformed JSON is 400; valid
// JSON that does not fit the contract (a field it does not name, a wrong
// type) is 422, stricter than the real API on purpose (see the package
// comment).
func decode(body []byte, v any) *response {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	err := dec.Decode(v)
	if err == nil {
		if _, err2 := dec.Token(); err2 != io.EOF {
			err = errors.New("data after the JSON value")
			r := errorResponse(http.StatusBadRequest, "invalid JSON body: "+err.Error())
			return &r
		}
		return nil
	}
	var typeErr *json.UnmarshalTypeError
	if errors.As(err, &typeErr) || strings.HasPrefix(err.Error(), "json: unknown field ") {
		r := errorResponse(http.StatusUnprocessableEntity, "invalid request: "+err.Error())
		return &r
	}
	r := errorResponse(http.StatusBadRequest, "invalid JSON body: "+err.Error())
	return &r
}

// Pagination.

const (
	defaultPerPage = 10
	maxPerPage     = 1000
)

type pageRequest struct {
	page, perPage int
}

// parsePage reads page and per_page (1-based; per_page capped at 1000).
func parsePage(q url.Values) (pageRequest, *response) {
	p := pageRequest{page: 1, perPage: defaultPerPage}
	for name, dst := range map[string]*int{"page": &p.page, "per_page": &p.perPage} {
		v := q.Get(name)
		if v == "" {
			continue
		}
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			r := errorResponse(http.StatusBadRequest, name+" must be a whole number >= 1, got "+strconv.Quote(v))
			return p, &r
		}
		*dst = n
	}
	p.perPage = min(p.perPage, maxPerPage)
	return p, nil
}

// paginate returns the requested page of items (already in list order)
// and its meta, whose links point at path.
func paginate[T any](items []T, p pageRequest, path string) ([]T, metaJSON) {
	total := len(items)
	last := max(1, (total+p.perPage-1)/p.perPage)
	link := func(page int) linkJSON {
		return linkJSON{Href: path + "?page=" + strconv.Itoa(page) + "&per_page=" + strconv.Itoa(p.perPage)}
	}
	m := metaJSON{First: link(1), Last: link(last), CurrentPage: p.page, LastPage: last, Total: total}
	if p.page > 1 {
		prev := link(min(p.page-1, last))
		m.Previous = &prev
	}
	if p.page < last {
		next := link(p.page + 1)
		m.Next = &next
	}
	lo := total // a page past the last one is empty
	if p.page <= last {
		lo = min(total, (p.page-1)*p.perPage)
	}
	hi := min(total, lo+p.perPage)
	return items[lo:hi], m
}
