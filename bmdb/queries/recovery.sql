-- name: WorkHeld :one
-- WorkHeld reports whether the session is alive and holds process on the
-- machine. A worker asks it in the transaction that admits a side effect:
-- a worker stalled past its lease (a GC pause, SIGSTOP, a paused VM) may
-- have lost the work to another one.
SELECT EXISTS (
    SELECT 1
    FROM work w
    JOIN sessions s ON s.session_id = w.session_id
    WHERE w.machine_id = @machine_id AND w.process = @process AND w.session_id = @session_id
      AND s.deadline > now() AND s.closed_at IS NULL
)::boolean AS held;

-- name: RecoveryAdmissionState :one
-- RecoveryAdmissionState reads what the admission of a rung of the
-- recovery ladder decides on, for one machine: the agent incarnation (start
-- time) being recovered, whether it ever heartbeated (a heartbeat row
-- exists only for the current incarnation), and whether a rung for it was
-- admitted already and has not failed. No row: the machine has no
-- AgentStarted. The streak is RecoveryStreak.
SELECT s.agent_started_at,
       EXISTS (SELECT 1 FROM machine_agent_heartbeat h WHERE h.machine_id = s.machine_id) AS heartbeated,
       EXISTS (
           SELECT 1 FROM recovery_admissions a
           WHERE a.machine_id = s.machine_id AND a.agent_started_at = s.agent_started_at AND NOT a.failed
       )::boolean AS already_admitted
FROM machine_agent_started s
WHERE s.machine_id = @machine_id;

-- name: RecoveryStreak :many
-- RecoveryStreak lists the rungs of the recovery ladder taken for the
-- machine since its agent last heartbeated, oldest first, failed ones
-- included: the ladder's progress. While the current agent incarnation has
-- heartbeated (a heartbeat row exists only for the current one), the
-- streak is the rungs taken for it: none until it falls silent, then its
-- climb. Otherwise the streak starts at the first admission for the last
-- incarnation that had heartbeated (a climb admits several rungs for one
-- incarnation). An operator's Reset of the machine's Recovery starts it
-- over in either case.
WITH cur AS (
    SELECT s.agent_started_at,
           EXISTS (SELECT 1 FROM machine_agent_heartbeat h WHERE h.machine_id = s.machine_id) AS heartbeated
    FROM machine_agent_started s
    WHERE s.machine_id = @machine_id
),
streak_start AS (
    SELECT GREATEST(
        CASE WHEN (SELECT cur.heartbeated FROM cur) THEN
            COALESCE((SELECT min(a.admitted_at) FROM recovery_admissions a, cur
                      WHERE a.machine_id = @machine_id AND a.agent_started_at = cur.agent_started_at),
                     'infinity'::timestamptz)
        ELSE
            (SELECT min(a.admitted_at) FROM recovery_admissions a
             WHERE a.machine_id = @machine_id AND a.heartbeated
               AND a.agent_started_at = (
                   SELECT max(b.agent_started_at) FROM recovery_admissions b
                   WHERE b.machine_id = @machine_id AND b.heartbeated))
        END,
        (SELECT max(h.at) + interval '1 microsecond' FROM work_history h
         WHERE h.machine_id = @machine_id AND h.process = 'Recovery' AND h.event = 'Reset'),
        '-infinity'::timestamptz) AS at
)
SELECT a.rung, a.failed, a.reached, a.result, a.admitted_at
FROM recovery_admissions a, streak_start st
WHERE a.machine_id = @machine_id AND a.admitted_at >= st.at
ORDER BY a.admission_id;

-- name: RecoveryAdmit :one
-- RecoveryAdmit records an admitted rung of the recovery ladder for the
-- machine's agent incarnation. No row: a reboot of the incarnation was admitted already
-- (recovery_admissions_incarnation).
INSERT INTO recovery_admissions (machine_id, provider, session_id, agent_started_at, heartbeated, rung)
VALUES (@machine_id, @provider, @session_id::uuid, @agent_started_at::timestamptz, @heartbeated, @rung)
ON CONFLICT (machine_id, agent_started_at) WHERE NOT failed DO NOTHING
RETURNING admission_id, admitted_at;

-- name: RecoveryAdmissionFailed :execrows
-- RecoveryAdmissionFailed records that an admitted reboot failed, and
-- whether its request reached the machine at all (one that did not is not
-- counted by the circuit breaker). A failed reboot is no reboot: it is not
-- part of the machine's streak, and a later claim may reboot the
-- incarnation again.
UPDATE recovery_admissions
SET failed = true, reached = @reached, result = @result
WHERE admission_id = @admission_id AND session_id = @session_id::uuid AND NOT failed;

-- name: RecoveryQuarantine :exec
-- RecoveryQuarantine quarantines the machine for Recovery (SPEC §2.5) with
-- the cause, and writes history Quarantined naming the session, unless it is
-- quarantined already. The backoff's interval and attempts stay as they
-- are: the quarantine is not one more failure of the policy. The recoverer
-- quarantines a machine whose ladder is exhausted; an operator's power off
-- holds a machine's recovery with it.
WITH q AS (
    INSERT INTO work_backoff AS b (machine_id, process, backoff_until, cause, last_interval_ms, attempts, quarantined_at)
    VALUES (@machine_id, 'Recovery', now(), @cause, 0, 1, now())
    ON CONFLICT (machine_id, process) DO UPDATE
    SET quarantined_at = now(), cause = EXCLUDED.cause, updated_at = now()
    WHERE b.quarantined_at IS NULL
    RETURNING b.machine_id
)
INSERT INTO work_history (machine_id, process, event, session_id, cause)
SELECT q.machine_id, 'Recovery', 'Quarantined', sqlc.narg(session_id)::uuid, @cause
FROM q;

-- name: RecoveryAdmissionsDelete :execrows
-- RecoveryAdmissionsDelete deletes admissions older than the retention,
-- which is at least the longest breaker window (bmdb.MaxRecoveryWindow).
DELETE FROM recovery_admissions
WHERE admitted_at < now() - interval '1 millisecond' * @retention_ms::bigint;

-- name: RecoveryPowerOffRelease :execrows
-- RecoveryPowerOffRelease ends the quarantine RecoveryPowerOffHold set (its
-- cause starts with @prefix), and writes history Reset; any other
-- quarantine of Recovery stays. The Reset starts the machine's recovery
-- streak over.
WITH d AS (
    DELETE FROM work_backoff b
    WHERE b.machine_id = @machine_id AND b.process = 'Recovery' AND b.quarantined_at IS NOT NULL
      AND starts_with(b.cause, @prefix::text)
    RETURNING b.machine_id
)
INSERT INTO work_history (machine_id, process, event, session_id, cause)
SELECT d.machine_id, 'Recovery', 'Reset', sqlc.narg(session_id)::uuid, @cause
FROM d;
