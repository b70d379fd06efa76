-- name: HistoryList :many
-- HistoryList pages through history in id order (the order events were
-- written): the first rows of the id range (after_id, before_id),
-- optionally for one machine, one process and a time range. It takes the
-- parameters of HistoryListNewest, its reverse.
SELECT history_id, machine_id, process, event, at, session_id, cause
FROM work_history
WHERE history_id > @after_id AND history_id < @before_id
  AND (sqlc.narg(machine_id)::uuid IS NULL OR machine_id = sqlc.narg(machine_id))
  AND (sqlc.narg(process)::text IS NULL OR process = sqlc.narg(process))
  AND (sqlc.narg(since)::timestamptz IS NULL OR at >= sqlc.narg(since))
  AND (sqlc.narg(until)::timestamptz IS NULL OR at < sqlc.narg(until))
ORDER BY history_id
LIMIT @row_limit::integer;

-- name: HistoryListNewest :many
-- HistoryListNewest pages through history newest first: the last rows of
-- the id range (after_id, before_id), optionally for one machine, one
-- process and a time range. For one machine it reads work_history_machine
-- backwards from before_id.
SELECT history_id, machine_id, process, event, at, session_id, cause
FROM work_history
WHERE history_id > @after_id AND history_id < @before_id
  AND (sqlc.narg(machine_id)::uuid IS NULL OR machine_id = sqlc.narg(machine_id))
  AND (sqlc.narg(process)::text IS NULL OR process = sqlc.narg(process))
  AND (sqlc.narg(since)::timestamptz IS NULL OR at >= sqlc.narg(since))
  AND (sqlc.narg(until)::timestamptz IS NULL OR at < sqlc.narg(until))
ORDER BY history_id DESC
LIMIT @row_limit::integer;
