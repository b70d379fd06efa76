package manager

import "time"

// SetUpdaterWaitHook makes Run tell f the period it waits after each pass
// (before jitter). Call it before Run.
func SetUpdaterWaitHook(u *Updater, f func(time.Duration)) { u.waiting = f }

// ListingSuspect reports whether g finds a listing that lacks missing of
// present machines suspect.
func ListingSuspect(g ListingGuard, missing, present int) bool { return g.suspect(missing, present) }
