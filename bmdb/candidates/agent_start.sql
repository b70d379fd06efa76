-- AgentStart: provided machines whose agent was never started (or was
-- cleared by recovery), longest waiting first; installed machines too, so
-- that one recovered after it fell silent is taken over again. agent_phase
-- encodes "no AgentStarted". Machines the provider reports as not up (still
-- provisioning, failed, stopped, gone) are left until the updater sees them
-- running: an attempt could only fail and back off for minutes.
--
-- since is when the machine became a candidate: the start of its phase, or
-- the end of its AgentStart backoff if that is later (a quarantine holds
-- until 'infinity'; migration 00014), or its last claim if that is later
-- still (migration 00026). The partial index
-- machine_provided_awaiting_agent is keyed by it, so the range up to now()
-- holds exactly the machines not held, in order, and a claim never reads a
-- machine that waits in backoff. The holds are the backoff, so the shared
-- backoff exclusion is left out (holds-exclude-backoff). A claim records
-- its time (claim-sets), which moves its machine behind every machine that
-- waited longer: the next claims do not read the machines in flight at the
-- head of the range.
-- +gencandidates:holds-exclude-backoff
-- +gencandidates:claim-sets agent_start_claimed_at = now()
SELECT p.machine_id, GREATEST(p.agent_phase_since, p.agent_start_held_until, p.agent_start_claimed_at) AS since
FROM machine_provided p
WHERE p.provider = @provider::text
  AND p.agent_phase = 'AwaitingAgent'
  AND p.provider_status NOT IN ('Provisioning', 'ProvisioningFailedPermanent', 'Stopped', 'Missing')
  AND GREATEST(p.agent_phase_since, p.agent_start_held_until, p.agent_start_claimed_at) <= now() -- +gencandidates:not-in-matching
