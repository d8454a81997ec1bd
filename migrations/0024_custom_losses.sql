-- Custom losses uploaded by the tinker SDK's create_custom_loss: the checked graph
-- (core.custom_loss.LossGraph.to_json), usable by the training models of the session that made
-- it. Postgres rather than Redis: a handle lives as long as its session's models can be trained
-- (a session's rows are never expired from under a model), reads are tenant-scoped like every
-- other row (tenancy.scoped), and the SDK's (session, custom_loss_seq_id) makes a retried upload
-- the same row. The trainer never reads this table: a forward_backward carries the graph in its
-- work item, so a replay after a crash needs nothing but the stream.
CREATE TABLE custom_losses (
    id          text PRIMARY KEY,  -- <session id>:loss:<custom_loss_seq_id>
    tenant_id   text NOT NULL REFERENCES tenants (id),
    session_id  text NOT NULL REFERENCES sessions (id) ON DELETE CASCADE,
    seq_id      bigint NOT NULL,
    name        text NOT NULL,
    graph       jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    UNIQUE (session_id, seq_id)
);
CREATE INDEX custom_losses_tenant ON custom_losses (tenant_id);
