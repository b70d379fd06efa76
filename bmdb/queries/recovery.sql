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
-- RecoveryAdmissionState reads what the admission of a reboot decides on,
-- for one machine: the agent incarnation (start time) being recovered,
-- whether it ever heartbeated (a heartbeat row exists only for the current
-- incarnation), whether a reboot of it was admitted already and has not
-- failed, and the machine's reboot streak: the reboots admitted since its
-- agent's last heartbeat, derived from the admissions (the last one whose
-- incarnation had heartbeated starts the streak; a current incarnation
-- that heartbeated ends it) and started over by an operator's Reset of the
-- machine's Recovery. No row: the machine has no AgentStarted.
WITH inc AS (
    SELECT s.machine_id, s.agent_started_at,
           EXISTS (SELECT 1 FROM machine_agent_heartbeat h WHERE h.machine_id = s.machine_id) AS heartbeated
    FROM machine_agent_started s
    WHERE s.machine_id = @machine_id
),
streak_start AS (
    SELECT GREATEST(
        (SELECT max(a.admitted_at) FROM recovery_admissions a
         WHERE a.machine_id = @machine_id AND a.heartbeated),
        (SELECT max(h.at) + interval '1 microsecond' FROM work_history h
         WHERE h.machine_id = @machine_id AND h.process = 'Recovery' AND h.event = 'Reset'),
        '-infinity'::timestamptz) AS at
),
streak AS (
    SELECT count(*) AS reboots, min(a.admitted_at) AS since
    FROM recovery_admissions a, inc, streak_start st
    WHERE a.machine_id = inc.machine_id AND NOT a.failed AND NOT inc.heartbeated
      AND a.admitted_at >= st.at
)
SELECT inc.agent_started_at, inc.heartbeated,
       EXISTS (
           SELECT 1 FROM recovery_admissions a
           WHERE a.machine_id = inc.machine_id AND a.agent_started_at = inc.agent_started_at AND NOT a.failed
       )::boolean AS already_admitted,
       k.reboots::integer AS streak,
       COALESCE(k.since, now())::timestamptz AS streak_since
FROM inc CROSS JOIN streak k;

-- name: RecoveryAdmit :one
-- RecoveryAdmit records an admitted reboot of the machine's agent
-- incarnation. No row: a reboot of the incarnation was admitted already
-- (recovery_admissions_incarnation).
INSERT INTO recovery_admissions (machine_id, provider, session_id, agent_started_at, heartbeated)
VALUES (@machine_id, @provider, @session_id::uuid, @agent_started_at::timestamptz, @heartbeated)
ON CONFLICT (machine_id, agent_started_at) WHERE NOT failed DO NOTHING
RETURNING admission_id, admitted_at;

-- name: RecoveryAdmissionFailed :execrows
-- RecoveryAdmissionFailed records that an admitted reboot failed, and
-- whether its request reached the machine at all (one that did not is not
-- counted by the circuit breaker). A failed reboot is no reboot: it is not
-- part of the machine's streak, and a later claim may reboot the
-- incarnation again.
UPDATE recovery_admissions
SET failed = true, reached = @reached
WHERE admission_id = @admission_id AND session_id = @session_id::uuid AND NOT failed;

-- name: RecoveryQuarantine :exec
-- RecoveryQuarantine quarantines the machine for Recovery (SPEC §2.5) with
-- the cause, and writes history Quarantined naming the session, unless it is
-- quarantined already. The backoff's interval and attempts stay as they
-- are: the quarantine is not one more failure of the policy.
WITH q AS (
    INSERT INTO work_backoff AS b (machine_id, process, backoff_until, cause, last_interval_ms, attempts, quarantined_at)
    VALUES (@machine_id, 'Recovery', now(), @cause, 0, 1, now())
    ON CONFLICT (machine_id, process) DO UPDATE
    SET quarantined_at = now(), cause = EXCLUDED.cause, updated_at = now()
    WHERE b.quarantined_at IS NULL
    RETURNING b.machine_id
)
INSERT INTO work_history (machine_id, process, event, session_id, cause)
SELECT q.machine_id, 'Recovery', 'Quarantined', @session_id::uuid, @cause
FROM q;

-- name: RecoveryAdmissionsDelete :execrows
-- RecoveryAdmissionsDelete deletes admissions older than the retention,
-- which is at least the longest breaker window (bmdb.MaxRecoveryWindow).
DELETE FROM recovery_admissions
WHERE admitted_at < now() - interval '1 millisecond' * @retention_ms::bigint;
