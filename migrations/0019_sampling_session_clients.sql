-- Clients that joined a sampling session (tinker's join_sampling_session): each unpickled copy of a
-- SamplingClient is given the next number, so the copies' request seq_ids (clone * 10^9 + n) never
-- collide. The original client is 0.
ALTER TABLE sampling_sessions ADD COLUMN clients bigint NOT NULL DEFAULT 0;
