"""Sessions: a client's lifetime, kept alive by heartbeats."""

from __future__ import annotations

from fastapi import APIRouter, Query

from api import admission_rule, records
from api.deps import Pool, Who
from api.input_guard import GuardedRoute
from api.routes.runs import metadata_text
from api.schemas import (
    CreateSessionRequest,
    FinishSessionRequest,
    SessionHeartbeatRequest,
)
from core import db, ids
from core.errors import UserError
from core.numbers import INT32_MAX
from core.settings import get_api_settings
from tenancy import scoped

router = APIRouter(route_class=GuardedRoute, tags=["sessions"])


class SessionFinished(UserError):
    status_code = 410


@router.post("/create_session")
async def create_session(body: CreateSessionRequest, who: Who, pool: Pool) -> dict:
    """Open a session; models and samplers are created inside one. Refused (402/403) while the
    tenant is suspended, and (429) while it holds QUILT_MAX_LIVE_SESSIONS_PER_TENANT live ones."""
    refusal = admission_rule.suspension_refusal(who)
    if refusal is not None:
        raise refusal
    session_id = ids.new_session_id()
    settings = get_api_settings()
    async with db.autocommit(pool) as conn:
        await records.insert_session(conn, who, session_id, tags=body.tags, user_metadata=body.user_metadata,
                                     sdk_version=body.sdk_version, display_name=body.display_name,
                                     max_live=settings.max_live_sessions_per_tenant, live_s=settings.session_live_s)
    return {"session_id": session_id, "type": "create_session"}


@router.post("/session_heartbeat")
async def session_heartbeat(body: SessionHeartbeatRequest, who: Who, pool: Pool) -> dict:
    """Keep a session alive; 410 once it has finished."""
    async with pool.connection() as conn:
        session = await scoped.get_session(conn, who, body.session_id)
        if session["finished_at"] is not None:
            raise SessionFinished(f"session {body.session_id!r} has finished", field="session_id")
        await records.touch_session(conn, body.session_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, body: FinishSessionRequest, who: Who, pool: Pool) -> dict:
    """Close a session (first reason wins)."""
    async with pool.connection() as conn:
        await scoped.get_session(conn, who, session_id)
        await records.finish_session(conn, session_id, str(body.reason.get("type", "success")))
    return {}


@router.get("/sessions")
async def list_sessions(who: Who, pool: Pool, limit: int = Query(20, ge=1, le=1000),
                        offset: int = Query(0, ge=0, le=INT32_MAX),
                        access_scope: str = Query("owned", max_length=32)) -> dict:
    """Your sessions' ids, newest first (`access_scope` other than `owned` sees the same: sessions
    are private to their tenant)."""
    async with pool.connection() as conn:
        return {"sessions": await scoped.list_sessions(conn, who, limit=limit, offset=offset)}


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, who: Who, pool: Pool, access_scope: str = Query("owned", max_length=32)) -> dict:
    """One of your sessions: its training runs, its samplers, and the `user_metadata` and
    `display_name` it was created with."""
    async with pool.connection() as conn:
        session, models, samplers = await scoped.session_contents(conn, who, session_id)
    return {"training_run_ids": models, "sampler_ids": samplers,
            "user_metadata": metadata_text(session["user_metadata"]) or None,
            "display_name": session["display_name"]}
