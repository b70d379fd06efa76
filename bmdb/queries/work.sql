-- name: WorkFinish :one
-- WorkFinish releases a work item held by a live session, clears the backoff
-- of (machine, process) and writes history Finished with the cause (what
-- was done, for work an operator asked for; '' for the control loops'). No
-- row: the session is no longer alive or the work is gone, so the lock is
-- not ours any more.
WITH released AS (
    DELETE FROM work w
    USING sessions s
    WHERE w.machine_id = @machine_id AND w.process = @process AND w.session_id = @session_id
      AND s.session_id = w.session_id AND s.deadline > now() AND s.closed_at IS NULL
    RETURNING w.machine_id, w.process, w.session_id
),
cleared AS (
    DELETE FROM work_backoff b
    USING released r
    WHERE b.machine_id = r.machine_id AND b.process = r.process
    RETURNING b.machine_id
)
INSERT INTO work_history (machine_id, process, event, session_id, cause)
SELECT r.machine_id, r.process, 'Finished', r.session_id, @cause
FROM released r
WHERE (SELECT count(*) FROM cleared) >= 0
RETURNING history_id;

-- name: WorkRelease :one
-- WorkRelease releases a work item held by a live session and writes one
-- history row (Failed, Canceled or Held) with the cause. The backoff is not touched.
WITH released AS (
    DELETE FROM work w
    USING sessions s
    WHERE w.machine_id = @machine_id AND w.process = @process AND w.session_id = @session_id
      AND s.session_id = w.session_id AND s.deadline > now() AND s.closed_at IS NULL
    RETURNING w.machine_id, w.process, w.session_id
)
INSERT INTO work_history (machine_id, process, event, session_id, cause)
SELECT r.machine_id, r.process, @event, r.session_id, @cause
FROM released r
RETURNING history_id;

-- name: BackoffGetForUpdate :one
SELECT backoff_until, cause, last_interval_ms, attempts, quarantined_at
FROM work_backoff
WHERE machine_id = @machine_id AND process = @process
FOR UPDATE;

-- name: BackoffUpsert :one
-- BackoffUpsert records a failure: the machine may not be worked by process
-- until now() + delay_ms. quarantine marks the row quarantined (kept if it
-- already was).
INSERT INTO work_backoff (machine_id, process, backoff_until, cause, last_interval_ms, attempts, quarantined_at)
SELECT @machine_id::uuid, @process::text, now() + interval '1 millisecond' * @delay_ms::bigint, @cause::text,
       @last_interval_ms::bigint, @attempts::integer, CASE WHEN @quarantine::boolean THEN now() END
ON CONFLICT (machine_id, process) DO UPDATE
SET backoff_until = EXCLUDED.backoff_until,
    cause = EXCLUDED.cause,
    last_interval_ms = EXCLUDED.last_interval_ms,
    attempts = EXCLUDED.attempts,
    quarantined_at = COALESCE(work_backoff.quarantined_at, EXCLUDED.quarantined_at),
    updated_at = now()
RETURNING backoff_until, quarantined_at;

-- name: HistoryAppend :exec
INSERT INTO work_history (machine_id, process, event, session_id, cause)
VALUES (@machine_id, @process, @event, @session_id, @cause);

-- name: BackoffReset :one
-- BackoffReset clears the backoff and quarantine of (machine, process) and
-- writes history Reset, in one statement. No row: there was nothing to reset.
WITH reset AS (
    DELETE FROM work_backoff b
    WHERE b.machine_id = @machine_id AND b.process = @process
    RETURNING b.machine_id, b.process, b.quarantined_at
)
INSERT INTO work_history (machine_id, process, event, session_id, cause)
SELECT r.machine_id, r.process, 'Reset', sqlc.narg(session_id)::uuid, @cause
FROM reset r
RETURNING history_id;

-- name: BackoffGet :one
SELECT machine_id, process, backoff_until, cause, last_interval_ms, attempts, quarantined_at, updated_at,
       (backoff_until > now())::boolean AS active
FROM work_backoff
WHERE machine_id = @machine_id AND process = @process;

-- name: BackoffListOfProcess :many
-- BackoffListOfProcess is every backoff and quarantine of one process, for
-- an operator's reset of many machines (work_backoff_process_until).
SELECT machine_id, backoff_until, cause, last_interval_ms, attempts, quarantined_at
FROM work_backoff
WHERE process = @process
ORDER BY machine_id;

-- name: ProcessList :many
SELECT process, machine_exclusive FROM processes ORDER BY process;

-- name: WorkList :many
SELECT w.machine_id, w.process, w.session_id, w.started_at,
       (s.deadline > now() AND s.closed_at IS NULL)::boolean AS alive
FROM work w
JOIN sessions s ON s.session_id = w.session_id
WHERE (sqlc.narg(machine_id)::uuid IS NULL OR w.machine_id = sqlc.narg(machine_id))
ORDER BY w.started_at, w.machine_id, w.process;

-- name: WorkReleaseUnknown :many
-- WorkReleaseUnknown releases every work item of a live session except the
-- (machine, process) pairs the session knows it holds, and writes history
-- Canceled with the cause. Such items come from claims that committed while
-- their reply was lost: nobody would ever end them. Work of a dead session is
-- left for expiry.
WITH released AS (
    DELETE FROM work w
    USING sessions s
    WHERE w.session_id = @session_id
      AND s.session_id = w.session_id AND s.deadline > now() AND s.closed_at IS NULL
      -- held names each known item as '<machine id> <process>'.
      AND NOT (w.machine_id::text || ' ' || w.process = ANY (@held::text[]))
    RETURNING w.machine_id, w.process, w.session_id
)
INSERT INTO work_history (machine_id, process, event, session_id, cause)
SELECT r.machine_id, r.process, 'Canceled', r.session_id, @cause
FROM released r
RETURNING machine_id, process;

-- name: WorkLastEvent :one
-- WorkLastEvent is the latest history event a session wrote for (machine,
-- process): after an end whose outcome was unknown, it says whether that end
-- committed.
SELECT event
FROM work_history
WHERE machine_id = @machine_id AND process = @process AND session_id = @session_id
ORDER BY history_id DESC
LIMIT 1;
