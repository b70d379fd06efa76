-- Backed-off decommissions leave the decommission candidate range (issue 17
-- item 4), as agent start and recovery did in 00014.
--
-- The decommission candidate query found the requests of a provider by
-- joining every open request with machine_provided and probing
-- work_backoff for each of them, and handed out the oldest first: a
-- provider that refuses to release machines (an API outage) backs off
-- every request, and every claim and count then read them all (2,000
-- requests with all but 10 backed off: 8,000 buffer hits and 13-50 ms per
-- statement). Now a backoff or quarantine of Decommission is mirrored onto
-- the request as a hold (held_until: the backoff's end, 'infinity' for a
-- quarantine, NULL for none or for a backoff already over when written),
-- maintained by triggers on work_backoff, and the query reads an index on
-- the request keyed by when it became (or becomes) a candidate: the later
-- of the request and the end of its hold. The range up to now() holds
-- exactly the requests not held, oldest first, so held requests are never
-- read. A request made while a backoff is recorded takes its hold over.

-- +goose Up
ALTER TABLE machine_decommission_request ADD COLUMN held_until timestamptz;

UPDATE machine_decommission_request d
   SET held_until = CASE WHEN b.quarantined_at IS NOT NULL THEN 'infinity' ELSE b.backoff_until END
  FROM work_backoff b
 WHERE b.machine_id = d.machine_id AND b.process = 'Decommission'
   AND (b.quarantined_at IS NOT NULL OR b.backoff_until > now());

-- +goose StatementBegin
CREATE FUNCTION work_backoff_decommission_hold() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    m uuid;
    held timestamptz;
BEGIN
    IF TG_OP = 'DELETE' THEN
        m := OLD.machine_id;
    ELSE
        m := NEW.machine_id;
        held := CASE WHEN NEW.quarantined_at IS NOT NULL THEN 'infinity' WHEN NEW.backoff_until > now() THEN NEW.backoff_until END;
    END IF;
    UPDATE machine_decommission_request SET held_until = held
     WHERE machine_id = m AND held_until IS DISTINCT FROM held;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- Two triggers, so that the backoffs of the other processes (every failed
-- agent start and recovery) do not call the function at all.
CREATE TRIGGER work_backoff_decommission_hold AFTER INSERT OR UPDATE ON work_backoff
    FOR EACH ROW WHEN (NEW.process = 'Decommission') EXECUTE FUNCTION work_backoff_decommission_hold();
CREATE TRIGGER work_backoff_decommission_unhold AFTER DELETE ON work_backoff
    FOR EACH ROW WHEN (OLD.process = 'Decommission') EXECUTE FUNCTION work_backoff_decommission_hold();

-- +goose StatementBegin
CREATE FUNCTION machine_decommission_request_hold() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    SELECT CASE WHEN b.quarantined_at IS NOT NULL THEN 'infinity' WHEN b.backoff_until > now() THEN b.backoff_until END
      INTO NEW.held_until
      FROM work_backoff b WHERE b.machine_id = NEW.machine_id AND b.process = 'Decommission';
    RETURN NEW;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER machine_decommission_request_hold BEFORE INSERT ON machine_decommission_request
    FOR EACH ROW EXECUTE FUNCTION machine_decommission_request_hold();

CREATE INDEX machine_decommission_request_since
    ON machine_decommission_request ((GREATEST(requested_at, held_until))) INCLUDE (machine_id);

-- +goose Down
DROP INDEX machine_decommission_request_since;
DROP TRIGGER machine_decommission_request_hold ON machine_decommission_request;
DROP FUNCTION machine_decommission_request_hold();
DROP TRIGGER work_backoff_decommission_unhold ON work_backoff;
DROP TRIGGER work_backoff_decommission_hold ON work_backoff;
DROP FUNCTION work_backoff_decommission_hold();
ALTER TABLE machine_decommission_request DROP COLUMN held_until;
