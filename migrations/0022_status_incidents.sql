-- The public status page's incident notes (issue 66): written by operators, read by anyone.
-- Service-wide, not a tenant's: no tenant_id, and nothing here may name a tenant. The length
-- bounds repeat the API's (api.routes.status), so a note written around the API still fits the page.
CREATE TABLE status_incidents (
    id          bigserial PRIMARY KEY,
    title       text NOT NULL CHECK (length(title) BETWEEN 1 AND 200),
    body        text NOT NULL DEFAULT '' CHECK (length(body) <= 4000),
    severity    text NOT NULL CHECK (severity IN ('minor', 'major', 'critical', 'maintenance')),
    started_at  timestamptz NOT NULL,
    resolved_at timestamptz CHECK (resolved_at IS NULL OR resolved_at >= started_at),
    created_by  text NOT NULL,  -- the operator's actor (key:<prefix> or account:<email>); never shown
    created_at  timestamptz NOT NULL DEFAULT now()
);
