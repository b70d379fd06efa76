package metal

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
)

// pageMeta is the part of a page's "meta" the client uses.
type pageMeta struct {
	Next *struct {
		Href string `json:"href"`
	} `json:"next"`
	LastPage int `json:"last_page"`
	Total    int `json:"total"`
}

// reportedPages is how many pages the API says the listing has, at
// perPage objects a page; 0 if it does not say.
func (m pageMeta) reportedPages(perPage int) int {
	switch {
	case m.LastPage > 0:
		return m.LastPage
	case m.Total > 0:
		return (m.Total + perPage - 1) / perPage
	}
	return 0
}

// pageLimit is how many pages a listing may take when the API reported
// that it has reported pages (0: it did not say): that many, plus slack
// for objects created while the listing runs, which push others onto later
// pages; never more than hardMax.
func pageLimit(reported, hardMax int) int {
	if reported <= 0 {
		return hardMax
	}
	return min(hardMax, reported+reported/10+10)
}

// listAll reads every page of a listing: it asks for c.cfg.PerPage objects
// a page and follows meta.next.href until it is null. Objects are
// deduplicated by id (offset pagination repeats an object when another is
// created meanwhile). A page link seen before, a page that repeats an
// earlier one, or more pages than the API reported (meta.last_page, or
// meta.total; with some slack, see pageLimit) end the listing with an
// error rather than loop forever; so does a listing of more than
// maxListObjects from an API that does not report its length. Each page is
// one call, with its own RetryDeadline.
func listAll[T any](ctx context.Context, c *Client, endpoint, path, key string, id func(T) string) ([]T, error) {
	q := url.Values{}
	q.Set("page", "1")
	q.Set("per_page", strconv.Itoa(c.cfg.PerPage))
	path += "?" + q.Encode()

	seenLinks := map[string]bool{path: true}
	seenPages := map[string]bool{}
	seenIDs := map[string]bool{}
	var all []T
	reported := 0 // the most pages the API said the listing has
	for page := 1; ; page++ {
		var raw map[string]json.RawMessage
		if err := c.do(ctx, &request{method: http.MethodGet, endpoint: endpoint, path: path, repeatable: true}, &raw); err != nil {
			return nil, fmt.Errorf("listing %s (page %d): %w", key, page, err)
		}
		itemsJSON, ok := raw[key]
		if !ok {
			return nil, fmt.Errorf("metal: GET %s: listing %s: the answer has no %q", path, key, key)
		}
		var items []T
		if err := json.Unmarshal(itemsJSON, &items); err != nil {
			return nil, fmt.Errorf("metal: GET %s: decoding %s: %w", path, key, err)
		}
		var meta pageMeta
		if m, ok := raw["meta"]; ok && string(m) != "null" {
			if err := json.Unmarshal(m, &meta); err != nil {
				return nil, fmt.Errorf("metal: GET %s: decoding meta: %w", path, err)
			}
		}

		ids := make([]string, len(items))
		for i, it := range items {
			if ids[i] = id(it); ids[i] == "" {
				return nil, fmt.Errorf("metal: GET %s: %s[%d] has no id", path, key, i)
			}
		}
		fp := strings.Join(ids, "\x00")
		if len(items) > 0 && seenPages[fp] {
			return nil, fmt.Errorf("metal: GET %s: listing %s: page %d repeats an earlier page", path, key, page)
		}
		seenPages[fp] = true
		for i, it := range items {
			if !seenIDs[ids[i]] {
				seenIDs[ids[i]] = true
				all = append(all, it)
			}
		}

		if meta.Next == nil || meta.Next.Href == "" {
			return all, nil
		}
		next, err := c.nextPath(meta.Next.Href)
		if err != nil {
			return nil, fmt.Errorf("metal: GET %s: listing %s: %w", path, key, err)
		}
		if seenLinks[next] {
			return nil, fmt.Errorf("metal: GET %s: listing %s: the next page link %q leads back to an earlier page",
				path, key, next)
		}
		reported = max(reported, meta.reportedPages(c.cfg.PerPage))
		if limit := pageLimit(reported, c.maxPages); page >= limit {
			if reported > 0 {
				return nil, fmt.Errorf("metal: listing %s: more than %d pages (the API reported %d)", key, limit, reported)
			}
			return nil, fmt.Errorf("metal: listing %s: more than %d pages", key, limit)
		}
		seenLinks[next] = true
		path = next
	}
}

// nextPath turns a page link, normally a path relative to the host such as
// "/metal/v1/projects/P/devices?page=2&per_page=100", into a path below the
// base URL with a canonical query. A link to another scheme, host or path
// prefix is refused: following it would send the token there.
func (c *Client) nextPath(href string) (string, error) {
	ref, err := url.Parse(href)
	if err != nil {
		return "", fmt.Errorf("the next page link %q is not a URL", href)
	}
	if !ref.IsAbs() && !strings.HasPrefix(ref.Path, "/") {
		return "", fmt.Errorf("the next page link %q is neither absolute nor host-relative", href)
	}
	u := c.base.ResolveReference(ref)
	basePath := strings.TrimRight(c.base.Path, "/")
	rest, ok := strings.CutPrefix(u.EscapedPath(), basePath)
	if u.Scheme != c.base.Scheme || u.Host != c.base.Host || u.User != nil || !ok || !strings.HasPrefix(rest, "/") {
		return "", fmt.Errorf("the next page link %q leaves the API at %s", href, c.cfg.BaseURL)
	}
	q := u.Query()
	if q.Get("per_page") == "" {
		q.Set("per_page", strconv.Itoa(c.cfg.PerPage))
	}
	return rest + "?" + q.Encode(), nil
}
