-- An agent-start claim moves its machine to the end of the candidate index
-- range (issue 17 item 5).
--
-- The agent-start candidates are handed out longest waiting first, by the
-- start of the machine's phase or the end of its hold (migration 00014). A
-- claim changed neither, so every machine in flight stayed at the head of
-- the range and each next claim read all of them, probing the work table
-- and the sessions for each, before it reached a free one: with 500
-- takeovers in parallel about 1.3 ms of PostgreSQL CPU per claim, the
-- largest cost of taking over 10,000 machines.
--
-- Now the claim records when it took the machine (agent_start_claimed_at),
-- and the range is ordered by the latest of phase start, hold end and last
-- claim. A claimed machine stays a candidate as far as the index goes (its
-- key is not in the future), so nothing about who may take it changes: the
-- live work keeps others off it, and work of a dead session is expired by
-- the next claim that reaches it. It only waits behind the machines that
-- have waited longer since, which is also the fair order for a machine
-- whose attempt was given back unfinished. A failed attempt's backoff holds
-- it beyond that anyway. The claim's update now changes an index key, so it
-- is no longer a heap-only update: one more index entry per claim, against
-- reading every machine in flight.

-- +goose Up
ALTER TABLE machine_provided ADD COLUMN agent_start_claimed_at timestamptz;

-- Work in flight keeps its place behind the machines that wait.
UPDATE machine_provided p SET agent_start_claimed_at = w.started_at
FROM work w WHERE w.machine_id = p.machine_id AND w.process = 'AgentStart';

DROP INDEX machine_provided_awaiting_agent;
CREATE INDEX machine_provided_awaiting_agent
    ON machine_provided (provider, (GREATEST(agent_phase_since, agent_start_held_until, agent_start_claimed_at)))
    INCLUDE (machine_id)
    WHERE agent_phase = 'AwaitingAgent'
      AND provider_status NOT IN ('Provisioning', 'ProvisioningFailedPermanent', 'Stopped', 'Missing');

-- +goose Down
DROP INDEX machine_provided_awaiting_agent;
ALTER TABLE machine_provided DROP COLUMN agent_start_claimed_at;
CREATE INDEX machine_provided_awaiting_agent
    ON machine_provided (provider, (GREATEST(agent_phase_since, agent_start_held_until)))
    INCLUDE (machine_id)
    WHERE agent_phase = 'AwaitingAgent'
      AND provider_status NOT IN ('Provisioning', 'ProvisioningFailedPermanent', 'Stopped', 'Missing');
