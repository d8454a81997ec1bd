"""The API's writes to the resource records: sessions, samplers, training models and request rows.
Every row is stamped with the caller's tenant, and a route changes a row only once it has read it
through tenancy.scoped; routes hold no SQL of their own."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
from psycopg import AsyncClientCursor, AsyncConnection
from psycopg.pq import TransactionStatus
from psycopg.rows import DictRow, dict_row
from psycopg.types.json import Jsonb

from checkpoints import retention
from core.errors import QuotaExceeded
from core.work import ADAMW
from tenancy import scoped
from tenancy.auth import Principal


@dataclass(frozen=True)
class NewModel:
    """The training model a create_model call brings into being, written beside its request row."""

    session_id: str
    model_seq_id: int
    base_model: str
    lora_config: dict
    user_metadata: dict
    optimizer: str = ADAMW  # its optimizer family (core.work.OPTIMIZERS), kept for its life
    context_length: int | None = None  # the longest datum it takes (bases.memory_plan.model_context)


# The lock's key: one per tenant, shared by quota_lock (a session lock) and locked_statement (a
# transaction lock), which therefore exclude each other.
_QUOTA_KEY = "hashtextextended('quilt-quota:' || %(quota_tenant)s, 0)"


@asynccontextmanager
async def quota_lock(conn: AsyncConnection[DictRow], tenant_id: str) -> AsyncIterator[None]:
    """Hold the tenant's quota lock (a session-level advisory lock, so it also works on an
    autocommit connection) around a count and the insert it allows: concurrent calls of one tenant
    take turns, and no two of them can both see the last free place. Other tenants never wait on it.
    The lock is given back even when the block fails or is cancelled (a failed transaction is
    rolled back first so the unlock can run); should taking or giving it back fail halfway, the
    connection is closed instead, which frees it in Postgres and drops it from the pool, so a lock
    never outlives its caller on a pooled connection. A single statement takes the lock more
    cheaply with locked_statement."""
    try:
        await conn.execute(f"SELECT pg_advisory_lock({_QUOTA_KEY})", {"quota_tenant": tenant_id})
    except BaseException:
        await _drop(conn)
        raise
    try:
        yield
    finally:
        with anyio.CancelScope(shield=True):  # a caller cancelled meanwhile still gives the lock back
            try:
                if conn.info.transaction_status == TransactionStatus.INERROR:
                    await conn.rollback()
                await conn.execute(f"SELECT pg_advisory_unlock({_QUOTA_KEY})", {"quota_tenant": tenant_id})
            except Exception:
                await _drop(conn)


async def locked_statement(conn: AsyncConnection[DictRow], tenant_id: str, query: str,
                           params: dict[str, Any]) -> AsyncClientCursor[DictRow]:
    """Run one statement (a count and the insert it allows) under the tenant's quota lock, in one
    round trip; returns its cursor. The lock and the statement go to Postgres as one message, which
    it runs as one transaction: the lock, a transaction lock, is taken before the statement starts
    and freed by its commit or rollback, so it never outlives the statement, whatever fails or is
    cancelled. The statement's snapshot is taken once the lock is granted (each statement of a READ
    COMMITTED transaction takes its own), so it counts what the lock's previous holder inserted.
    quota_lock's lock, its release and the statement were three waits; this is one, at the price of
    binding parameters client-side (two statements share a message only so), which plans the
    statement afresh each time. `conn` must be in autocommit with no transaction open."""
    assert conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE, "one message, one transaction"
    cur = AsyncClientCursor(conn, row_factory=dict_row)
    await cur.execute(f"SELECT pg_advisory_xact_lock({_QUOTA_KEY}); {query}", {**params, "quota_tenant": tenant_id})
    cur.nextset()  # the statement's result, after the lock's
    return cur


async def _drop(conn: AsyncConnection[DictRow]) -> None:
    with anyio.CancelScope(shield=True):
        if not conn.closed:
            await conn.close()


async def insert_session(conn: AsyncConnection[DictRow], who: Principal, session_id: str, *, tags: list, user_metadata: dict,
                         sdk_version: str | None, display_name: str | None, max_live: int, live_s: int,
                         project_id: str | None = None) -> None:
    """Record a session, unless the tenant already has `max_live` live ones (unfinished, with a
    heartbeat in the last `live_s` seconds): 429 naming the limit. Counted and written under the
    tenant's quota lock, so a burst of creations cannot pass the limit."""
    cur = await locked_statement(
        conn, who.tenant_id,
        "INSERT INTO sessions (id, tenant_id, api_key_id, tags, user_metadata, sdk_version, display_name, project_id) "
        "SELECT %(id)s, %(tenant)s, %(key)s, %(tags)s, %(meta)s, %(sdk)s, %(name)s, %(project)s "
        "WHERE (SELECT count(*) FROM sessions "
        "WHERE tenant_id = %(tenant)s AND finished_at IS NULL AND last_heartbeat_at > now() - make_interval(secs => "
        "%(live_s)s)) < %(max_live)s RETURNING id",
        {"id": session_id, "tenant": who.tenant_id, "key": who.key_id, "tags": Jsonb(tags), "meta": Jsonb(user_metadata),
         "sdk": sdk_version, "name": display_name, "live_s": live_s, "max_live": max_live, "project": project_id})
    if await cur.fetchone() is None:
        raise QuotaExceeded(f"sessions: your tenant has {max_live} live sessions, the most it may hold; finish "
                            f"one (or let it lapse: {live_s} s without a heartbeat)", field="session_id",
                            retry_after_s=60)


