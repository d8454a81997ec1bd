"""Tenant-scoped reads for the API. Every lookup filters on the caller's tenant, so another
tenant's resource is indistinguishable from a missing one (404), and no route compares owners."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from psycopg import AsyncConnection
from psycopg.rows import DictRow
from psycopg.types.json import Jsonb

from checkpoints import retention
from core import db
from core.errors import Conflict, Forbidden, NotFound
from core.queue import MAX_CLONE
from tenancy import sharing
from tenancy.auth import Principal

# Admission's reads: the tenant's requests in flight, its calls waiting in a queue state
# (api.queue_states), and whether a monthly budget bounds the tenant or the calling key (billing.budgets).
_ADMISSION_READS = ("(SELECT count(*) FROM requests WHERE tenant_id = %(tenant)s AND status IN ('queued', 'running')) "
                    "AS inflight, (SELECT count(*) FROM requests WHERE tenant_id = %(tenant)s AND status = 'paused') "
                    "AS paused, EXISTS (SELECT 1 FROM budgets WHERE tenant_id = %(tenant)s "
                    "AND (api_key_id IS NULL OR api_key_id = %(key)s)) AS budgeted")


async def _one(conn: AsyncConnection[DictRow], sql: str, params: tuple | dict, missing: NotFound) -> dict:
    cur = await conn.execute(sql, params)
    row = await cur.fetchone()
    if row is None:
        raise missing
    return row


def model_not_found(model_id: str) -> NotFound:
    """The 404 for a model that is not the caller's (or does not exist: the two read the same)."""
    return NotFound(f"model {model_id!r} not found", field="model_id")


async def get_session(conn: AsyncConnection[DictRow], who: Principal, session_id: str) -> dict:
    return await _one(
        conn,
        "SELECT * FROM sessions WHERE id = %s AND tenant_id = %s",
        (session_id, who.tenant_id),
        NotFound(f"session {session_id!r} not found", field="session_id"),
    )


# A session is the caller's own when the calling key made it, or another key of the same member
# account did (the tinker SDK's `owned` scope); `accessible` is every session of the tenant.
# Parameters: key, member.
_OWNED = ("(s.api_key_id = %(key)s OR (%(member)s::text IS NOT NULL AND s.api_key_id IN "
          "(SELECT id FROM api_keys WHERE member_id = %(member)s)))")
ACCESS_SCOPES = ("owned", "accessible")


async def list_sessions(conn: AsyncConnection[DictRow], who: Principal, *, limit: int, offset: int,
                        access_scope: str = "owned") -> list[str]:
    """Your sessions' ids, newest first: those you made (`owned`) or all of your tenant's (`accessible`)."""
    owned = _OWNED if access_scope == "owned" else "true"
    cur = await conn.execute(
        f"SELECT s.id FROM sessions s WHERE s.tenant_id = %(tenant)s AND {owned} "
        "ORDER BY s.created_at DESC, s.id LIMIT %(limit)s OFFSET %(offset)s",
        {"tenant": who.tenant_id, "key": who.key_id, "member": who.member_id, "limit": limit, "offset": offset},
    )
    return [row["id"] for row in await cur.fetchall()]


@dataclass(frozen=True)
class SessionSearch:
    """A session search (the tinker SDK's SessionSearchRequest), checked: `owner` is `own`,
    `accessible`, or the key prefixes of `key:<prefix>` owner URNs; `statuses` lists `active` and
    `client_finished:<reason>` (None: any status); `after` the cursor (created_at, session id)."""

    limit: int
    owner: str = "own"
    owner_prefixes: tuple[str, ...] = ()
    session_id: str | None = None
    display_words: tuple[str, ...] = ()
    project_ids: tuple[str, ...] | None = None
    user_metadata: dict[str, str] = field(default_factory=dict)
    statuses: tuple[str, ...] | None = None
    after: tuple[datetime, str] | None = None


def _like(word: str) -> str:
    return "%" + word.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


