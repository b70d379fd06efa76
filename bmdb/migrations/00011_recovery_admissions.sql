-- Recovery admissions and reboot streaks (SPEC §3.4).
--
-- recovery_admissions has one row per reboot the recoverer admitted: the
-- transaction that admits it (bmdb Session.AdmitReboot) verifies that the
-- session is alive and holds the machine's Recovery work, that the machine
-- is still silent, that no reboot of the same agent incarnation (machine,
-- agent_started_at) was admitted already, and that the provider's reboots
-- in the circuit breaker's window leave room, and inserts the row. The
-- breaker counts these rows, whatever became of the work afterwards
-- (Finished, Failed, Canceled, Expired): a crash-looping recoverer cannot
-- exceed the budget, and a claim that was not admitted yet counts nothing.
-- A reboot that certainly never reached the machine (a dial error, a
-- machine gone from the inventory) is marked reached = false and does not
-- count. A failed reboot is marked failed, so that a later claim may try
-- the same incarnation again; otherwise at most one admission per
-- incarnation exists (recovery_admissions_incarnation): one reboot per
-- silence episode, even when the worker that issued it lost its session
-- before it could record the result.
--
-- recovery_streaks counts, per machine, the reboots admitted since its
-- agent's last heartbeat: any heartbeat deletes the row (the triggers
-- below), a failed reboot takes itself back, and an operator's Reset of the
-- machine's Recovery (history Reset) deletes it. A machine whose streak
-- reached the recoverer's limit is quarantined instead of being rebooted
-- again: its agent cannot report (a rack that cannot reach the callback
-- server), and rebooting it forever helps nobody.
--
-- Missing and Stopped machines are no longer silent (machine_states is
-- replaced): a machine the provider lost or powered off has no agent to
-- recover, and rebooting it would only fail. They get the derived states
-- Missing and Stopped; the recovery candidate query excludes them too, so
-- that Silent stays exactly the recovery candidates by tags.

