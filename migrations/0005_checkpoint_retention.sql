-- Checkpoint lifetimes and deferred deletion of checkpoint files.
--   expires_at:    after it the checkpoint is gone (hidden at once, files removed by the sweep);
--                  set from the client's ttl_seconds, or for anonymous sampler snapshots by default.
--   sliding_ttl_s: set for anonymous snapshots only: each use moves expires_at to now + this, so a
--                  sampler in use never expires under its user, and an abandoned one does.
-- storage_garbage holds directories to remove once `delete_after` has passed: a superseded version
-- of named sampler weights waits QUILT_SUPERSEDED_VERSION_GRACE_S because the generation pool may
-- still have requests queued that name it. Rows are removed after their files are.
-- Depends on 0001_spine (checkpoints, tenants).

ALTER TABLE checkpoints ADD COLUMN expires_at timestamptz;
ALTER TABLE checkpoints ADD COLUMN sliding_ttl_s integer CHECK (sliding_ttl_s > 0);
CREATE INDEX checkpoints_expiring ON checkpoints (expires_at) WHERE expires_at IS NOT NULL;

CREATE TABLE storage_garbage (
    id           bigserial PRIMARY KEY,
    tenant_id    text NOT NULL REFERENCES tenants (id),
    path         text NOT NULL,
    delete_after timestamptz NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX storage_garbage_due ON storage_garbage (delete_after);