async def search_sessions(conn: AsyncConnection[DictRow], who: Principal, q: SessionSearch) -> list[dict]:
    """One page of your tenant's sessions matching `q`, newest first, with their owner's key prefix,
    live checkpoint count and bytes. `q.project_ids` must all be the tenant's (checked by the caller)."""
    p: dict = {"tenant": who.tenant_id, "key": who.key_id, "member": who.member_id, "limit": q.limit,
               "sid": q.session_id, "projects": list(q.project_ids) if q.project_ids is not None else None,
               "meta": Jsonb(q.user_metadata), "prefixes": list(q.owner_prefixes),
               "statuses": list(q.statuses) if q.statuses is not None else None,
               "after_at": q.after[0] if q.after else None, "after_id": q.after[1] if q.after else None}
    words = " AND ".join(f"s.display_name ILIKE %(w{i})s" for i in range(len(q.display_words)))
    p.update({f"w{i}": _like(w) for i, w in enumerate(q.display_words)})
    if q.session_id is not None and words:
        match = f"(s.id = %(sid)s OR ({words}))"
    else:
        match = "s.id = %(sid)s" if q.session_id is not None else (f"({words})" if words else "true")
    owner = {"own": _OWNED, "accessible": "true", "user": "k.prefix = ANY(%(prefixes)s)"}[q.owner]
    status = ("CASE WHEN s.finished_at IS NULL THEN 'active' WHEN s.finish_reason IN ('success', 'errored', 'interrupted') "
              "THEN 'client_finished:' || s.finish_reason END")
    cur = await conn.execute(
        "SELECT s.id, s.created_at, s.project_id, s.display_name, s.user_metadata, s.finished_at, s.finish_reason, "
        "k.prefix AS key_prefix, "
        f"(SELECT count(*) FROM checkpoints c JOIN training_models m ON m.id = c.model_id WHERE m.session_id = s.id "
        f"AND {retention.LIVE}) AS checkpoints, "
        f"(SELECT COALESCE(sum(c.size_bytes), 0)::bigint FROM checkpoints c JOIN training_models m ON m.id = c.model_id "
        f"WHERE m.session_id = s.id AND {retention.LIVE}) AS checkpoint_bytes "
        "FROM sessions s LEFT JOIN api_keys k ON k.id = s.api_key_id "
        f"WHERE s.tenant_id = %(tenant)s AND {match} AND {owner} "
        "AND (%(projects)s::text[] IS NULL OR s.project_id = ANY(%(projects)s)) AND s.user_metadata @> %(meta)s "
        f"AND (%(statuses)s::text[] IS NULL OR {status} = ANY(%(statuses)s)) "
        "AND (%(after_at)s::timestamptz IS NULL OR (s.created_at, s.id) < (%(after_at)s, %(after_id)s)) "
        "ORDER BY s.created_at DESC, s.id DESC LIMIT %(limit)s", p)
    return await cur.fetchall()


async def get_project(conn: AsyncConnection[DictRow], who: Principal, project_id: str, field: str = "project_id") -> dict:
    """A project of your tenant (404 for another tenant's, like a missing one)."""
    return await _one(conn, "SELECT * FROM projects WHERE id = %s AND tenant_id = %s", (project_id, who.tenant_id),
                      NotFound(f"project {project_id!r} not found", field=field))


async def list_projects(conn: AsyncConnection[DictRow], who: Principal) -> list[dict]:
    """Your tenant's projects, the default first, then by creation, with their sessions counted."""
    cur = await conn.execute(
        "SELECT p.id, p.name, p.is_default, p.created_at, (SELECT count(*) FROM sessions s WHERE s.project_id = p.id) "
        "AS sessions FROM projects p WHERE p.tenant_id = %s ORDER BY p.is_default DESC, p.created_at, p.id",
        (who.tenant_id,))
    return await cur.fetchall()


async def session_contents(conn: AsyncConnection[DictRow], who: Principal, session_id: str) -> tuple[dict, list[str], list[str]]:
    """A session of yours, its training models (deleted ones left out) and its samplers, each in
    creation order."""
    session = await get_session(conn, who, session_id)
    cur = await conn.execute(
        "SELECT id FROM training_models WHERE session_id = %s AND tenant_id = %s AND status <> 'deleted' "
        "ORDER BY model_seq_id", (session_id, who.tenant_id))
    models = [row["id"] for row in await cur.fetchall()]
    cur = await conn.execute(
        "SELECT id FROM sampling_sessions WHERE session_id = %s AND tenant_id = %s ORDER BY seq_id",
        (session_id, who.tenant_id))
    return session, models, [row["id"] for row in await cur.fetchall()]


def _model_read(admission: bool) -> str:
    quota = f", {_ADMISSION_READS}" if admission else ""
    # a model's own context (chosen at create_model), or its base's for a model made before it was chosen
    return ("SELECT m.*, b.vocab_size, COALESCE(m.context_length, b.max_context_length) AS max_context_length, "
            "r.id AS seq_holder_id, r.kind AS seq_holder_kind, "
            f"r.status AS seq_holder_status{quota} "
            "FROM training_models m JOIN base_models b ON b.name = m.base_model "
            "LEFT JOIN requests r ON r.model_id = m.id AND r.seq_id = %(seq)s "
            "WHERE m.id = %(model)s AND m.tenant_id = %(tenant)s AND m.status <> 'deleted'")