-- +goose Up
CREATE TABLE recovery_admissions (
    admission_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    machine_id uuid NOT NULL REFERENCES machines (machine_id),
    provider text NOT NULL,
    -- The session that admitted the reboot; not a foreign key, since the
    -- janitor deletes old sessions.
    session_id uuid,
    -- The agent incarnation being recovered: machine_agent_started's
    -- agent_started_at at admission. NULL only for reboots carried over
    -- from history by this migration.
    agent_started_at timestamptz,
    admitted_at timestamptz NOT NULL DEFAULT now(),
    -- false: the reboot request certainly never reached the machine (or
    -- its provider's API); it does not count against the breaker.
    reached boolean NOT NULL DEFAULT true,
    -- true: the reboot reported an error; a later claim may reboot the
    -- same incarnation again.
    failed boolean NOT NULL DEFAULT false,
    CHECK (reached OR failed)
);
CREATE UNIQUE INDEX recovery_admissions_incarnation ON recovery_admissions (machine_id, agent_started_at)
    WHERE NOT failed;
CREATE INDEX recovery_admissions_window ON recovery_admissions (provider, admitted_at) WHERE reached;
CREATE INDEX recovery_admissions_at ON recovery_admissions (admitted_at);

-- The reboots of the last day, as the old count saw them (Recovery work
-- that ended Finished or Failed), so that the breaker's window stays honest
-- across the upgrade. They do not block a later reboot of any incarnation.
INSERT INTO recovery_admissions (machine_id, provider, session_id, agent_started_at, admitted_at, reached, failed)
SELECT h.machine_id, p.provider, h.session_id, NULL, h.at, true, true
FROM work_history h
JOIN machine_provided p ON p.machine_id = h.machine_id
WHERE h.process = 'Recovery' AND h.event IN ('Finished', 'Failed') AND h.at > now() - interval '1 day';

CREATE TABLE recovery_streaks (
    machine_id uuid PRIMARY KEY REFERENCES machines (machine_id),
    -- Reboots admitted since the agent's last heartbeat.
    reboots integer NOT NULL CHECK (reboots >= 0),
    -- When the first of them was admitted.
    since timestamptz NOT NULL DEFAULT now()
);

-- A heartbeat ends the machine's streak. Statement triggers with transition
-- tables: a heartbeat batch costs one DELETE, not one per row. An UPDATE
-- counts only if it moved agent_heartbeat_at (the phase triggers update
-- the watched flag, which is no heartbeat).
-- +goose StatementBegin
CREATE FUNCTION recovery_streak_end_inserted() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM recovery_streaks s USING beats b WHERE s.machine_id = b.machine_id;
    RETURN NULL;
END
$$;
-- +goose StatementEnd
-- +goose StatementBegin
CREATE FUNCTION recovery_streak_end_updated() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM recovery_streaks s
    USING beats b JOIN prior o ON o.machine_id = b.machine_id
    WHERE s.machine_id = b.machine_id AND b.agent_heartbeat_at IS DISTINCT FROM o.agent_heartbeat_at;
    RETURN NULL;
END
$$;
-- +goose StatementEnd
CREATE TRIGGER machine_agent_heartbeat_streak_insert AFTER INSERT ON machine_agent_heartbeat
    REFERENCING NEW TABLE AS beats
    FOR EACH STATEMENT EXECUTE FUNCTION recovery_streak_end_inserted();
CREATE TRIGGER machine_agent_heartbeat_streak_update AFTER UPDATE ON machine_agent_heartbeat
    REFERENCING OLD TABLE AS prior NEW TABLE AS beats
    FOR EACH STATEMENT EXECUTE FUNCTION recovery_streak_end_updated();

-- An operator's Reset of a machine's Recovery (shepherd machine reset,
-- an accepted host key) starts its streak over, or the next admission
-- would quarantine it again at once.
-- +goose StatementBegin
CREATE FUNCTION recovery_streak_end_reset() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM recovery_streaks WHERE machine_id = NEW.machine_id;
    RETURN NULL;
END
$$;
-- +goose StatementEnd
CREATE TRIGGER work_history_recovery_reset AFTER INSERT ON work_history
    FOR EACH ROW WHEN (NEW.event = 'Reset' AND NEW.process = 'Recovery')
    EXECUTE FUNCTION recovery_streak_end_reset();

-- machine_states (migration 00005) with the Stopped state, and with the
-- silent arms excluding Missing and Stopped machines as the recovery
-- candidate query does.
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
           WHEN p.agent_phase = 'Installed' THEN 'Installed'
           WHEN i.failed THEN 'InstallFailed'
           WHEN i.machine_id IS NOT NULL AND p.agent_phase = 'Heartbeating' THEN 'Installing'
           WHEN f.backed_off THEN 'BackedOff'
           WHEN p.agent_phase = 'AwaitingAgent' THEN 'Provided'
           WHEN o.machine_id IS NOT NULL OR hs.machine_id IS NOT NULL THEN 'Silent'
           WHEN p.agent_phase = 'AwaitingFirstHeartbeat' THEN 'AwaitingFirstHeartbeat'
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
-- Requests without a report of their generation (pending), and failed ones.
LEFT JOIN (
    SELECT q.machine_id, (r.generation = q.generation) AS failed
    FROM machine_os_installation_request q
    LEFT JOIN machine_os_installation_report r ON r.machine_id = q.machine_id
    WHERE r.generation IS DISTINCT FROM q.generation OR NOT r.success
) i ON i.machine_id = p.machine_id
-- The first arm of the recovery candidate query: no heartbeat within the
-- first heartbeat timeout of the start.
LEFT JOIN (
    SELECT s.machine_id
    FROM machine_provided p2
    JOIN machine_agent_started s ON s.machine_id = p2.machine_id
    WHERE p2.agent_phase = 'AwaitingFirstHeartbeat'
      AND p2.provider_status NOT IN ('Missing', 'Stopped')
      AND p2.agent_phase_since < now() - interval '1 millisecond' * first_heartbeat_timeout_ms
      AND s.agent_started_at < now() - interval '1 millisecond' * first_heartbeat_timeout_ms
) o ON o.machine_id = p.machine_id
-- The second arm: a watched (Heartbeating) agent's last heartbeat is older
-- than the heartbeat timeout.
LEFT JOIN machine_agent_heartbeat hs ON hs.machine_id = p.machine_id AND hs.watched
     AND p.provider_status NOT IN ('Missing', 'Stopped')
     AND hs.agent_heartbeat_at < now() - interval '1 millisecond' * heartbeat_timeout_ms
$$;
-- +goose StatementEnd

-- +goose Down
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
           WHEN f.quarantined THEN 'Quarantined'
           WHEN f.agent_starting THEN 'AgentStarting'
           WHEN f.recovering THEN 'Recovering'
           WHEN p.agent_phase = 'Installed' THEN 'Installed'
           WHEN i.failed THEN 'InstallFailed'
           WHEN i.machine_id IS NOT NULL AND p.agent_phase = 'Heartbeating' THEN 'Installing'
           WHEN f.backed_off THEN 'BackedOff'
           WHEN p.agent_phase = 'AwaitingAgent' THEN 'Provided'
           WHEN o.machine_id IS NOT NULL OR hs.machine_id IS NOT NULL THEN 'Silent'
           WHEN p.agent_phase = 'AwaitingFirstHeartbeat' THEN 'AwaitingFirstHeartbeat'
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
        SELECT b.machine_id, CASE WHEN b.quarantined_at IS NOT NULL THEN 'quarantined' ELSE 'backed_off' END
        FROM work_backoff b
        WHERE b.quarantined_at IS NOT NULL OR b.backoff_until > now()
        UNION ALL
        SELECT w.machine_id, CASE WHEN w.process = 'AgentStart' THEN 'agent_starting' ELSE 'recovering' END
        FROM work w
        JOIN sessions ss ON ss.session_id = w.session_id
        WHERE w.process IN ('AgentStart', 'Recovery') AND ss.deadline > now() AND ss.closed_at IS NULL
    ) x
    GROUP BY x.machine_id
) f ON f.machine_id = p.machine_id
LEFT JOIN (
    SELECT q.machine_id, (r.generation = q.generation) AS failed
    FROM machine_os_installation_request q
    LEFT JOIN machine_os_installation_report r ON r.machine_id = q.machine_id
    WHERE r.generation IS DISTINCT FROM q.generation OR NOT r.success
) i ON i.machine_id = p.machine_id
LEFT JOIN (
    SELECT s.machine_id
    FROM machine_provided p2
    JOIN machine_agent_started s ON s.machine_id = p2.machine_id
    WHERE p2.agent_phase = 'AwaitingFirstHeartbeat'
      AND p2.agent_phase_since < now() - interval '1 millisecond' * first_heartbeat_timeout_ms
      AND s.agent_started_at < now() - interval '1 millisecond' * first_heartbeat_timeout_ms
) o ON o.machine_id = p.machine_id
LEFT JOIN machine_agent_heartbeat hs ON hs.machine_id = p.machine_id AND hs.watched
     AND hs.agent_heartbeat_at < now() - interval '1 millisecond' * heartbeat_timeout_ms
$$;
-- +goose StatementEnd
DROP TRIGGER work_history_recovery_reset ON work_history;
DROP FUNCTION recovery_streak_end_reset();
DROP TRIGGER machine_agent_heartbeat_streak_update ON machine_agent_heartbeat;
DROP TRIGGER machine_agent_heartbeat_streak_insert ON machine_agent_heartbeat;
DROP FUNCTION recovery_streak_end_updated();
DROP FUNCTION recovery_streak_end_inserted();
DROP TABLE recovery_streaks;
DROP TABLE recovery_admissions;
