-- Accounts a customer and an operator manage: suspension, credit grants and an audit trail.
--
-- A suspended tenant keeps everything (nothing is deleted) and its running work finishes; new work
-- is refused with the reason (tenancy.accounts). `payment` suspensions answer 402, `operator` 403.
ALTER TABLE tenants ADD COLUMN suspended_at timestamptz;
ALTER TABLE tenants ADD COLUMN suspended_kind text CHECK (suspended_kind IN ('payment', 'operator'));
ALTER TABLE tenants ADD COLUMN suspended_reason text;
ALTER TABLE tenants ADD CONSTRAINT tenants_suspension_whole
    CHECK ((suspended_at IS NULL) = (suspended_kind IS NULL) AND (suspended_at IS NULL) = (suspended_reason IS NULL));

-- Prepaid or promotional credit, consumed by usage from the day it is granted (billing.credits).
-- Append-only like the usage ledger: a mistaken grant is corrected by telling the customer, not by
-- rewriting what they were shown.
CREATE TABLE credit_grants (
    id               bigserial PRIMARY KEY,
    tenant_id        text NOT NULL REFERENCES tenants (id),
    amount_micro_usd bigint NOT NULL CHECK (amount_micro_usd > 0),
    category         text NOT NULL CHECK (category IN ('paid', 'promotional')),
    reason           text NOT NULL,
    granted_by       text NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX credit_grants_tenant ON credit_grants (tenant_id, created_at);

-- Who did what: key created or revoked, budget set or cleared, tenant suspended or restored, credit
-- granted. Owners read their tenant's rows, operators everyone's.
CREATE TABLE audit_log (
    id        bigserial PRIMARY KEY,
    tenant_id text NOT NULL REFERENCES tenants (id),
    actor     text NOT NULL,
    action    text NOT NULL,
    detail    jsonb NOT NULL DEFAULT '{}',
    at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX audit_log_tenant_at ON audit_log (tenant_id, at DESC, id DESC);

CREATE FUNCTION quilt_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% is append-only: % is not allowed', TG_TABLE_NAME, TG_OP;
END $$;
CREATE TRIGGER credit_grants_no_update BEFORE UPDATE OR DELETE ON credit_grants
    FOR EACH ROW EXECUTE FUNCTION quilt_append_only();
CREATE TRIGGER credit_grants_no_truncate BEFORE TRUNCATE ON credit_grants
    FOR EACH STATEMENT EXECUTE FUNCTION quilt_append_only();
CREATE TRIGGER audit_log_no_update BEFORE UPDATE OR DELETE ON audit_log
    FOR EACH ROW EXECUTE FUNCTION quilt_append_only();
CREATE TRIGGER audit_log_no_truncate BEFORE TRUNCATE ON audit_log
    FOR EACH STATEMENT EXECUTE FUNCTION quilt_append_only();