async def insert_sampling_session(conn: AsyncConnection[DictRow], who: Principal, sampler_id: str, *, session_id: str,
                                  seq_id: int, base_model: str, model_id: str | None, model_path: str | None) -> bool:
    """Record a sampler; False if its id (session, sampling seq id) exists already."""
    cur = await conn.execute(
        "INSERT INTO sampling_sessions (id, tenant_id, session_id, seq_id, base_model, model_id, model_path) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (id) DO NOTHING RETURNING id",
        (sampler_id, who.tenant_id, session_id, seq_id, base_model, model_id, model_path),
    )
    return await cur.fetchone() is not None


async def insert_custom_loss(conn: AsyncConnection[DictRow], who: Principal, loss_id: str, *, session_id: str,
                             seq_id: int, name: str, graph: dict, max_per_session: int) -> dict | None:
    """Record a custom loss; a repeat of its (session, seq id) leaves the first. Returns the row as
    stored, or None when the session holds `max_per_session` others already."""
    await conn.execute(
        "INSERT INTO custom_losses (id, tenant_id, session_id, seq_id, name, graph) "
        "SELECT %s, %s, %s, %s, %s, %s WHERE (SELECT count(*) FROM custom_losses WHERE session_id = %s) < %s "
        "ON CONFLICT (id) DO NOTHING",
        (loss_id, who.tenant_id, session_id, seq_id, name, Jsonb(graph), session_id, max_per_session),
    )
    cur = await conn.execute("SELECT * FROM custom_losses WHERE id = %s AND tenant_id = %s", (loss_id, who.tenant_id))
    return await cur.fetchone()


async def insert_training_model(conn: AsyncConnection[DictRow], who: Principal, model_id: str, model: NewModel,
                                 shard: str | None = None) -> None:
    """Record a new model, placed on trainer shard `shard` (None: one trainer per base)."""
    await conn.execute(
        "INSERT INTO training_models (id, tenant_id, session_id, model_seq_id, base_model, lora_config, "
        "user_metadata, trainer_shard, optimizer, context_length) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s) "
        "ON CONFLICT (id) DO NOTHING",
        (model_id, who.tenant_id, model.session_id, model.model_seq_id, model.base_model, Jsonb(model.lora_config),
         Jsonb(model.user_metadata), shard, model.optimizer, model.context_length),
    )


async def model_shard(conn: AsyncConnection[DictRow], model_id: str, choose: Callable[[], Awaitable[str]]) -> str:
    """The trainer shard of a model; one not placed yet (made before there were shards) is placed
    on `await choose()` now, unless a concurrent call placed it first."""
    row = await (await conn.execute("SELECT trainer_shard FROM training_models WHERE id = %s",
                                    (model_id,))).fetchone()
    if row is not None and row["trainer_shard"]:
        return row["trainer_shard"]
    chosen = await choose()
    row = await (await conn.execute(
        "UPDATE training_models SET trainer_shard = COALESCE(trainer_shard, %s) WHERE id = %s RETURNING trainer_shard",
        (chosen, model_id))).fetchone()
    return row["trainer_shard"] if row else chosen


