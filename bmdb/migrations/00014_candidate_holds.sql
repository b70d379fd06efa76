-- Backed-off and quarantined machines leave the candidate index ranges
-- (issue 10 item 20, SPEC §2.6 at scale).
--
-- The candidate indexes hand machines out oldest first by phase time or
-- heartbeat time, which a failure does not move: a machine in backoff stayed
-- at the front of its range and every claim scanned past it (50,000
-- AwaitingAgent machines with all but 10 backed off cost 200,000 buffer hits
-- per claim). Now a backoff or quarantine of AgentStart or Recovery is
-- mirrored onto the machine as a hold (agent_start_held_until,
-- recovery_held_until: the backoff's end, 'infinity' for a quarantine,
-- NULL for none or for a backoff already over when written), maintained by
-- a trigger on work_backoff. Agent start orders its index by the later of
-- phase start and hold end, so held machines lie beyond now() in it.
-- Recovery's main indexes hold unheld machines only; held machines sit in
-- an index ordered by the end of their hold, where a claim reads only those
-- whose hold has ended (candidates again, ordered by when they became so)
-- and stops at the first that is still held. A recovery hold also clears the
-- heartbeat's watched flag, taking the machine out of the stale-heartbeat
-- index. A hold ends with its backoff row: a finished attempt or an
-- operator's reset deletes it, and the janitor deletes the ended Recovery
-- backoffs of machines that heartbeat again on their own (their held rows
-- would otherwise be read, and skipped, by every recovery claim).

-- +goose Up
ALTER TABLE machine_provided
    ADD COLUMN agent_start_held_until timestamptz,
    ADD COLUMN recovery_held_until timestamptz;

UPDATE machine_provided p SET agent_start_held_until = CASE WHEN b.quarantined_at IS NOT NULL THEN 'infinity' ELSE b.backoff_until END
FROM work_backoff b WHERE b.machine_id = p.machine_id AND b.process = 'AgentStart'
  AND (b.quarantined_at IS NOT NULL OR b.backoff_until > now());
UPDATE machine_provided p SET recovery_held_until = CASE WHEN b.quarantined_at IS NOT NULL THEN 'infinity' ELSE b.backoff_until END
FROM work_backoff b WHERE b.machine_id = p.machine_id AND b.process = 'Recovery'
  AND (b.quarantined_at IS NOT NULL OR b.backoff_until > now());

-- +goose StatementBegin
CREATE FUNCTION work_backoff_hold() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    r work_backoff;
    held timestamptz;
BEGIN
    IF TG_OP = 'DELETE' THEN
        r := OLD;
    ELSE
        r := NEW;
        held := CASE WHEN NEW.quarantined_at IS NOT NULL THEN 'infinity' WHEN NEW.backoff_until > now() THEN NEW.backoff_until END;
    END IF;
    IF r.process = 'AgentStart' THEN
        UPDATE machine_provided SET agent_start_held_until = held
         WHERE machine_id = r.machine_id AND agent_start_held_until IS DISTINCT FROM held;
    ELSIF r.process = 'Recovery' THEN
        UPDATE machine_provided SET recovery_held_until = held
         WHERE machine_id = r.machine_id AND recovery_held_until IS DISTINCT FROM held;
        UPDATE machine_agent_heartbeat SET watched = (held IS NULL)
         WHERE machine_id = r.machine_id AND watched IS DISTINCT FROM (held IS NULL);
    END IF;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER work_backoff_hold AFTER INSERT OR UPDATE OR DELETE ON work_backoff
    FOR EACH ROW EXECUTE FUNCTION work_backoff_hold();

-- The phase triggers keep the watched flag; it now also needs no recovery
-- hold. A machine_provided row added while a backoff exists (re-provided)
-- takes the holds over.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION machine_agent_phase_refresh() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    m uuid;
    phase text;
BEGIN
    IF TG_OP = 'DELETE' THEN
        m := OLD.machine_id;
    ELSE
        m := NEW.machine_id;
    END IF;
    phase := machine_agent_phase(m);
    UPDATE machine_provided SET agent_phase = phase, agent_phase_since = now(), revision = revision + 1
     WHERE machine_id = m AND agent_phase IS DISTINCT FROM phase;
    UPDATE machine_agent_heartbeat h SET watched = w.watched
      FROM (SELECT phase = 'Heartbeating' AND NOT EXISTS (
                SELECT 1 FROM machine_provided p WHERE p.machine_id = m AND p.recovery_held_until IS NOT NULL) AS watched) w
     WHERE h.machine_id = m AND h.watched IS DISTINCT FROM w.watched;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION machine_provided_set_phase() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.agent_phase := machine_agent_phase(NEW.machine_id);
    NEW.agent_phase_since := now();
    SELECT CASE WHEN b.quarantined_at IS NOT NULL THEN 'infinity' WHEN b.backoff_until > now() THEN b.backoff_until END
      INTO NEW.agent_start_held_until
      FROM work_backoff b WHERE b.machine_id = NEW.machine_id AND b.process = 'AgentStart';
    SELECT CASE WHEN b.quarantined_at IS NOT NULL THEN 'infinity' WHEN b.backoff_until > now() THEN b.backoff_until END
      INTO NEW.recovery_held_until
      FROM work_backoff b WHERE b.machine_id = NEW.machine_id AND b.process = 'Recovery';
    RETURN NEW;
