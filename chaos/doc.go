// Package chaos is Shepherd's randomized fault soak (`make chaos`; a short
// run is part of `make test`).
//
// The soak runs the real binaries against real PostgreSQL: three `shepherd
// run` processes with the components spread over them share one BMDB, a
// primary with a synchronous streaming standby reached through TCP proxies
// and a multi-host URL. They manage a simulated fleet (provider/sim, served
// over real TCP SSH and taken over through the static provider, so every
// process reaches every machine) and a few real OpenSSH machines running the
// real agent. A seeded schedule (Schedule) injects faults at random times
// and in random combinations: processes killed and restarted, stopped past
// their lease and continued, PostgreSQL restarted, failed over, black-holed,
// delayed or reset, agents hung and machines dead, reboots that fail or
// hang, a rack cut off from the callback server, host keys rotated, and a
// hostile client. The simulator records what really happened (Truth); at
// the end the invariants I1–I8 of issue 11 are checked in SQL over the BMDB
// and against that ground truth.
//
// The harness is in the package's test files, since it starts its servers
// with the test helpers; this file set holds what is pure: the schedule and
// the ground truth.
package chaos