# `get_model(..., admission=True)`'s statement, for a write that reads the model in the same
# statement (api.records.insert_call); parameters: seq, model, tenant, key.
MODEL_FOR_ADMISSION = _model_read(admission=True)


async def get_model(conn: AsyncConnection[DictRow], who: Principal, model_id: str, *, seq_id: int | None = None,
                    admission: bool = False) -> dict:
    """A training model of yours, with its base's limits (`vocab_size`, `max_context_length`) and,
    given `seq_id`, the request already holding it (`seq_holder_id`, `seq_holder_kind` and
    `seq_holder_status`, else None): everything a call on the model needs, in one read. With
    `admission`, also admission's own reads (`inflight_and_budgeted`'s `inflight` and `budgeted`),
    so a call on a model waits on one statement before its insert, not two."""
    return await _one(
        conn,
        MODEL_FOR_ADMISSION if admission else _model_read(admission=False),
        {"seq": seq_id, "model": model_id, "tenant": who.tenant_id, "key": who.key_id},
        model_not_found(model_id),
    )


async def get_request(conn: AsyncConnection[DictRow], who: Principal, request_id: str) -> dict:
    return await _one(
        conn,
        "SELECT id, status, kind, model_id, seq_id, finished_at, error, queue_state, queue_reason FROM requests "
        "WHERE id = %s AND tenant_id = %s",
        (request_id, who.tenant_id),
        NotFound(f"future {request_id!r} not found", field="request_id"),
    )


async def get_checkpoint(conn: AsyncConnection[DictRow], who: Principal, model_id: str, kind: str, name: str) -> dict:
    return await _one(
        conn,
        f"SELECT * FROM checkpoints WHERE model_id = %s AND kind = %s AND name = %s AND tenant_id = %s "
        f"AND {retention.LIVE}",
        (model_id, kind, name, who.tenant_id),
        NotFound(f"checkpoint tinker://{model_id}/{kind}/{name} not found", field="path"),
    )


async def readable_checkpoint(conn: AsyncConnection[DictRow], who: Principal, model_id: str, kind: str, name: str,
                              field: str = "path") -> dict:
    """A live checkpoint you may read (sample, copy, download): yours, or another tenant's while it
    is published. With its run's `base_model`, `lora_config` and `optimizer`. Another tenant's
    unpublished checkpoint is a 404, like a missing one."""
    return await _one(
        conn,
        "SELECT c.*, m.base_model, m.lora_config, m.optimizer FROM checkpoints c JOIN training_models m "
        "ON m.id = c.model_id WHERE c.model_id = %s AND c.kind = %s AND c.name = %s "
        f"AND (c.tenant_id = %s OR c.published_at IS NOT NULL) AND {retention.LIVE}",
        (model_id, kind, name, who.tenant_id),
        NotFound(f"checkpoint tinker://{model_id}/{kind}/{name} not found", field=field),
    )


async def download_checkpoint(conn: AsyncConnection[DictRow], tenant_id: str, checkpoint_id: int, api_key_id: str) -> dict:
    """The checkpoint a signed URL names, if the link still holds: the checkpoint lives and is the
    link's tenant's or still published, the key that minted it (`api_key_id`, "" for none; a key of
    the link's tenant) is not revoked, and no operator has suspended the checkpoint's owner (a
    payment suspension keeps downloads working), nor the link's own tenant (`sharing.download_link_refusal`).
    NotFound or Forbidden saying which otherwise."""
    cur = await conn.execute(
        "SELECT c.*, t.suspended_kind, h.suspended_kind AS holder_suspended_kind, k.id AS minted_by, "
        "k.revoked_at AS minted_by_revoked_at FROM checkpoints c JOIN tenants t ON t.id = c.tenant_id "
        "LEFT JOIN tenants h ON h.id = %(tenant)s LEFT JOIN api_keys k ON k.id = %(key)s AND k.tenant_id = %(tenant)s "
        f"WHERE c.id = %(id)s AND (c.tenant_id = %(tenant)s OR c.published_at IS NOT NULL) AND {retention.LIVE}",
        {"key": api_key_id, "id": checkpoint_id, "tenant": tenant_id})
    row = await cur.fetchone()
    if row is None:
        raise NotFound("the checkpoint of this download link was deleted, has expired or is no longer published",
                       field="token")
    if api_key_id and (row["minted_by"] is None or row["minted_by_revoked_at"] is not None):
        raise NotFound("the API key that made this download link was revoked; ask for a new link", field="token")
    refusal = sharing.download_link_refusal(owner_suspended=row["suspended_kind"],
                                            holder_suspended=row["holder_suspended_kind"])
    if refusal:
        raise Forbidden(refusal, field="token")
    return row


