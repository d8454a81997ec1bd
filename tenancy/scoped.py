"""Tenant-scoped reads for the API. Every lookup filters on the caller's tenant, so another
tenant's resource is indistinguishable from a missing one (404), and no route compares owners."""

from __future__ import annotations

from psycopg import AsyncConnection

from core.errors import NotFound
from tenancy.auth import Principal


async def _one(conn: AsyncConnection, sql: str, params: tuple, missing: str, field: str) -> dict:
    cur = await conn.execute(sql, params)
    row = await cur.fetchone()
    if row is None:
        raise NotFound(missing, field=field)
    return row


async def get_session(conn: AsyncConnection, who: Principal, session_id: str) -> dict:
    return await _one(
        conn,
        "SELECT * FROM sessions WHERE id = %s AND tenant_id = %s",
        (session_id, who.tenant_id),
        f"session {session_id!r} not found",
        "session_id",
    )


async def get_model(conn: AsyncConnection, who: Principal, model_id: str) -> dict:
    return await _one(
        conn,
        "SELECT * FROM training_models WHERE id = %s AND tenant_id = %s AND status <> 'deleted'",
        (model_id, who.tenant_id),
        f"model {model_id!r} not found",
        "model_id",
    )


async def get_request(conn: AsyncConnection, who: Principal, request_id: str) -> dict:
    return await _one(
        conn,
        "SELECT id, status, kind, model_id, seq_id, finished_at FROM requests WHERE id = %s AND tenant_id = %s",
        (request_id, who.tenant_id),
        f"future {request_id!r} not found",
        "request_id",
    )


async def get_checkpoint(conn: AsyncConnection, who: Principal, model_id: str, kind: str, name: str) -> dict:
    return await _one(
        conn,
        "SELECT * FROM checkpoints WHERE model_id = %s AND kind = %s AND name = %s AND tenant_id = %s",
        (model_id, kind, name, who.tenant_id),
        f"checkpoint tinker://{model_id}/{kind}/{name} not found",
        "path",
    )


async def get_sampling_session(conn: AsyncConnection, who: Principal, sampling_session_id: str) -> dict:
    return await _one(
        conn,
        "SELECT * FROM sampling_sessions WHERE id = %s AND tenant_id = %s",
        (sampling_session_id, who.tenant_id),
        f"sampling session {sampling_session_id!r} not found",
        "sampling_session_id",
    )


async def count_live_models(conn: AsyncConnection, who: Principal) -> int:
    cur = await conn.execute(
        "SELECT count(*) AS n FROM training_models WHERE tenant_id = %s AND status IN ('creating', 'ready')",
        (who.tenant_id,),
    )
    return (await cur.fetchone())["n"]


async def count_inflight(conn: AsyncConnection, who: Principal) -> int:
    cur = await conn.execute(
        "SELECT count(*) AS n FROM requests WHERE tenant_id = %s AND status IN ('queued', 'running')",
        (who.tenant_id,),
    )
    return (await cur.fetchone())["n"]


async def list_models(conn: AsyncConnection, who: Principal, *, limit: int, offset: int) -> tuple[list[dict], int]:
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
    return [], (await cur.fetchone())["n"]


async def list_checkpoints(conn: AsyncConnection, who: Principal, *, model_id: str | None = None,
                           limit: int = 1000, offset: int = 0) -> tuple[list[dict], int]:
    cur = await conn.execute(
        "SELECT c.*, count(*) OVER () AS total FROM checkpoints c WHERE tenant_id = %s "
        "AND (%s::text IS NULL OR model_id = %s) ORDER BY created_at DESC LIMIT %s OFFSET %s",
        (who.tenant_id, model_id, model_id, limit, offset),
    )
    rows = await cur.fetchall()
    return rows, (rows[0]["total"] if rows else 0)
