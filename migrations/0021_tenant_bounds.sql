-- Every tenant bounded (issue 46): the bytes of live checkpoints a tenant may keep (a plan field
-- like max_models; a save is refused once they are reached), and the index the live-sessions
-- count (QUILT_MAX_LIVE_SESSIONS_PER_TENANT) reads.
ALTER TABLE tenants ADD COLUMN max_checkpoint_bytes bigint NOT NULL DEFAULT 107374182400
    CHECK (max_checkpoint_bytes > 0);
CREATE INDEX sessions_tenant_live ON sessions (tenant_id, last_heartbeat_at) WHERE finished_at IS NULL;
