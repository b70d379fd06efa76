// Package bmdb is the bare-metal database: the one place where Shepherd keeps
// machines, their tags, and the locks, backoffs and history of the processes
// that work on them (SPEC §2).
//
// A component opens a [Session] whose lease it renews in the background. On
// behalf of the session it claims machines with [Session.Work], which selects
// candidates and claims one in a single statement, and ends each [Work] with
// exactly one of Finish, Fail or Cancel. All liveness decisions use the
// database clock. Sessions that stop renewing lose their locks to the next
// claimer, which records the expiry in history.
//
// A lost reply leaves an outcome unknown, and bmdb resolves it rather than
// leave a machine held by a live session. Finish, Fail and Cancel may be
// retried after an error ([Unavailable] says when that is worth it); a retry
// after an attempt that committed unheard reports success. After a claim whose
// reply was lost, the session releases every work row it holds that no Work of
// its own knows (history Canceled), retrying until the database answers.
//
// bmdb is the only package that speaks SQL. Its queries live in
// bmdb/queries/*.sql (the candidate queries are generated from
// bmdb/candidates/*.sql) and are compiled by sqlc into bmdb/model; callers use
// the types exported here and never import pgx.
package bmdb
