package web

import (
	"net/http"

	"github.com/shepherd/shepherd/bmdb"
)

// maxSessions bounds the sessions page; a fleet runs a handful of
// processes, and dead sessions are deleted after a retention period.
const maxSessions = 1000

type sessionsData struct {
	Sessions []bmdb.SessionInfo
	Dead     bool
}

// sessions lists the component instances: the live ones, or with ?dead=on
// also the closed and expired ones the janitor has not deleted yet.
func (s *Server) sessions(_ http.ResponseWriter, r *http.Request) (*view, error) {
	d := &sessionsData{Dead: r.URL.Query().Get("dead") == "on"}
	var err error
	if d.Sessions, err = s.db.ListSessions(r.Context(), d.Dead, maxSessions); err != nil {
		return nil, err
	}
	return &view{Title: "Sessions", Nav: "sessions", Refresh: s.refreshSeconds(), Data: d}, nil
}
