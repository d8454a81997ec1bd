-- A client's metric rows carry the key of the call that wrote them, so a retried POST (after a
-- timeout or a 5xx whose write had landed) does not add the same point twice.
-- Depends on 0004_run_metrics.

ALTER TABLE run_metrics ADD COLUMN client_key text CHECK (client_key IS NULL OR source = 'client');
CREATE UNIQUE INDEX run_metrics_client_key ON run_metrics (model_id, client_key) WHERE client_key IS NOT NULL;
