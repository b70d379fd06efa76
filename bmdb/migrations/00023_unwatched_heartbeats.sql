-- The recoverer's circuit breaker counts silent machines without probing
-- every held one's heartbeat (issue 17 item 4, P3).
--
-- The matching count (CountRecoveryMatching: silent agents by their tags,
-- whatever backoff they wait in) reads every machine held by a Recovery
-- backoff or quarantine, and asked of each Heartbeating one whether its
-- heartbeat was old: an index probe of machine_agent_heartbeat per held
-- machine, 8,000 buffer hits and over 5 ms per count with 2,000 held. A
-- held machine is Heartbeating only with a heartbeat row, and the hold
-- clears the row's watched flag (00014), so the held machines that are not
-- silent are exactly those whose unwatched heartbeat is recent; the query
-- now asks that, once per statement, of this index.
--
-- The index holds the unwatched heartbeats only (the held machines',
-- bounded by the failures in flight), in order of time. A watched
-- heartbeat, every healthy machine's, is not in it, so the heartbeats of a
-- healthy fleet cost it nothing (they update the watched index already,
-- which names agent_heartbeat_at, so none was a HOT update). Its key is an
-- expression, and the statistics object gives the planner the
-- distribution of that expression, the times of unwatched heartbeats
-- alone: the planner ignores the statistics of partial indexes, and the
-- times of all heartbeats, nearly all recent, made it expect thousands of
-- recent unwatched ones and read the table whole instead of the index (as
-- machine_agent_heartbeat_watched, 00014, has its expression for the same
-- reason).

-- +goose Up
CREATE INDEX machine_agent_heartbeat_unwatched ON machine_agent_heartbeat ((CASE WHEN NOT watched THEN agent_heartbeat_at END))
    INCLUDE (machine_id) WHERE NOT watched;
CREATE STATISTICS machine_agent_heartbeat_unwatched_at ON (CASE WHEN NOT watched THEN agent_heartbeat_at END)
    FROM machine_agent_heartbeat;
ANALYZE machine_agent_heartbeat;

-- +goose Down
DROP STATISTICS machine_agent_heartbeat_unwatched_at;
DROP INDEX machine_agent_heartbeat_unwatched;
