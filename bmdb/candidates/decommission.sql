-- Decommission: provided machines an operator asked to decommission, oldest
-- request first. This is the one candidate query that does not exclude
-- machines with a decommission request: they are what it selects. It reads
-- machine_decommission_request, which holds only open requests (the
-- decommissioner deletes each one with the machine's other tags), and
-- joins each request to its machine by primary key.
-- +gencandidates:decommission-requests-are-candidates
SELECT p.machine_id, d.requested_at AS since
FROM machine_decommission_request d
JOIN machine_provided p ON p.machine_id = d.machine_id
WHERE p.provider = @provider
