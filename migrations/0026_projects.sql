-- Projects (issue 62 item 4): a tenant's sessions, and so its runs and checkpoints, grouped. Every
-- tenant has exactly one default project, made by a trigger when the tenant is made (and here for
-- the tenants already there), so no code path that makes a tenant can forget it. A session not
-- placed in a project (the SDK without TINKER_PROJECT_ID) lands in its tenant's default project,
-- also by trigger, so every session row names one.
CREATE TABLE projects (
    id          text PRIMARY KEY,  -- proj-<16 hex>
    tenant_id   text NOT NULL REFERENCES tenants (id),
    name        text NOT NULL,
    is_default  boolean NOT NULL DEFAULT false,
    created_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (tenant_id, name)
);
CREATE UNIQUE INDEX projects_one_default ON projects (tenant_id) WHERE is_default;

CREATE FUNCTION quilt_default_project() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO projects (id, tenant_id, name, is_default)
    VALUES ('proj-' || substr(md5(random()::text || NEW.id || clock_timestamp()::text), 1, 16), NEW.id, 'default', true)
    ON CONFLICT DO NOTHING;
    RETURN NEW;
END $$;
CREATE TRIGGER tenants_default_project AFTER INSERT ON tenants
    FOR EACH ROW EXECUTE FUNCTION quilt_default_project();

INSERT INTO projects (id, tenant_id, name, is_default)
SELECT 'proj-' || substr(md5(random()::text || id), 1, 16), id, 'default', true FROM tenants
ON CONFLICT DO NOTHING;

ALTER TABLE sessions ADD COLUMN project_id text REFERENCES projects (id);
UPDATE sessions s SET project_id = p.id FROM projects p WHERE p.tenant_id = s.tenant_id AND p.is_default;

CREATE FUNCTION quilt_session_project() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.project_id IS NULL THEN
        NEW.project_id := (SELECT id FROM projects WHERE tenant_id = NEW.tenant_id AND is_default);
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER sessions_default_project BEFORE INSERT ON sessions
    FOR EACH ROW EXECUTE FUNCTION quilt_session_project();
ALTER TABLE sessions ALTER COLUMN project_id SET NOT NULL;
-- search_sessions pages newest first by (created_at, id) within a tenant.
CREATE INDEX sessions_tenant_created ON sessions (tenant_id, created_at DESC, id DESC);
