-- Metering and billing: the price book, the append-only usage ledger and its rollups, budgets,
-- Stripe customers, meters and the meter-event outbox (the Stripe sync state).
-- Money is integer micro-USD (1 USD = 1,000,000); rates are micro-USD per million tokens.
-- Depends only on 0001_spine.

CREATE TABLE price_book (
    id                         bigserial PRIMARY KEY,
    base_model                 text NOT NULL,
    effective_from             timestamptz NOT NULL,
    prefill_micro_usd_per_mtok bigint NOT NULL CHECK (prefill_micro_usd_per_mtok >= 0),
    sample_micro_usd_per_mtok  bigint NOT NULL CHECK (sample_micro_usd_per_mtok >= 0),
    train_micro_usd_per_mtok   bigint NOT NULL CHECK (train_micro_usd_per_mtok >= 0),
    note                       text NOT NULL DEFAULT '',
    created_at                 timestamptz NOT NULL DEFAULT now(),
    UNIQUE (base_model, effective_from)
);

-- Seed rates. Qwen3-8B is the public anchor (prefill 0.195, sample 0.60, train 0.44 USD per million
-- tokens); the other sizes keep its unit ratios and scale roughly with active parameters. The tiny
-- test model gets a nominal rate so that its usage is visible. Change prices by adding rows with a
-- later effective_from (`quilt prices set`); rows are never edited, the ledger points at them.
INSERT INTO price_book (base_model, effective_from, prefill_micro_usd_per_mtok, sample_micro_usd_per_mtok,
                        train_micro_usd_per_mtok, note) VALUES
    ('quilt/tiny-qwen3',      '2025-01-01T00:00:00Z',  100000,  300000,  200000, 'nominal rate for the tiny local model'),
    ('Qwen/Qwen3-0.6B',       '2025-01-01T00:00:00Z',   30000,   90000,   70000, 'seed'),
    ('Qwen/Qwen3-1.7B',       '2025-01-01T00:00:00Z',   50000,  150000,  110000, 'seed'),
    ('Qwen/Qwen3-4B',         '2025-01-01T00:00:00Z',  100000,  300000,  220000, 'seed'),
    ('Qwen/Qwen3-8B',         '2025-01-01T00:00:00Z',  195000,  600000,  440000, 'seed: public anchor rate'),
    ('Qwen/Qwen3-14B',        '2025-01-01T00:00:00Z',  340000, 1050000,  770000, 'seed'),
    ('Qwen/Qwen3-32B',        '2025-01-01T00:00:00Z',  780000, 2400000, 1760000, 'seed'),
    ('Qwen/Qwen3-30B-A3B',    '2025-01-01T00:00:00Z',  120000,  360000,  270000, 'seed: MoE, 3B active'),
    ('Qwen/Qwen3-235B-A22B',  '2025-01-01T00:00:00Z',  680000, 2100000, 1540000, 'seed: MoE, 22B active');

