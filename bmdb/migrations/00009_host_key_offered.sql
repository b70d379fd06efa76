-- +goose Up
-- A machine that presents an SSH host key other than the one in force keeps
-- the key it presented here, with when it last presented it, so that an
-- operator can accept exactly that key (shepherd machine host-key accept)
-- after checking it out of band.
ALTER TABLE machine_ssh_host_key
    ADD COLUMN offered_host_key bytea CHECK (octet_length(offered_host_key) > 0),
    ADD COLUMN offered_at timestamptz,
    ADD CONSTRAINT machine_ssh_host_key_offered CHECK ((offered_host_key IS NULL) = (offered_at IS NULL));

-- +goose Down
ALTER TABLE machine_ssh_host_key
    DROP CONSTRAINT machine_ssh_host_key_offered,
    DROP COLUMN offered_at,
    DROP COLUMN offered_host_key;
