package web

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"time"

	"github.com/shepherd/shepherd/bmdb"
)

// pageTemplate is the layout together with one page's templates.
type pageTemplate struct{ t *template.Template }

// pageNames are the page templates in templates/, each parsed together
// with layout.html.
var pageNames = []string{"overview", "machines", "machine", "sessions", "confirm", "error"}

func parsePages() (map[string]*pageTemplate, error) {
	base, err := template.New("layout.html").Funcs(funcs).ParseFS(templateFS, "templates/layout.html")
	if err != nil {
		return nil, fmt.Errorf("web: parsing layout: %w", err)
	}
	pages := make(map[string]*pageTemplate, len(pageNames))
	for _, name := range pageNames {
		t, err := template.Must(base.Clone()).ParseFS(templateFS, "templates/"+name+".html")
		if err != nil {
			return nil, fmt.Errorf("web: parsing page %s: %w", name, err)
		}
		pages[name] = &pageTemplate{t: t}
	}
	return pages, nil
}

// view is what the layout renders: the page's own data is in Data.
type view struct {
	Title string
	Nav   string // the navigation entry to highlight
	// Refresh makes the page reload itself every Refresh seconds (0: never).
	Refresh int
	Actions bool
	Data    any
}

// httpError is an error with the status code and the message a page shows;
// err (logged, never shown) says what went wrong inside.
type httpError struct {
	code int
	msg  string
	err  error
}

func (e *httpError) Error() string {
	if e.err != nil {
		return e.msg + ": " + e.err.Error()
	}
	return e.msg
}

func (e *httpError) Unwrap() error { return e.err }

func badRequest(format string, args ...any) error {
	return &httpError{code: http.StatusBadRequest, msg: fmt.Sprintf(format, args...)}
}

func notFound(format string, args ...any) error {
	return &httpError{code: http.StatusNotFound, msg: fmt.Sprintf(format, args...)}
}

// pageFunc reads what a page shows. It may write the response itself (a
// redirect) and return nil, nil.
type pageFunc func(w http.ResponseWriter, r *http.Request) (*view, error)

// page serves the page template name with the view fn returns, or an error
// page.
func (s *Server) page(name string, fn pageFunc) http.Handler {
	return s.instrument(name, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), requestTimeout)
		defer cancel()
		r = r.WithContext(ctx)
		v, err := fn(w, r)
		if err != nil {
			s.fail(w, r, err)
			return
		}
		if v == nil {
			return
		}
		s.render(w, r, http.StatusOK, name, v)
	}))
}

// fail answers with an error page. Client errors show their message;
// anything else is logged and shown without details, which may name
// database internals.
func (s *Server) fail(w http.ResponseWriter, r *http.Request, err error) {
	var he *httpError
	if !errors.As(err, &he) {
		he = &httpError{code: http.StatusInternalServerError, msg: "reading the BMDB failed; the server log has the details", err: err}
		if errors.Is(err, context.DeadlineExceeded) {
			he.code, he.msg = http.StatusServiceUnavailable, "the BMDB did not answer in time"
		}
	}
	if he.code >= 500 {
		s.log.ErrorContext(r.Context(), "serving page failed", "path", r.URL.Path, "err", err)
	}
	s.render(w, r, he.code, "error", &view{Title: http.StatusText(he.code), Data: he.msg})
}

// render executes the page into a buffer first, so that a template error
// becomes a clean 500 instead of half a page.
func (s *Server) render(w http.ResponseWriter, r *http.Request, code int, name string, v *view) {
	v.Actions = s.cfg.Actions
	var buf bytes.Buffer
	if err := s.pages[name].t.ExecuteTemplate(&buf, "layout", v); err != nil {
		s.log.ErrorContext(r.Context(), "rendering page failed", "page", name, "err", err)
		http.Error(w, "rendering the page failed", http.StatusInternalServerError)
		return
	}
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	// Pages show live state, and confirmation pages carry CSRF tokens.
	h.Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	if r.Method != http.MethodHead {
		_, _ = w.Write(buf.Bytes())
	}
}

