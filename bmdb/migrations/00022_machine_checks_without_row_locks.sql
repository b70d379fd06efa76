-- work and work_history check their machine with a trigger instead of a
-- foreign key (issue 17, P2), as migration 00019 did for their process.
--
-- A foreign key check locks the referenced machines row FOR KEY SHARE, and
-- a row lock is a heap lock record in the WAL: one for a claim (its work
-- row and its Started history row lock the same row) and one for a finish
-- (its Finished row), about 110 of the 1,700 bytes a claim + finish cycle
-- writes, all of it waiting in the commit flush. Nothing in shepherd deletes
-- a machine or changes its id (a decommissioned machine keeps its row, so
-- that its history stays attached), so the checks need no row lock to stay
-- true: the trigger below reads the row. A trigger on machines does what
-- the foreign keys did when a machine is deleted or its id changed anyway
-- (by hand): it deletes the machine's work (work's ON DELETE CASCADE) and
-- refuses while work or history names it (NO ACTION). It first takes SHARE
-- locks on both tables, so that it waits for transactions that may be
-- adding such rows and blocks new ones until it commits: no row can slip in
-- between its check and its commit. A transaction that is not READ
-- COMMITTED (none writes work or history today) could still insert a row
-- its snapshot let it check before such a deletion committed, so for it
-- the check locks the row as the foreign key did, and fails with a
-- serialization error instead. The tags and work_backoff keep their foreign
-- keys: a claim and a finish do not write them.

-- +goose Up
-- +goose StatementBegin
CREATE FUNCTION work_machine_check() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('transaction_isolation') = 'read committed' THEN
        PERFORM 1 FROM machines m WHERE m.machine_id = NEW.machine_id;
    ELSE
        PERFORM 1 FROM machines m WHERE m.machine_id = NEW.machine_id FOR KEY SHARE;
    END IF;
    IF NOT FOUND THEN
        RAISE EXCEPTION '% names machine %, which the machines table does not hold', TG_TABLE_NAME, NEW.machine_id
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = TG_TABLE_NAME || '_machine_check';
    END IF;
    RETURN NEW;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION machines_keep_referenced() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.machine_id = OLD.machine_id THEN
        RETURN NEW;
    END IF;
    LOCK TABLE work, work_history IN SHARE MODE;
    IF TG_OP = 'DELETE' THEN
        DELETE FROM work w WHERE w.machine_id = OLD.machine_id;
    END IF;
    IF EXISTS (SELECT 1 FROM work w WHERE w.machine_id = OLD.machine_id)
       OR EXISTS (SELECT 1 FROM work_history h WHERE h.machine_id = OLD.machine_id) THEN
        RAISE EXCEPTION 'machine % is still named by work or history', OLD.machine_id
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'machines_keep_referenced';
    END IF;
    RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER work_machine_check BEFORE INSERT OR UPDATE OF machine_id ON work
    FOR EACH ROW EXECUTE FUNCTION work_machine_check();
CREATE TRIGGER work_history_machine_check BEFORE INSERT OR UPDATE OF machine_id ON work_history
    FOR EACH ROW EXECUTE FUNCTION work_machine_check();
CREATE TRIGGER machines_keep_referenced BEFORE UPDATE OF machine_id OR DELETE ON machines
    FOR EACH ROW EXECUTE FUNCTION machines_keep_referenced();
ALTER TABLE work DROP CONSTRAINT work_machine_id_fkey;
ALTER TABLE work_history DROP CONSTRAINT work_history_machine_id_fkey;

-- +goose Down
ALTER TABLE work ADD CONSTRAINT work_machine_id_fkey
    FOREIGN KEY (machine_id) REFERENCES machines (machine_id) ON DELETE CASCADE;
ALTER TABLE work_history ADD CONSTRAINT work_history_machine_id_fkey
    FOREIGN KEY (machine_id) REFERENCES machines (machine_id);
DROP TRIGGER machines_keep_referenced ON machines;
DROP TRIGGER work_history_machine_check ON work_history;
DROP TRIGGER work_machine_check ON work;
DROP FUNCTION machines_keep_referenced();
DROP FUNCTION work_machine_check();
