-- Per-step metrics of training runs, for curves (the dashboard) and the operator's staleness view.
-- Results otherwise live only in Redis futures with a TTL. Two sources:
--   'trainer': one row per completed forward_backward, written in the transaction that finishes the
--              request (billing.ledger.settle), so a redelivered request never adds a second row;
--   'client':  rows a client posts (`POST /api/v1/quilt/models/{id}/metrics`: rewards, evals).
-- `step` is the model's policy version (optimizer steps taken) when the data was computed.
-- Depends on 0001_spine (tenants, training_models) and 0003_billing (usage_ledger).

CREATE TABLE run_metrics (
    id         bigserial PRIMARY KEY,
    tenant_id  text NOT NULL REFERENCES tenants (id),
    model_id   text NOT NULL REFERENCES training_models (id),
    request_id text UNIQUE,  -- the forward_backward a trainer row belongs to; NULL for client rows
    step       integer NOT NULL CHECK (step >= 0),
    source     text NOT NULL CHECK (source IN ('trainer', 'client')),
    metrics    jsonb NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CHECK ((source = 'trainer') = (request_id IS NOT NULL))
);
CREATE INDEX run_metrics_model_step ON run_metrics (model_id, step);
-- The operator page reads recent rows of every tenant (staleness histogram) ...
CREATE INDEX run_metrics_created ON run_metrics (created_at);
-- ... and recent ledger rows of every tenant (token rates, each tenant's share of compute).
CREATE INDEX usage_ledger_created ON usage_ledger (created_at);
-- ... and recently finished sampling requests (time from submission to a finished group).
CREATE INDEX requests_sample_finished ON requests (finished_at) WHERE kind = 'sample';
