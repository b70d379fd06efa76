-- AgentStart: provided machines whose agent was never started (or was
-- cleared by recovery) and that are not installed, longest waiting first.
-- agent_phase encodes "no AgentStarted, not installed" and is served by the
-- machine_provided_awaiting_agent partial index.
SELECT p.machine_id, p.agent_phase_since AS since
FROM machine_provided p
WHERE p.provider = @provider
  AND p.agent_phase = 'AwaitingAgent'