_INSERT_REQUEST = "INSERT INTO requests (id, tenant_id, api_key_id, model_id, seq_id, kind, n_tokens)"
# After the request row `r`: the model's last request, noted to the second (a model's concurrent
# calls would otherwise queue on its row's lock until each commit); parameters: touch, model.
_TOUCHED = ("touched AS (UPDATE training_models SET last_request_at = now() WHERE %(touch)s AND id = %(model)s "
            "AND last_request_at < now() - interval '1 second' AND EXISTS (SELECT 1 FROM r))")


async def insert_request(conn: AsyncConnection[DictRow], who: Principal, request_id: str, *, model_id: str | None,
                         seq_id: int | None, kind: str, n_tokens: int, touch_model: bool,
                         paused: tuple[str, str] | None = None) -> bool:
    """Insert a request's row (and, with `touch_model`, note the model's last request: `_TOUCHED`)
    in one statement; False if `(model_id, seq_id)` or the id is taken already. With `paused`
    (queue state, reason) the row waits in that state (api.queue_states) instead of `queued`."""
    state, reason = paused or (None, None)
    cur = await conn.execute(
        "WITH r AS (INSERT INTO requests (id, tenant_id, api_key_id, model_id, seq_id, kind, n_tokens, status, "
        "queue_state, queue_reason) VALUES (%(id)s, %(tenant)s, %(key)s, %(model)s, %(seq)s, %(kind)s, "
        "%(n_tokens)s, %(status)s, %(state)s, %(reason)s) "
        f"ON CONFLICT DO NOTHING RETURNING id), {_TOUCHED} SELECT id FROM r",
        {"id": request_id, "tenant": who.tenant_id, "key": who.key_id, "model": model_id, "seq": seq_id,
         "kind": kind, "n_tokens": n_tokens, "touch": touch_model, "status": "paused" if paused else "queued",
         "state": state, "reason": reason},
    )
    return await cur.fetchone() is not None


async def insert_call(conn: AsyncConnection[DictRow], who: Principal, request_id: str, *, model_id: str, seq_id: int,
                      kind: str, n_tokens: int, billable: bool, admissible: bool, unusable: list[str]) -> dict:
    """A call on an existing model in one statement: the model's row as
    `tenancy.scoped.get_model(..., seq_id=seq_id, admission=True)` reads it (NotFound, 404, the
    same way), with the call's request row inserted beside it when nothing in the row can refuse
    the call: `admissible` (what the caller judged without the row), a status not in `unusable`,
    `seq_id` free, the tenant's in-flight count under its quota, none of its calls waiting in a
    queue state (api.queue_states: a new call waits behind them), and no budget to check for a
    `billable` call. The row's `inserted` says whether it was; if not, admission judges the row
    as it judges a plain read (and writes the row itself when it admits the call after all)."""
    cur = await locked_statement(
        conn, who.tenant_id,
        f"WITH model AS ({scoped.MODEL_FOR_ADMISSION}), "
        f"r AS ({_INSERT_REQUEST} SELECT %(id)s, %(tenant)s, %(key)s, model.id, %(seq)s, %(kind)s, %(n_tokens)s "
        "FROM model WHERE %(admissible)s AND model.status <> ALL(%(unusable)s) AND model.seq_holder_id IS NULL "
        "AND model.inflight < %(max_inflight)s AND model.paused = 0 AND NOT (%(billable)s AND model.budgeted) "
        f"ON CONFLICT DO NOTHING RETURNING id), {_TOUCHED} "
        "SELECT model.*, EXISTS (SELECT 1 FROM r) AS inserted FROM model",
        {"seq": seq_id, "model": model_id, "tenant": who.tenant_id, "key": who.key_id, "id": request_id,
         "kind": kind, "n_tokens": n_tokens, "billable": billable, "admissible": admissible, "unusable": unusable,
         "max_inflight": who.max_inflight_requests, "touch": True},
    )
    row = await cur.fetchone()
    if row is None:
        raise scoped.model_not_found(model_id)
    return row


async def delete_refused(conn: AsyncConnection[DictRow], request_id: str) -> None:
    """Delete the row of a request whose entry the tokens-per-minute bucket refused (it never
    reached a worker), freeing its seq_id for the client's retry."""
    await conn.execute("DELETE FROM requests WHERE id = %s AND status = 'queued'", (request_id,))


