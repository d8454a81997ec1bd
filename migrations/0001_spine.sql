-- The platform spine: tenants, keys, the base-model catalogue, sessions, training models,
-- checkpoints and requests (futures). Every tenant table has a non-null tenant_id.

CREATE TABLE tenants (
    id                    text PRIMARY KEY,
    name                  text NOT NULL UNIQUE,
    role                  text NOT NULL DEFAULT 'tenant' CHECK (role IN ('tenant', 'operator')),
    plan_weight           real NOT NULL DEFAULT 1.0 CHECK (plan_weight > 0),
    max_models            integer NOT NULL CHECK (max_models > 0),
    max_inflight_requests integer NOT NULL CHECK (max_inflight_requests > 0),
    tokens_per_minute     integer NOT NULL CHECK (tokens_per_minute > 0),
    created_at            timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE api_keys (
    id           text PRIMARY KEY,
    tenant_id    text NOT NULL REFERENCES tenants (id),
    prefix       text NOT NULL,
    key_hash     bytea NOT NULL UNIQUE,
    name         text NOT NULL DEFAULT '',
    created_at   timestamptz NOT NULL DEFAULT now(),
    revoked_at   timestamptz,
    last_used_at timestamptz
);
CREATE INDEX api_keys_tenant ON api_keys (tenant_id);
CREATE INDEX api_keys_prefix ON api_keys (prefix);

CREATE TABLE base_models (
    name               text PRIMARY KEY,
    path               text NOT NULL,
    vocab_size         integer NOT NULL CHECK (vocab_size > 0),
    max_context_length integer NOT NULL CHECK (max_context_length > 0),
    trainable          boolean NOT NULL DEFAULT true,
    sampleable         boolean NOT NULL DEFAULT true,
    created_at         timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE sessions (
    id                text PRIMARY KEY,
    tenant_id         text NOT NULL REFERENCES tenants (id),
    api_key_id        text REFERENCES api_keys (id),
    tags              jsonb NOT NULL DEFAULT '[]',
    user_metadata     jsonb NOT NULL DEFAULT '{}',
    sdk_version       text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    last_heartbeat_at timestamptz NOT NULL DEFAULT now(),
    finished_at       timestamptz,
    finish_reason     text
);
CREATE INDEX sessions_tenant ON sessions (tenant_id);

CREATE TABLE training_models (
    id              text PRIMARY KEY,
    tenant_id       text NOT NULL REFERENCES tenants (id),
    session_id      text NOT NULL REFERENCES sessions (id),
    model_seq_id    integer NOT NULL CHECK (model_seq_id >= 0),
    base_model      text NOT NULL REFERENCES base_models (name),
    lora_config     jsonb NOT NULL,
    user_metadata   jsonb NOT NULL DEFAULT '{}',
    status          text NOT NULL DEFAULT 'creating'
                    CHECK (status IN ('creating', 'ready', 'failed', 'lost', 'deleted')),
    status_detail   text,
    created_at      timestamptz NOT NULL DEFAULT now(),
    last_request_at timestamptz NOT NULL DEFAULT now(),
    UNIQUE (session_id, model_seq_id)
);
CREATE INDEX training_models_tenant ON training_models (tenant_id);

CREATE TABLE checkpoints (
    id           bigserial PRIMARY KEY,
    tenant_id    text NOT NULL REFERENCES tenants (id),
    model_id     text NOT NULL REFERENCES training_models (id),
    kind         text NOT NULL CHECK (kind IN ('weights', 'sampler_weights')),
    name         text NOT NULL,
    storage_path text NOT NULL,
    size_bytes   bigint NOT NULL DEFAULT 0,
    created_at   timestamptz NOT NULL DEFAULT now(),
    UNIQUE (model_id, kind, name)
);
CREATE INDEX checkpoints_tenant ON checkpoints (tenant_id);

CREATE TABLE requests (
    id          text PRIMARY KEY,
    tenant_id   text NOT NULL REFERENCES tenants (id),
    api_key_id  text REFERENCES api_keys (id),
    model_id    text,
    seq_id      integer,
    kind        text NOT NULL,
    status      text NOT NULL DEFAULT 'queued' CHECK (status IN ('queued', 'running', 'done', 'failed')),
    n_tokens    integer NOT NULL DEFAULT 0,
    error       jsonb,
    created_at  timestamptz NOT NULL DEFAULT now(),
    started_at  timestamptz,
    finished_at timestamptz,
    UNIQUE (model_id, seq_id)
);
CREATE INDEX requests_tenant_status ON requests (tenant_id, status);
