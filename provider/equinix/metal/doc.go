// Package metal is a small client of our own for the subset of the
// Equinix Metal v1 API that Shepherd uses (SPEC §5.3): devices, hardware
// reservations and project SSH keys. The official SDKs are gone with the
// service; the exact wire shapes this package speaks are written down in
// notes/metal-wire.md, which the fake server (provider/equinix/fakemetal)
// implements too.
//
// # One client per account
//
// The API meters requests per account, so a Client keeps to the account's
// request budget: a token bucket (Config.RequestsPerSecond, Config.Burst)
// and a bound on requests in flight (Config.MaxConcurrency). Every control
// loop of a process shares one Client per account, and therefore the
// budget. When several processes use the account, Config.SharedBudget
// gives them one bucket among them (Shepherd keeps it in the BMDB, SPEC
// §5.3), named by Config.Account, a digest that does not reveal the token;
// a 429 any of them gets then pauses them all.
//
// # Retries
//
// Every HTTP attempt is bounded by Config.CallTimeout, and a call with all
// its retries by Config.RetryDeadline (and, as always, by its context).
//
//   - 429 Too Many Requests blocks the whole client, every caller, until the
//     later of Retry-After (seconds or an HTTP date) and X-RateLimit-Reset
//     (seconds), at most 10 minutes, then the request is sent again. A 429
//     ends a call early, with an error matching ErrRateLimited, only when
//     the wait would outlast the call's deadline.
//   - Network errors, attempt timeouts, 408 and 5xx answers are retried with
//     jittered exponential backoff (250ms doubling up to 10s) until the
//     deadline, but only where repeating the request is harmless; see
//     below.
//   - Other answers are final. 400, 401, 403, 404 and 422 are permanent
//     (IsPermanent); 404 is ErrNotFound.
//
// # Requests that must not be repeated blindly
//
// A failure after which the server may have acted (a network error or
// timeout once the request's headers were written, a 5xx, a response lost
// or unreadable after the server answered) is ambiguous; one before (no
// connection) is not, and is retried like any transient failure. GETs, PUTs and DELETEs are repeated after
// one. CreateDevice is not: each create carries the caller's witness tag
// (WitnessTag), and after an ambiguous failure, or a 422, the client reads
// the hardware reservation. If it holds a device with our witness that
// device is the result; a device without it means ErrRaceLost; no device
// means it is safe to send the create again. MoveHardwareReservation checks
// the reservation's project the same way, device actions check the
// device's state after an unexpected 422, and EnsureSSHKey lists the keys
// again before it creates one. CreateSSHKey alone leaves the decision to
// its caller and returns an error wrapping ErrOutcomeUnknown.
//
// # Secrets
//
// The API token is sent only in the X-Auth-Token header of requests to
// Config.BaseURL's host: redirects are not followed, and a pagination link
// to another host is refused. It never appears in errors, logs or metrics,
// and Config and Client print it as REDACTED with every fmt verb. Messages
// the API returns are scrubbed of the token before they reach an error.
//
// # Metrics
//
//	shepherd_metal_requests_total{endpoint,method,status}  HTTP attempts; status is the code or "error"
//	shepherd_metal_request_duration_seconds{endpoint}      attempt latency
//	shepherd_metal_rate_limited_total                      429 answers
//	shepherd_metal_retries_total{endpoint}                 attempts after the first within a call
//
// endpoint is a path template such as "/projects/{id}/devices", never an
// id. The collectors are registered on Config.Registerer (a private
// registry when nil). Clients that share a Registerer share the series,
// and their counts add up; to tell accounts apart, give each client a
// registerer wrapped with prometheus.WrapRegistererWith and a label of
// your choosing.
package metal
