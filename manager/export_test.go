package manager

import "time"

// SetUpdaterWaitHook makes Run tell f the period it waits after each pass
// (before jitter). Call it before Run.
func SetUpdaterWaitHook(u *Updater, f func(time.Duration)) { u.waiting = f }
