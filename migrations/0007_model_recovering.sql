-- A restarted trainer's models read 'recovering' while their snapshots load and the requests
-- since are replayed, then 'ready' again (issue 15: health tells the truth).
ALTER TABLE training_models DROP CONSTRAINT training_models_status_check;
ALTER TABLE training_models ADD CONSTRAINT training_models_status_check
    CHECK (status IN ('creating', 'ready', 'recovering', 'failed', 'lost', 'deleted'));
