-- Review fixes to copies, tokens and projects (after 0026/0027).
--
-- A weights access token grants the files it was made for, not whatever a later save under the
-- same checkpoint name writes (a save replaces the row's storage_path in place, same id). A token
-- made before this column is tied to the files its checkpoint names now.
ALTER TABLE weights_access_tokens ADD COLUMN storage_path text;
UPDATE weights_access_tokens w SET storage_path = c.storage_path FROM checkpoints c WHERE c.id = w.checkpoint_id;
ALTER TABLE weights_access_tokens ALTER COLUMN storage_path SET NOT NULL;

-- list_projects counts each project's sessions; the foreign key had no index.
CREATE INDEX sessions_project ON sessions (project_id);

-- billing.storage.newest_accrued_hour: the watermark the hourly storage accrual catches up from.
CREATE INDEX usage_ledger_storage_hour ON usage_ledger (created_at) WHERE storage_byte_hours > 0;

-- Whether a directory is still used counts rows naming a path inside it (checkpoints.retention.USES_PATH):
-- a prefix LIKE, which the plain index on storage_path cannot serve outside the C collation.
CREATE INDEX checkpoints_storage_path_prefix ON checkpoints (storage_path text_pattern_ops);
