-- A checkpoint's user_metadata, as the tinker SDK's save_state / save_weights_for_sampler send it
-- (text keys and values); listed with the checkpoint. Saving a name again replaces the mapping, as
-- tinker's overwrite does. NULL: none given.
ALTER TABLE checkpoints ADD COLUMN user_metadata jsonb;
