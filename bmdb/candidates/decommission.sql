-- Decommission: provided machines an operator asked to decommission, oldest
-- request first. This is the one candidate query that does not exclude
-- machines with a decommission request: they are what it selects. It reads
-- machine_decommission_request, which holds only open requests (the
-- decommissioner deletes each one with the machine's other tags), and
-- joins each request to its machine by primary key.
--
-- since is when the request became a candidate: when it was made, or the
-- end of its Decommission backoff if that is later (a quarantine holds
-- until 'infinity'; migration 00020). The index
-- machine_decommission_request_since is keyed by it, so the range up to
-- now() holds exactly the requests not held, in order, and a claim never
-- reads a request that waits in backoff (a provider refusing to release
-- machines backs off every request). The holds are the backoff, so the
-- shared backoff exclusion is left out:
-- +gencandidates:decommission-requests-are-candidates
-- +gencandidates:holds-exclude-backoff
SELECT p.machine_id, GREATEST(d.requested_at, d.held_until) AS since
FROM machine_decommission_request d
JOIN machine_provided p ON p.machine_id = d.machine_id
WHERE p.provider = @provider::text
  AND GREATEST(d.requested_at, d.held_until) <= now() -- +gencandidates:not-in-matching
