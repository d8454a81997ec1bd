-- People who log in to the dashboard with an email and a password (tenancy.members), each a member
-- of one tenant as `owner` (budgets, members) or `member` (keys, runs, spend). API keys keep working
-- as before. Invitations and password resets are single-use tokens stored as SHA-256 hashes, so a
-- copy of the database hands out neither.
CREATE TABLE members (
    id            text PRIMARY KEY,
    tenant_id     text NOT NULL REFERENCES tenants (id),
    email         text NOT NULL,
    password_hash text NOT NULL,
    role          text NOT NULL CHECK (role IN ('owner', 'member')),
    created_at    timestamptz NOT NULL DEFAULT now(),
    removed_at    timestamptz
);
-- One live account per address (a removed member may be invited again).
CREATE UNIQUE INDEX members_email ON members (lower(email)) WHERE removed_at IS NULL;

CREATE TABLE member_tokens (
    token_hash bytea PRIMARY KEY,
    purpose    text NOT NULL CHECK (purpose IN ('invite', 'reset')),
    tenant_id  text NOT NULL REFERENCES tenants (id),
    email      text NOT NULL,
    role       text CHECK (role IN ('owner', 'member')),
    created_by text NOT NULL,
    expires_at timestamptz NOT NULL,
    used_at    timestamptz
);

