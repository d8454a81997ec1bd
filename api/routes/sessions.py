"""Sessions: a client's lifetime, kept alive by heartbeats."""

from __future__ import annotations

from fastapi import APIRouter

from api import records
from api.deps import Pool, Who
from api.input_guard import GuardedRoute
from api.schemas import (
    CreateSessionRequest,
    FinishSessionRequest,
    SessionHeartbeatRequest,
)
from core import db, ids
from core.errors import UserError
from tenancy import scoped

router = APIRouter(route_class=GuardedRoute, tags=["sessions"])


class SessionFinished(UserError):
    status_code = 410


@router.post("/create_session")
async def create_session(body: CreateSessionRequest, who: Who, pool: Pool) -> dict:
    """Open a session; models and samplers are created inside one."""
    session_id = ids.new_session_id()
    async with db.autocommit(pool) as conn:
        await records.insert_session(conn, who, session_id, tags=body.tags, user_metadata=body.user_metadata,
                                     sdk_version=body.sdk_version)
    return {"session_id": session_id, "type": "create_session"}


@router.post("/session_heartbeat")
async def session_heartbeat(body: SessionHeartbeatRequest, who: Who, pool: Pool) -> dict:
    """Keep a session alive; 410 once it has finished."""
    async with pool.connection() as conn:
        session = await scoped.get_session(conn, who, body.session_id)
        if session["finished_at"] is not None:
            raise SessionFinished(f"session {body.session_id!r} has finished", field="session_id")
        await conn.execute("UPDATE sessions SET last_heartbeat_at = now() WHERE id = %s", (body.session_id,))
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, body: FinishSessionRequest, who: Who, pool: Pool) -> dict:
    """Close a session (first reason wins)."""
    async with pool.connection() as conn:
        await scoped.get_session(conn, who, session_id)
        await conn.execute(
            "UPDATE sessions SET finished_at = now(), finish_reason = %s WHERE id = %s AND finished_at IS NULL",
            (str(body.reason.get("type", "success")), session_id),
        )
    return {}
