-- Recovery: started, not installed machines whose agent is silent, longest
-- silent first: either no heartbeat arrived within first_heartbeat_timeout of
-- the start, or the last heartbeat is older than heartbeat_timeout. The arms
-- read the partial indexes machine_provided_awaiting_first_heartbeat (whose
-- phase began when AgentStarted was set, so it bounds the start time) and
-- machine_agent_heartbeat_watched, so only silent machines are visited.
-- Machines the provider lost (Missing) or powered off (Stopped) are not
-- silent: there is no agent to recover, and a reboot could only fail.
SELECT p.machine_id, p.agent_phase_since AS since
FROM machine_provided p
JOIN machine_agent_started s ON s.machine_id = p.machine_id
WHERE p.provider = @provider
  AND p.agent_phase = 'AwaitingFirstHeartbeat'
  AND p.provider_status NOT IN ('Missing', 'Stopped')
  AND p.agent_phase_since < now() - interval '1 millisecond' * @first_heartbeat_timeout_ms::bigint
  AND s.agent_started_at < now() - interval '1 millisecond' * @first_heartbeat_timeout_ms::bigint
UNION ALL
SELECT h.machine_id, h.agent_heartbeat_at AS since
FROM machine_agent_heartbeat h
JOIN machine_provided p ON p.machine_id = h.machine_id
WHERE h.watched
  AND h.agent_heartbeat_at < now() - interval '1 millisecond' * @heartbeat_timeout_ms::bigint
  AND p.provider = @provider
  AND p.provider_status NOT IN ('Missing', 'Stopped')