async def pause(conn: AsyncConnection[DictRow], request_id: str, queue_state: str, reason: str,
                wait_s: float = 0.0) -> bool:
    """Set a queued request (its entry not appended) waiting in `queue_state` for `reason`, to try
    its append again no sooner than `wait_s` from now (api.queue_states). False if it was not queued."""
    cur = await conn.execute(
        "UPDATE requests SET status = 'paused', queue_state = %s, queue_reason = %s, "
        "not_before = now() + make_interval(secs => %s) WHERE id = %s AND status IN ('queued', 'paused') RETURNING id",
        (queue_state, reason, wait_s, request_id))
    return await cur.fetchone() is not None


async def unpause(conn: AsyncConnection[DictRow], request_id: str) -> bool:
    """A paused request, queued again for its append (its queue state kept, for the record of why it
    waited; `not_before` now says when it was queued, which upkeep's never-enqueued sweep counts
    from). False if it was no longer paused (another API process promoted or failed it)."""
    cur = await conn.execute("UPDATE requests SET status = 'queued', not_before = now() WHERE id = %s "
                             "AND status = 'paused' RETURNING id", (request_id,))
    return await cur.fetchone() is not None


async def paused_requests(conn: AsyncConnection[DictRow], tenant_id: str, limit: int) -> list[dict]:
    """A tenant's first `limit` paused requests in the order they came, with their age and bucket
    wait in seconds, and their model's base and trainer shard."""
    cur = await conn.execute(
        "SELECT r.id, r.model_id, r.seq_id, r.kind, r.n_tokens, r.queue_state, r.queue_reason, m.base_model, "
        "m.trainer_shard, extract(epoch FROM now() - r.created_at)::float8 AS age_s, "
        "greatest(0, extract(epoch FROM coalesce(r.not_before, now()) - now()))::float8 AS wait_s "
        "FROM requests r JOIN training_models m ON m.id = r.model_id "
        "WHERE r.tenant_id = %s AND r.status = 'paused' ORDER BY r.created_at, r.id LIMIT %s",
        (tenant_id, limit))
    return await cur.fetchall()


async def seq_holder(conn: AsyncConnection[DictRow], model_id: str, seq_id: int) -> tuple[str | None, str | None]:
    """(request id, kind) of the request at `seq_id` of `model_id`, or (None, None)."""
    cur = await conn.execute("SELECT id, kind FROM requests WHERE model_id = %s AND seq_id = %s", (model_id, seq_id))
    row = await cur.fetchone()
    return (row["id"], row["kind"]) if row else (None, None)


async def request_status(conn: AsyncConnection[DictRow], request_id: str) -> str | None:
    """The status of request `request_id`, or None if it was never recorded."""
    cur = await conn.execute("SELECT status FROM requests WHERE id = %s", (request_id,))
    row = await cur.fetchone()
    return row["status"] if row else None


async def touch_session(conn: AsyncConnection[DictRow], session_id: str) -> None:
    """A session's heartbeat."""
    await conn.execute("UPDATE sessions SET last_heartbeat_at = now() WHERE id = %s", (session_id,))


async def finish_session(conn: AsyncConnection[DictRow], session_id: str, reason: str) -> None:
    """Close a session; the first reason given wins."""
    await conn.execute("UPDATE sessions SET finished_at = now(), finish_reason = %s WHERE id = %s AND finished_at IS NULL",
                       (reason, session_id))


async def delete_checkpoint(conn: AsyncConnection[DictRow], checkpoint_id: int) -> bool:
    """Delete a checkpoint's row; True if its files may go too, False while another row (a copy,
    or the source of one) still names them (checkpoints.retention). Two statements in the caller's
    transaction (`pool.connection()`), not one: a copy being
    made holds its source row until it commits, and the count, read after the delete got the row,
    sees that copy."""
    cur = await conn.execute("DELETE FROM checkpoints WHERE id = %s RETURNING storage_path", (checkpoint_id,))
    gone = await cur.fetchone()
    if gone is None:
        return False
    cur = await conn.execute(f"SELECT 1 FROM checkpoints WHERE {retention.USES_PATH} LIMIT 1",
                             {"path": gone["storage_path"], "under": retention.under_pattern(gone["storage_path"])})
    return await cur.fetchone() is None


async def set_published(conn: AsyncConnection[DictRow], checkpoint_id: int, published: bool) -> bool:
    """Publish or unpublish a checkpoint; False if it already was so."""
    cur = await conn.execute(
        "UPDATE checkpoints SET published_at = CASE WHEN %(pub)s THEN now() END WHERE id = %(id)s "
        "AND (published_at IS NOT NULL) <> %(pub)s RETURNING id", {"id": checkpoint_id, "pub": published})
    return await cur.fetchone() is not None