// refreshSeconds is the reload interval of self-refreshing pages.
func (s *Server) refreshSeconds() int {
	if s.cfg.Refresh < 0 {
		return 0
	}
	return max(1, int(s.cfg.Refresh.Seconds()))
}

// funcs are the template functions. None of them returns template.HTML or
// another trusted type: everything they produce is escaped like any value.
var funcs = template.FuncMap{
	"ts":         formatTime,
	"ago":        ago,
	"bytes":      formatBytes,
	"dur":        formatDuration,
	"pct":        func(f float64) string { return fmt.Sprintf("%.0f%%", 100*f) },
	"stateClass": stateClass,
	"listURL":    listURL,
	"now":        time.Now,
}

// timeOf returns the time v holds: a time.Time or a *time.Time (nil is the
// zero time), as the BMDB's types have them.
func timeOf(v any) time.Time {
	switch t := v.(type) {
	case time.Time:
		return t
	case *time.Time:
		if t != nil {
			return *t
		}
	}
	return time.Time{}
}

// formatTime shows a time (or *time.Time) in UTC to the second; the zero
// time is "-".
func formatTime(v any) string {
	t := timeOf(v)
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format("2006-01-02 15:04:05Z")
}

// ago says how long ago t (a time.Time or *time.Time) was, to one or two
// units; the zero time is "never". Times in the future (a backoff's end)
// read "in 3m".
func ago(v any) string {
	t := timeOf(v)
	if t.IsZero() {
		return "never"
	}
	d := time.Since(t)
	if d < 0 {
		return "in " + formatDuration(-d)
	}
	return formatDuration(d) + " ago"
}

// formatDuration rounds d to what a person reads at a glance.
func formatDuration(d time.Duration) string {
	switch {
	case d < time.Second:
		return "0s"
	case d < time.Minute:
		return d.Truncate(time.Second).String()
	case d < time.Hour:
		return twoUnits(int(d.Minutes()), "m", int(d.Seconds())%60, "s")
	case d < 48*time.Hour:
		return twoUnits(int(d.Hours()), "h", int(d.Minutes())%60, "m")
	default:
		return twoUnits(int(d.Hours())/24, "d", int(d.Hours())%24, "h")
	}
}

// twoUnits writes "3m07s", or "3m" when the smaller unit is zero.
func twoUnits(a int, ua string, b int, ub string) string {
	if b == 0 {
		return fmt.Sprintf("%d%s", a, ua)
	}
	return fmt.Sprintf("%d%s%02d%s", a, ua, b, ub)
}

// formatBytes shows a size in binary units.
func formatBytes(n any) string {
	var v float64
	switch x := n.(type) {
	case uint64:
		v = float64(x)
	case int64:
		v = float64(x)
	case int32:
		v = float64(x)
	case int:
		v = float64(x)
	case float64:
		v = x
	default:
		return fmt.Sprint(n)
	}
	units := []string{"B", "KiB", "MiB", "GiB", "TiB", "PiB"}
	i := 0
	for v >= 1024 && i < len(units)-1 {
		v /= 1024
		i++
	}
	if i == 0 {
		return fmt.Sprintf("%.0f B", v)
	}
	return fmt.Sprintf("%.1f %s", v, units[i])
}

// stateClass is the CSS class of a state's badge: the colour says whether
// an operator should look.
func stateClass(state any) string {
	switch st := bmdb.MachineState(fmt.Sprint(state)); st {
	case bmdb.StateHealthy, bmdb.StateInstalled:
		return "ok"
	case bmdb.StateSilent, bmdb.StateBackedOff, bmdb.StateMissing, bmdb.StateStopped:
		return "warn"
	case bmdb.StateQuarantined, bmdb.StateInstallFailed:
		return "bad"
	default:
		return "busy"
	}
}

// listURL is the machine list filtered by the given key, value pairs.
func listURL(kv ...string) string {
	q := url.Values{}
	for i := 0; i+1 < len(kv); i += 2 {
		if kv[i+1] != "" {
			q.Set(kv[i], kv[i+1])
		}
	}
	if len(q) == 0 {
		return "/machines"
	}
	return "/machines?" + q.Encode()
}
