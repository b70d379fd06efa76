-- name: HeartbeatRecord :many
-- HeartbeatRecord records the heartbeats of many agents, and the reports
-- some of them carry, in one statement: one snapshot authenticates every
-- pair, so a report is stored exactly when its heartbeat is (a key
-- committed between two statements could accept the heartbeat but not its
-- report). Each (machine, key) pair is authenticated against AgentStarted:
-- only a pair whose key is the machine's current agent key counts, and its
-- heartbeat is recorded at database time. Rows are written in machine id
-- order, so that batches sharing machines cannot deadlock. The foreign key
-- of machine_agent_heartbeat makes a heartbeat that raced a recovery
-- (AgentStarted deleted after this statement's snapshot) fail instead of
-- leaving a heartbeat without its AgentStarted; the caller retries it alone.
-- A successful report of the current installation generation forgets the
-- machine's SSH host key recorded on first use: the new system has new host
-- keys (SPEC §3.3); a pinned key stays. A report that differs from the
-- one stored (another generation, or another outcome) writes history
-- Installed or InstallFailed (process Reinstall, the agent's error as the
-- cause), and a pending request handed to the agent for the first time
-- writes history Installing, so that the course of every installation
-- survives later requests.
-- A pair's counter is 0 for a heartbeat that came over TLS, and the
-- datagram's counter for one that came by datagram (migration 00024): a
-- datagram counts only if its counter is above the machine's
-- datagram_counter, which it then becomes; a TLS heartbeat leaves the
-- counter alone. The comparison is the upsert's DO UPDATE condition, so it
-- reads the row as the last committed writer left it, under the row lock,
-- not this statement's snapshot: of two statements carrying the same
-- datagram at once (a replay sent to another callback server), the second
-- waits for the first and then finds the counter no longer below its own.
-- An authenticated pair whose datagram is refused so records nothing (no
-- heartbeat time, no report, no delivery): only the pairs beat accepted go
-- on to the CTEs after it.
-- It returns, per authenticated ordinal (a machine has one current key, so
-- at most one pair per machine), whether it was accepted (false: a replayed
-- datagram), the machine's datagram counter after the statement, what was
-- recorded and the machine's pending installation request: the current
-- request if no report of its generation exists (or arrives now).
WITH req AS (
    -- Set-returning functions in a select list run in lockstep: row i pairs
    -- the i-th element of every array.
    SELECT unnest(@ordinals::integer[]) AS ordinal, unnest(@machine_ids::uuid[]) AS machine_id,
           unnest(@public_keys::bytea[]) AS public_key, unnest(@counters::bigint[]) AS counter
),
authed AS (
    SELECT r.ordinal, s.machine_id, r.counter
    FROM req r
    JOIN machine_agent_started s ON s.machine_id = r.machine_id AND s.agent_public_key = r.public_key
),
beat AS (
    INSERT INTO machine_agent_heartbeat AS h (machine_id, agent_heartbeat_at, datagram_counter)
    SELECT a.machine_id, now(), a.counter FROM authed a ORDER BY a.machine_id
    ON CONFLICT (machine_id) DO UPDATE
    SET agent_heartbeat_at = EXCLUDED.agent_heartbeat_at,
        datagram_counter = GREATEST(h.datagram_counter, EXCLUDED.datagram_counter)
    WHERE EXCLUDED.datagram_counter = 0 OR EXCLUDED.datagram_counter > h.datagram_counter
    RETURNING h.machine_id, h.datagram_counter
),
outcome AS (
    -- Every authenticated pair, and whether beat accepted it. The one join
    -- of authed and beat: with a generic plan, which estimates one row
    -- for every array, a join of two CTEs is a nested loop, its cost the
    -- square of the batch.
    SELECT a.ordinal, a.machine_id, b.machine_id IS NOT NULL AS accepted, b.datagram_counter
    FROM authed a
    LEFT JOIN beat b ON b.machine_id = a.machine_id
),
accepted AS (
    SELECT o.ordinal, o.machine_id FROM outcome o WHERE o.accepted
),
hw AS (
    INSERT INTO machine_hardware_report (machine_id, hardware_report_raw, reported_at, cpu_threads, memory_bytes, disk_count, disk_bytes)
    SELECT a.machine_id, h.raw, now(), h.cpu_threads, h.memory_bytes, h.disk_count, h.disk_bytes
    FROM (
        SELECT unnest(@hw_ordinals::integer[]) AS ordinal, unnest(@hw_raws::bytea[]) AS raw,
               unnest(@hw_cpu_threads::integer[]) AS cpu_threads, unnest(@hw_memory_bytes::bigint[]) AS memory_bytes,
               unnest(@hw_disk_counts::integer[]) AS disk_count, unnest(@hw_disk_bytes::bigint[]) AS disk_bytes
    ) h
    JOIN accepted a ON a.ordinal = h.ordinal
    ORDER BY a.machine_id
    ON CONFLICT (machine_id) DO UPDATE
    SET hardware_report_raw = EXCLUDED.hardware_report_raw,
        reported_at = EXCLUDED.reported_at,
        cpu_threads = EXCLUDED.cpu_threads,
        memory_bytes = EXCLUDED.memory_bytes,
        disk_count = EXCLUDED.disk_count,
        disk_bytes = EXCLUDED.disk_bytes
    RETURNING machine_id
),
prev AS (
    -- The reports as they were before this statement (every part of it
    -- reads the same snapshot).
    SELECT r.machine_id, r.generation, r.success
    FROM machine_os_installation_report r
    JOIN accepted a ON a.machine_id = r.machine_id
),
ins AS (
    INSERT INTO machine_os_installation_report (machine_id, generation, success, error_message, os_installation_report_raw, reported_at)
    SELECT a.machine_id, i.generation, i.success, i.error_message, i.raw, now()
    FROM (
        SELECT unnest(@ins_ordinals::integer[]) AS ordinal, unnest(@ins_generations::bigint[]) AS generation,
               unnest(@ins_successes::boolean[]) AS success, unnest(@ins_error_messages::text[]) AS error_message,
               unnest(@ins_raws::bytea[]) AS raw
    ) i
    JOIN accepted a ON a.ordinal = i.ordinal
    ORDER BY a.machine_id
    ON CONFLICT (machine_id) DO UPDATE
    SET generation = EXCLUDED.generation,
        success = EXCLUDED.success,
        error_message = EXCLUDED.error_message,
        os_installation_report_raw = EXCLUDED.os_installation_report_raw,
        reported_at = EXCLUDED.reported_at
    RETURNING machine_id, generation, success, error_message
),
ins_history AS (
    INSERT INTO work_history (machine_id, process, event, cause)
    SELECT ins.machine_id, 'Reinstall', CASE WHEN ins.success THEN 'Installed' ELSE 'InstallFailed' END,
           'OS installation generation ' || ins.generation::text
               || CASE WHEN ins.success THEN ' installed, the agent reports'
                       ELSE ' failed, the agent reports: ' || ins.error_message END
    FROM ins
    LEFT JOIN prev ON prev.machine_id = ins.machine_id
    WHERE prev.machine_id IS NULL OR prev.generation <> ins.generation OR prev.success <> ins.success
    ORDER BY ins.machine_id
),
pending AS (
    -- The pending installation requests the result returns: the current
    -- request, unless a report of its generation exists or arrives now.
    -- Read once for the result and for delivered, so that a heartbeat
    -- without a pending request (nearly all of them) looks its machine's
    -- request up once, as before delivered_generation was tracked.
    SELECT q.machine_id, q.generation, q.os_installation_request_raw, q.delivered_generation
    FROM accepted a
    JOIN machine_os_installation_request q ON q.machine_id = a.machine_id
    LEFT JOIN ins ON ins.machine_id = a.machine_id
    WHERE q.generation IS DISTINCT FROM ins.generation
      AND NOT EXISTS (
          SELECT 1 FROM machine_os_installation_report ir
          WHERE ir.machine_id = q.machine_id AND ir.generation = q.generation)
),
delivered AS (
    -- Pending requests handed to the agent for the first time (not one
    -- that a request made since this statement's snapshot replaced). The
    -- delivered check reads the row being updated, not the snapshot, so
    -- that of two heartbeats of one machine at once (an agent's retry)
    -- only the first records the delivery.
    UPDATE machine_os_installation_request q
    SET delivered_generation = pd.generation
    FROM pending pd
    WHERE q.machine_id = pd.machine_id AND q.generation = pd.generation
      AND pd.delivered_generation IS DISTINCT FROM pd.generation
      AND q.delivered_generation IS DISTINCT FROM q.generation
    RETURNING q.machine_id, q.generation, q.requested_by
),
delivered_history AS (
    INSERT INTO work_history (machine_id, process, event, cause)
    SELECT d.machine_id, 'Reinstall', 'Installing',
           'OS installation generation ' || d.generation::text
               || CASE WHEN d.requested_by <> '' THEN ' (requested by ' || d.requested_by || ')' ELSE '' END
               || ' handed to the agent with its heartbeat'
    FROM delivered d
    ORDER BY d.machine_id
),
forgotten_host_key AS (
    DELETE FROM machine_ssh_host_key k
    USING ins, machine_os_installation_request q
    WHERE k.machine_id = ins.machine_id AND ins.success AND NOT k.pinned
      AND q.machine_id = ins.machine_id AND q.generation = ins.generation
    RETURNING k.machine_id
)
SELECT a.ordinal::integer AS ordinal,
       a.accepted::boolean AS accepted,
       COALESCE(a.datagram_counter, 0)::bigint AS datagram_counter,
       (hw.machine_id IS NOT NULL)::boolean AS hardware_recorded,
       ins.generation AS installation_recorded,
       pd.generation AS pending_generation,
       pd.os_installation_request_raw AS pending_request
FROM outcome a
LEFT JOIN hw ON hw.machine_id = a.machine_id
LEFT JOIN ins ON ins.machine_id = a.machine_id
LEFT JOIN pending pd ON pd.machine_id = a.machine_id;

-- name: HeartbeatRetired :many
-- HeartbeatRetired returns the ordinals of the pairs whose key is the last
-- agent key of a decommissioned machine: that agent is told to stop.
SELECT r.ordinal::integer AS ordinal
FROM (
    SELECT unnest(@ordinals::integer[]) AS ordinal, unnest(@machine_ids::uuid[]) AS machine_id,
           unnest(@public_keys::bytea[]) AS public_key
) r
JOIN decommissioned_machines d ON d.machine_id = r.machine_id AND d.agent_public_key = r.public_key;

-- name: InstallationGet :one
-- InstallationGet returns the installation request and report of a machine.
SELECT m.machine_id,
       q.generation AS request_generation, q.os_installation_request_raw AS request_raw, q.requested_at,
       q.requested_by,
       r.generation AS report_generation, r.success AS report_success, r.error_message AS report_error,
       r.os_installation_report_raw AS report_raw, r.reported_at
FROM machines m
LEFT JOIN machine_os_installation_request q ON q.machine_id = m.machine_id
LEFT JOIN machine_os_installation_report r ON r.machine_id = m.machine_id
WHERE m.machine_id = @machine_id;

-- name: HardwareReportGet :one
SELECT hardware_report_raw, reported_at, cpu_threads, memory_bytes, disk_count, disk_bytes
FROM machine_hardware_report
WHERE machine_id = @machine_id;

-- name: AgentKeyList :many
-- AgentKeyList returns every machine's current agent key.
SELECT machine_id, agent_public_key FROM machine_agent_started;

-- name: HeartbeatRecorderRegister :exec
-- HeartbeatRecorderRegister registers the session of a callback server as a
-- heartbeat recorder that starts recording now (migration 00013).
INSERT INTO heartbeat_recorders (session_id) VALUES (@session_id)
ON CONFLICT (session_id) DO UPDATE SET ok_since = now(), checked_at = now();

-- name: HeartbeatRecorderCheckIn :execrows
-- HeartbeatRecorderCheckIn confirms that a recorder can write; recovered
-- says it could not before, so its silence window starts again now.
UPDATE heartbeat_recorders
SET checked_at = now(),
    ok_since = CASE WHEN @recovered::boolean THEN now() ELSE ok_since END
WHERE session_id = @session_id;

-- name: DatagramSecretCreate :exec
-- DatagramSecretCreate stores the secret the MAC keys of heartbeat
-- datagrams derive from, unless one exists (migration 00024): the first
-- callback server to ask creates it, and it never changes.
INSERT INTO heartbeat_datagram_secret (secret) VALUES (@secret)
ON CONFLICT (singleton) DO NOTHING;

-- name: DatagramSecretGet :one
-- DatagramSecretGet reads the secret of heartbeat datagrams.
SELECT secret FROM heartbeat_datagram_secret;
