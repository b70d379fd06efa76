-- heartbeat_recording_impaired and duration_text become PL/pgSQL functions,
-- with the same bodies, because a call of a SQL function that PostgreSQL
-- cannot inline costs a plan of its body in every statement that calls it.
--
-- Neither can be inlined: the first is an EXISTS (a subquery), the second
-- reads a FROM clause. So each statement that called them started the SQL
-- function executor afresh, which parsed and planned the body again: about
-- 0.1 ms a call (PostgreSQL 15, measured with auto_explain on a fleet of
-- 100,000 machines). The recovery candidates call
-- heartbeat_recording_impaired once in each of their three arms, so every
-- recovery list, count, matching count and claim paid about 0.3 ms for it:
-- over a third of a claim's execution, and the margin P3's recovery claim
-- (p99 4.4 ms against the 5 ms goal of issue 17) lacked. PL/pgSQL keeps the
-- plan of its expression for the life of the connection, so a call after
-- the first costs about 0.015 ms. duration_text writes the causes of
-- recovery claims (twice in each) and is cheap in either language; it moves
-- with the other so that no cause pays the SQL executor's start-up.
--
-- Behaviour is unchanged: both keep their volatility (STABLE sees the
-- calling statement's snapshot, as before), strictness and results.

-- +goose Up
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION heartbeat_recording_impaired(window_ms bigint) RETURNS boolean
LANGUAGE plpgsql STABLE AS $$
BEGIN
    RETURN EXISTS (
        SELECT 1 FROM heartbeat_recorders r JOIN sessions rs ON rs.session_id = r.session_id
        WHERE rs.closed_at IS NULL
          AND (r.ok_since > now() - interval '1 millisecond' * window_ms
               OR (rs.deadline > now() - interval '1 millisecond' * window_ms
                   AND (rs.deadline <= now() OR r.checked_at < now() - interval '5 seconds'))));
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION duration_text(d interval) RETURNS text
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    s bigint := GREATEST(floor(extract(epoch FROM d)), 0)::bigint;
BEGIN
    RETURN CASE
        WHEN s >= 3600 THEN (s / 3600)::text || 'h' || (s % 3600 / 60)::text || 'm' || (s % 60)::text || 's'
        WHEN s >= 60 THEN (s / 60)::text || 'm' || (s % 60)::text || 's'
        ELSE s::text || 's'
    END;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION heartbeat_recording_impaired(window_ms bigint) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM heartbeat_recorders r JOIN sessions rs ON rs.session_id = r.session_id
        WHERE rs.closed_at IS NULL
          AND (r.ok_since > now() - interval '1 millisecond' * window_ms
               OR (rs.deadline > now() - interval '1 millisecond' * window_ms
                   AND (rs.deadline <= now() OR r.checked_at < now() - interval '5 seconds'))))
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION duration_text(d interval) RETURNS text
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT CASE
        WHEN s >= 3600 THEN (s / 3600)::text || 'h' || (s % 3600 / 60)::text || 'm' || (s % 60)::text || 's'
        WHEN s >= 60 THEN (s / 60)::text || 'm' || (s % 60)::text || 's'
        ELSE s::text || 's'
    END
    FROM (SELECT GREATEST(floor(extract(epoch FROM d)), 0)::bigint AS s) x
$$;
-- +goose StatementEnd