async def model_base(conn: AsyncConnection[DictRow], tenant_id: str, model_id: str) -> str:
    """The base model of tenant `tenant_id`'s training model `model_id` (404 if not theirs)."""
    row = await _one(conn, "SELECT base_model FROM training_models WHERE id = %s AND tenant_id = %s",
                     (model_id, tenant_id), model_not_found(model_id))
    return row["base_model"]


async def key_id(conn: AsyncConnection[DictRow], who: Principal, prefix: str) -> str:
    """The id of the caller's tenant's API key with `prefix` (404 if none)."""
    row = await _one(conn, "SELECT id FROM api_keys WHERE tenant_id = %s AND prefix = %s", (who.tenant_id, prefix),
                     NotFound(f"no API key of yours with prefix {prefix!r}", field="api_key_prefix"))
    return row["id"]


async def get_sampling_session(conn: AsyncConnection[DictRow], who: Principal, sampling_session_id: str) -> dict:
    return await _one(
        conn,
        "SELECT * FROM sampling_sessions WHERE id = %s AND tenant_id = %s",
        (sampling_session_id, who.tenant_id),
        NotFound(f"sampling session {sampling_session_id!r} not found", field="sampling_session_id"),
    )


async def get_custom_loss(conn: AsyncConnection[DictRow], who: Principal, loss_id: str, session_id: str) -> dict:
    """Your custom loss `loss_id`, usable only by the session that made it: 404 for another
    session's or another tenant's, like a missing one."""
    return await _one(
        conn,
        "SELECT * FROM custom_losses WHERE id = %s AND tenant_id = %s AND session_id = %s",
        (loss_id, who.tenant_id, session_id),
        NotFound(f"custom loss {loss_id!r} not found in this model's session", field="loss_fn_config.loss_id"),
    )


async def join_sampling_session(conn: AsyncConnection[DictRow], who: Principal, sampling_session_id: str) -> int:
    """Your sampling session's next client number (the original client is 0, so the first copy gets
    1); 404 unless the session is yours."""
    cur = await conn.execute(
        "UPDATE sampling_sessions SET clients = clients + 1 WHERE id = %s AND tenant_id = %s AND clients < %s "
        "RETURNING clients", (sampling_session_id, who.tenant_id, MAX_CLONE))
    row = await cur.fetchone()
    if row is None:
        await get_sampling_session(conn, who, sampling_session_id)
        raise Conflict(f"sampling session {sampling_session_id!r} has had {MAX_CLONE:,} clients, the "
                       "most its seq_ids can number; create a new sampling session", field="sampling_session_id")
    return row["clients"]


async def count_live_models(conn: AsyncConnection[DictRow], who: Principal) -> int:
    cur = await conn.execute(
        "SELECT count(*) AS n FROM training_models WHERE tenant_id = %s AND status IN ('creating', 'ready', 'recovering')",
        (who.tenant_id,),
    )
    return db.one(await cur.fetchone())["n"]


async def inflight_and_budgeted(conn: AsyncConnection[DictRow], who: Principal) -> tuple[int, bool, int]:
    """The tenant's requests in flight, whether a monthly budget bounds the tenant or the calling
    key (billing.budgets), and its calls waiting in a queue state: admission's reads in one
    statement, one round trip (a call on a model reads them with the model instead:
    `get_model(..., admission=True)`)."""
    cur = await conn.execute(f"SELECT {_ADMISSION_READS}", {"tenant": who.tenant_id, "key": who.key_id})
    row = db.one(await cur.fetchone())
    return row["inflight"], row["budgeted"], row["paused"]


async def list_models(conn: AsyncConnection[DictRow], who: Principal, *, limit: int, offset: int) -> tuple[list[dict], int]:
    cur = await conn.execute(
        "SELECT m.*, count(*) OVER () AS total FROM training_models m WHERE tenant_id = %s AND status <> 'deleted' "
        "ORDER BY created_at DESC LIMIT %s OFFSET %s",
        (who.tenant_id, limit, offset),
    )
    rows = await cur.fetchall()
    if rows:
        return rows, rows[0]["total"]
    cur = await conn.execute(
        "SELECT count(*) AS n FROM training_models WHERE tenant_id = %s AND status <> 'deleted'", (who.tenant_id,)
    )
    return [], db.one(await cur.fetchone())["n"]


