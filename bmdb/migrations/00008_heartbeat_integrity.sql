-- Heartbeat integrity (issue: hardening of the heartbeat path).
--
-- A heartbeat row belongs to the agent that AgentStarted names: without it
-- the row means nothing, and worse, a heartbeat that raced a recovery could
-- leave one behind, so that the next takeover started out Heartbeating with
-- a stale time and was rebooted at once. The foreign key makes that
-- impossible, and deleting AgentStarted (recovery, decommission) takes the
-- heartbeat with it. Heartbeat updates do not change the key, so the hot
-- path pays nothing for it; only a first heartbeat checks it.
--
-- A decommissioned machine keeps its last agent key, so that the callback
-- server can tell that agent to stop instead of refusing it for ever.

-- +goose Up
DELETE FROM machine_agent_heartbeat h
WHERE NOT EXISTS (SELECT 1 FROM machine_agent_started s WHERE s.machine_id = h.machine_id);
ALTER TABLE machine_agent_heartbeat
    ADD CONSTRAINT machine_agent_heartbeat_agent_started_fkey
    FOREIGN KEY (machine_id) REFERENCES machine_agent_started (machine_id) ON DELETE CASCADE;
ALTER TABLE decommissioned_machines ADD COLUMN agent_public_key bytea;

-- +goose Down
ALTER TABLE decommissioned_machines DROP COLUMN agent_public_key;
ALTER TABLE machine_agent_heartbeat DROP CONSTRAINT machine_agent_heartbeat_agent_started_fkey;
