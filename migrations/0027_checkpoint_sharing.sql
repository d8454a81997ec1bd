-- Copies, weights access tokens and publishing (issue 62 items 4 and 5).
--
-- A copy (copy_weights) is a new checkpoint row, in a new training run of status 'copy' (it holds
-- weights and takes no training call), naming the same storage_path as its source: no byte is
-- duplicated. The files are reference-counted by the rows themselves: a path is removed only when
-- no checkpoint row names it any more (checkpoints.retention, api.records.delete_checkpoint), so
-- deleting either copy never breaks the other.
ALTER TABLE training_models DROP CONSTRAINT training_models_status_check;
ALTER TABLE training_models ADD CONSTRAINT training_models_status_check
    CHECK (status IN ('creating', 'ready', 'recovering', 'failed', 'lost', 'deleted', 'copy'));
ALTER TABLE training_models ADD COLUMN copied_from text;  -- the source's tinker path (status 'copy')
CREATE INDEX checkpoints_storage_path ON checkpoints (storage_path);

-- Published: readable (sampled, copied, downloaded) by every tenant through its tinker path while
-- set; its owner's row still, counted in its owner's storage.
ALTER TABLE checkpoints ADD COLUMN published_at timestamptz;

-- An owner's grant of one checkpoint to whoever holds the token (another tenant it is handed to),
-- for copy_weights only; revocable, each use in the owner's audit log. Only the token's hash is kept.
CREATE TABLE weights_access_tokens (
    id                text PRIMARY KEY,  -- wat-<16 hex>
    tenant_id         text NOT NULL REFERENCES tenants (id),
    checkpoint_id     bigint NOT NULL REFERENCES checkpoints (id) ON DELETE CASCADE,
    token_sha256      bytea NOT NULL UNIQUE,
    created_by        text NOT NULL,
    created_at        timestamptz NOT NULL DEFAULT now(),
    expires_at        timestamptz,
    revoked_at        timestamptz
);
CREATE INDEX weights_access_tokens_tenant ON weights_access_tokens (tenant_id, created_at DESC);
