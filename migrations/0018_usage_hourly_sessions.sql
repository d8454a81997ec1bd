-- A third rollup of the ledger, updated in its transaction like usage_daily and usage_hourly: per
-- UTC hour, base model, client session and key, what the tinker SDK's hourly usage report
-- (GET /api/v1/billing/usage/events) reads, so that a 14-day report reads at most one row per
-- hour and attribution instead of every ledger row. session_id '' = none (OpenAI-compatible
-- calls, base-model samplers of no session); api_key_id '' = no key recorded.
CREATE TABLE usage_hourly_sessions (
    tenant_id         text NOT NULL REFERENCES tenants (id),
    hour              timestamptz NOT NULL,
    base_model        text NOT NULL,
    session_id        text NOT NULL DEFAULT '',
    api_key_id        text NOT NULL DEFAULT '',
    prefill_tokens    bigint NOT NULL DEFAULT 0,
    sample_tokens     bigint NOT NULL DEFAULT 0,
    train_tokens      bigint NOT NULL DEFAULT 0,
    prefill_micro_usd bigint NOT NULL DEFAULT 0,
    sample_micro_usd  bigint NOT NULL DEFAULT 0,
    train_micro_usd   bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, hour, base_model, session_id, api_key_id)
);

-- What the ledger already holds (rows with tokens: an optim_step or a save adds nothing here). A
-- training request's model and a sampling request's sampler each belong to one session.
INSERT INTO usage_hourly_sessions
SELECT l.tenant_id, date_trunc('hour', l.created_at, 'UTC'), l.base_model,
       COALESCE(m.session_id, s.session_id, ''), COALESCE(l.api_key_id, ''),
       sum(l.prefill_tokens), sum(l.sample_tokens), sum(l.train_tokens),
       sum(l.prefill_micro_usd), sum(l.sample_micro_usd), sum(l.train_micro_usd)
FROM usage_ledger l
LEFT JOIN training_models m ON m.id = l.model_id
LEFT JOIN sampling_sessions s ON s.id = l.model_id
WHERE l.prefill_tokens + l.sample_tokens + l.train_tokens > 0
GROUP BY 1, 2, 3, 4, 5;
