"""Admission of training work: one path for every request kind.

Checks ownership (404 for anything not the caller's), the tenant's in-flight quota and monthly
budgets (402, see billing.budgets), de-duplicates on `(model_id, seq_id)` (a retried submission gets
the existing future), records the request in Postgres, then appends it to the base model's stream.
The row is committed before the stream entry exists, so a worker never sees work the database does
not know.
"""

from __future__ import annotations

import logging

from psycopg_pool import AsyncConnectionPool
from redis.asyncio import Redis

from billing import budgets
from core import ids, queue
from core.errors import InvalidInput, QuotaExceeded
from tenancy import scoped
from tenancy.auth import Principal

log = logging.getLogger("quilt.api.submit")

_UNUSABLE = {"failed": "failed to be created", "lost": "was lost when its trainer restarted; load a checkpoint into a new model"}


def future_response(request_id: str, model_id: str | None) -> dict:
    out = {"request_id": request_id}
    if model_id:
        out["model_id"] = model_id
    return out


async def _existing(conn, model_id: str, seq_id: int, kind: str) -> str | None:
    cur = await conn.execute("SELECT id, kind FROM requests WHERE model_id = %s AND seq_id = %s", (model_id, seq_id))
    row = await cur.fetchone()
    if row is None:
        return None
    if row["kind"] != kind:
        # 400, not 409: the tinker SDK retries 409 for minutes, and this is a client bug, not a race.
        raise InvalidInput(
            f"seq_id {seq_id} of model {model_id!r} was already used by a {row['kind']} request", field="seq_id"
        )
    return row["id"]


async def _admit(conn, who: Principal, *, billable: bool = True) -> None:
    """Quota, then budget. `billable=False` (requests that meter no tokens: optim_step, save, load)
    skips the budget, so a tenant over budget can still step and save the work it paid for."""
    inflight = await scoped.count_inflight(conn, who)
    if inflight >= who.max_inflight_requests:
        raise QuotaExceeded(
            f"{inflight} requests in flight reach your limit of {who.max_inflight_requests}; "
            "wait for some futures to finish",
            field="max_inflight_requests",
        )
    if billable:
        await budgets.check(conn, tenant_id=who.tenant_id, tenant_name=who.tenant_name, key_id=who.key_id)


async def usable_model(conn, who: Principal, model_id: str) -> dict:
    """The caller's model, if requests may still be queued on it (else 404 / 400)."""
    model = await scoped.get_model(conn, who, model_id)
    if model["status"] in _UNUSABLE:
        raise InvalidInput(f"model {model_id!r} {_UNUSABLE[model['status']]}", field="model_id")
    return model


async def record_request(conn, who: Principal, request_id: str, *, model_id: str, seq_id: int, kind: str,
                         n_tokens: int = 0) -> bool:
    """Insert the request's row; False if `(model_id, seq_id)` is taken already."""
    cur = await conn.execute(
        "INSERT INTO requests (id, tenant_id, api_key_id, model_id, seq_id, kind, n_tokens) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT (model_id, seq_id) DO NOTHING RETURNING id",
        (request_id, who.tenant_id, who.key_id, model_id, seq_id, kind, n_tokens),
    )
    return await cur.fetchone() is not None


async def submit_model_request(
    pool: AsyncConnectionPool, redis: Redis, who: Principal, *, model_id: str, seq_id: int, kind: str,
    body: dict, n_tokens: int = 0,
) -> dict:
    """Queue one request on an existing model; returns the future's JSON."""
    async with pool.connection() as conn:
        model = await usable_model(conn, who, model_id)
        existing = await _existing(conn, model_id, seq_id, kind)
        if existing:
            return future_response(existing, model_id)
        await _admit(conn, who, billable=n_tokens > 0)
        request_id = ids.new_request_id()
        if not await record_request(conn, who, request_id, model_id=model_id, seq_id=seq_id, kind=kind,
                                    n_tokens=n_tokens):  # a concurrent duplicate won the insert
            return future_response(await _existing(conn, model_id, seq_id, kind), model_id)
        await conn.execute("UPDATE training_models SET last_request_at = now() WHERE id = %s", (model_id,))
    await enqueue(pool, redis, model["base_model"], queue.WorkItem(
        request_id=request_id, tenant_id=who.tenant_id, model_id=model_id, seq_id=seq_id, kind=kind,
        n_tokens=n_tokens, body=body,
    ))
    return future_response(request_id, model_id)


async def enqueue(pool: AsyncConnectionPool, redis: Redis, base_model: str, item: queue.WorkItem) -> None:
    """Append to the stream; if Redis refuses, fail the recorded request rather than leave it queued."""
    try:
        await queue.enqueue(redis, base_model, item)
    except Exception:
        log.exception("could not enqueue %s", item.request_id)
        async with pool.connection() as conn:
            await conn.execute(
                "UPDATE requests SET status = 'failed', finished_at = now() WHERE id = %s", (item.request_id,)
            )
        raise
