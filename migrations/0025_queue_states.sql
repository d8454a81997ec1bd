-- Queue states (api.queue_states): a call over its tenant's rate or concurrency limits, or on a base
-- at capacity, is accepted as 'paused' and waits, holding its seq_id, until it can be admitted.
-- Paused rows are not in flight (they hold no worker's attention) and are never billed until they run.
ALTER TABLE requests DROP CONSTRAINT requests_status_check;
ALTER TABLE requests ADD CONSTRAINT requests_status_check
    CHECK (status IN ('paused', 'queued', 'running', 'done', 'failed'));
ALTER TABLE requests
    ADD COLUMN queue_state  text CHECK (queue_state IN ('paused_rate_limit', 'paused_capacity')),
    ADD COLUMN queue_reason text,
    ADD COLUMN not_before   timestamptz;
CREATE INDEX requests_paused ON requests (tenant_id, created_at) WHERE status = 'paused';
