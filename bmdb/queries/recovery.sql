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
-- whether a reboot of that incarnation was admitted already and has not
-- failed, and the machine's reboot streak (reboots admitted since its
-- agent's last heartbeat). No row: the machine has no AgentStarted.
SELECT s.agent_started_at,
       EXISTS (
           SELECT 1 FROM recovery_admissions a
           WHERE a.machine_id = s.machine_id AND a.agent_started_at = s.agent_started_at AND NOT a.failed
       )::boolean AS already_admitted,
       COALESCE(k.reboots, 0)::integer AS streak,
       k.since AS streak_since
FROM machine_agent_started s
LEFT JOIN recovery_streaks k ON k.machine_id = s.machine_id
WHERE s.machine_id = @machine_id;

-- name: RecoveryAdmit :one
-- RecoveryAdmit records an admitted reboot of the machine's agent
-- incarnation and adds it to the machine's streak. No row: a reboot of the
-- incarnation was admitted already (recovery_admissions_incarnation).
WITH admitted AS (
    INSERT INTO recovery_admissions (machine_id, provider, session_id, agent_started_at)
    VALUES (@machine_id, @provider, @session_id::uuid, @agent_started_at::timestamptz)
    ON CONFLICT (machine_id, agent_started_at) WHERE NOT failed DO NOTHING
    RETURNING admission_id, machine_id
),
streak AS (
    INSERT INTO recovery_streaks AS k (machine_id, reboots)
    SELECT machine_id, 1 FROM admitted
    ON CONFLICT (machine_id) DO UPDATE SET reboots = k.reboots + 1
    RETURNING reboots, since
)
SELECT a.admission_id, s.reboots, s.since
FROM admitted a CROSS JOIN streak s;

-- name: RecoveryAdmissionFailed :execrows
-- RecoveryAdmissionFailed records that an admitted reboot failed, and
-- whether its request reached the machine at all (one that did not is not
-- counted by the circuit breaker). A failed reboot is no reboot: it leaves
-- the machine's streak, and a later claim may reboot the incarnation again.
WITH failed AS (
    UPDATE recovery_admissions
    SET failed = true, reached = @reached
    WHERE admission_id = @admission_id AND session_id = @session_id::uuid AND NOT failed
    RETURNING machine_id
)
UPDATE recovery_streaks k
SET reboots = k.reboots - 1
FROM failed f
WHERE k.machine_id = f.machine_id AND k.reboots > 0;

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
