-- Recovery: started machines whose agent is silent, longest silent first:
-- either no heartbeat arrived within first_heartbeat_timeout of the start,
-- or the last heartbeat is older than heartbeat_timeout. An installed
-- machine is no exception: one that stopped heartbeating (it rebooted into
-- an OS without the agent, or died) is silent. The first two arms read the
-- partial indexes machine_provided_awaiting_first_heartbeat (whose phase
-- began when AgentStarted was set, so it bounds the start time) and
-- machine_agent_heartbeat_watched (on the heartbeat time of watched
-- machines, an expression, for its statistics), so only silent machines are
-- visited.
-- Machines in Recovery backoff or quarantine are held (migration 00014) and
-- in neither index; the third arm reads them from
-- machine_provided_recovery_held in order of the end of their hold, only
-- those whose hold has ended. A held machine that is Heartbeating is silent
-- unless its heartbeat is recent: it has a heartbeat row (that is what the
-- phase means) and the row is not watched (the hold clears the flag), so
-- the arm asks whether it is among the few unwatched heartbeats that are
-- recent, which machine_agent_heartbeat_unwatched (migration 00023) holds
-- in order of time; NOT h.watched selects that partial index, and its key
-- is an expression so that the planner has statistics of unwatched
-- heartbeat times alone (those of all heartbeats, nearly all recent, made
-- it read the table whole). Asked the other way round, whether the
-- heartbeat is old, it cost an index probe per held machine, and the
-- matching count (the circuit breaker's, which keeps held machines) reads
-- them all: with 2,000 held, 8,000 buffers per count. The start time of
-- a held machine that never sent a heartbeat (its agent may have been
-- started again since its phase began) is read by its key, as a scalar
-- subquery: as an EXISTS, the planner, expecting many held machines, could
-- hash every started agent of the fleet to answer it. Machines the
-- provider lost (Missing) or powered off (Stopped) are not silent: there is
-- no agent to recover, and a reboot could only fail.
--
-- Silence that overlaps the callback servers' own inability to record
-- heartbeats does not count: no machine is silent while a heartbeat
-- recorder (re)started recording within the heartbeat timeout, misses its
-- check-ins (it cannot write now), or died without closing its session
-- within the timeout (heartbeat_recording_impaired, migration 00013). The
-- condition does not depend on the machine: as a scalar subquery it is
-- evaluated once per arm, three times a statement, which is why the
-- function is PL/pgSQL (migration 00025: a SQL function that cannot be
-- inlined plans its body at every call). The holds are
-- the backoff, so the shared backoff exclusion is left out:
-- +gencandidates:holds-exclude-backoff
SELECT p.machine_id, p.agent_phase_since AS since
FROM machine_provided p
JOIN machine_agent_started s ON s.machine_id = p.machine_id
WHERE p.provider = @provider::text
  AND p.agent_phase = 'AwaitingFirstHeartbeat'
  AND p.recovery_held_until IS NULL
  AND p.provider_status NOT IN ('Missing', 'Stopped')
  AND p.agent_phase_since < now() - interval '1 millisecond' * @first_heartbeat_timeout_ms::bigint
  AND s.agent_started_at < now() - interval '1 millisecond' * @first_heartbeat_timeout_ms::bigint
  AND NOT (SELECT heartbeat_recording_impaired(@heartbeat_timeout_ms::bigint))
UNION ALL
SELECT h.machine_id, (CASE WHEN h.watched THEN h.agent_heartbeat_at END) AS since
FROM machine_agent_heartbeat h
JOIN machine_provided p ON p.machine_id = h.machine_id
WHERE (CASE WHEN h.watched THEN h.agent_heartbeat_at END) < now() - interval '1 millisecond' * @heartbeat_timeout_ms::bigint
  AND p.provider = @provider::text
  AND p.provider_status NOT IN ('Missing', 'Stopped')
  AND NOT (SELECT heartbeat_recording_impaired(@heartbeat_timeout_ms::bigint))
UNION ALL
SELECT p.machine_id, p.recovery_held_until AS since
FROM machine_provided p
WHERE p.provider = @provider::text
  AND p.agent_phase IN ('AwaitingFirstHeartbeat', 'Heartbeating')
  AND p.recovery_held_until IS NOT NULL
  AND p.provider_status NOT IN ('Missing', 'Stopped')
  AND p.recovery_held_until <= now() -- +gencandidates:not-in-matching
  AND ((p.agent_phase = 'AwaitingFirstHeartbeat'
        AND p.agent_phase_since < now() - interval '1 millisecond' * @first_heartbeat_timeout_ms::bigint
        AND (SELECT s.agent_started_at FROM machine_agent_started s WHERE s.machine_id = p.machine_id)
            < now() - interval '1 millisecond' * @first_heartbeat_timeout_ms::bigint)
       OR (p.agent_phase = 'Heartbeating'
        AND NOT EXISTS (SELECT 1 FROM machine_agent_heartbeat h WHERE h.machine_id = p.machine_id
                          AND NOT h.watched
                          AND (CASE WHEN NOT h.watched THEN h.agent_heartbeat_at END)
                              >= now() - interval '1 millisecond' * @heartbeat_timeout_ms::bigint)))
  AND NOT (SELECT heartbeat_recording_impaired(@heartbeat_timeout_ms::bigint))
