-- Real base models (issue 16): where a base came from, what it is, and how it is served.
-- `config` is the model's config.json, so the API can check a LoRA against the architecture without
-- the model's files; `serving` holds per-base worker settings (device, dtype, vLLM memory share,
-- LoRA limits) that `quilt up` hands to that base's trainer and generation worker.
ALTER TABLE base_models
    ADD COLUMN architecture      text NOT NULL DEFAULT 'qwen3',
    ADD COLUMN config            jsonb NOT NULL DEFAULT '{}',
    ADD COLUMN source            text NOT NULL DEFAULT 'path' CHECK (source IN ('path', 'hub')),
    ADD COLUMN hub_id            text,
    ADD COLUMN revision          text,
    ADD COLUMN dtype             text NOT NULL DEFAULT 'auto' CHECK (dtype IN ('auto', 'bfloat16', 'float32')),
    ADD COLUMN tokenizer_id      text NOT NULL DEFAULT '',
    ADD COLUMN renderer          text NOT NULL DEFAULT '',
    ADD COLUMN num_parameters    bigint NOT NULL DEFAULT 0 CHECK (num_parameters >= 0),
    ADD COLUMN active_parameters bigint NOT NULL DEFAULT 0 CHECK (active_parameters >= 0),
    ADD COLUMN serving           jsonb NOT NULL DEFAULT '{}';

-- A removed base keeps its row while anything refers to it (models, ledger rows); it is no longer
-- listed or served, and adding it again brings it back.
ALTER TABLE base_models ADD COLUMN removed_at timestamptz;
