// Package bmdb is the bare-metal database: the one place where Shepherd keeps
// machines, their tags, and the locks, backoffs and history of the processes
// that work on them (SPEC §2). Every component builds on it; this is a short
// tour. The examples run against a real database under `go test`.
//
// # Opening
//
// [Open] connects to PostgreSQL ([Config].URL) and, by default, applies the
// embedded migrations the database lacks ([SchemaMigrate]; serialised
// between processes, so any number may open at once). Processes that must
// not change a shared schema use [SchemaRequireCurrent]. A [DB] is safe for
// concurrent use; Close it when done.
//
// A machine is a row with a UUID plus tags, one optional row per kind
// (Provided, AgentStarted, AgentHeartbeat, installation request, ...).
// Processes find their work by which tags a machine has or lacks, and
// change tags through [Tx], inside a transaction of their session;
// operators' requests ([DB.RequestInstallation], [DB.RequestDecommission])
// are made outside any session.
//
// # Sessions
//
// A running component instance holds a [Session] ([DB.StartSession]): a
// lease the database grants for [SessionConfig].Lease (default
// [DefaultLease]) and the session renews in the background every Lease/3
// until [Session.Close]. Whether a session is alive is decided by the
// database clock alone. A session that misses its renewals is lost: its
// Context is cancelled, its calls fail with [ErrSessionExpired], and the
// work it held goes to the next claimer, which records the expiry (history
// Expired). [DB.KeepSession] runs a function under a session and replaces a
// lost one. [Session.Transact] runs tag changes in a transaction that first
// checks that the session is alive; serialization failures and deadlocks
// restart it, so its function must have no side effects outside the
// database.
//
// # Work
//
// [Session.Work] claims one machine for a [Process]: in a single statement
// it picks the free candidate that has waited longest, locks it, records
// the claim and writes history Started. (An agent-start claim counts the
// wait from the machine's last claim: a machine given back unfinished
// waits behind those never tried, and the machines in flight are not read
// by every next claim.) It returns [ErrNothingToDo] when no
// candidate is free and [ErrWorkConflict] when it kept losing races for
// them. The machine-exclusive processes (all but ProviderUpdate) act on the
// machine itself, and the database lets at most one of them hold a machine.
//
// Exactly one of [Work.Finish], [Work.Fail] or [Work.Cancel] ends a [Work]
// ([Work.FailWithoutBackoff] for work an operator asked for). Finish applies
// the caller's tag changes in the transaction that releases the lock, so the
// side effect's record and the end of the work commit together. After an
// error for which [Unavailable] is true the end may be retried: a retry
// after an attempt that committed unheard reports success. A claim whose
// reply was lost may have committed all the same: the session then releases
// every work item it holds that no Work of its own knows (history Canceled),
// retrying until the database answers.
//
// # Backoff
//
// [Work.Fail] backs the machine off for that process according to a
// [BackoffPolicy]: Initial after the first failure, then the last interval
// times Exponent (rounded up to whole seconds) up to Maximum, each wait
// stretched by a random fraction below Jitter so machines that failed
// together are retried apart. After MaxAttempts failures in a row the
// machine is quarantined for the process (history Quarantined) until an
// operator resets it with [DB.ResetBackoff] (history Reset). A Finish
// clears the backoff. [DB.GetBackoff] reads it; [AgentStartBackoff],
// [RecoveryBackoff] and [DecommissionBackoff] are the processes' defaults,
// and [ParseBackoff] reads a policy from a flag.
//
// # History
//
// Every claim and every end of work appends a row to the machine's history:
// Started, Finished, Failed, Canceled, Held, Expired, Quarantined and Reset,
// with the session that did it and a cause; operators' requests (an
// installation, a decommission) are Requested rows, and the heartbeat
// statement writes the course of an installation (Installing when the
// agent is handed the request, then Installed or InstallFailed).
// [DB.History] reads it with a [HistoryFilter] (one machine, one process,
// a time range, a page after or before an id, oldest or newest first);
// [DB.ExportHistory] writes it out as JSON lines.
//
// # Candidates
//
// A [Candidates] query says which machines of a provider a process should
// work on, judged by their tags: [AgentStartCandidates],
// [RecoveryCandidates] and [DecommissionCandidates]. Work, [DB.ListCandidates]
// and [DB.CountCandidates] add the exclusions every process shares (live
// conflicting work, backoff, quarantine, a decommission request);
// [DB.CountMatching] counts by tags alone. The queries are generated from
// one definition per process (bmdb/candidates/*.sql), so a count cannot
// drift from the query that hands out work.
//
// bmdb is the only package that speaks SQL. Its queries live in
// bmdb/queries/*.sql (the candidate queries are generated from
// bmdb/candidates/*.sql) and are compiled by sqlc into bmdb/model; callers use
// the types exported here and never import pgx.
package bmdb