async def expire_checkpoint(conn: AsyncConnection[DictRow], checkpoint_id: int, ttl_s: int | None) -> None:
    """Expire a checkpoint `ttl_s` from now (None: never), replacing any earlier expiry, sliding or not."""
    await conn.execute("UPDATE checkpoints SET expires_at = now() + make_interval(secs => %s), sliding_ttl_s = NULL "
                       "WHERE id = %s", (ttl_s, checkpoint_id))


async def slide_checkpoint(conn: AsyncConnection[DictRow], checkpoint_id: int) -> None:
    """A use of a checkpoint with a sliding lifetime restarts its clock (checkpoints.retention)."""
    await conn.execute("UPDATE checkpoints SET expires_at = now() + make_interval(secs => sliding_ttl_s) WHERE id = %s",
                       (checkpoint_id,))


# ------------------------------------------------------------------ projects, copies, access tokens

async def insert_project(conn: AsyncConnection[DictRow], who: Principal, project_id: str, name: str,
                         max_projects: int) -> bool:
    """Record a project; False if the tenant has one of that name already. QuotaExceeded past
    `max_projects` (counted under the tenant's quota lock)."""
    cur = await locked_statement(
        conn, who.tenant_id,
        "WITH n AS (SELECT count(*) AS n FROM projects WHERE tenant_id = %(tenant)s), "
        "ins AS (INSERT INTO projects (id, tenant_id, name) SELECT %(id)s, %(tenant)s, %(name)s FROM n "
        "WHERE n.n < %(most)s ON CONFLICT (tenant_id, name) DO NOTHING RETURNING id) "
        "SELECT (SELECT n FROM n) AS n, (SELECT id FROM ins) AS id",
        {"tenant": who.tenant_id, "id": project_id, "name": name, "most": max_projects})
    row = await cur.fetchone()
    if row is not None and row["id"] is None and row["n"] >= max_projects:
        raise QuotaExceeded(f"projects: your tenant has {row['n']} projects, the most it may hold ({max_projects})",
                            field="name", retry_after_s=3600)
    return row is not None and row["id"] is not None


async def assign_session_project(conn: AsyncConnection[DictRow], who: Principal, session_id: str, project_id: str) -> None:
    """Move a session of the tenant (with its runs and samplers) into one of its projects."""
    await conn.execute("UPDATE sessions SET project_id = %s WHERE id = %s AND tenant_id = %s",
                       (project_id, session_id, who.tenant_id))


async def lock_copy_source(conn: AsyncConnection[DictRow], checkpoint_id: int) -> dict | None:
    """The source row of a copy, locked until the copy commits (so deleting the source, which
    takes the row, waits for the copy and then sees it), or None if it went meanwhile."""
    cur = await conn.execute(f"SELECT * FROM checkpoints WHERE id = %s AND {retention.LIVE} FOR SHARE",
                             (checkpoint_id,))
    return await cur.fetchone()


async def use_weights_token(conn: AsyncConnection[DictRow], token_sha256: bytes, checkpoint_id: int,
                            storage_path: str) -> str | None:
    """The id of a live (unrevoked, unexpired) weights access token for this checkpoint as it was
    when the token was made (a later save under the name keeps the row's id but names new files,
    which the token does not grant), locked until the copy commits (a revocation waits for it), or None."""
    cur = await conn.execute(
        "SELECT id FROM weights_access_tokens WHERE token_sha256 = %s AND checkpoint_id = %s AND storage_path = %s "
        "AND revoked_at IS NULL AND (expires_at IS NULL OR expires_at > now()) FOR SHARE",
        (token_sha256, checkpoint_id, storage_path))
    row = await cur.fetchone()
    return row["id"] if row else None


async def insert_copy_session(conn: AsyncConnection[DictRow], who: Principal, session_id: str, project_id: str) -> None:
    """The session a copy into a project lives in: finished at once (nothing runs in it), so it
    counts against no live-session limit. A retry with the same id finds it there."""
    await conn.execute(
        "INSERT INTO sessions (id, tenant_id, api_key_id, tags, project_id, finished_at, finish_reason, sdk_version) "
        "VALUES (%s, %s, %s, %s, %s, now(), 'success', 'copy_weights') ON CONFLICT (id) DO NOTHING",
        (session_id, who.tenant_id, who.key_id or None, Jsonb(["copy_weights"]), project_id))


