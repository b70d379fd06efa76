-- name: SilenceTimeoutsSet :exec
-- SilenceTimeoutsSet records the heartbeat timeouts a recoverer uses
-- (migration 00018); the last writer wins.
INSERT INTO silence_timeouts (setting, value_ms, provider, written_by, written_at)
VALUES ('first_heartbeat_timeout', @first_heartbeat_timeout_ms::bigint, @provider::text, @written_by::text, now()),
       ('heartbeat_timeout', @heartbeat_timeout_ms::bigint, @provider::text, @written_by::text, now())
ON CONFLICT (setting) DO UPDATE
SET value_ms = EXCLUDED.value_ms, provider = EXCLUDED.provider, written_by = EXCLUDED.written_by, written_at = EXCLUDED.written_at;

-- name: SilenceTimeoutsGet :many
-- SilenceTimeoutsGet reads the recorded heartbeat timeouts.
SELECT setting, value_ms, provider, written_by, written_at
FROM silence_timeouts
ORDER BY setting;
