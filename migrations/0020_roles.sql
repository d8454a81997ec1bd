-- Roles that hold (tenancy.roles). An API key carries a role (capped at its maker's) and the member
-- account that made it (NULL: the CLI, or a key made from a key's dashboard session), so removing
-- a member revokes their keys. Keys made before this migration keep acting as owners, as they did.
-- `read_only` people and keys read and never change or spend.
ALTER TABLE members DROP CONSTRAINT members_role_check;
ALTER TABLE members ADD CONSTRAINT members_role_check CHECK (role IN ('owner', 'member', 'read_only'));
ALTER TABLE member_tokens DROP CONSTRAINT member_tokens_role_check;
ALTER TABLE member_tokens ADD CONSTRAINT member_tokens_role_check CHECK (role IN ('owner', 'member', 'read_only'));
-- Invitations are listed and revoked by this id (the token itself is kept only as a hash).
ALTER TABLE member_tokens ADD COLUMN id bigserial UNIQUE;

ALTER TABLE api_keys ADD COLUMN role text NOT NULL DEFAULT 'owner'
    CHECK (role IN ('owner', 'member', 'read_only'));
ALTER TABLE api_keys ADD COLUMN member_id text REFERENCES members (id);
ALTER TABLE api_keys ADD COLUMN created_by text NOT NULL DEFAULT 'cli';
CREATE INDEX api_keys_member ON api_keys (member_id) WHERE member_id IS NOT NULL;
