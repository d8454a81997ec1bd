-- Prefix-cache hits and checkpoint storage, priced apart (issue 62 item 8).
-- Cached prompt tokens have their own rate per base (NULL: 20% of the entry's prefill rate,
-- billing.pricing.default_cached_rate); checkpoint storage is priced per GB-month (10^9 bytes for
-- 720 hours) and metered in byte-hours, one ledger row per tenant, base model and hour
-- (billing.storage). Every ledger row's cost stays the sum of its unit costs.
-- Depends on 0003_billing and 0018_usage_hourly_sessions.

ALTER TABLE price_book
    ADD COLUMN cached_micro_usd_per_mtok bigint CHECK (cached_micro_usd_per_mtok >= 0),
    ADD COLUMN storage_micro_usd_per_gb_month bigint NOT NULL DEFAULT 100000
        CHECK (storage_micro_usd_per_gb_month >= 0);

-- The cost check of 0003 was declared on its column, unnamed: drop it by what it says.
DO $$
DECLARE name text;
BEGIN
    SELECT conname INTO name FROM pg_constraint
    WHERE conrelid = 'usage_ledger'::regclass AND contype = 'c'
      AND pg_get_constraintdef(oid) LIKE '%cost_micro_usd = %';
    EXECUTE format('ALTER TABLE usage_ledger DROP CONSTRAINT %I', name);
END $$;

ALTER TABLE usage_ledger
    ADD COLUMN cached_tokens      bigint NOT NULL DEFAULT 0 CHECK (cached_tokens >= 0),
    ADD COLUMN cached_micro_usd   bigint NOT NULL DEFAULT 0 CHECK (cached_micro_usd >= 0),
    ADD COLUMN storage_byte_hours bigint NOT NULL DEFAULT 0 CHECK (storage_byte_hours >= 0),
    ADD COLUMN storage_micro_usd  bigint NOT NULL DEFAULT 0 CHECK (storage_micro_usd >= 0),
    ADD CONSTRAINT usage_ledger_cost_is_the_sum CHECK (
        cost_micro_usd = prefill_micro_usd + sample_micro_usd + train_micro_usd + cached_micro_usd + storage_micro_usd);

ALTER TABLE usage_daily
    ADD COLUMN cached_tokens      bigint NOT NULL DEFAULT 0,
    ADD COLUMN cached_micro_usd   bigint NOT NULL DEFAULT 0,
    ADD COLUMN storage_byte_hours bigint NOT NULL DEFAULT 0,
    ADD COLUMN storage_micro_usd  bigint NOT NULL DEFAULT 0;

ALTER TABLE usage_hourly
    ADD COLUMN cached_tokens      bigint NOT NULL DEFAULT 0,
    ADD COLUMN storage_byte_hours bigint NOT NULL DEFAULT 0;

ALTER TABLE usage_hourly_sessions
    ADD COLUMN cached_tokens      bigint NOT NULL DEFAULT 0,
    ADD COLUMN cached_micro_usd   bigint NOT NULL DEFAULT 0,
    ADD COLUMN storage_byte_hours bigint NOT NULL DEFAULT 0,
    ADD COLUMN storage_micro_usd  bigint NOT NULL DEFAULT 0;