-- One row per completed request, written in the same transaction that marks the request done.
-- Each unit's cost is rounded half up to whole micro-USD separately; cost = their sum.
CREATE TABLE usage_ledger (
    id                bigserial PRIMARY KEY,
    request_id        text NOT NULL UNIQUE,
    tenant_id         text NOT NULL REFERENCES tenants (id),
    api_key_id        text REFERENCES api_keys (id),
    model_id          text,
    base_model        text NOT NULL,
    prefill_tokens    bigint NOT NULL DEFAULT 0 CHECK (prefill_tokens >= 0),
    sample_tokens     bigint NOT NULL DEFAULT 0 CHECK (sample_tokens >= 0),
    train_tokens      bigint NOT NULL DEFAULT 0 CHECK (train_tokens >= 0),
    price_id          bigint REFERENCES price_book (id),
    prefill_micro_usd bigint NOT NULL DEFAULT 0 CHECK (prefill_micro_usd >= 0),
    sample_micro_usd  bigint NOT NULL DEFAULT 0 CHECK (sample_micro_usd >= 0),
    train_micro_usd   bigint NOT NULL DEFAULT 0 CHECK (train_micro_usd >= 0),
    cost_micro_usd    bigint NOT NULL CHECK (cost_micro_usd = prefill_micro_usd + sample_micro_usd + train_micro_usd),
    created_at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX usage_ledger_tenant_time ON usage_ledger (tenant_id, created_at);

CREATE FUNCTION usage_ledger_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'usage_ledger is append-only: % is not allowed', TG_OP;
END $$;
CREATE TRIGGER usage_ledger_no_update BEFORE UPDATE OR DELETE ON usage_ledger
    FOR EACH ROW EXECUTE FUNCTION usage_ledger_append_only();
CREATE TRIGGER usage_ledger_no_truncate BEFORE TRUNCATE ON usage_ledger
    FOR EACH STATEMENT EXECUTE FUNCTION usage_ledger_append_only();

-- Rollups, updated in the ledger's transaction: per UTC day (usage reports, budgets, the spend
-- header) and per UTC hour (Stripe meter windows). api_key_id '' = no key recorded.
CREATE TABLE usage_daily (
    tenant_id         text NOT NULL REFERENCES tenants (id),
    api_key_id        text NOT NULL DEFAULT '',
    day               date NOT NULL,
    base_model        text NOT NULL,
    requests          bigint NOT NULL DEFAULT 0,
    prefill_tokens    bigint NOT NULL DEFAULT 0,
    sample_tokens     bigint NOT NULL DEFAULT 0,
    train_tokens      bigint NOT NULL DEFAULT 0,
    prefill_micro_usd bigint NOT NULL DEFAULT 0,
    sample_micro_usd  bigint NOT NULL DEFAULT 0,
    train_micro_usd   bigint NOT NULL DEFAULT 0,
    cost_micro_usd    bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, day, base_model, api_key_id)
);

CREATE TABLE usage_hourly (
    tenant_id      text NOT NULL REFERENCES tenants (id),
    hour           timestamptz NOT NULL,
    requests       bigint NOT NULL DEFAULT 0,
    prefill_tokens bigint NOT NULL DEFAULT 0,
    sample_tokens  bigint NOT NULL DEFAULT 0,
    train_tokens   bigint NOT NULL DEFAULT 0,
    cost_micro_usd bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant_id, hour)
);
CREATE INDEX usage_hourly_hour ON usage_hourly (hour);

-- Monthly spend limits: api_key_id NULL = the whole tenant.
CREATE TABLE budgets (
    id                      bigserial PRIMARY KEY,
    tenant_id               text NOT NULL REFERENCES tenants (id),
    api_key_id              text REFERENCES api_keys (id),
    monthly_limit_micro_usd bigint NOT NULL CHECK (monthly_limit_micro_usd >= 0),
    updated_at              timestamptz NOT NULL DEFAULT now(),
    UNIQUE NULLS NOT DISTINCT (tenant_id, api_key_id)
);

-- A Stripe customer per billed tenant. Usage from `sync_from` (an hour boundary) on is sent.
CREATE TABLE billing_accounts (
    tenant_id          text PRIMARY KEY REFERENCES tenants (id),
    stripe_customer_id text NOT NULL UNIQUE,
    sync_from          timestamptz NOT NULL,
    created_at         timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE stripe_meters (
    event_name      text PRIMARY KEY,
    stripe_meter_id text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);

-- The sync state: an outbox of meter events. A row is planned (with its final value) and committed
-- before it is sent, so a retry resends exactly the same identifier and value. Revision 1 carries a
-- window's total; a later revision carries usage that committed after the window was sent.
CREATE TABLE stripe_meter_events (
    identifier         text PRIMARY KEY,
    tenant_id          text NOT NULL REFERENCES tenants (id),
    stripe_customer_id text NOT NULL,
    event_name         text NOT NULL,
    window_start       timestamptz NOT NULL,
    revision           integer NOT NULL CHECK (revision >= 1),
    value              bigint NOT NULL CHECK (value > 0),
    status             text NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'sent', 'failed', 'review')),
    attempts           integer NOT NULL DEFAULT 0,
    first_attempt_at   timestamptz,
    sent_at            timestamptz,
    last_error         text,
    created_at         timestamptz NOT NULL DEFAULT now(),
    UNIQUE (tenant_id, event_name, window_start, revision)
);
CREATE INDEX stripe_meter_events_pending ON stripe_meter_events (status) WHERE status = 'pending';
