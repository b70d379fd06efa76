-- +goose Up
-- Agent start leaves machines the provider reports as not up; the partial
-- index serving it holds only the machines that query can return, so that
-- counting and claiming stay index-only scans.
DROP INDEX machine_provided_awaiting_agent;
CREATE INDEX machine_provided_awaiting_agent ON machine_provided (provider, agent_phase_since)
    INCLUDE (machine_id)
    WHERE agent_phase = 'AwaitingAgent'
      AND provider_status NOT IN ('Provisioning', 'ProvisioningFailedPermanent', 'Stopped', 'Missing');

-- +goose Down
DROP INDEX machine_provided_awaiting_agent;
CREATE INDEX machine_provided_awaiting_agent ON machine_provided (provider, agent_phase_since)
    INCLUDE (machine_id) WHERE agent_phase = 'AwaitingAgent';
