-- core.row_retention deletes finished requests and finished model-less sessions some time after
-- they finish (QUILT_RECORD_RETENTION_S), from Celery beat every minute: these indexes let each
-- run find the oldest finished rows without reading the whole table.
CREATE INDEX requests_finished ON requests (finished_at) WHERE status IN ('done', 'failed');
CREATE INDEX sessions_finished ON sessions (finished_at) WHERE finished_at IS NOT NULL;
