-- name: FleetStates :many
-- FleetStates counts a provider's machines per derived state (SPEC §3.7),
-- computed from tags on every call and never stored, by the one definition
-- of the state: machine_states (migration 00005), which the machine list
-- and the machine page read too.
WITH ms AS (
    SELECT s.provider::text AS provider, s.state::text AS state
    FROM machine_states(@first_heartbeat_timeout_ms::bigint, @heartbeat_timeout_ms::bigint) s
)
SELECT ms.state, count(*) AS machines
FROM ms
WHERE ms.provider = @provider::text
GROUP BY ms.state
ORDER BY ms.state;
