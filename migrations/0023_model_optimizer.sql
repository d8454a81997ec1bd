-- A training model's optimizer family (issue 62): chosen at create_model (tinker's optimizer_config)
-- and kept for the model's life; optim_step refuses another family's hyperparameters, and its
-- checkpoints carry the family's state. Models made before it are AdamW, the only family there was.
ALTER TABLE training_models ADD COLUMN optimizer text NOT NULL DEFAULT 'adamw'
    CHECK (optimizer IN ('adamw', 'dimuon'));