END
$$;
-- +goose StatementEnd

UPDATE machine_agent_heartbeat h SET watched = false
FROM machine_provided p WHERE p.machine_id = h.machine_id AND p.recovery_held_until IS NOT NULL AND h.watched;

-- Agent start reads one index, keyed by when each machine became (or
-- becomes) a candidate: the start of its phase, or the end of its hold if
-- that is later (GREATEST ignores a NULL hold; a quarantine is 'infinity').
-- A claim reads the range up to now() in that order, so machines still held
-- lie beyond it and are never read.
DROP INDEX machine_provided_awaiting_agent;
CREATE INDEX machine_provided_awaiting_agent
    ON machine_provided (provider, (GREATEST(agent_phase_since, agent_start_held_until)))
    INCLUDE (machine_id)
    WHERE agent_phase = 'AwaitingAgent'
      AND provider_status NOT IN ('Provisioning', 'ProvisioningFailedPermanent', 'Stopped', 'Missing');
DROP INDEX machine_provided_awaiting_first_heartbeat;
CREATE INDEX machine_provided_awaiting_first_heartbeat ON machine_provided (provider, agent_phase_since)
    INCLUDE (machine_id) WHERE agent_phase = 'AwaitingFirstHeartbeat' AND recovery_held_until IS NULL;
-- The stale-heartbeat index holds the heartbeat time of watched machines
-- only (NULL for the others) as an expression, so that ANALYZE keeps
-- statistics of watched heartbeat times alone: with thousands of silent
-- machines held, the plain column's statistics made the planner expect
-- thousands of watched silent machines and scan machine_provided whole.
DROP INDEX machine_agent_heartbeat_watched;
CREATE INDEX machine_agent_heartbeat_watched ON machine_agent_heartbeat ((CASE WHEN watched THEN agent_heartbeat_at END))
    INCLUDE (machine_id);
CREATE INDEX machine_provided_recovery_held ON machine_provided (provider, recovery_held_until)
    INCLUDE (machine_id, agent_phase, agent_phase_since)
    WHERE agent_phase IN ('AwaitingFirstHeartbeat', 'Heartbeating') AND recovery_held_until IS NOT NULL;

-- Derived machine state (SPEC §3.7; see 00005 for its shape): Installed is a
-- derived state of a healthy machine (00013), silence follows the candidate
-- holds, and Missing and Stopped machines (00011) are never Silent: those
-- states come first.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION machine_states(first_heartbeat_timeout_ms bigint, heartbeat_timeout_ms bigint)
RETURNS TABLE (
    machine_id uuid,
    provider text,
    provider_id text,
    provider_reservation_id text,
    provider_ip_address inet,
    provider_location text,
    provider_status text,
    provider_status_at timestamptz,
    agent_phase text,
    state text
)
LANGUAGE sql STABLE AS $$
SELECT p.machine_id, p.provider, p.provider_id, p.provider_reservation_id, p.provider_ip_address,
       p.provider_location, p.provider_status, p.provider_status_at, p.agent_phase,
       CASE
           WHEN f.decommission_requested THEN 'Decommissioning'
           WHEN p.provider_status = 'Missing' THEN 'Missing'
           WHEN p.provider_status = 'Stopped' THEN 'Stopped'
           WHEN f.quarantined THEN 'Quarantined'
           WHEN f.agent_starting THEN 'AgentStarting'
           WHEN f.recovering THEN 'Recovering'
           WHEN i.failed THEN 'InstallFailed'
           WHEN i.pending AND p.agent_phase = 'Heartbeating' THEN 'Installing'
           WHEN f.backed_off THEN 'BackedOff'
           WHEN p.agent_phase = 'AwaitingAgent' THEN 'Provided'
           WHEN sl.machine_id IS NOT NULL THEN 'Silent'
           WHEN p.agent_phase = 'AwaitingFirstHeartbeat' THEN 'AwaitingFirstHeartbeat'
           WHEN i.installed THEN 'Installed'
           ELSE 'Healthy'
       END
