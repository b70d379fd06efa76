-- name: SessionStart :one
-- SessionStart opens a session whose lease runs lease_ms from now (database time).
-- The caller chooses the id, so that a start whose reply was lost can still
-- be closed (SessionAbandon).
INSERT INTO sessions (session_id, component, hostname, pid, version, lease_ms, deadline)
VALUES (@session_id, @component, @hostname, @pid, @version, @lease_ms, now() + interval '1 millisecond' * @lease_ms::bigint)
RETURNING session_id, deadline;

-- name: SessionAbandon :exec
-- SessionAbandon closes a session whose start failed with its outcome
-- unknown (the reply was lost, or the caller gave up waiting for it). It
-- inserts the session closed if its start has not committed, so that a start
-- still in flight then fails on the key instead of opening it; it closes it
-- if it has. Nobody was told of the session, so it holds no work.
INSERT INTO sessions (session_id, component, hostname, pid, version, lease_ms, deadline, closed_at)
VALUES (@session_id, @component, @hostname, @pid, @version, @lease_ms, now(), now())
ON CONFLICT (session_id) DO UPDATE SET closed_at = COALESCE(sessions.closed_at, now());

-- name: SessionRenew :one
-- SessionRenew moves the deadline of a live session; it returns no row once
-- the session has expired or was closed, because the locks of such a session may
-- already belong to someone else and must not be revived.
UPDATE sessions
SET deadline = now() + lease_ms * interval '1 millisecond'
WHERE session_id = @session_id AND deadline > now() AND closed_at IS NULL
RETURNING deadline;

-- name: SessionAlive :one
SELECT EXISTS (
    SELECT 1 FROM sessions
    WHERE session_id = @session_id AND deadline > now() AND closed_at IS NULL)::boolean AS alive;

-- name: SessionLockForClose :exec
-- SessionLockForClose locks the session's row so that claims in flight,
-- which hold it FOR KEY SHARE until they commit, finish first and new ones
-- wait and then find the session closed. SessionClose, in the same
-- transaction, then sees every work item the session holds.
SELECT 1 FROM sessions WHERE session_id = @session_id FOR UPDATE;

-- name: SessionClose :one
-- SessionClose marks the session closed and, if it was still alive, cancels
-- its work (history Canceled) in the same statement. Work of a session that had
-- already expired is left for expiry, which records it as Expired.
WITH closed AS (
    UPDATE sessions s
    SET closed_at = now()
    WHERE s.session_id = @session_id AND s.closed_at IS NULL
    RETURNING (s.deadline > now())::boolean AS alive, s.component, s.hostname, s.pid
),
canceled AS (
    DELETE FROM work w
    WHERE w.session_id = @session_id AND (SELECT cl.alive FROM closed cl)
    RETURNING w.machine_id, w.process, w.session_id
),
canceled_history AS (
    INSERT INTO work_history (machine_id, process, event, session_id, cause)
    SELECT ca.machine_id, ca.process, 'Canceled', ca.session_id,
           'session closed before the work ended (' || cl.component
               || CASE WHEN cl.hostname <> '' THEN ' on ' || cl.hostname || ', pid ' || cl.pid::text ELSE '' END
               || ' is stopping or restarting its session); the machine is free for the next claim'
    FROM canceled ca
    CROSS JOIN closed cl
    RETURNING history_id
)
SELECT
    (SELECT count(*) FROM closed)::bigint AS closed,
    COALESCE((SELECT alive FROM closed), false)::boolean AS was_alive,
    (SELECT count(*) FROM canceled_history)::bigint AS canceled;

-- name: SessionGet :one
SELECT session_id, component, hostname, pid, version, created_at, lease_ms, deadline, closed_at,
       (deadline > now() AND closed_at IS NULL)::boolean AS alive
FROM sessions
WHERE session_id = @session_id;

-- name: SessionList :many
SELECT session_id, component, hostname, pid, version, created_at, lease_ms, deadline, closed_at,
       (deadline > now() AND closed_at IS NULL)::boolean AS alive
FROM sessions
ORDER BY created_at DESC
LIMIT @row_limit::integer;

-- name: WorkExpire :many
-- WorkExpire removes the work of every dead session (deadline passed, or
-- closed while expired) and writes history Expired naming that session.
WITH expired AS (
    DELETE FROM work w
    USING sessions s
    WHERE s.session_id = w.session_id
      AND NOT (s.deadline > now() AND s.closed_at IS NULL)
    RETURNING w.machine_id, w.process, w.session_id,
              dead_session_cause(s.session_id, s.component, s.hostname, s.pid, s.deadline, s.closed_at) AS cause
)
INSERT INTO work_history (machine_id, process, event, session_id, cause)
SELECT machine_id, process, 'Expired', session_id, cause
FROM expired
RETURNING machine_id, process, session_id;

-- name: SessionsDelete :execrows
-- SessionsDelete deletes sessions that ended (closed, or past their deadline)
-- more than retention_ms ago and hold no work; history keeps their ids.
DELETE FROM sessions s
WHERE COALESCE(s.closed_at, s.deadline) < now() - interval '1 millisecond' * @retention_ms::bigint
  AND NOT EXISTS (SELECT 1 FROM work w WHERE w.session_id = s.session_id);
