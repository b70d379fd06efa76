-- AgentStart: provided machines whose agent was never started (or was
-- cleared by recovery), longest waiting first; installed machines too, so
-- that one recovered after it fell silent is taken over again. agent_phase
-- encodes "no AgentStarted" and is served by the
-- machine_provided_awaiting_agent partial index. Machines the provider
-- reports as not up (still provisioning, failed, stopped, gone) are left
-- until the updater sees them running: an attempt could only fail and back
-- off for minutes.
SELECT p.machine_id, p.agent_phase_since AS since
FROM machine_provided p
WHERE p.provider = @provider
  AND p.agent_phase = 'AwaitingAgent'
  AND p.provider_status NOT IN ('Provisioning', 'ProvisioningFailedPermanent', 'Stopped', 'Missing')
