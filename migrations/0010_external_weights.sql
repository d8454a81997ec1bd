-- Adapter exports for download (save_weights_external): PEFT files without optimizer state, a
-- checkpoint kind of their own so they are listed, expired and deleted like the others. Signed
-- download URLs are HMAC'd with a key every API process shares; it lives here unless the operator
-- gives one (QUILT_DOWNLOAD_SIGNING_KEY).
ALTER TABLE checkpoints DROP CONSTRAINT checkpoints_kind_check;
ALTER TABLE checkpoints ADD CONSTRAINT checkpoints_kind_check
    CHECK (kind IN ('weights', 'sampler_weights', 'external_weights'));

CREATE TABLE server_secrets (
    name       text PRIMARY KEY,
    value      bytea NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
