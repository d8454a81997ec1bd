-- Sampling sessions: a sampler bound either to a base model or to a published adapter
-- (`tinker://<model>/sampler_weights/<name>`). Ids follow Tinker: `<session_id>:sample:<seq>`.
-- An anonymous save_weights_for_sampler creates the session before its weights exist (the save is
-- queued behind the model's earlier requests), so model_path may name a checkpoint not yet written.

CREATE TABLE sampling_sessions (
    id          text PRIMARY KEY,
    tenant_id   text NOT NULL REFERENCES tenants (id),
    session_id  text NOT NULL REFERENCES sessions (id),
    seq_id      integer NOT NULL CHECK (seq_id >= 0),
    base_model  text NOT NULL REFERENCES base_models (name),
    model_id    text REFERENCES training_models (id),
    model_path  text,
    created_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (session_id, seq_id),
    CHECK ((model_id IS NULL) = (model_path IS NULL))
);
CREATE INDEX sampling_sessions_tenant ON sampling_sessions (tenant_id);
