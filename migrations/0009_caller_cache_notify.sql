-- Each API process caches who is calling (principal by key hash, month-to-date spend by tenant,
-- bases by name; api.caller_cache). Every change to what those entries hold NOTIFYs it, at
-- commit, whichever process or tool made the change: the CLI, the dashboard, a worker settling a
-- ledger row, or SQL typed by hand. The payload is `KIND:KEY`; the trigger's arguments name the
-- kind and the column that holds the key.
CREATE FUNCTION quilt_notify_caller_cache() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    r record;
BEGIN
    IF TG_OP = 'DELETE' THEN r := OLD; ELSE r := NEW; END IF;
    PERFORM pg_notify('quilt_caller_cache', TG_ARGV[0] || ':' || (to_jsonb(r) ->> TG_ARGV[1]));
    RETURN NULL;
END $$;

CREATE TRIGGER tenants_caller_cache AFTER UPDATE OR DELETE ON tenants
    FOR EACH ROW EXECUTE FUNCTION quilt_notify_caller_cache('tenant', 'id');
CREATE TRIGGER api_keys_caller_cache AFTER UPDATE OR DELETE ON api_keys
    FOR EACH ROW EXECUTE FUNCTION quilt_notify_caller_cache('tenant', 'tenant_id');
CREATE TRIGGER usage_daily_caller_cache AFTER INSERT OR UPDATE OR DELETE ON usage_daily
    FOR EACH ROW EXECUTE FUNCTION quilt_notify_caller_cache('spend', 'tenant_id');
CREATE TRIGGER base_models_caller_cache AFTER INSERT OR UPDATE OR DELETE ON base_models
    FOR EACH ROW EXECUTE FUNCTION quilt_notify_caller_cache('base', 'name');
-- What get_info shows of a training model; not last_request_at, which every request touches.
CREATE TRIGGER training_models_caller_cache AFTER UPDATE OF tenant_id, status, lora_config, base_model OR DELETE
    ON training_models FOR EACH ROW EXECUTE FUNCTION quilt_notify_caller_cache('model', 'id');
