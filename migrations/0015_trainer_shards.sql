-- Trainer shards (QUILT_TRAINER_SHARDS above 1): each training model is placed on one shard of its
-- base, which holds its adapter and optimizer state and reads the shard's own stream. NULL: not
-- placed (one trainer per base, or a model from before shards; placed on its next call).
ALTER TABLE training_models ADD COLUMN trainer_shard text;
CREATE INDEX training_models_shard ON training_models (base_model, trainer_shard)
    WHERE status IN ('creating', 'ready', 'recovering');

-- A shard an operator is draining (`quilt trainers drain`): it moves its models to the others and
-- gets no new ones until undrained.
CREATE TABLE trainer_shards (
    base_model text NOT NULL REFERENCES base_models (name) ON DELETE CASCADE,
    shard      text NOT NULL,
    draining   boolean NOT NULL DEFAULT false,
    changed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (base_model, shard)
);

-- A placement change is a change of what get_info reports (its "recovering" reads the shard's
-- heartbeat): the API processes' cached model rows must drop it too.
DROP TRIGGER training_models_caller_cache ON training_models;
CREATE TRIGGER training_models_caller_cache
    AFTER UPDATE OF tenant_id, status, lora_config, base_model, trainer_shard OR DELETE
    ON training_models FOR EACH ROW EXECUTE FUNCTION quilt_notify_caller_cache('model', 'id');