FROM machine_provided p
LEFT JOIN (
    SELECT x.machine_id,
           bool_or(x.flag = 'decommission_requested') AS decommission_requested,
           bool_or(x.flag = 'quarantined') AS quarantined,
           bool_or(x.flag = 'backed_off') AS backed_off,
           bool_or(x.flag = 'agent_starting') AS agent_starting,
           bool_or(x.flag = 'recovering') AS recovering
    FROM (
        SELECT d.machine_id, 'decommission_requested' AS flag
        FROM machine_decommission_request d
        UNION ALL
        -- A quarantine counts whatever its backoff time says.
        SELECT b.machine_id, CASE WHEN b.quarantined_at IS NOT NULL THEN 'quarantined' ELSE 'backed_off' END
        FROM work_backoff b
        WHERE b.quarantined_at IS NOT NULL OR b.backoff_until > now()
        UNION ALL
        -- Work of a dead session is free (SPEC §2.3): it does not count.
        SELECT w.machine_id, CASE WHEN w.process = 'AgentStart' THEN 'agent_starting' ELSE 'recovering' END
        FROM work w
        JOIN sessions ss ON ss.session_id = w.session_id
        WHERE w.process IN ('AgentStart', 'Recovery') AND ss.deadline > now() AND ss.closed_at IS NULL
    ) x
    GROUP BY x.machine_id
) f ON f.machine_id = p.machine_id
-- Every installation request, with what its report (of the same
-- generation) says: failed, installed, or neither yet (pending).
LEFT JOIN (
    SELECT q.machine_id,
           coalesce(r.generation = q.generation AND NOT r.success, false) AS failed,
           coalesce(r.generation = q.generation AND r.success, false) AS installed,
           r.generation IS DISTINCT FROM q.generation AS pending
    FROM machine_os_installation_request q
    LEFT JOIN machine_os_installation_report r ON r.machine_id = q.machine_id
) i ON i.machine_id = p.machine_id
-- Silent: the machines the recovery candidate query selects by tags (its
-- Count...Matching form: a hold does not matter here, the CASE above shows
-- a machine still held as BackedOff or Quarantined). The arms read the same
-- partial indexes as the candidate query; the recorder condition (migration
-- 00013) does not depend on the machine and is evaluated once.
LEFT JOIN (
    SELECT u.machine_id
    FROM (
        -- No heartbeat within the first heartbeat timeout of the start.
        SELECT s.machine_id
        FROM machine_provided p2
        JOIN machine_agent_started s ON s.machine_id = p2.machine_id
        WHERE p2.agent_phase = 'AwaitingFirstHeartbeat'
          AND p2.recovery_held_until IS NULL
          AND p2.agent_phase_since < now() - interval '1 millisecond' * first_heartbeat_timeout_ms
          AND s.agent_started_at < now() - interval '1 millisecond' * first_heartbeat_timeout_ms
        UNION ALL
        -- A watched (Heartbeating, not held) agent's last heartbeat is older
        -- than the heartbeat timeout.
        SELECT h.machine_id
        FROM machine_agent_heartbeat h
        WHERE (CASE WHEN h.watched THEN h.agent_heartbeat_at END) < now() - interval '1 millisecond' * heartbeat_timeout_ms
        UNION ALL
        -- Either, for a machine held by a recovery backoff or quarantine.
        SELECT p3.machine_id
        FROM machine_provided p3
        WHERE p3.agent_phase IN ('AwaitingFirstHeartbeat', 'Heartbeating')
          AND p3.recovery_held_until IS NOT NULL
          AND ((p3.agent_phase = 'AwaitingFirstHeartbeat'
                AND p3.agent_phase_since < now() - interval '1 millisecond' * first_heartbeat_timeout_ms
                AND EXISTS (SELECT 1 FROM machine_agent_started s3 WHERE s3.machine_id = p3.machine_id
                              AND s3.agent_started_at < now() - interval '1 millisecond' * first_heartbeat_timeout_ms))
               OR (p3.agent_phase = 'Heartbeating'
                AND EXISTS (SELECT 1 FROM machine_agent_heartbeat h3 WHERE h3.machine_id = p3.machine_id
                              AND h3.agent_heartbeat_at < now() - interval '1 millisecond' * heartbeat_timeout_ms)))
    ) u
    WHERE NOT (SELECT heartbeat_recording_impaired(heartbeat_timeout_ms))
) sl ON sl.machine_id = p.machine_id
$$;
-- +goose StatementEnd


-- +goose Down
SELECT 'irreversible';
