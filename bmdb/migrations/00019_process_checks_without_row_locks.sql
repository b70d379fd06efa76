-- work and work_history check their process against the processes table
-- with triggers instead of foreign keys (issue 17, P2).
--
-- A foreign key check locks the referenced row FOR KEY SHARE. Every claim
-- and every end of work references one of a handful of processes rows, so
-- all workers lock the same row at once, and PostgreSQL records each of
-- those concurrent locks as a new MultiXact naming every locker: a heap
-- lock record and a MultiXact record in the WAL per statement, about a
-- sixth of the WAL a claim + finish cycle writes, all of it waiting in the
-- commit flush. The processes rows change only in migrations, so the
-- checks need no row lock to stay true: the triggers below read the row
-- (work: the process and its machine_exclusive flag, as the composite
-- foreign key did; history: the process), and a trigger on processes
-- refuses to delete a process, or change its name or flag, while work or
-- history still names it, which is what the foreign keys' NO ACTION did.
-- It first takes SHARE locks on both tables, so that it waits for
-- transactions that may be adding such rows and blocks new ones until it
-- commits: no row can slip in between its check and its commit.
-- work_backoff, written only when work fails, keeps its foreign key.

-- +goose Up
-- +goose StatementBegin
CREATE FUNCTION work_process_check() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM processes p
     WHERE p.process = NEW.process AND p.machine_exclusive = NEW.machine_exclusive;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'work names process % with machine_exclusive %, which the processes table does not hold',
            NEW.process, NEW.machine_exclusive
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'work_process_check';
    END IF;
    RETURN NEW;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION work_history_process_check() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM processes p WHERE p.process = NEW.process;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'work_history names process %, which the processes table does not hold', NEW.process
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'work_history_process_check';
    END IF;
    RETURN NEW;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION processes_keep_referenced() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' AND NEW.process = OLD.process AND NEW.machine_exclusive = OLD.machine_exclusive THEN
        RETURN NEW;
    END IF;
    LOCK TABLE work, work_history IN SHARE MODE;
    IF EXISTS (SELECT 1 FROM work w WHERE w.process = OLD.process)
       OR EXISTS (SELECT 1 FROM work_history h WHERE h.process = OLD.process) THEN
        RAISE EXCEPTION 'process % is still named by work or history', OLD.process
            USING ERRCODE = 'foreign_key_violation', CONSTRAINT = 'processes_keep_referenced';
    END IF;
    RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER work_process_check BEFORE INSERT OR UPDATE OF process, machine_exclusive ON work
    FOR EACH ROW EXECUTE FUNCTION work_process_check();
CREATE TRIGGER work_history_process_check BEFORE INSERT OR UPDATE OF process ON work_history
    FOR EACH ROW EXECUTE FUNCTION work_history_process_check();
CREATE TRIGGER processes_keep_referenced BEFORE UPDATE OR DELETE ON processes
    FOR EACH ROW EXECUTE FUNCTION processes_keep_referenced();
ALTER TABLE work DROP CONSTRAINT work_process_machine_exclusive_fkey;
ALTER TABLE work_history DROP CONSTRAINT work_history_process_fkey;

-- +goose Down
ALTER TABLE work ADD CONSTRAINT work_process_machine_exclusive_fkey
    FOREIGN KEY (process, machine_exclusive) REFERENCES processes (process, machine_exclusive);
ALTER TABLE work_history ADD CONSTRAINT work_history_process_fkey
    FOREIGN KEY (process) REFERENCES processes (process);
DROP TRIGGER processes_keep_referenced ON processes;
DROP TRIGGER work_history_process_check ON work_history;
DROP TRIGGER work_process_check ON work;
DROP FUNCTION processes_keep_referenced();
DROP FUNCTION work_history_process_check();
DROP FUNCTION work_process_check();