async def insert_copy(conn: AsyncConnection[DictRow], who: Principal, source: dict, *, model_id: str, session_id: str,
                      model_seq_id: int, copied_from: str, ttl_s: int | None) -> bool:
    """A copy of checkpoint row `source` (with its run's `base_model`, `lora_config`, `optimizer`):
    a training run of status 'copy' holding one checkpoint row that names the same files. False
    if `model_id` exists already (a retry, or a slot taken: the caller tells which)."""
    cur = await conn.execute(
        "INSERT INTO training_models (id, tenant_id, session_id, model_seq_id, base_model, lora_config, status, "
        "optimizer, copied_from) VALUES (%s, %s, %s, %s, %s, %s, 'copy', %s, %s) ON CONFLICT DO NOTHING RETURNING id",
        (model_id, who.tenant_id, session_id, model_seq_id, source["base_model"], Jsonb(source["lora_config"]),
         source["optimizer"], copied_from))
    if await cur.fetchone() is None:
        return False
    await conn.execute(
        "INSERT INTO checkpoints (tenant_id, model_id, kind, name, storage_path, size_bytes, expires_at, user_metadata) "
        "VALUES (%s, %s, %s, %s, %s, %s, now() + make_interval(secs => %s), %s)",
        (who.tenant_id, model_id, source["kind"], source["name"], source["storage_path"], source["size_bytes"], ttl_s,
         None if source["user_metadata"] is None else Jsonb(source["user_metadata"])))
    return True


async def holds_files(conn: AsyncConnection[DictRow], tenant_id: str, storage_path: str) -> bool:
    """Whether a live checkpoint of the tenant already names these files (a copy then adds no bytes)."""
    cur = await conn.execute(f"SELECT 1 FROM checkpoints WHERE tenant_id = %s AND storage_path = %s AND {retention.LIVE} "
                             "LIMIT 1", (tenant_id, storage_path))
    return await cur.fetchone() is not None


async def live_copies(conn: AsyncConnection[DictRow], tenant_id: str) -> int:
    """How many live checkpoints of the tenant copy_weights made (QUILT_TENANT_MAX_COPIES)."""
    cur = await conn.execute("SELECT count(*) AS n FROM checkpoints c JOIN training_models m ON m.id = c.model_id "
                             "WHERE c.tenant_id = %s AND m.status = 'copy' AND (c.expires_at IS NULL OR c.expires_at > now())",
                             (tenant_id,))
    return int((await cur.fetchone() or {"n": 0})["n"])


async def live_weights_tokens(conn: AsyncConnection[DictRow], tenant_id: str) -> int:
    """How many unrevoked, unexpired weights access tokens the tenant has (QUILT_TENANT_MAX_WEIGHTS_TOKENS)."""
    cur = await conn.execute("SELECT count(*) AS n FROM weights_access_tokens WHERE tenant_id = %s AND revoked_at IS NULL "
                             "AND (expires_at IS NULL OR expires_at > now())", (tenant_id,))
    return int((await cur.fetchone() or {"n": 0})["n"])


async def insert_weights_token(conn: AsyncConnection[DictRow], who: Principal, token_id: str, checkpoint: dict,
                               token_sha256: bytes, ttl_s: int | None) -> dict:
    """Record a token to checkpoint row `checkpoint`'s files as they are now."""
    cur = await conn.execute(
        "INSERT INTO weights_access_tokens (id, tenant_id, checkpoint_id, storage_path, token_sha256, created_by, expires_at) "
        "VALUES (%s, %s, %s, %s, %s, %s, now() + make_interval(secs => %s)) RETURNING created_at, expires_at",
        (token_id, who.tenant_id, checkpoint["id"], checkpoint["storage_path"], token_sha256, who.actor, ttl_s))
    row = await cur.fetchone()
    assert row is not None
    return row


async def revoke_weights_token(conn: AsyncConnection[DictRow], who: Principal, token_id: str) -> dict | None:
    """Revoke a token of the tenant's; its row (with the checkpoint's tinker path parts), or None
    if there is none or it was revoked already."""
    cur = await conn.execute(
        "UPDATE weights_access_tokens w SET revoked_at = now() FROM checkpoints c WHERE w.id = %s AND w.tenant_id = %s "
        "AND w.revoked_at IS NULL AND c.id = w.checkpoint_id RETURNING w.id, c.model_id, c.kind, c.name",
        (token_id, who.tenant_id))
    return await cur.fetchone()