async def list_checkpoints(conn: AsyncConnection[DictRow], who: Principal, *, model_id: str | None = None,
                           limit: int = 1000, offset: int = 0) -> tuple[list[dict], int]:
    cur = await conn.execute(
        f"SELECT c.*, count(*) OVER () AS total FROM checkpoints c WHERE tenant_id = %s AND {retention.LIVE} "
        "AND (%s::text IS NULL OR model_id = %s) ORDER BY created_at DESC LIMIT %s OFFSET %s",
        (who.tenant_id, model_id, model_id, limit, offset),
    )
    rows = await cur.fetchall()
    return rows, (rows[0]["total"] if rows else 0)


async def checkpoint_bytes(conn: AsyncConnection[DictRow], who: Principal) -> int:
    """The bytes of the caller's tenant's live checkpoints (its max_checkpoint_bytes quota)."""
    # Each stored directory once: copies inside a tenant share their source's files (copy_weights).
    cur = await conn.execute(f"SELECT COALESCE(sum(size_bytes), 0)::bigint AS n FROM (SELECT DISTINCT ON (storage_path) "
                             f"size_bytes FROM checkpoints WHERE tenant_id = %s AND {retention.LIVE}) c", (who.tenant_id,))
    return db.one(await cur.fetchone())["n"]


async def checkpoint_storage(conn: AsyncConnection[DictRow], who: Principal, *, project_id: str | None = None) -> list[dict]:
    """Your live checkpoints' count and bytes by project and by the key that created their session
    (`key_prefix`, `key_name`; None where the session records no key), most bytes first; only
    `project_id`'s, given one (that project's lines of the whole report). `checkpoints` counts
    checkpoints, copies included; `size_bytes` counts each stored directory once, in the line of
    the first checkpoint that names it (copies inside the tenant share files, and storage bills
    them once so: billing.storage), so a line of copies only has checkpoints and no bytes, and the
    lines' bytes add up to what is billed."""
    cur = await conn.execute(
        "SELECT project_id, key_prefix, key_name, count(*) AS checkpoints, "
        "COALESCE(sum(size_bytes) FILTER (WHERE first), 0)::bigint AS size_bytes "
        "FROM (SELECT s.project_id, k.prefix AS key_prefix, k.name AS key_name, c.size_bytes, "
        "row_number() OVER (PARTITION BY c.storage_path ORDER BY c.id) = 1 AS first "
        "FROM checkpoints c JOIN training_models m ON m.id = c.model_id "
        "JOIN sessions s ON s.id = m.session_id LEFT JOIN api_keys k ON k.id = s.api_key_id "
        f"WHERE c.tenant_id = %s AND {retention.LIVE}) f "
        "WHERE (%s::text IS NULL OR project_id = %s) "
        "GROUP BY project_id, key_prefix, key_name ORDER BY size_bytes DESC, project_id, key_prefix",
        (who.tenant_id, project_id, project_id),
    )
    return await cur.fetchall()


async def list_sampling_sessions(conn: AsyncConnection[DictRow], who: Principal, *, limit: int = 200) -> list[dict]:
    """Your samplers, newest first, with how many sampling requests each has run and is running."""
    cur = await conn.execute(
        "SELECT s.id, s.base_model, s.model_id, s.model_path, s.created_at, "
        "count(r.id) FILTER (WHERE r.status = 'done') AS done, "
        "count(r.id) FILTER (WHERE r.status = 'failed') AS failed, "
        "count(r.id) FILTER (WHERE r.status IN ('queued', 'running')) AS in_flight "
        "FROM sampling_sessions s LEFT JOIN requests r ON r.model_id = s.id AND r.tenant_id = s.tenant_id "
        "WHERE s.tenant_id = %s GROUP BY s.id ORDER BY s.created_at DESC LIMIT %s",
        (who.tenant_id, limit),
    )
    return await cur.fetchall()


async def run_progress(conn: AsyncConnection[DictRow], who: Principal, model_ids: list[str]) -> dict[str, dict]:
    """Per training model of yours: `step` (optimizer steps completed: its policy version),
    `in_flight` requests, the newest trainer `loss` (loss per weighted token) if any, and the calls
    `waiting` in a queue state (api.queue_states) with the first one's `queue_state` and `queue_reason`."""
    out = {m: {"step": 0, "in_flight": 0, "loss": None, "waiting": 0, "queue_state": None, "queue_reason": None}
           for m in model_ids}
    cur = await conn.execute(
        "SELECT model_id, count(*) FILTER (WHERE kind = 'optim_step' AND status = 'done') AS step, "
        "count(*) FILTER (WHERE status IN ('queued', 'running')) AS in_flight, "
        "count(*) FILTER (WHERE status = 'paused') AS waiting "
        "FROM requests WHERE tenant_id = %s AND model_id = ANY(%s) GROUP BY model_id",
        (who.tenant_id, model_ids),
    )
    for row in await cur.fetchall():
        out[row["model_id"]].update(step=row["step"], in_flight=row["in_flight"], waiting=row["waiting"])
    cur = await conn.execute(
        "SELECT DISTINCT ON (model_id) model_id, queue_state, queue_reason FROM requests "
        "WHERE tenant_id = %s AND model_id = ANY(%s) AND status = 'paused' ORDER BY model_id, seq_id",
        (who.tenant_id, model_ids),
    )
    for row in await cur.fetchall():
        out[row["model_id"]].update(queue_state=row["queue_state"], queue_reason=row["queue_reason"])
    cur = await conn.execute(
        "SELECT DISTINCT ON (model_id) model_id, (metrics->>'loss:mean')::float8 AS loss FROM run_metrics "
        "WHERE tenant_id = %s AND model_id = ANY(%s) AND source = 'trainer' ORDER BY model_id, step DESC, id DESC",
        (who.tenant_id, model_ids),
    )
    for row in await cur.fetchall():
        out[row["model_id"]]["loss"] = row["loss"]
    return out


async def list_run_metrics(conn: AsyncConnection[DictRow], who: Principal, model_id: str, *, limit: int) -> list[dict]:
    """A run of yours' per-step metrics (trainer and client rows), by step then arrival."""
    await get_model(conn, who, model_id)
    cur = await conn.execute(
        "SELECT step, source, metrics, created_at FROM run_metrics WHERE model_id = %s AND tenant_id = %s "
        "ORDER BY step, id LIMIT %s",
        (model_id, who.tenant_id, limit),
    )
    return await cur.fetchall()


async def session_requests(conn: AsyncConnection[DictRow], tenant_id: str, session_id: str,
                           limit: int) -> tuple[list[dict], bool]:
    """The latest `limit` requests of tenant `tenant_id`'s session (on its training models and
    samplers), with their timestamps, and whether it has more. 404 when the session is not theirs."""
    await _one(conn, "SELECT id FROM sessions WHERE id = %s AND tenant_id = %s", (session_id, tenant_id),
               NotFound(f"session {session_id!r} not found", field="session_id"))
    cur = await conn.execute(
        "SELECT r.id, r.kind, r.status, r.model_id, r.seq_id, r.n_tokens, r.queue_state, r.created_at, r.started_at, "
        "r.finished_at FROM requests r WHERE r.tenant_id = %s AND r.model_id IN ("
        " SELECT id FROM training_models WHERE session_id = %s AND tenant_id = %s"
        " UNION ALL SELECT id FROM sampling_sessions WHERE session_id = %s AND tenant_id = %s) "
        "ORDER BY r.created_at DESC, r.id DESC LIMIT %s",
        (tenant_id, session_id, tenant_id, session_id, tenant_id, limit + 1))
    rows = await cur.fetchall()
    return rows[:limit], len(rows) > limit


async def trace_link_holds(conn: AsyncConnection[DictRow], tenant_id: str, api_key_id: str) -> None:
    """A session trace's signed link holds while the key that minted it is not revoked and no
    operator has suspended its tenant (as a checkpoint's, `download_checkpoint`)."""
    cur = await conn.execute(
        "SELECT t.suspended_kind, k.id AS minted_by, k.revoked_at FROM tenants t "
        "LEFT JOIN api_keys k ON k.id = %s AND k.tenant_id = t.id WHERE t.id = %s", (api_key_id, tenant_id))
    row = await cur.fetchone()
    if row is None or (api_key_id and (row["minted_by"] is None or row["revoked_at"] is not None)):
        raise NotFound("the API key that made this trace link was revoked; ask for a new link", field="token")
    if row["suspended_kind"] == "operator":
        raise Forbidden("this tenant is suspended by an operator: its download links do not work", field="token")
